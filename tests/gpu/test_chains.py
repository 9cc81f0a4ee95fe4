"""Random chains from the epilogue grammar through the fused kernels, against PyTorch.

The chain specs come from ``gemmfuse.chains.chain_pool`` (a fixed pool: one kernel build each,
every op and reduction covered); hypothesis draws everything else on every run: which spec,
argument values and tensors, shapes, group sizes that fit a tile and group sizes that straddle
tiles (the cross-tile statistics path), the data, and the kernel.

Bar (issue 4): allclose(eager fp32, atol=rtol=1e-4), no NaN where eager has a number, the
exact shape, on every drawn case; and at the benchmark's width (K = N = 8192,
test_pool_chain_at_full_width) max abs error against float64 within helpers.float64_bar (eager
fp32's plus the chain's own fp32 op rounding). On the small drawn shapes the float64 comparison
is not asserted: there the split GEMM's error can exceed eager's (helpers.float64_bar says by
how much), which the issue notes report.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmfuse.chains import chain_pool
from gemmfuse.ops import fused_linear_with_path
from gemmfuse.reference import apply_epilogue, linear_epilogue
from helpers import float64_bar, max_abs_err, poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
POOL = chain_pool()


def kernels() -> list[str]:
    if not torch.cuda.is_available():
        return ["portable"]
    return ["hopper", "portable"] if torch.cuda.get_device_capability() == (9, 0) else ["portable"]


def op_floor(epilogue, args, params, exact) -> float:
    """Max error of the chain's fp32 ops alone: run on the float64 GEMM result rounded to fp32."""
    x, w, b, gn_w, gn_b = args
    y = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    return max_abs_err(apply_epilogue(y, epilogue, gn_w, gn_b, params), exact)


def run_chain(spec, m, k, group_size, groups, eps, seed, kernel):
    gen = torch.Generator().manual_seed(seed)
    n = group_size * groups
    epilogue, params = spec.instantiate(gen, n, groups, eps)
    bound = k**-0.5
    x = torch.randn(m, k, generator=gen)
    w = (torch.rand(n, k, generator=gen) * 2 - 1) * bound
    b = (torch.rand(n, generator=gen) * 2 - 1) * bound
    gn = (1 + 0.1 * torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen))
    gn = gn if spec.norm and spec.affine else (None, None)
    args = [t.to(CUDA) if t is not None else None for t in (x, w, b, *gn)]
    params = [p.to(CUDA) for p in params]
    with torch.no_grad():
        eager = linear_epilogue(*args[:3], epilogue, *args[3:], params)
        exact = linear_epilogue(
            *[t.double() if t is not None else None for t in args[:3]], epilogue,
            *[t.double() if t is not None else None for t in args[3:]],
            [p.double() for p in params],
        )  # fmt: skip
        poison_allocator(4 * max(eager.numel(), m * n), CUDA)
        got, path = fused_linear_with_path(
            *args[:3], epilogue, *args[3:], params=params, kernel=kernel
        )
    return epilogue, eager, exact, got, path, op_floor(epilogue, args, params, exact)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    index=st.integers(0, len(POOL) - 1),
    m=st.sampled_from([1, 5, 130, 300]),
    k=st.sampled_from([64, 300, 1024, 2048]),
    group_size=st.sampled_from([16, 48, 128, 200, 640]),
    groups=st.integers(1, 3),
    eps=st.sampled_from([1e-5, 1e-3]),
    seed=st.integers(0, 2**31 - 1),
    kernel=st.sampled_from(kernels()),
)
def test_random_chain_matches_pytorch(index, m, k, group_size, groups, eps, seed, kernel):
    spec = POOL[index]
    epilogue, eager, _, got, path, _ = run_chain(spec, m, k, group_size, groups, eps, seed, kernel)
    label = f"{spec.describe()} | {epilogue}"
    assert path == "fused", label
    assert got.shape == eager.shape and got.dtype == eager.dtype, label
    assert not (got.isnan() & ~eager.isnan()).any(), label
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4, msg=lambda s: f"{label}\n{s}")


@pytest.mark.parametrize("index", range(len(POOL)))
@pytest.mark.parametrize("groups", [1, 16])
def test_pool_chain_at_full_width(index, groups):
    """K = N = 8192 (as the benchmark), groups wider than a tile: one group and 16 groups."""
    spec = POOL[index]
    epilogue, eager, exact, got, path, floor = run_chain(
        spec, 64, 8192, 8192 // groups, groups, 1e-5, 1234 + index, kernels()[0]
    )
    assert path == "fused"
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(eager, exact), floor, exact)
