"""Split K (dispatch.fused_k_splits): where the Hopper kernel's split variant has fewer 128 x 128
output tiles than SMs (a few rows), each tile's K is cut into slices, a block each; the last
block of a tile to arrive adds the slices' sums in slice order and runs the epilogue.

At sizes that split (each test checks that the call's spec had k_splits > 1), chains of the
benchmark's pool (pointwise alone: the direct stores; GroupNorm within a tile and across tiles;
row reductions) and #62's on fresh random data: no NaN where eager has a number (the allocator
poisoned first), max abs error against float64 within helpers.float64_bar, allclose(1e-4) to
float64, and the same bits on a second call (the slices are added in a fixed order). That the
kernel itself split: its bits differ somewhere from the unsplit call's (fused_k_splits patched
to 1). A slice per k-tile, forced, walks many units a block; a captured call replays with the
uncaptured call's bits. Under autograd, where the kernel also stores z for the backward, #62's
gradients are held to tests/gpu/test_autograd.py's bars, a channel max's to the unsplit call's.
"""

import pytest
import torch

import gemmfuse.plan
from gemmfuse.chains import chain_pool, chain_references, linear_data
from gemmfuse.kernelbench.models import epilogue_62
from gemmfuse.ops import fused_linear_with_path
from gpu.test_autograd import EPS, Chain, check_gradients
from helpers import (
    assert_float64_bar,
    assert_graph_replays_match,
    hopper,
    poison_allocator,
    rel_err,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")]
CUDA = torch.device("cuda")
POOL = chain_pool()
# (M, K, N): 32 tiles of 64 k-tiles (4 slices); 2 x 8 tiles, the second row tile one row, of
# 65 k-tiles (K padded from 4100 to 4160: 4 slices of 16 and 17)
SHAPES = [(16, 4096, 4096), (129, 4100, 1024)]
# pointwise (direct stores); GroupNorm then mish, groups of 16 and 512 channels (within a tile,
# across tiles); a mean, a max and a min over the channels
CHAINS = [(0, 0), (1, 16), (1, 512), (2, 16), (5, 512), (6, 0)]


def case(index, group_channels, shape, seed):
    """(epilogue, x, w, b, gn, params) of a pool chain at shape on fresh random data."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    spec = POOL[index]
    epilogue, params = spec.instantiate(gen, n, n // group_channels if spec.norm else 1)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, m, k, n))
    gn = (gn_w, gn_b) if spec.norm and spec.affine else (None, None)
    return epilogue, x, w, b, gn, [p.to(CUDA) for p in params]


@pytest.fixture
def splits(monkeypatch):
    """The k_splits of every spec made while the test runs (plan.forward_spec's answers)."""
    seen = []
    decide = gemmfuse.plan.fused_k_splits

    def spy(*args):
        seen.append(decide(*args))
        return seen[-1]

    monkeypatch.setattr(gemmfuse.plan, "fused_k_splits", spy)
    return seen


def unsplit(monkeypatch, call):
    """call() with every spec made during it at k_splits 1."""
    with monkeypatch.context() as patch:
        patch.setattr(gemmfuse.plan, "fused_k_splits", lambda *args: 1)
        return call()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("index, group_channels", CHAINS)
def test_split_k_holds_the_float64_bar(splits, shape, index, group_channels):
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
    epilogue, x, w, b, gn, params = case(index, group_channels, shape, seed)
    label = f"{POOL[index].describe()} | groups of {group_channels} | {shape} | seed {seed}"

    def call():
        return fused_linear_with_path(x, w, b, epilogue, *gn, params=params)

    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(8 * shape[0] * shape[2], CUDA)
        got, path = call()
        again = call()[0]
    assert path == "fused" and splits and min(splits) > 1, f"{label}: k_splits {splits}"
    assert_float64_bar(got, eager, exact, ops_alone, label)
    torch.testing.assert_close(again, got, atol=0, rtol=0, equal_nan=True, msg=label)


@pytest.mark.parametrize("shape", SHAPES)
def test_split_k_gradients_hold_the_autograd_bars(splits, shape):
    """#62's chain (groups of 16, affine) under autograd, where the kernel also stores z for the
    backward: every gradient held to tests/gpu/test_autograd.py's bars (float64 from our own z
    and eager's, eager's error, the allclose counts)."""
    m, k, n = shape
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
    gen = torch.Generator().manual_seed(seed)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, m, k, n))
    chain = Chain(x, w, b, epilogue_62(n // 16, 1e-5, True, 0.01), (gn_w, gn_b), ())
    grad = torch.randn(m, n, generator=gen).to(CUDA)
    label = f"62 {shape} seed {seed}"
    poison_allocator(8 * m * n, CUDA)
    path, _ = check_gradients(chain, grad, "auto", label, ["x", "weight", "bias", "gn_w", "gn_b"])
    assert path == "fused" and splits and min(splits) > 1, f"{label}: k_splits {splits}"


@pytest.mark.parametrize("shape", SHAPES)
def test_split_k_gradients_are_no_worse_than_unsplit(monkeypatch, splits, shape):
    """A max over the channels after groups of 512 (pool chain 5), under autograd: each
    gradient's relative L2 error against float64 (from the call's own saved z) within 1.25 times
    the same call's with no split (fused_k_splits patched to 1), plus an fp32 ulp. Its bar here
    is the unsplit call's, not test_autograd.py's: at 16 x 4096 x 4096 that bar misses on some
    seeds with or without split K (seed 203962110: x's gradient 3.574e-7 split, 3.524e-7
    unsplit, against 3.52e-7; H100, 2026-11-28)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
    epilogue, x, w, b, gn, params = case(5, 512, shape, seed)
    chain = Chain(x, w, b, epilogue, gn, params)
    grad = torch.randn(shape[0], 1, generator=torch.Generator().manual_seed(seed)).to(CUDA)
    poison_allocator(8 * shape[0] * shape[2], CUDA)
    got, z, path = chain.fused(grad, "auto")
    assert path == "fused" and splits and min(splits) > 1, f"k_splits {splits}"
    whole, z_whole, _ = unsplit(monkeypatch, lambda: chain.fused(grad, "auto"))
    exact, exact_whole = chain.given_z(z, grad), chain.given_z(z_whole, grad)
    names = ["x", "weight", "bias"] + [f"leaf {i}" for i in range(3, len(got))]
    for name, g, e, w_, e_ in zip(names, got, exact, whole, exact_whole, strict=True):
        err, err_whole = rel_err(g, e), rel_err(w_, e_)
        assert not g.isnan().any() and err <= 1.25 * err_whole + EPS, (
            f"pool 5 {shape} seed {seed}: grad {name}: {err:.3e} against unsplit {err_whole:.3e}"
        )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("index, group_channels", [(0, 0), (1, 16)])  # direct stores; staged
def test_the_kernel_adds_the_slices(monkeypatch, splits, shape, index, group_channels):
    """The launch splits, not just the rule: on random data the slices' sums, added in another
    order than one tile's k-tiles, differ from the unsplit call's in some bits, and both hold
    the float64 bar."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    epilogue, x, w, b, gn, params = case(index, group_channels, shape, seed)
    label = f"{POOL[index].describe()} | {shape} | seed {seed}"

    def call():
        return fused_linear_with_path(x, w, b, epilogue, *gn, params=params)[0]

    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(8 * shape[0] * shape[2], CUDA)
        got = call()
        whole = unsplit(monkeypatch, call)
    assert splits and min(splits) > 1, f"{label}: k_splits {splits}"
    assert_float64_bar(got, eager, exact, ops_alone, label)
    assert_float64_bar(whole, eager, exact, ops_alone, f"{label} (unsplit)")
    assert (got != whole).any(), f"{label}: the split call's bits are the unsplit call's"


@pytest.mark.parametrize("index, group_channels", [(0, 0), (1, 16)])
def test_more_slices_than_blocks(monkeypatch, index, group_channels):
    """A slice per k-tile (64 at K = 4096), forced: 2048 units, so the persistent grid of a
    pointwise chain's direct stores walks many (tile, slice) units a block (the stage phase
    carried across slices, the column terms of skipped units), and a staged chain launches a
    block per unit."""
    shape = (16, 4096, 4096)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    epilogue, x, w, b, gn, params = case(index, group_channels, shape, seed)
    label = f"{POOL[index].describe()} | 64 slices | seed {seed}"
    monkeypatch.setattr(gemmfuse.plan, "fused_k_splits", lambda *args: 64)

    def call():
        return fused_linear_with_path(x, w, b, epilogue, *gn, params=params)[0]

    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(8 * shape[0] * shape[2], CUDA)
        got, again = call(), call()
    assert_float64_bar(got, eager, exact, ops_alone, label)
    torch.testing.assert_close(again, got, atol=0, rtol=0, equal_nan=True, msg=label)


def test_split_k_replays_in_a_cuda_graph(splits):
    """Captured, a split call counts its slices on counters of its own, zeroed inside the graph:
    each replay, on new data copied into the captured input, gives the uncaptured call's bits."""
    shape = (16, 4096, 4096)
    epilogue, x, w, b, gn, params = case(1, 16, shape, int(torch.randint(0, 2**31 - 1, ())))

    def call(x):
        return fused_linear_with_path(x, w, b, epilogue, *gn, params=params)[0]

    assert_graph_replays_match(call, x, torch.randn)
    assert splits and min(splits) > 1, f"k_splits {splits}"
