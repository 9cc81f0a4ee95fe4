"""The fused kernels on the GPU: full-size problems, odd shapes, layouts, caching, export."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gemmfuse import Epilogue, FallbackWarning, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.bench import check
from gemmfuse.chains import chain_references, linear_data
from gemmfuse.kernelbench.export import standalone_source
from gemmfuse.kernelbench.registry import get_problem
from gemmfuse.ops import fused_linear_with_path
from helpers import (
    GEMV_KERNELS,
    build_pair,
    float64_bar,
    kernel_names,
    max_abs_err,
    ops_alone,
    poison_allocator,
    run_both,
    small_pair,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# Every CUDA path runs on the H100: the Hopper kernel by default at large sizes, the portable one
# when forced, and the epilogue path (PyTorch's GEMM, then the chain in one kernel) by default
# at small sizes.
KERNELS = ["hopper", "portable", "epilogue"]


@pytest.fixture(params=KERNELS)
def kernel(request):
    if request.param == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    return request.param


@pytest.fixture(params=KERNELS[:2])
def fused_kernel(request):
    if request.param == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    return request.param


def path_of(kernel: str) -> str:
    return "epilogue" if kernel == "epilogue" else "fused"


@pytest.mark.parametrize("number", [62, 75])
def test_full_size_ten_seeds(number, fused_kernel):
    kernel = fused_kernel
    problem = get_problem(number)
    module = problem.load()
    ref, new = build_pair(problem, module.get_init_inputs())
    new.kernel = kernel
    result = check(problem, ref.to(CUDA), new.to(CUDA), module.get_inputs, 10, CUDA)
    assert result.paths == [path_of(kernel)]
    # allclose(eager, 1e-4) and error vs float64 <= eager's, on every seed
    assert result.correct, result
    assert result.max_err_gemmfuse <= result.max_err_eager


@pytest.mark.parametrize("number", [62, 75])
def test_full_size_epilogue_path(number):
    """Forced at KernelBench's size: the GEMM is eager's own, so the error against float64 is
    eager's, give or take the epilogue's fp32 rounding (float64_bar's one ulp)."""
    problem = get_problem(number)
    module = problem.load()
    ref, new = build_pair(problem, module.get_init_inputs())
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = "epilogue"
    for seed in range(3):
        torch.manual_seed(seed)
        x = module.get_inputs()[0].to(CUDA)
        expect, exact, got = run_both(ref, new, x)
        assert new.last_path == "epilogue"
        assert got.shape == expect.shape
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
        assert max_abs_err(got, exact) <= float64_bar(max_abs_err(expect, exact), 0.0, exact)


# (group size, channels): groups that divide the 128-channel tile are normalised in it (sizes
# 8, 16 and 32 in registers, 64 and up a warp per group, the others a thread per group); the
# others (straddling tiles, up to one group of all channels) take the cross-tile statistics.
GROUPS = [(1, 200), (8, 264), (16, 592), (32, 800), (64, 1024), (3, 300), (96, 384),
          (512, 1024), (640, 640), (2048, 2048)]  # fmt: skip


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize("m", [1, 3, 257])
@pytest.mark.parametrize("k", [8, 1000, 8192])
@pytest.mark.parametrize("group,n", GROUPS)
def test_odd_shapes(number, m, k, group, n, kernel):
    init = (k, n, n // group) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=m + k + n, init=init)
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = kernel
    x = torch.randn(m, k, device=CUDA)
    if m * group == 1:  # one value per group: PyTorch refuses, and so must gemmfuse
        with pytest.raises(ValueError, match="more than 1 value"):
            ref(x)
        with pytest.raises(ValueError, match="more than 1 value"):
            new(x)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expect, exact, got = run_both(ref, new, x)
    assert new.last_path == path_of(kernel)
    assert not any(issubclass(w.category, FallbackWarning) for w in caught)
    assert got.shape == expect.shape
    assert not got.isnan().any()
    # Judged against float64, not against eager: a group of 3 nearly equal values makes
    # GroupNorm amplify any rounding by up to 1/sqrt(eps) ~ 316, so eager fp32 and any other
    # fp32-accurate evaluation can differ by more than 1e-4 while both are right to fp32
    # precision. Bar: issue 4's (helpers.float64_bar: eager's error plus the chain's own fp32
    # op rounding and one ulp), or within 1e-4. Without the op rounding the comparison is a coin
    # toss wherever both errors are mostly the same GEMM's (the epilogue path runs eager's own):
    # at the worst element the two epilogues' amplified roundings decide which is larger. An
    # exact epilogue on a given fp32 GEMM result came out above eager's in 9 of 20 simulated
    # draws (257 x 1000 x 300, groups of 3), a float-mean one in 6.
    err, err_eager = max_abs_err(got, exact), max_abs_err(expect, exact)
    bar = max(float64_bar(err_eager, max_abs_err(ops_alone(ref, x), exact), exact), 1e-4)
    assert err <= bar, f"gemmfuse {err:.3e} vs eager {err_eager:.3e}, bar {bar:.3e}"


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize(
    "m,k,n,groups",
    [(257, 1000, 592, 37), (2048, 64, 4096, 64), (3, 8, 256, 2), (300, 128, 384, 3),
     (4396, 64, 640, 2)],
)  # fmt: skip
def test_hopper_tile_walk_on_exact_operands(number, precision, m, k, n, groups):
    """Both Hopper variants against eager on operands in quarters from -1 to 1: every product
    and partial sum is exact in fp16 and fp32, so the one-pass variant (precision="tf32") is
    exact too and both must be allclose. The shapes cover row and 256-column tiles cut by M and
    N, a single k-tile, more tiles than resident blocks (later rounds of the one-pass
    variant's persistent walk, whose pipeline phases carry over from tile to tile), and 35 row
    tiles: the walk's bands of 16 row tiles, the last one cut short (3), with a group and #75's
    row minimum straddling column tiles."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    init = (k, n, groups) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=m + k, init=init)
    ref, new = ref.to(CUDA), new.to(CUDA)
    gen = torch.Generator().manual_seed(m + n)
    w = (torch.randint(-4, 5, (n, k), generator=gen) / 4).to(CUDA)
    with torch.no_grad():
        for model in (ref, new):
            next(mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)).weight.copy_(w)
    new.kernel, new.precision = "hopper", precision
    x = (torch.randint(-4, 5, (m, k), generator=gen) / 4).to(CUDA)
    expect, _, got = run_both(ref, new, x)
    assert new.last_path == "fused"
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


# Chains the split variant stores from registers (gemm_gn_sm90.cuh's direct_store): a plain
# GEMM, and pointwise ops reading a per-channel vector.
DIRECT_CHAINS = {
    "plain": Epilogue(),
    "pointwise": Epilogue(pre=(Pointwise("mul", (Param(0),)), Pointwise("relu"))),
}


@pytest.mark.parametrize("chain", DIRECT_CHAINS)
@pytest.mark.parametrize(
    "m,k,n",
    [(257, 1000, 592), (3, 8, 257), (300, 64, 1001), (4396, 64, 640), (1024, 1024, 8192),
     (129, 130, 2)],
)  # fmt: skip
def test_direct_store_on_exact_operands(chain, m, k, n):
    """The split variant's direct stores on operands in quarters from -1 to 1 (every product and
    partial sum exact in fp16 and fp32): equal to PyTorch's fp32 result bit for bit. The shapes
    cut row and column tiles by M and N (odd N: single stores, not pairs), take a single k-tile
    (a warpgroup may then run a tile ahead of the other over the double-buffered column terms),
    and walk more tiles than resident blocks on the persistent grid."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    gen = torch.Generator().manual_seed(m + k + n)

    def quarters(*shape):
        return (torch.randint(-4, 5, shape, generator=gen) / 4).to(CUDA)

    x, w, b, scale = quarters(m, k), quarters(n, k), quarters(n), quarters(n)
    epilogue = DIRECT_CHAINS[chain]
    params = (scale,) if epilogue.pre else ()
    poison_allocator(4 * m * n, CUDA)
    with torch.no_grad():
        got, path = fused_linear_with_path(x, w, b, epilogue, params=params, kernel="hopper")
        expect = torch.nn.functional.linear(x, w, b)
        if epilogue.pre:
            expect = torch.relu(expect * scale)
    assert path == "fused"
    assert got.shape == expect.shape and torch.equal(got, expect)


@pytest.mark.parametrize("layout", ["row-strided", "transposed"])
def test_non_contiguous_input(layout, kernel):
    ref, new = small_pair(62, init=(512, 256, 16))
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = kernel
    if layout == "row-strided":
        x = torch.randn(100, 600, device=CUDA)[:, 13:525]
    else:
        x = torch.randn(512, 100, device=CUDA).t()
    assert not x.is_contiguous()
    expect, exact, got = run_both(ref, new, x)
    assert new.last_path == path_of(kernel)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


def test_weight_changes_are_seen(kernel):
    ref, new = small_pair(62, init=(256, 256, 16))
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = kernel
    x = torch.rand(64, 256, device=CUDA)
    with torch.no_grad():
        before = new(x)
        new.fc.weight.mul_(-0.5)  # in place: bumps the version counter
        ref.fc.weight.mul_(-0.5)
        torch.testing.assert_close(new(x), ref(x), atol=1e-4, rtol=1e-4)
        other, _ = small_pair(62, seed=7, init=(256, 256, 16))
        new.load_state_dict(other.state_dict())
        ref.load_state_dict(other.state_dict())
        after = new(x)
        torch.testing.assert_close(after, ref(x), atol=1e-4, rtol=1e-4)
    assert new.last_path == path_of(kernel)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("number", [62, 75])
def test_small_problems_take_the_epilogue_path_under_auto(number):
    """Below the fused kernel's thresholds: PyTorch's GEMM (eager's own result) and the chain
    in one kernel, silently (it is the faster path there, not a fallback)."""
    init = (256, 256, 16) + (((1, 256, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, init=init)
    ref, new = ref.to(CUDA), new.to(CUDA)
    x = torch.rand(64, 256, device=CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        expect, exact, got = run_both(ref, new, x)
    assert new.last_path == "epilogue"
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(expect, exact), 0.0, exact)


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize("m", [1, 2, 3, 9])
@pytest.mark.parametrize("k", [4, 1002, 4096])
@pytest.mark.parametrize("n,groups", [(1024, 64), (1024, 16), (640, 2), (4096, 2)])
def test_epilogue_path_few_rows(number, m, k, n, groups):
    """One or two rows with K a multiple of 4 take the epilogue path's matrix-vector kernel (its
    own compensated GEMM and the chain in one launch); more rows, or K = 1002, take PyTorch's
    GEMM and the tile kernel. Either way: allclose to eager and within the float64 bar. Groups
    of 16 fit a tile (normalised in registers), groups of 64 too (a warp per group); groups of
    320 straddle tiles on a short row (finished in the same launch: the row kernel, or the
    matrix-vector kernel's last block); groups of 2048 on rows of 4096 take the second pass
    after the matrix-vector kernel, and one block a row in registers otherwise
    (wide_rows_kernel)."""
    init = (k, n, groups) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=m * k, init=init)
    ref, new = ref.to(CUDA), new.to(CUDA)
    x = torch.randn(m, k, device=CUDA) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        expect, exact, got = run_both(ref, new, x)
    assert new.last_path == "epilogue"
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(expect, exact), 0.0, exact)


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k,n,groups,whole_rows", [
    (1024, 1024, 2, True), (2048, 1024, 4, True), (1024, 768, 3, True), (512, 512, 1, True),
    (4096, 1024, 2, False),  # 32 slices of K: more than one block's fold takes
    (1024, 2048, 2, False),  # rows longer than a thread's quad each
])  # fmt: skip
def test_few_rows_whole_tile_groups(number, m, k, n, groups, whole_rows):
    """GroupNorm groups of whole 128-channel tiles on rows of at most 1024 channels, over at
    most 16 slices of K: the few-rows kernel's last block folds every slice and finishes the
    rows in registers (gemv_whole_rows_kernel); otherwise the window epilogue and finish_row
    (gemv_epilogue_kernel). Either way allclose to eager and within the float64 bar; the
    kernel that ran, from the profiler."""
    init = (k, n, groups) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=m * k + n, init=init)
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = "epilogue"
    x = torch.randn(m, k, device=CUDA) * 3 + 0.5
    expect, exact, got = run_both(ref, new, x)
    assert new.last_path == "epilogue"
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(expect, exact), 0.0, exact)
    with torch.no_grad():
        names = kernel_names(new, x)
    ran = [k for k in GEMV_KERNELS if any(k in name for name in names)]
    assert ran == [GEMV_KERNELS[1] if whole_rows else GEMV_KERNELS[0]], names
    again = run_both(ref, new, torch.rand(m, k, device=CUDA) - 0.25)  # counters left at zero
    torch.testing.assert_close(again[2], again[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize("n,groups", [(65536, 16), (60000, 3000)])
def test_epilogue_path_rows_longer_than_shared_memory(number, n, groups):
    """Rows too long to stage in shared memory are finished in place in global memory."""
    init = (64, n, groups) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=n, init=init)
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = "epilogue"
    x = torch.randn(3, 64, device=CUDA)
    expect, exact, got = run_both(ref, new, x)
    assert new.last_path == "epilogue"
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= float64_bar(max_abs_err(expect, exact), 0.0, exact)


NOT_HOPPER = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
    reason="16-bit models take the Hopper paths only (sm_90): elsewhere the reason differs",
)


@NOT_HOPPER
def test_bf16_small_problems_take_the_pytorch_path_under_auto():
    ref, new = small_pair(62, init=(256, 256, 16))
    ref, new = ref.to(CUDA, torch.bfloat16), new.to(CUDA, torch.bfloat16)
    x = torch.rand(64, 256, device=CUDA, dtype=torch.bfloat16)
    with pytest.warns(FallbackWarning, match="thresholds"):
        with torch.no_grad():
            got = new(x)
    assert new.last_path == "torch"
    torch.testing.assert_close(got, ref(x).detach(), rtol=0, atol=0)


def test_reduction_counters_survive_many_calls(kernel):
    ref, new = small_pair(75, init=(256, 1024, 64, (1, 1024, 1, 1)))
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = kernel
    for m in (300, 5, 129, 300):
        x = torch.randn(m, 256, device=CUDA)
        expect, _, got = run_both(ref, new, x)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize(
    "m,k,n,groups",
    [(1024, 8192, 8192, 512), (257, 1000, 592, 37), (3, 8, 256, 2), (4396, 64, 640, 2)],
)
def test_bf16_model(number, m, k, n, groups):
    """KernelBench's bf16 mode: Model and ModelNew converted with .to(bfloat16), tolerance 1e-2.
    On sm_90 the Hopper kernel fuses #62 (other GPUs run PyTorch). #75's reduction takes the
    epilogue path where its groups divide 128 channels (all but the last shape): eager's own
    GEMM and eager bf16's GroupNorm arithmetic, so its output is eager's, bit for bit."""
    init = (k, n, groups) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=m, init=init)
    ref, new = ref.to(CUDA, torch.bfloat16), new.to(CUDA, torch.bfloat16)
    exact_model = copy.deepcopy(ref).double()  # the bf16 model's own values, in float64
    new.kernel = "hopper" if torch.cuda.get_device_capability() == (9, 0) else "auto"
    x = torch.rand(m, k, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        expect = ref(x)
        exact = exact_model(x.double())
        got = new(x)
    assert got.dtype == torch.bfloat16 and got.shape == expect.shape
    if number == 75 and 128 % (n // groups) == 0:
        assert new.last_path == "epilogue"
        assert torch.equal(got, expect)
    elif torch.cuda.get_device_capability() == (9, 0) and number == 62:
        assert new.last_path == "fused"
        # rounded to bf16 where eager rounds; fp32 in between: as accurate as eager bf16
        assert max_abs_err(got, exact) <= 2 * max_abs_err(expect, exact)
    else:
        assert new.last_path == "torch"
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("number", [62, 75])
@pytest.mark.parametrize(
    "m,k,n,groups",
    [(1024, 8192, 8192, 512), (257, 1000, 592, 37), (3, 8, 256, 2), (4396, 64, 640, 2)],
)
def test_fp16_model(number, m, k, n, groups):
    """KernelBench's fp16 mode: Model and ModelNew converted with .to(float16), tolerance 1e-2.
    On sm_90 the Hopper kernel fuses both, #75's reduction included (one ulp of an fp16 minimum
    is 2^-11 of it, within the tolerance where a bf16 one is not): rounded to fp16 where eager
    rounds, fp32 in between, so no further from the fp16 model's float64 values than twice
    eager fp16's error. Other GPUs run PyTorch."""
    init = (k, n, groups) + (((1, n, 1, 1),) if number == 75 else ())
    ref, new = small_pair(number, seed=m, init=init)
    ref, new = ref.to(CUDA, torch.float16), new.to(CUDA, torch.float16)
    exact_model = copy.deepcopy(ref).double()  # the fp16 model's own values, in float64
    hopper = torch.cuda.get_device_capability() == (9, 0)
    new.kernel = "hopper" if hopper else "auto"
    torch.manual_seed(m)
    x = torch.randn(m, k, device=CUDA, dtype=torch.float16)
    with torch.no_grad():
        expect = ref(x)
        exact = exact_model(x.double())
        poison_allocator(expect.numel() * 4, x.device)
        got = new(x)
    assert got.dtype == torch.float16 and got.shape == expect.shape
    assert new.last_path == ("fused" if hopper else "torch")
    assert max_abs_err(got, exact) <= 2 * max_abs_err(expect, exact)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


@NOT_HOPPER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("number", [62, 75])
def test_16bit_models_at_kernelbench_size_take_the_epilogue_path(number, dtype):
    """Under kernel="auto" a 16-bit model at KernelBench's size runs PyTorch's GEMM in its dtype
    and then the chain kernel (dispatch.model16_in_tiles): a bf16 model's output is eager bf16's
    to the bit (eager's GEMM, its GroupNorm statistics, its roundings); an fp16 one's is no
    further from the fp16 model's float64 values than twice eager fp16's, allclose(1e-2)."""
    problem = get_problem(number)
    module = problem.load()
    ref, new = build_pair(problem, module.get_init_inputs())
    ref, new = ref.to(CUDA, dtype), new.to(CUDA, dtype)
    exact_model = copy.deepcopy(ref).double()  # the 16-bit model's own values, in float64
    torch.manual_seed(number)
    x = module.get_inputs()[0].to(CUDA, dtype)
    with torch.no_grad():
        expect = ref(x)
        exact = exact_model(x.double())
        poison_allocator(expect.numel() * 4, x.device)
        got = new(x)
    assert new.last_path == "epilogue"
    assert got.dtype == dtype and got.shape == expect.shape and not got.isnan().any()
    if dtype == torch.bfloat16:
        assert torch.equal(got, expect)
    else:
        assert max_abs_err(got, exact) <= 2 * max_abs_err(expect, exact)
        torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


@NOT_HOPPER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_epilogue_path_on_rows_not_16_byte_aligned(dtype):
    """A GroupNorm (groups of 4) -> min chain at N = 1004 and M = 300 (neither a multiple of
    the tiles), whose 16-bit rows (2008 bytes) are not 16-byte aligned: the chain kernel stages
    its tile a value at a time (norm_finalize.cuh's stage_values; until 2026-11-27 this test
    took N = 1000, whose rows are aligned, and so staged 16 bytes a load). bf16: the row
    minima equal eager's to the bit; fp16: within twice eager's error of the float64 values."""
    torch.manual_seed(3)
    m, k, n = 300, 1024, 1004
    model = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.GroupNorm(n // 4, n)).to(
        CUDA, dtype
    )
    with torch.no_grad():
        model[1].weight.normal_(1.0, 0.5)
        model[1].bias.normal_(0.0, 0.5)
    x = torch.randn(m, k, device=CUDA, dtype=dtype)
    epilogue = Epilogue(norm=GroupNormSpec(n // 4), reduce=Reduction("min"))
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        expect = model(x).amin(dim=1)
        exact = exact_model(x.double()).amin(dim=1)
        poison_allocator(4 * m * n, CUDA)
        got, path = fused_linear_with_path(
            x, model[0].weight, model[0].bias, epilogue, model[1].weight, model[1].bias
        )
    assert path == "epilogue" and got.dtype == dtype and not got.isnan().any()
    if dtype == torch.bfloat16:
        assert torch.equal(got, expect)
    else:
        assert max_abs_err(got, exact) <= 2 * max_abs_err(expect, exact)


@NOT_HOPPER
def test_bf16_layer_norm_on_the_epilogue_path_keeps_float_statistics():
    """A bf16 LayerNorm over 128 channels (one group within a tile) takes the epilogue path
    under kernel="auto" with the package's own statistics, not eager bf16 GroupNorm's rounded
    ones, which eager's LayerNorm does not use: on data with a large common mean (where that
    rounding shows most) within twice eager's error of the float64 values, allclose(1e-2)."""
    torch.manual_seed(4)
    m, k, n = 1024, 1024, 128
    model = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.LayerNorm(n)).to(
        CUDA, torch.bfloat16
    )
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16) * 0.05 + 1.0
    with torch.no_grad():
        model[0].bias.add_(20.0)  # a common mean far above the spread
    epilogue = Epilogue(norm=GroupNormSpec(1, layer=True))
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        expect = model(x)
        exact = exact_model(x.double())
        got, path = fused_linear_with_path(
            x, model[0].weight, model[0].bias, epilogue, model[1].weight, model[1].bias
        )
    assert path == "epilogue"
    assert max_abs_err(got, exact) <= 2 * max_abs_err(expect, exact)
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)


@NOT_HOPPER
def test_fp16_small_problems_and_unaligned_rows_take_the_pytorch_path():
    """Under kernel="auto", a float16 problem below the fused kernel's thresholds runs eager's
    own ops, as does one whose rows are not 16-byte aligned, each saying why."""
    cases = (((256, 512, 16), 64, "below the fused kernel's thresholds"),
             ((1001, 256, 16), 300, "16-byte aligned"))  # fmt: skip
    for init, m, reason in cases:
        ref, new = small_pair(62, init=init)
        ref, new = ref.to(CUDA, torch.float16), new.to(CUDA, torch.float16)
        x = torch.rand(m, init[0], device=CUDA, dtype=torch.float16)
        with pytest.warns(FallbackWarning, match=reason):
            with torch.no_grad():
                got = new(x)
        assert new.last_path == "torch"
        torch.testing.assert_close(got, ref(x).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("group_size", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("data", ["randn", "offset"])
def test_bf16_reduction_matches_eager_bit_for_bit(group_size, data):
    """A bf16 GroupNorm -> min chain on the epilogue path, every group size it takes (the
    register groups of 8 to 32 and the shared-memory ones), random affine vectors, data centred
    or offset (a large common mean, where the statistics' rounding shows most): the row minima
    equal eager bf16's exactly, so any later op (#75's + bias) sees eager's values."""
    torch.manual_seed(group_size)
    m, k, n = 300, 512, 1024
    model = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.GroupNorm(n // group_size, n)).to(
        CUDA, torch.bfloat16
    )
    with torch.no_grad():
        model[1].weight.normal_(1.0, 0.5)
        model[1].bias.normal_(0.0, 0.5)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    if data == "offset":
        x = x * 0.05 + 1.0
    epilogue = Epilogue(norm=GroupNormSpec(n // group_size), reduce=Reduction("min"))
    with torch.no_grad():
        expect = model(x).amin(dim=1)
        got, path = fused_linear_with_path(
            x, model[0].weight, model[0].bias, epilogue, model[1].weight, model[1].bias
        )
    assert path == "epilogue"
    assert got.dtype == torch.bfloat16
    mismatched = (got != expect).sum().item()
    assert mismatched == 0, f"{mismatched} of {m} row minima differ from eager bf16's"


def test_bf16_unaligned_rows_fall_back_with_warning():
    ref, new = small_pair(62, init=(1001, 256, 16))
    ref, new = ref.to(CUDA, torch.bfloat16), new.to(CUDA, torch.bfloat16)
    x = torch.rand(300, 1001, device=CUDA, dtype=torch.bfloat16)
    with pytest.warns(FallbackWarning, match="bfloat16"):
        with torch.no_grad():
            got = new(x)
    assert new.last_path == "torch"
    torch.testing.assert_close(got, ref(x).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("number", [62, 75])
def test_standalone_export_runs_fused(number):
    namespace: dict = {}
    exec(standalone_source(number), namespace)
    problem = get_problem(number)
    module = problem.load()
    init = module.get_init_inputs()
    torch.manual_seed(3)
    ref = module.Model(*init).to(CUDA)
    torch.manual_seed(3)
    new = namespace["ModelNew"](*init).to(CUDA)
    x = module.get_inputs()[0].to(CUDA)
    expect, exact, got = run_both(ref, new, x)
    assert new.last_path == "fused"
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    assert max_abs_err(got, exact) <= max_abs_err(expect, exact)


# Reductions over a max pooling's windows (Reduction.pool), the structures the model file
# max_pool_over_channels.py also builds. 997 channels leave a partial last window of 1, 1 and
# 5 columns for windows of 2, 4 and 8 (dropped, as max_pool1d drops it) in the last tile; 130
# channels, one of 2 for a window of 4; M = 1 and 2 run the few-rows kernel under
# kernel="epilogue".
POOLED = [Reduction("sum", pool=2), Reduction("mean", True, 4), Reduction("logsumexp", pool=8)]


@pytest.mark.parametrize("reduce", POOLED, ids=[r.op for r in POOLED])
@pytest.mark.parametrize("m,k,n", [(1, 1024, 997), (2, 512, 130), (257, 1024, 997),
                                   (128, 2048, 4096)])  # fmt: skip
def test_pooled_reductions(reduce, m, k, n, kernel):
    gen = torch.Generator().manual_seed(m + k + n)
    x, w, b = (t.to(CUDA) for t in linear_data(gen, m, k, n)[:3])
    x = x + 0.5  # rows with a mean: window maxima and sums of one sign
    epilogue = Epilogue(reduce=reduce)
    with torch.no_grad():
        eager, exact, ops = chain_references(x, w, b, epilogue, None, None, [])
        poison_allocator(4 * m * n, CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, kernel=kernel)
    assert path == path_of(kernel)
    assert got.shape == eager.shape == ((m, 1) if reduce.keepdim else (m,))
    assert not got.isnan().any()
    err, err_eager = max_abs_err(got, exact), max_abs_err(eager, exact)
    bar = max(float64_bar(err_eager, max_abs_err(ops, exact), exact), 1e-4)
    assert err <= bar, f"gemmfuse {err:.3e} vs eager {err_eager:.3e}, bar {bar:.3e}"
