"""The epilogue path's register-group kernel (csrc/epilogue/group_rows.cuh) against eager PyTorch in
the model's dtype, 16-bit (groups of 8, 16, 32) and float32 (groups of 8 and 16, and of 32 and 64
where a call has few (row, group) tasks): GroupNorm chains with a `pre` op reading a per-element
tensor, a `post` op reading a per-channel one, every reduction and none, N = 256 to 8192, blocks of
one row and of several with a shorter last one. Other sizes take the tile kernel
(norm_finalize.cuh) on the same bar, so a failure of both says the bar, not the kernel, is off.

The bar: a bf16 chain's output is eager bf16's to the bit (eager's GEMM, its GroupNorm
statistics, its roundings: dispatch.group_stats_mode); an fp16 one's no further from the fp16
model's float64 values than twice eager's error, and allclose(1e-2), but for fp16 groups of 4
(tile kernel) the float64 bar alone: a group of 4 whose spread is near eps's amplifies fp16's
roundings until both results stray (M=37, N=8192, no reduction: eager's largest error against
float64 1.5e-2, ours 1.3e-2, and one output of 303104 0.019 from eager's; H100, 2026-11-27), so
allclose(1e-2) to eager is ill-posed there. A float32 chain's (the GEMM eager's own F.linear,
the chain kernel's fp32-accurate statistics) is allclose(1e-4) to eager fp32 and within
helpers.float64_bar of the float64 values (eager's error, plus eager's fp32 ops' own on the
exactly rounded GEMM result, plus an ulp)."""

from __future__ import annotations

import copy

import pytest
import torch

from gemmfuse import Epilogue, GroupNormSpec, Param, Pointwise, Reduction, fused_epilogue
from gemmfuse.ops import fused_linear_with_path
from gemmfuse.reference import apply_epilogue
from helpers import float64_bar, kernel_names, max_abs_err, poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
NOT_HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the 16-bit epilogue path needs an sm_90 GPU",
)
REDUCES = [None, "min", "max", "sum", "mean", "logsumexp"]
# bf16 chains reduce on this path by min and max only (dispatch.select_path: a sum's value must
# be eager's to the bit, which its order is not); fp16 by every reduction.
DTYPE_REDUCES = [(torch.bfloat16, r) for r in REDUCES[:3]] + [(torch.float16, r) for r in REDUCES]
REGISTER_GROUPS = (8, 16, 32)  # group_rows_serves' sizes
FP32_REGISTER_GROUPS = (8, 16)  # a float32 z's at every size
FP32_FEW_TASKS = 32768  # group_rows.cuh's kGroupRowsFewTasks: float32 groups of 32 and 64 up to it
FP32_MAX_ROW_GROUPS = 256  # ... and up to kGroupRowsThreads groups a row
NO_SM80 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="the float32 epilogue path needs an sm_80+ GPU",
)


def _chain(groups: int, reduce: str | None, affine: bool) -> Epilogue:
    return Epilogue(
        pre=(Pointwise("add", (Param(0),)),),
        norm=GroupNormSpec(groups, affine=affine),
        post=(Pointwise("leaky_relu", (0.2,)), Pointwise("mul", (Param(1),))),
        reduce=None if reduce is None else Reduction(reduce),
    )


def _case(dtype, m, k, n, group_size, reduce, affine=True, seed=0):
    """(epilogue, x, linear, norm, params) of one drawn case, on the GPU in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n)
    norm = torch.nn.GroupNorm(n // group_size, n, affine=affine)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        linear.bias.copy_(torch.randn(n, generator=gen))
        if affine:
            norm.weight.copy_(1 + 0.5 * torch.randn(n, generator=gen))
            norm.bias.copy_(0.5 * torch.randn(n, generator=gen))
    x = torch.randn(m, k, generator=gen)
    params = [torch.randn(m, n, generator=gen), 0.5 + torch.rand(n, generator=gen)]
    linear, norm = linear.to(CUDA, dtype), norm.to(CUDA, dtype)
    return (_chain(n // group_size, reduce, affine), x.to(CUDA, dtype), linear, norm,
            [p.to(CUDA, dtype) for p in params])  # fmt: skip


def _eager(epilogue, x, linear, norm, params):
    gn = (norm.weight, norm.bias) if norm.affine else (None, None)
    return apply_epilogue(linear(x), epilogue, *gn, params)


def _takes_group_rows(dtype, group_size: int, m: int, n: int) -> bool:
    """group_rows_serves' answer for an aligned call with a norm in tiles."""
    if dtype != torch.float32:
        return group_size in REGISTER_GROUPS
    groups = n // group_size
    few = groups <= FP32_MAX_ROW_GROUPS and m * groups <= FP32_FEW_TASKS
    return group_size in FP32_REGISTER_GROUPS or (group_size in (32, 64) and few)


def _run(epilogue, x, linear, norm, params):
    gn = (norm.weight, norm.bias) if norm.affine else (None, None)
    return fused_linear_with_path(
        x, linear.weight, linear.bias, epilogue, *gn, params=params, kernel="epilogue"
    )


@NOT_HOPPER
@pytest.mark.parametrize(
    "dtype,reduce", DTYPE_REDUCES, ids=[f"{str(d)[6:]}-{r}" for d, r in DTYPE_REDUCES]
)
@pytest.mark.parametrize("group_size", [4, 8, 16, 32, 64])
# Rows a block owns (group_rows_per_block): one at M = 300 and 37; 8 at M = 2053, N = 1024
# (257 blocks, the last with 5 rows: the kernel's own count from its grid).
@pytest.mark.parametrize("m,n", [(300, 256), (300, 1024), (37, 8192), (2053, 1024)])
def test_chain_matches_eager(dtype, reduce, group_size, m, n):
    epilogue, x, linear, norm, params = _case(dtype, m, 512, n, group_size, reduce, seed=m + n)
    exact_args = [t.double() for t in (x, *params)]
    with torch.no_grad():
        eager = _eager(epilogue, x, linear, norm, params)
        exact = _eager(epilogue, exact_args[0], copy.deepcopy(linear).double(),
                       copy.deepcopy(norm).double(), exact_args[1:])  # fmt: skip
        poison_allocator(4 * m * n, CUDA)
        got, path = _run(epilogue, x, linear, norm, params)
    label = f"{dtype} {epilogue} M={m} N={n}"
    assert path == "epilogue", label
    assert got.dtype == dtype and got.shape == eager.shape and not got.isnan().any(), label
    if dtype == torch.bfloat16:
        differ = (got != eager).sum().item()
        assert differ == 0, f"{label}: {differ} of {got.numel()} outputs differ from eager's"
    else:
        err, eager_err = max_abs_err(got, exact), max_abs_err(eager, exact)
        label += f": error {err:.3e}, eager's {eager_err:.3e}"
        assert err <= 2 * eager_err, label
        if group_size == 4:
            return  # allclose(1e-2) to eager is ill-posed there (the module's docstring)
        torch.testing.assert_close(
            got.float(), eager.float(), atol=1e-2, rtol=1e-2, msg=lambda s: f"{label}\n{s}"
        )


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, marks=NOT_HOPPER), pytest.param(torch.float32, marks=NO_SM80)],
)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("reduce", [None, "min"])
@pytest.mark.parametrize("group_size", [4, 8, 16, 32, 64])
@pytest.mark.parametrize("m,n", [(1024, 8192), (16, 1024)])
def test_register_groups_take_the_kernel(group_size, reduce, affine, dtype, m, n):
    """Groups of 8, 16 and 32 of a bf16 z, 8 and 16 of a float32 one, and float32 groups of 32
    and 64 at few tasks (16 rows of 1024, the shape sweep's; not 1024 rows of 8192), run
    group_rows_kernel, other sizes the tile kernel, with or without the norm's affine part; a
    bf16 chain's output is eager's to the bit either way, a float32 one's allclose(1e-4) to
    eager's."""
    epilogue, x, linear, norm, params = _case(
        dtype, m, 1024, n, group_size, reduce, affine, seed=group_size + m
    )
    with torch.no_grad():
        eager = _eager(epilogue, x, linear, norm, params)
        poison_allocator(4 * eager.numel(), CUDA)
        out = []
        names = kernel_names(lambda: out.append(_run(epilogue, x, linear, norm, params)))
    got, path = out[0]
    assert path == "epilogue"
    ran_rows = any("group_rows_kernel" in name for name in names)
    ran_tiles = any("tile_epilogue_kernel" in name for name in names)
    rows = _takes_group_rows(dtype, group_size, m, n)
    assert (ran_rows, ran_tiles) == (rows, not rows), sorted(names)
    if dtype == torch.bfloat16:
        assert torch.equal(got, eager)
    else:
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)


# Float arguments of the binary ops (pointwise.py): x / a multiplies by PyTorch's float64
# reciprocal, a / x rounds x's reciprocal to the model's dtype first (PyTorch's two ops). Each set
# (a, b, c, d, m) keeps the values O(1) and both clamps binding: in a CPU emulation of bf16 at
# these sizes the maximum took 1-16% of the values, the minimum 44-60%, and a / x without its
# inner rounding changed 2,600-25,000 of the 307,200 outputs (fp16: 4,600-20,000).
FLOAT_ARGUMENT_SETS = [
    (1.1, 1.252802910310969, -0.3, 0.7, -2.0),
    (3.0, -7.123456789, 0.25, -1.7, -8.0),
]


@NOT_HOPPER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("args", FLOAT_ARGUMENT_SETS, ids=["set0", "set1"])
def test_float_argument_ops_after_the_norm(dtype, args):
    """A 16-bit chain whose post ops take Python floats (div, maximum, add, rdiv on values kept
    at 0.7 or more, mul, rsub, sub, minimum), each rounded where eager rounds, on the epilogue
    path (eager's GEMM): the module's bars, eager's output to the bit in bf16 (the case that
    sees a rounding missed), within twice eager's error against float64 in fp16."""
    a, b, c, d, m = args
    post = (Pointwise("div", (a,)), Pointwise("maximum", (-1.0,)), Pointwise("add", (c + 2.0,)),
            Pointwise("rdiv", (b,)), Pointwise("mul", (d,)), Pointwise("rsub", (c,)),
            Pointwise("sub", (a,)), Pointwise("minimum", (m,)))  # fmt: skip
    seed = int(torch.randint(0, 2**31 - 1, ()))
    _, x, linear, norm, _ = _case(dtype, 300, 512, 1024, 16, None, seed=seed)
    epilogue = Epilogue(norm=GroupNormSpec(1024 // 16), post=post)
    label = f"{dtype} {args} seed {seed}"
    with torch.no_grad():
        eager = _eager(epilogue, x, linear, norm, [])
        poison_allocator(4 * eager.numel(), CUDA)
        got, path = _run(epilogue, x, linear, norm, [])
        exact = _eager(epilogue, x.double(), copy.deepcopy(linear).double(),
                       copy.deepcopy(norm).double(), [])  # fmt: skip
    assert path == "epilogue", label
    assert got.dtype == dtype and not got.isnan().any(), label
    differ = (got != eager).sum().item()
    err, eager_err = max_abs_err(got, exact), max_abs_err(eager, exact)
    label += f": {differ} of {got.numel()} differ from eager's; error {err:.3e}, {eager_err:.3e}"
    if dtype == torch.bfloat16:
        assert differ == 0, label
    else:
        assert err <= 2 * eager_err, label


def _float64_and_ops_alone(epilogue, x, linear, norm, params):
    """(float64 values, eager fp32's chain on the float64 GEMM result rounded to fp32)."""
    linear64, norm64 = copy.deepcopy(linear).double(), copy.deepcopy(norm).double()
    z64 = linear64(x.double())
    gn64 = (norm64.weight, norm64.bias) if norm.affine else (None, None)
    exact = apply_epilogue(z64, epilogue, *gn64, [p.double() for p in params])
    gn = (norm.weight, norm.bias) if norm.affine else (None, None)
    return exact, apply_epilogue(z64.float(), epilogue, *gn, params)


@NO_SM80
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("group_size", [4, 8, 16, 32, 64])
# Float32 groups of 32 and 64 take group_rows at the first three shapes, the tile kernel at
# 2053 x 1024 (65696 and 32848 tasks).
@pytest.mark.parametrize("m,n", [(16, 1024), (300, 256), (37, 8192), (2053, 1024)])
def test_float32_chain_matches_eager(reduce, group_size, m, n, affine):
    """In place on F.linear's output (the epilogue path's launch, as the chain apart's)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
    epilogue, x, linear, norm, params = _case(torch.float32, m, 512, n, group_size, reduce,
                                              affine, seed=seed)  # fmt: skip
    with torch.no_grad():
        eager = _eager(epilogue, x, linear, norm, params)
        exact, ops_alone = _float64_and_ops_alone(epilogue, x, linear, norm, params)
        poison_allocator(4 * m * n, CUDA)
        got, path = _run(epilogue, x, linear, norm, params)
    err, eager_err = max_abs_err(got, exact), max_abs_err(eager, exact)
    label = f"{epilogue} M={m} N={n} seed {seed}: error {err:.3e}, eager's {eager_err:.3e}"
    assert path == "epilogue", label
    assert got.dtype == torch.float32 and got.shape == eager.shape, label
    assert not got.isnan().any(), label
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4, msg=lambda s: f"{label}\n{s}")
    assert err <= float64_bar(eager_err, max_abs_err(ops_alone, exact), exact), label


@NO_SM80
@pytest.mark.parametrize("reduce", [None, "sum"])
@pytest.mark.parametrize(
    "group_size,m,n,rows",
    [
        (32, 1024, 1024, True),  # 32768 tasks (four rows a block): group_rows_kernel
        (32, 1025, 1024, False),  # one row more: the tile kernel
        (64, 2048, 1024, True),  # 32768 tasks
        (64, 2049, 1024, False),
        (32, 8, 16384, False),  # 512 groups a row: the tile kernel, however few the tasks
        (64, 1000, 1024, True),  # two rows a block, whose fold a reduction takes
    ],
)
def test_float32_wide_groups_bound(group_size, m, n, rows, reduce):
    """Float32 groups of 32 and 64 take group_rows_kernel up to kGroupRowsFewTasks tasks and
    kGroupRowsThreads groups a row, the tile kernel past either, each on the float64 bar."""
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
    epilogue, x, linear, norm, params = _case(torch.float32, m, 512, n, group_size, reduce,
                                              seed=seed)  # fmt: skip
    with torch.no_grad():
        eager = _eager(epilogue, x, linear, norm, params)
        exact, ops_alone = _float64_and_ops_alone(epilogue, x, linear, norm, params)
        poison_allocator(4 * m * n, CUDA)
        out = []
        names = kernel_names(lambda: out.append(_run(epilogue, x, linear, norm, params)))
    got, path = out[0]
    err, eager_err = max_abs_err(got, exact), max_abs_err(eager, exact)
    label = f"{epilogue} M={m} N={n} seed {seed}: error {err:.3e}, eager's {eager_err:.3e}"
    assert path == "epilogue", label
    ran_rows = any("group_rows_kernel" in name for name in names)
    ran_tiles = any("tile_epilogue_kernel" in name for name in names)
    assert rows == _takes_group_rows(torch.float32, group_size, m, n), label  # the mirror agrees
    assert (ran_rows, ran_tiles) == (rows, not rows), f"{label}: {sorted(names)}"
    assert not got.isnan().any(), label
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4, msg=lambda s: f"{label}\n{s}")
    assert err <= float64_bar(eager_err, max_abs_err(ops_alone, exact), exact), label


@NO_SM80
@pytest.mark.parametrize("offset", [0, 1])  # z 16-byte aligned, and 4 bytes past
@pytest.mark.parametrize("reduce", [None, "min", "sum"])
@pytest.mark.parametrize("group_size", [8, 16])
def test_float32_given_z_kept_and_alignment(group_size, reduce, offset):
    """``fused_epilogue`` on a given float32 z: the kernel reads it (FusedArgs.epilogue_in) and
    leaves it as it was; z 4 bytes off 16-byte alignment takes the tile kernel, on the same bar."""
    m, n = 300, 1024
    epilogue, x, linear, norm, params = _case(torch.float32, m, 512, n, group_size, reduce,
                                              seed=group_size + offset)  # fmt: skip
    with torch.no_grad():
        buffer = torch.empty(m * n + offset, device=CUDA)
        z = buffer[offset:].view(m, n)
        z.copy_(linear(x))
        before = z.clone()
        eager = apply_epilogue(before, epilogue, norm.weight, norm.bias, params)
        exact, ops_alone = _float64_and_ops_alone(epilogue, x, linear, norm, params)
        out = []
        names = kernel_names(
            lambda: out.append(fused_epilogue(z, epilogue, norm.weight, norm.bias, params=params))
        )
    got = out[0]
    label = f"{epilogue} offset {offset}"
    assert torch.equal(z, before), f"{label}: z changed"
    ran_rows = any("group_rows_kernel" in name for name in names)
    assert ran_rows == (offset == 0), f"{label}: {sorted(names)}"
    assert not got.isnan().any(), label
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4, msg=lambda s: f"{label}\n{s}")
    err, eager_err = max_abs_err(got, exact), max_abs_err(eager, exact)
    assert err <= float64_bar(eager_err, max_abs_err(ops_alone, exact), exact), label
