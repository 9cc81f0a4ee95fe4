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

import pytest
import torch

from gemmfuse.chains import chain_pool, chain_references, linear_data
from gemmfuse.dispatch import chain_apart
from gemmfuse.ops import fused_linear_with_path
from helpers import CHAIN_KERNELS, assert_float64_bar, hopper, kernel_names, poison_allocator

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
