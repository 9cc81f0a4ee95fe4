"""The fused path's chain run apart (dispatch.chain_apart): under kernel="auto", a float32 call on
sm_90 from M*N = 2^23 with K >= 4096 runs the split GEMM storing z, then the chain kernel on z.

Every chain of the benchmark's pool (chains.chain_pool) with groups wider than a tile and within
one, on fresh random data: no NaN where eager has a number (the allocator poisoned first), max
abs error against float64 within helpers.float64_bar, and allclose(1e-4) to the float64 values.
The profiler shows which kernels ran: the chain kernel after the GEMM under kernel="auto", the
fused kernel alone under kernel="hopper". Planned calls of this kind are compared with the
Python path bit for bit in test_plan.py; the full-size #62 and #75 gradients (test_autograd.py)
run this way too.

Why allclose to float64 and not to eager fp32 (test_chains.py's bar on its shapes): for the
pool's chain 1 (log of a sigmoid, normed in groups of 16) at these sizes eager's own error
against float64 reached 7.1e-4, and on 25 of 60 seeds eager was more than 1e-4 from ours while
ours was 2.6 to 4.6 times closer to float64 than eager (the seeds printed), the chain in the
fused kernel (kernel="hopper") giving the same values as the chain apart (H100, 2026-11-27).
"""

from dataclasses import replace

import pytest
import torch

from gemmfuse import Epilogue, fused_epilogue
from gemmfuse.chains import chain_pool, chain_references, linear_data
from gemmfuse.dispatch import chain_apart
from gemmfuse.epilogue import REDUCTIONS
from gemmfuse.ops import fused_linear_with_path
from helpers import (
    CHAIN_KERNELS,
    assert_float64_bar,
    assert_graph_replays_match,
    hopper,
    kernel_names,
    poison_allocator,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
POOL = chain_pool()
M, K, N = 1024, 4096, 8192  # M * N = 2^23, K = 4096: the smallest sizes that run apart
# groups of 8192, 512 (both wider than a tile), 16 and 8 channels, where the chain norms
CASES = [(i, g) for i, spec in enumerate(POOL) for g in ((1, 16, 512, 1024) if spec.norm else (1,))]


def case(index, groups, seed):
    """(epilogue, x, w, b, gn, params) of a pool chain at (M, K, N) on fresh random data."""
    gen = torch.Generator().manual_seed(seed)
    spec = POOL[index]
    epilogue, params = spec.instantiate(gen, N, groups)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, M, K, N))
    gn = (gn_w, gn_b) if spec.norm and spec.affine else (None, None)
    return epilogue, x, w, b, gn, [p.to(CUDA) for p in params]


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("index, groups", CASES)
def test_pool_chain_apart_holds_the_float64_bar(index, groups):
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
    epilogue, x, w, b, gn, params = case(index, groups, seed)
    label = f"{POOL[index].describe()} | groups {groups} | seed {seed}"
    assert chain_apart("fused", epilogue, x, N, "auto", "fp32"), label
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(8 * M * N, CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, *gn, params=params)
    assert path == "fused", label
    assert_float64_bar(got, eager, exact, ops_alone, label)


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("index", [0, 1])  # a pointwise chain; a GroupNorm chain
def test_auto_runs_the_chain_kernel_after_the_gemm(index):
    """kernel="auto" at these sizes: the split GEMM, then a chain kernel; kernel="hopper": the
    fused kernel with the chain in its epilogue, no chain kernel (groups of 16 fit a tile)."""
    epilogue, x, w, b, gn, params = case(index, 512, 7)

    def run(kernel):
        with torch.no_grad():
            fused_linear_with_path(x, w, b, epilogue, *gn, params=params, kernel=kernel)

    run("auto"), run("hopper")  # built and split before profiling
    auto, forced = kernel_names(run, "auto"), kernel_names(run, "hopper")
    assert any("fused_gemm_gn_sm90_kernel" in name for name in auto), auto
    assert any(any(c in name for c in CHAIN_KERNELS) for name in auto), auto
    assert any("fused_gemm_gn_sm90_kernel" in name for name in forced), forced
    assert not any(any(c in name for c in CHAIN_KERNELS) for name in forced), forced


# A pool chain that norms and reduces nothing: its chain kernel follows the GEMM's tiles, as it
# does with a reduction over the channels after it (#75's chain: GroupNorm, then a min).
FOLLOWING = next(i for i, spec in enumerate(POOL) if spec.norm and spec.reduce is None)


def following_case(m, n, seed, k=K, reduce=None, group=16):
    """(epilogue, x, w, b, gn, params) of FOLLOWING's chain, then `reduce` over the channels
    (keepdim) where given, in groups of `group` at m x k x n."""
    gen = torch.Generator().manual_seed(seed)
    spec = POOL[FOLLOWING]
    if reduce is not None:
        spec = replace(spec, reduce=reduce, keepdim=True)
    epilogue, params = spec.instantiate(gen, n, n // group)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, m, k, n))
    gn = (gn_w, gn_b) if spec.affine else (None, None)
    return epilogue, x, w, b, gn, [p.to(CUDA) for p in params]


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize(
    "m, n, k",
    [
        (M, N, K),  # whole tiles
        (1100, 8208, K),  # a part tile each way
        (M, N, 8 * K),  # K = 32768: the GEMM's tiles take long, so the chain waits for them
        (M, N, 2 * K),  # x's split (2 x 16 MB) as large as the output the chain writes beside it
    ],
)
@pytest.mark.parametrize("grad", [False, True])
def test_chain_following_the_tiles_gives_the_chain_kernels_bits(m, n, k, grad):
    """A chain that norms in tiles and reduces nothing runs behind the split GEMM, following its
    tiles (group_tiles.cuh): the same bits as the chain kernel run on the GEMM's z afterwards
    (fused_epilogue, group_rows_kernel), three calls in a row (each leaves the tile counts
    zero for the next), with autograd recording (the chain writes a tensor of its own, allocated
    while the GEMM still reads x's split) or not (in place)."""
    assert_following_gives_the_chain_kernels_bits(m, n, k, grad)


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("reduce", sorted(REDUCTIONS))
@pytest.mark.parametrize(
    "m, n, k, group, grad",
    [
        (M, N, K, 16, True),  # #75's sizes but K, and its groups
        (M, N, K, 16, False),
        (M, N, K, 8, True),
        (1100, 8208, K, 16, True),  # part tiles: a row band of 12 rows, a column tile of one group
        (1100, 8240, K, 8, True),  # part tiles: six groups of 8 in the last column tile
        (1156, N, 2 * K, 8, True),  # seven of the last row tile's eight slices hold no rows
    ],
)
def test_reducing_chain_following_the_tiles_gives_the_chain_kernels_bits(
    reduce, m, n, k, group, grad
):
    """A chain that norms in tiles and then reduces over the channels (#75's) follows the GEMM's
    tiles too: each unit leaves its rows' partials of the tile, the last of a row band to arrive
    merges them in tile order, so the reduced rows are group_rows_kernel's bits, with autograd
    recording (the GEMM's z kept for the backward, as KernelBench times it) or not."""
    assert_following_gives_the_chain_kernels_bits(m, n, k, grad, reduce, group)


def chain_kernel_bits(x, w, b, epilogue, gn, params):
    """The chain kernel's output run after the plain GEMM (its z's bits): what a chain that
    follows the GEMM's tiles must give."""
    with torch.no_grad():
        z = fused_linear_with_path(x, w, b, Epilogue())[0]
        return fused_epilogue(z, epilogue, *gn, params=params)


def assert_follows_the_tiles(names):
    """The kernel names of a call: its chain kernel followed the GEMM's tiles (group_tiles_kernel),
    not run after the GEMM on the whole z (group_rows_kernel)."""
    assert any("group_tiles_kernel" in name for name in names), names
    assert not any("group_rows_kernel" in name for name in names), names


def assert_following_gives_the_chain_kernels_bits(m, n, k, grad, reduce=None, group=16):
    """Three calls in a row, each on new x: the bits of the plain GEMM's z run through
    fused_epilogue (the chain kernel after the GEMM). New data each call, so that a unit or a
    band's fold reading a slot before this call wrote it (the last call's values, which the
    allocator's reused block may still hold) shows."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    epilogue, x, w, b, gn, params = following_case(m, n, seed, k, reduce, group)
    label = (f"{POOL[FOLLOWING].describe()} -> {reduce} | groups of {group} | {m} x {k} x {n} | "
             f"grad {grad} | seed {seed}")  # fmt: skip
    assert chain_apart("fused", epilogue, x, n, "auto", "fp32"), label
    if grad:
        w.requires_grad_(True)

    def call():
        with torch.set_grad_enabled(grad):
            return fused_linear_with_path(x, w, b, epilogue, *gn, params=params)[0].detach()

    call()  # built, and the weight split, before poisoning
    gen = torch.Generator().manual_seed(seed + 1)
    for i in range(3):
        x.copy_(torch.randn(x.shape, generator=gen))
        expect = chain_kernel_bits(x, w, b, epilogue, gn, params)
        poison_allocator(8 * m * n, CUDA)
        got = call()
        torch.testing.assert_close(got, expect, atol=0, rtol=0, msg=f"{label} | call {i}")
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w.detach(), b, epilogue, *gn, params)
    assert_float64_bar(got, eager, exact, ops_alone, label)
    assert_follows_the_tiles(kernel_names(call))


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("reduce", [None, "sum", "min"])
def test_chain_following_the_tiles_replays_in_a_cuda_graph(reduce):
    """Captured, the GEMM and the following chain kernel count tiles (and a reducing chain's
    row bands) on counters of their own, zeroed inside the graph before the GEMM (a programmatic
    edge between the two kernels): each replay, on new data copied into the captured input,
    gives the uncaptured call's bits, and the chain kernel follows the tiles in the graph too."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    epilogue, x, w, b, gn, params = following_case(M, N, seed, reduce=reduce)

    def call(x):
        return fused_linear_with_path(x, w, b, epilogue, *gn, params=params)[0]

    graph = assert_graph_replays_match(call, x, torch.rand)
    with torch.no_grad():
        assert_follows_the_tiles(kernel_names(graph.replay))


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("reduce", ["min", "logsumexp"])
def test_reducing_chain_on_another_stream_follows_and_gives_the_bits(reduce):
    """On a side stream (its own counter set, made before the GEMM where the stream had none:
    PyTorch's pool hands its streams out again, so not necessarily a first call), each call on
    new data gives the bits of the chain kernel run after the plain GEMM, and the chain kernel
    follows the tiles there. A smoke test of the counters' placement, not a regression test of
    it: fresh counters come from cudaMalloc, whose memory is usually zero anyway; the graph
    test above is the one that sees a chain kernel not following."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    epilogue, x, w, b, gn, params = following_case(M, N, seed, reduce=reduce)
    label = f"{reduce} | seed {seed}"
    gen = torch.Generator().manual_seed(seed + 1)
    stream = torch.cuda.Stream()

    def on_stream():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            poison_allocator(8 * M * N, CUDA)
            out = fused_linear_with_path(x, w, b, epilogue, *gn, params=params)[0]
        torch.cuda.current_stream().wait_stream(stream)
        return out

    with torch.no_grad():
        fused_linear_with_path(x, w, b, Epilogue())  # built, and the weight split
        for i in range(2):
            x.copy_(torch.randn(x.shape, generator=gen))
            expect = chain_kernel_bits(x, w, b, epilogue, gn, params)
            got = on_stream()
            torch.testing.assert_close(got, expect, atol=0, rtol=0, msg=f"{label} | call {i}")
        assert_follows_the_tiles(kernel_names(on_stream))
