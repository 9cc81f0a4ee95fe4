"""Random chains from the epilogue grammar through gemmfuse's CUDA paths, against PyTorch.

The chain specs come from ``gemmfuse.chains.chain_pool`` (a fixed pool: one kernel build each,
every op and reduction covered); hypothesis draws everything else on every run: which spec,
argument values and tensors, shapes, group sizes that fit a tile and group sizes that straddle
tiles (the cross-tile statistics path), the data, and the kernel: both fused kernels forced,
and kernel="auto", which at these sizes takes the fused kernel or the epilogue path (PyTorch's
GEMM followed by the chain in one kernel) as dispatch.fused_pays says.

Bar (issue 4): allclose(eager fp32, atol=rtol=1e-4), no NaN where eager has a number, the
exact shape, on every drawn case; and max abs error against float64 within helpers.float64_bar
(eager fp32's plus the chain's own fp32 op rounding) wherever gemmfuse's default dispatch runs
the case: kernel="auto" on the small shapes, and the fused kernel at the benchmark's width
(K = N = 8192, test_pool_chain_at_full_width). The fused kernels forced onto small shapes are
held to allclose only: there the split GEMM's error can exceed eager's (helpers.float64_bar
says by how much), which is why auto does not send them there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gemmfuse.chains import (
    chain_pool,
    chain_references,
    layer_norm_chain,
    linear_data,
    value_chain_pool,
    value_chains,
)
from gemmfuse.dispatch import fused_pays
from gemmfuse.ops import fused_linear_with_path
from helpers import float64_bar, fused_kernels, max_abs_err, poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
POOL = chain_pool()
VALUE_POOL = value_chain_pool()


def run_chain(spec, m, k, group_size, groups, eps, seed, kernel):
    """(epilogue, eager, float64, gemmfuse, path, error of the fp32 ops alone) for one case."""
    gen = torch.Generator().manual_seed(seed)
    n = group_size * groups
    epilogue, params = spec.instantiate(gen, n, groups, eps)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, m, k, n))
    gn = (gn_w, gn_b) if spec.norm and spec.affine else (None, None)
    params = [p.to(CUDA) for p in params]
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(4 * max(eager.numel(), m * n), CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, *gn, params=params, kernel=kernel)
    return epilogue, eager, exact, got, path, max_abs_err(ops_alone, exact)


@settings(
    max_examples=300,
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
    kernel=st.sampled_from([*fused_kernels(), "auto"]),
)
# Drawn at commit 48682c0 and failing there: the epilogue path's error (eager's GEMM; one
# group of 48, a mean over channels) 2.38e-7 against the float64 bar's 1.75e-7. Kept as a case
# of every run until it passes.
@example(index=1, m=5, k=300, group_size=48, groups=1, eps=1e-5, seed=5, kernel="auto")
def test_random_chain_matches_pytorch(index, m, k, group_size, groups, eps, seed, kernel):
    check_drawn(POOL[index], m, k, group_size, groups, eps, seed, kernel)


def check_drawn(spec, m, k, group_size, groups, eps, seed, kernel):
    """One drawn case against the bar of this module's docstring."""
    epilogue, eager, exact, got, path, floor = run_chain(
        spec, m, k, group_size, groups, eps, seed, kernel
    )
    label = f"{spec.describe()} | {epilogue} | kernel={kernel}"
    auto_path = "fused" if fused_pays(m, group_size * groups, k) else "epilogue"
    assert path == (auto_path if kernel == "auto" else "fused"), label
    assert got.shape == eager.shape and got.dtype == eager.dtype, label
    assert not (got.isnan() & ~eager.isnan()).any(), label
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4, msg=lambda s: f"{label}\n{s}")
    if kernel == "auto":
        err, bar = max_abs_err(got, exact), float64_bar(max_abs_err(eager, exact), floor, exact)
        assert err <= bar, f"{label}: error vs float64 {err:.3e} above the bar {bar:.3e}"


@pytest.mark.parametrize("index", range(len(POOL)))
@pytest.mark.parametrize("groups", [1, 16])
def test_pool_chain_at_full_width(index, groups):
    """K = N = 8192 (as the benchmark), groups wider than a tile: one group and 16 groups."""
    spec = POOL[index]
    epilogue, eager, exact, got, path, floor = run_chain(
        spec, 64, 8192, 8192 // groups, groups, 1e-5, 1234 + index, fused_kernels()[0]
    )
    assert path == "fused"
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(eager, exact), floor, exact)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("m", [64, 300])
def test_layer_norm_at_full_width(affine, m, rms):
    """A LayerNorm (a one-group GroupNorm in the kernels) or an RMSNorm over the channels at
    K = N = 8192, against eager's F.layer_norm / F.rms_norm chain and float64."""
    gen = torch.Generator().manual_seed(m + affine + 2 * rms)
    epilogue = layer_norm_chain(affine, rms=rms)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, m, 8192, 8192))
    gn = (gn_w, gn_b) if affine else (None, None)
    params = [(0.5 + torch.rand(8192, generator=gen)).to(CUDA)]
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(4 * m * 8192, CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, *gn, params=params)
    assert path == "fused"
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    floor = max_abs_err(ops_alone, exact)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(eager, exact), floor, exact)


@pytest.mark.parametrize("index", range(len(value_chains())))
@pytest.mark.parametrize("kernel", [*fused_kernels(), "auto"])
@pytest.mark.parametrize("m, k, groups", [(5, 300, 2), (130, 1024, 3), (64, 8192, 16)])
def test_value_chain_matches_pytorch(index, kernel, m, k, groups):
    """Chains that read values again (chains.value_chains) on every path: allclose to eager,
    and within the float64 bar where gemmfuse's own dispatch (auto) runs them."""
    n = 128 * groups if k < 8192 else 8192
    epilogue = value_chains(groups)[index]
    gen = torch.Generator().manual_seed(10 * index + m)
    x, w, b, gn_w, gn_b = (t.to(CUDA) for t in linear_data(gen, m, k, n))
    gn = (gn_w, gn_b) if epilogue.norm is not None else (None, None)
    params = [(0.5 + torch.rand(n, generator=gen)).to(CUDA) for _ in epilogue.channel_params]
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
        poison_allocator(4 * max(eager.numel(), m * n), CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, *gn, params=params, kernel=kernel)
    assert path == ("fused" if kernel != "auto" or fused_pays(m, n, k) else "epilogue")
    assert got.shape == eager.shape and not (got.isnan() & ~eager.isnan()).any()
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    if kernel == "auto":
        floor = max_abs_err(ops_alone, exact)
        assert max_abs_err(got, exact) <= float64_bar(max_abs_err(eager, exact), floor, exact)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    index=st.integers(0, len(VALUE_POOL) - 1),
    m=st.sampled_from([1, 5, 130, 300]),
    k=st.sampled_from([64, 300, 1024, 2048]),
    group_size=st.sampled_from([16, 48, 128, 200, 640]),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    kernel=st.sampled_from([*fused_kernels(), "auto"]),
)  # fmt: skip
def test_random_value_chain_matches_pytorch(index, m, k, group_size, groups, seed, kernel):
    """Drawn graphs (chains.value_chain_pool: values read again, some detached), as
    test_random_chain_matches_pytorch draws chains, to the same bar."""
    check_drawn(VALUE_POOL[index], m, k, group_size, groups, 1e-5, seed, kernel)
