"""How a call is served: which path it takes, and the thresholds and constants the rules use.

``select_path`` picks the path of a call (``fused``, ``epilogue`` or ``torch``; ops.py's module
docstring says what each runs) from its tensors, the GPU and ``kernel=``, and
``select_epilogue_path`` that of a ``fused_epilogue`` call (the chain on a given tensor);
``fused_pays`` holds the size thresholds of ``kernel="auto"``, ``chain_apart`` whether a fused
call's chain runs in the GEMM's epilogue or in the chain kernel after it, ``gemv_fits`` whether
an epilogue-path call runs the one-or-two-rows kernel, ``forward_parts`` which parts of a
chain's library a forward runs; ``backward_products`` says which backward
products run on the sparse kernels (a dz zero but for a few groups a row) or the split
tensor-core kernel. Not yet here: the launch's own choices (which chain kernel and second sweep
a wide GroupNorm takes, in csrc/epilogue/norm_finalize.cuh; whether the chain backward kernel
fits, in autograd.py; tiles and grids in csrc/). The constants that the
CUDA sources share are checked against them by tests/test_sources.py, and against the compiled
extension's when it is loaded (sources.check_constants).

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import functools
import warnings

import torch

from gemmfuse.epilogue import Epilogue, per_channel, per_element

K_ALIGN = 64  # the Hopper kernel's k-tile: operands are zero-padded in K to a multiple of it
TILE = 128  # kTile in csrc/abi/fused_args.h: groups that divide it are normalised in the tile
# kernel= choices: the fused kernels ("auto" picks one by device: fused_kernel_code), and the
# epilogue path (PyTorch's GEMM, then the chain in one kernel).
KERNELS = ("auto", "portable", "hopper", "epilogue")
# The fused kernels' launch codes (chain_table.cu's launch_fused, gemm_split): fused_kernel_code.
PORTABLE_KERNEL, HOPPER_KERNEL = 1, 2
# "fp32": hi*hi + hi*lo + lo*hi, as accurate as PyTorch fp32. "tf32": hi*hi alone, operands with
# 11 significant bits like TF32's, one third of the tensor-core work (the backward's products too).
PRECISIONS = {"fp32": True, "tf32": False}
# The 16-bit models the Hopper kernel fuses: one tensor-core product on their own operands, the
# epilogue in fp32, rounded to their dtype where eager rounds (fused_args.h's ModelDtype).
MODEL16 = (torch.bfloat16, torch.float16)
# The dtypes the backward's kernels take (the chain backward, the sparse products, the column sums)
BACKWARD_DTYPES = (torch.float32, *MODEL16)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# kernel="auto" takes the fused kernel from these sizes up, and below them the epilogue path
# (float32) or the PyTorch path (bfloat16, float16; a bf16 chain with a min or max takes the
# epilogue path at every size). Below MIN_FUSED_WORK = M*N*K the fused kernel's
# fixed cost (two launches) dominates; below MIN_FUSED_ROWS = M the GEMM is a matrix-vector
# product bound by reading W, where 128-row tiles waste their tensor work and a grid of N/128
# blocks leaves SMs idle (both set from the shape sweep of docs/PERFORMANCE.md, which times
# both paths on every row, H100). Below MIN_FUSED_K the split GEMM's error, about 2^-22 of
# |x||w| per product whatever K, is no longer reliably below eager fp32's accumulated
# rounding, which grows with K (scripts/small_shape_accuracy.py; docs/DESIGN.md).
MIN_FUSED_WORK = 1e8
MIN_FUSED_ROWS = 16
MIN_FUSED_K = 1024
# kernel="auto" runs a float32 fused call on Hopper as two kernels from these sizes up
# (chain_apart): the split GEMM storing z, then the chain kernel on z. The fused kernel's chain
# runs after each tile's mainloop, on one block an SM, with the tensor cores idle; the chain
# kernel runs at full occupancy, and z's extra store and read cost less from M * N = 2^23 with
# K >= 4096 (docs/DESIGN.md section 4). The two kernels' time against the fused kernel's, H200,
# 2026-11-27, median of 20: #62 1.00x, #75 0.94x, the pool's random chains 0.74-1.02x, 8192 x
# 8192 0.87-0.90x; K = 1024 or M * N = 2^22: 0.97-1.18x; tf32's single product 1.12-1.14x (so
# it keeps the fused kernel). KernelBench's method on an H100 that day: #62 0.655 and 0.695 ms
# against 0.734 and 0.732, #75 0.671 and 0.691 against 0.715 and 0.720 (before the float32
# group_rows_kernel took the chain kernel from 55 to 34 us). Under no_grad, where the fused
# kernel stores no z, #62's light chain ran apart up to 4.7% slower on that H100 (the sweep of
# docs/PERFORMANCE.md): the rule weighs neither autograd nor the chain's cost.
CHAIN_APART_MIN_OUTPUTS = 2**23
CHAIN_APART_MIN_K = 4096
# The Hopper kernel's split variant runs a block per 128 x 128 output tile; where the tiles are
# fewer than the SMs (a few rows: M = 16 at N = 4096 is 32 tiles on 132 SMs) it cuts each
# tile's K into slices, a block each, up to a block per SM, each slice at least
# SPLIT_K_MIN_K_TILES k-tiles of K_ALIGN (fused_k_splits; the last block of a tile adds the
# slices' sums in slice order). On an H100 (2026-11-28, docs/DESIGN.md section 4, which holds
# the table) 16 x 4096 x 4096 took 57.4 us in 4 slices against 79.1 unsplit; slices of 4 and 8
# k-tiles at K = 1024 lost, hence 16.
SPLIT_K_MIN_K_TILES = 16
MAX_K_SPLITS = 1024  # kMaxKSplits in csrc/abi/fused_args.h: the launch's bound
GEMV_MAX_ROWS = 2  # kGemvMaxRows in csrc/abi/fused_args.h
# kSplitColsMax in csrc/operands/split.h: split_cols' grid bound on columns
SPLIT_COLS_MAX = 65535 * 32


# The tail ops (after a reduction) that run as one kernel where their tensor operand broadcasts
# the reduction's value into an outer product's layout (tail.py), in the order of
# csrc/operands/outer_binary.h's OuterOp. float32 only: #75 in KernelBench's method (H200,
# 2026-11-26, the kernel against PyTorch's broadcast in one process, three runs) took 0.68 ms
# against 0.75 forward and 1.02-1.04 against 1.04-1.07 a training step in float32, but in bf16
# and fp16, whose calls are bound by the host's time, the kernel's 12 us saved did not show in
# the forward and the training step was slower in every run (0.92-1.02 ms against 0.63-0.85).
# On an H100 (6cf6058, 2026-11-26) the 16-bit forward gained (fp16 0.221 ms against 0.232) and
# the training step lost host time (fp16 0.810 ms against 0.545): docs/DESIGN.md, section 3.
OUTER_OPS = ("add", "sub", "rsub", "mul", "div")
OUTER_DTYPES = (torch.float32,)


def check_settings(kernel, precision) -> None:
    """Raises ValueError naming ``kernel`` or ``precision`` where it is not one of the choices
    (a string: a list or other unhashable value gets the same message, not a TypeError)."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")


def split_padded(n: int) -> int:
    """n rounded up to a multiple of K_ALIGN: a split operand's padded contraction dimension
    (csrc/host/host_common.h's split_padded)."""
    return -(-n // K_ALIGN) * K_ALIGN


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class FallbackWarning(UserWarning):
    """A CUDA call ran on a slower gemmfuse path than the fully fused kernel."""


def _channel_param_problem(epilogue: Epilogue, params, x, n: int) -> str:
    """Why the kernel cannot read the pre/post tensor arguments per channel or per element
    ("" if it can)."""
    m = x.shape[0]
    for i in sorted(set(epilogue.channel_params)):
        t = params[i]
        if not (per_channel(tuple(t.shape), n) or per_element(t.shape, m, n)):
            return (
                f"params[{i}] of shape {tuple(t.shape)} is neither per channel ((), (1,), "
                f"({n},) or (1, {n})) nor per element (({m}, {n})), so the chain runs in PyTorch"
            )
        if t.dtype != x.dtype or t.device != x.device:
            return (
                f"params[{i}] is {t.dtype} on {t.device}, not {x.dtype} on {x.device} like x, "
                "so PyTorch's type promotion decides the result: the chain runs in PyTorch"
            )
    return ""


def _bf16_reduction_problem(epilogue: Epilogue, n: int, device_index: int) -> str:
    """Why a bfloat16 chain with a reduction cannot take the epilogue path ("" if it can). The
    path is taken whatever ``kernel=`` says: the fused kernels' GEMM is not eager's.

    Such chains run PyTorch's bf16 GEMM (eager's own bits), then the chain in one kernel with
    eager bf16's GroupNorm arithmetic (fused_args.h's group_stats): the reduced value must
    match eager's to the bit, because a later op can cancel it (#75's ``+ bias``) and one ulp of
    it is then beyond bf16's 1e-2 tolerance. Measured on #75 (H100, torch 2.11, 2026-11-25,
    three draws each, rows of 1024 with an output beyond 1e-2 of eager's): cuBLAS's bits with
    the statistics computed exactly, 225 to 286 (eager bf16 normalises with its mean and rstd
    rounded to bf16); eager's statistics on a GEMM summed in fp32 in another order (0.4% of the
    bf16 GEMM outputs differ), 2 to 4; cuBLAS's bits with eager's statistics, none (the output
    equals eager's bit for bit)."""
    if epilogue.reduce.op not in ("min", "max"):
        # A sum's float order, or logsumexp's rounding between ops in eager bf16, would differ
        # from eager's by an ulp of the result: not reproduced, so not taken.
        return (
            f"bfloat16 chains with a {epilogue.reduce.op} reduction run the PyTorch path "
            "(min and max are fused: their value is eager's bit for bit)"
        )
    norm = epilogue.norm
    if norm is None:
        return ""
    if norm.layer or TILE % (n // norm.num_groups):
        return (
            "bfloat16 chains with a min or max are fused with a GroupNorm whose groups divide 128 "
            "channels (eager bf16's statistics are reproduced there), or with no norm"
        )
    if eager_bf16_group_stats(device_index) == 0:
        return "this torch's bfloat16 GroupNorm arithmetic is not one gemmfuse reproduces"
    return ""


def group_stats_mode(epilogue: Epilogue, x) -> int:
    """The epilogue kernel's group_stats for a call on x (fused_args.h): eager bf16's GroupNorm
    arithmetic for a bf16 model's chain with a GroupNorm, else 0 (the package's own statistics:
    eager's LayerNorm keeps its statistics in float, which is not GroupNorm's arithmetic)."""
    if x.dtype != torch.bfloat16 or epilogue.norm is None or epilogue.norm.layer:
        return 0
    return eager_bf16_group_stats(x.device.index)


_GROUP_STATS: dict[int, int] = {}  # device index -> eager_bf16_group_stats' finding


def eager_bf16_group_stats(device_index: int) -> int:
    """How eager bf16 GroupNorm normalises with this torch (fused_args.h's group_stats): 2 with
    its mean and rstd rounded to bf16, 1 with them in float, 0 neither (not reproduced).

    Found once per device from a group of [256, 258]: its mean 257 rounds to 256 in bf16, so
    the two give [0, 2] and [-1, 1]. Not while a CUDA graph is captured (the probe would be
    captured too): 0 then, until a call outside capture probes that device. Autocast is off
    for the probe (it would run the GroupNorm in float32)."""
    found = _GROUP_STATS.get(device_index)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        return 0
    with torch.autocast("cuda", enabled=False):
        x = torch.tensor([[256.0, 258.0]], dtype=torch.bfloat16, device=f"cuda:{device_index}")
        y = tuple(torch.nn.functional.group_norm(x, 1).float().tolist()[0])
    found = {(0.0, 2.0): 2, (-1.0, 1.0): 1}.get(y, 0)
    _GROUP_STATS[device_index] = found
    return found


def fused_pays(m: int, n: int, k: int) -> bool:
    """Whether kernel="auto" sends an (M, K) x (K, N) problem to the fused kernel."""
    return not _below_fused_thresholds(m, n, k, bool)


def _below_fused_thresholds(m, n, k, surely) -> bool:
    """Whether an (M, K) x (K, N) problem falls below one of the fused kernel's thresholds,
    ``surely`` deciding each clause (bool for sizes; _surely for a traced call's)."""
    return (
        surely(m * n * k < MIN_FUSED_WORK) or surely(m < MIN_FUSED_ROWS) or surely(k < MIN_FUSED_K)
    )


def fused_kernel_code(kernel: str, x) -> int:
    """The fused kernel a call on x's device launches, as the host extension's launch code
    (chain_table.cu's launch_fused and the backward's gemm_split run it, deciding nothing):
    HOPPER_KERNEL for kernel="hopper" and for "auto" on sm_90, PORTABLE_KERNEL for "portable"
    and for "auto" elsewhere; 0 (no fused kernel: launch_fused refuses it) for
    kernel="epilogue" and off the GPU."""
    if kernel == "hopper":
        return HOPPER_KERNEL
    if kernel == "portable":
        return PORTABLE_KERNEL
    if kernel != "auto" or x.device.type != "cuda":
        return 0
    return HOPPER_KERNEL if _capability(x.device.index) == (9, 0) else PORTABLE_KERNEL


def splits_no_weight(m: int, n: int, k: int, float32: bool, kernel: str) -> bool:
    """Whether a call of these sizes takes no split of its weight on any path, from sizes alone
    (what a traced call knows): a 16-bit model's (its kernels read the weight as it is; other
    dtypes run PyTorch), or a float32 call on kernel="epilogue" or that kernel="auto" sends
    below the fused kernel's thresholds (the epilogue path, its few-rows kernel, or PyTorch's
    where no kernel runs). Such a call keeps no tensor between calls that a CUDA graph's replay
    would need afresh, and ops.traced_chain_call gives it the graph-safe op (library.py)."""
    if not float32 or kernel == "epilogue":
        return True
    return kernel == "auto" and _below_fused_thresholds(m, n, k, _surely)


def _surely(condition) -> bool:
    """``condition`` (a clause of _below_fused_thresholds) where the sizes decide it, a traced
    call's symbolic sizes guarding on it; False where they cannot (a size that data decides, as
    after boolean indexing: the graph-safe op is then not chosen). Only traced calls come here
    (ops._inference_op), and torch.compile has imported symbolic_shapes by then: eager calls
    do not pay its import (sympy's with it). No isinstance test first: Dynamo evaluates a
    symbolic bool to answer one, which a data-decided size cannot. A torch without
    guard_or_false (before 2.8) guards on the condition as it stands (a data-decided size then
    fails the compile, as it did before d7b4f33)."""
    from torch.fx.experimental import symbolic_shapes

    guard_or_false = getattr(symbolic_shapes, "guard_or_false", None)
    if guard_or_false is not None:
        return guard_or_false(condition)
    return True if condition else False  # noqa: SIM210 (Dynamo before 2.8 cannot trace bool())


def _device_problem(x) -> str:
    """Why no gemmfuse kernel runs on x's device ("" when one can)."""
    if x.device.type != "cuda":
        return f"{x.device.type} tensors run the PyTorch reference path"
    if _capability(x.device.index) < (8, 0):
        return "the fused kernels need compute capability 8.0 or newer"
    return ""


def kernels_run_on(x) -> bool:
    """Whether gemmfuse's kernels run on x's device (a CUDA GPU of sm_80 or newer)."""
    return not _device_problem(x)


def _model16_problem(x, kernel: str) -> str:
    """Why the Hopper kernel cannot take a 16-bit model's call on x ("" if it can)."""
    name = _DTYPE_NAMES[x.dtype]
    if _capability(x.device.index) != (9, 0) or kernel == "portable":
        return f"{name} models are fused by the Hopper kernel only (sm_90)"
    if x.shape[1] % 8 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return f"{name} rows must be 16-byte aligned (in_features a multiple of 8)"
    return ""


# No chain: its z is its output. Its library runs a chain apart's GEMM and the backward's split
# products (plan.py asks for it).
PLAIN_GEMM = Epilogue()


def chain_apart(path: str, epilogue: Epilogue, x, n: int, kernel: str, precision: str) -> bool:
    """Whether a call that took ``path`` runs a chain on float32 x with n output channels as the
    split GEMM storing z, then the chain kernel on z, rather than the chain in the GEMM's
    epilogue: the fused path under kernel="auto", precision="fp32", on sm_90, from
    CHAIN_APART_MIN_OUTPUTS and CHAIN_APART_MIN_K, for a chain that does something
    (kernel="hopper" keeps the chain in the fused kernel). plan.forward_spec puts the answer in
    the spec the host extension's executor runs."""
    m, k = x.shape
    return (
        path == "fused" and kernel == "auto" and precision == "fp32"
        and x.dtype == torch.float32
        and m * n >= CHAIN_APART_MIN_OUTPUTS and k >= CHAIN_APART_MIN_K
        and _capability(x.device.index) == (9, 0)
        and epilogue.structure != PLAIN_GEMM
    )  # fmt: skip


def forward_parts(
    path: str,
    apart: bool,
    kernel_code: int,
    split: bool,
    dtype: torch.dtype,
    norm_wide: bool,
    gemv: bool,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the chain's parts, the plain GEMM's parts) that a forward so decided runs: files of
    csrc/chain/ (gemmfuse.jit.CHAIN_PARTS), as chain_table.cu's dispatch picks them, and the
    chain's backward, whose plan plan.keep_plan asks of every call it keeps a plan for
    (autograd.kernel_plan). A chain's first call builds these at once with the rest it needs;
    a part this leaves out is built when it is first called, so a wrong answer here costs that
    call time, never its result."""
    epilogue_part = "chain_epilogue_16bit.cu" if dtype in MODEL16 else "chain_epilogue.cu"
    backward = "chain_backward.cu"
    if path == "epilogue":  # a few-rows call that saves z runs the chain kernel after the GEMM
        return ("chain_gemv.cu", epilogue_part, backward) if gemv else (epilogue_part, backward), ()
    if apart:
        return ("chain_epilogue.cu", backward), ("chain_sm90_split.cu",)
    if dtype == torch.bfloat16:
        gemm = "chain_sm90_bf16.cu"
    elif kernel_code != HOPPER_KERNEL:
        gemm = "chain_sm80.cu"
    elif split and dtype == torch.float32:
        gemm = "chain_sm90_split.cu"
    else:
        gemm = "chain_sm90_fp16.cu" if dtype == torch.float16 else "chain_sm90_one_pass.cu"
    return (gemm, epilogue_part, backward) if norm_wide else (gemm, backward), ()


def fused_k_splits(path: str, x, n: int, kernel_code: int, precision: str) -> int:
    """The slices a fused call on float32 x with n output channels cuts its K into (1: none):
    on the Hopper kernel's split variant (precision="fp32"), as many as keep the blocks (tiles
    times slices) within the SMs, each of at least SPLIT_K_MIN_K_TILES k-tiles; so a call splits
    where its 128 x 128 output tiles are at most half the SMs and K at least 2048. The result's
    bits then depend on M and on the GPU's SM count (the slices' sums are added in another order
    than one tile's k-tiles), as cuBLAS's split-K choices make PyTorch's. plan.forward_spec puts
    the answer in the spec the host extension's executor runs."""
    if (path != "fused" or kernel_code != HOPPER_KERNEL or not PRECISIONS[precision]
            or x.dtype != torch.float32 or x.device.type != "cuda"):  # fmt: skip
        return 1
    m, k = x.shape
    tiles = -(-m // TILE) * -(-n // TILE)
    k_tiles = split_padded(k) // K_ALIGN
    slices = min(_sm_count(x.device.index) // tiles, k_tiles // SPLIT_K_MIN_K_TILES, MAX_K_SPLITS)
    return max(1, slices)


def select_path(x, weight, epilogue: Epilogue, kernel="auto", params=()) -> tuple[str, str]:
    """(path, reason) for this call; reason says why a faster path was not taken."""
    problem = _device_problem(x)
    if problem:
        return "torch", problem
    bf16_reduction = x.dtype == torch.bfloat16 and epilogue.reduce is not None
    if x.dtype in MODEL16 and not bf16_reduction:
        problem = _model16_problem(x, kernel)
        if problem:
            return "torch", problem
    elif x.dtype not in (torch.float32, torch.bfloat16):
        return "torch", f"{x.dtype} inputs run the PyTorch path (fused: float32, bfloat16, float16)"
    (m, k), n = x.shape, weight.shape[0]
    if 0 in (m, n, k):
        return "torch", "empty tensors run the PyTorch path"
    if max(m, n) >= 2**31 or k >= 2**31 - K_ALIGN or m * n >= 2**40:
        return "torch", "sizes beyond 32-bit indexing run the PyTorch path"
    problem = _channel_param_problem(epilogue, params, x, n)
    if problem:
        return "torch", problem
    if bf16_reduction:
        problem = _bf16_reduction_problem(epilogue, n, x.device.index)
        return ("torch", problem) if problem else ("epilogue", "")
    if kernel == "epilogue":
        if x.dtype == torch.float32 or model16_in_tiles(epilogue, n):
            return "epilogue", ""
        return "torch", (
            "the epilogue path takes float32 inputs, and 16-bit ones whose chains norm or "
            "reduce within 128-channel tiles"
        )
    if kernel == "auto" and not fused_pays(m, n, k):
        if x.dtype == torch.float32:
            return "epilogue", ""
        return "torch", (
            f"M={m}, N={n}, K={k} is below the fused kernel's thresholds (dispatch.MIN_FUSED_*), "
            f'where eager {_DTYPE_NAMES[x.dtype]} is as fast; kernel="hopper" forces it'
        )
    if x.dtype in MODEL16 and kernel == "auto" and model16_in_tiles(epilogue, n):
        return "epilogue", ""
    return "fused", ""


def model16_in_tiles(epilogue: Epilogue, n: int) -> bool:
    """Whether a 16-bit model's call that the fused kernel would take runs the epilogue path
    instead: PyTorch's GEMM in the model's dtype, then the chain kernel on its result, for
    chains that norm or reduce within 128-channel tiles (the kernel that reads a 16-bit input).
    cuBLAS's 16-bit GEMM outruns the fused kernel's single product, whose epilogue is not
    overlapped with its mainloop: at #62's size (H100, 2026-11-26, torch.profiler, commit
    6d92f8d) the bf16 GEMM took 169 us and the chain kernel 36 us, 205 us in all against the
    fused kernel's 224 (231 saving z); fp16 216 against 228 (the bf16 chain kernel: 24.3 us since
    edb0080, 16.3 us since 2d7d717, docs/DESIGN.md section 2). A bf16 chain there normalises with
    eager bf16's statistics and gives eager's output to the bit."""
    norm = epilogue.norm
    if norm is None and epilogue.reduce is None:
        return False  # a pointwise chain's kernel reads float32
    if norm is not None and norm.softmax:
        return False
    return not norm_settings(epilogue, n)[2]


def select_epilogue_path(z, epilogue: Epilogue, params=()) -> tuple[str, str]:
    """(path, reason) of a ``fused_epilogue`` call: "epilogue" (the chain kernel on z) or
    "torch"; reason says why the kernel was not taken."""
    problem = _device_problem(z)
    if problem:
        return "torch", problem
    if z.dtype != torch.float32:
        return "torch", f"{z.dtype} inputs run the PyTorch path (the chain kernel: float32)"
    m, n = z.shape
    if 0 in (m, n):
        return "torch", "empty tensors run the PyTorch path"
    if max(m, n) >= 2**31 or m * n >= 2**40:
        return "torch", "sizes beyond 32-bit indexing run the PyTorch path"
    problem = _channel_param_problem(epilogue, params, z, n)
    return ("torch", problem) if problem else ("epilogue", "")


def take_path(x, weight, epilogue: Epilogue, kernel: str, params) -> str:
    """The path a validated call takes (:func:`select_path`), after refusing a forced kernel the
    GPU lacks; a CUDA call sent to the PyTorch path warns (:class:`FallbackWarning`) why."""
    path, reason = select_path(x, weight, epilogue, kernel, params)
    if path == "fused" and kernel == "hopper" and _capability(x.device.index) != (9, 0):
        raise ValueError('kernel="hopper" needs an sm_90 GPU (H100/H200)')
    if path == "torch" and x.device.type == "cuda":
        warnings.warn(f"gemmfuse: {reason}", FallbackWarning, stacklevel=4)
    return path


def norm_settings(epilogue: Epilogue, n: int) -> tuple[int, float, bool]:
    """(group size, eps, whether groups straddle the 128-channel output tiles: the wide
    GroupNorm's cross-tile statistics and second sweep) of a chain on n channels."""
    norm = epilogue.norm
    if norm is None:
        return 1, 0.0, False
    group_size = n // norm.num_groups
    return group_size, norm.eps, TILE % group_size != 0


def gemv_fits(path: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call that took ``path`` runs the epilogue path's one-or-two-rows kernel where it
    saves no z (plan.forward_spec puts the answer in the executor's spec): a float32 call on the
    epilogue path with K a multiple of 4 and 16-byte aligned rows."""
    m, k = x.shape
    return (
        path == "epilogue"
        and x.dtype == torch.float32
        and m <= GEMV_MAX_ROWS
        and k % 4 == 0
        and x.stride(1) == 1
        and x.stride(0) % 4 == 0
        and x.data_ptr() % 16 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
    )


# The sparse products pay where a row's nonzero dz columns (one group per extreme) are at most
# this fraction of its channels.
SPARSE_MAX_FRACTION = 1 / 8
# Their bounds (csrc/operands/sparse_products.h): K up to 2^30 (int32 column indices with
# slack), int32 indexing of N (with a 2048-column piece of slack) and of the scratch's ints.
SPARSE_MAX_K = 2**30  # kSparseMaxK
SPARSE_STRIP = SPARSE_BATCH = 16  # kSparseStrip, kSparseBatch
SPARSE_COUNTERS = 6  # kSparseCounters


def sparse_gradient(epilogue: Epilogue, n: int) -> bool:
    """Whether the chain's dz (the gradient of x @ W^T + b) is zero but for a few columns of
    each row: a min or max over the n channels sends a row's gradient to its extremes alone,
    pointwise ops keep it in their columns and a GroupNorm spreads it over their groups, each a
    small part of the row. A tie spreads it over more groups (each tied extreme's), which the
    sparse products take too, at a cost in proportion."""
    reduce = epilogue.reduce
    if reduce is None or reduce.op not in ("min", "max"):
        return False
    norm = epilogue.norm
    width = 1 if norm is None else n // norm.num_groups  # a LayerNorm's group: the row
    return width <= n * SPARSE_MAX_FRACTION


def sparse_fits(m: int, n: int, k: int) -> bool:
    """Whether the sparse products' kernels take an (m, n) dz and k columns of W and x
    (host_sparse.cpp's checks, so that a call beyond them keeps PyTorch's products)."""
    strips = -(-n // SPARSE_STRIP)
    scratch = 2 * m + SPARSE_COUNTERS + strips * (3 + m) + 1 + 2 * strips * -(-m // SPARSE_BATCH)
    return k <= SPARSE_MAX_K and n < 2**31 - 2048 and m < 2**31 and scratch < 2**31


def backward_products(path: str, x, weight, kernel: str, epilogue: Epilogue):
    """(sparse, split dx, split dW): where dz is sparse (:func:`sparse_gradient`, a CUDA float32,
    bfloat16 or float16 call on a gemmfuse kernel path, within the kernels' sizes) both products
    take its nonzero entries alone (csrc/operands/sparse_products.cu); else
    :func:`backward_splits`."""
    (m, k), n = x.shape, weight.shape[0]
    if (
        path != "torch"
        and x.dtype in BACKWARD_DTYPES
        and sparse_gradient(epilogue, n)
        and sparse_fits(m, n, k)
    ):
        return True, False, False
    return (False, *backward_splits(path, x, weight, kernel))


def backward_splits(path: str, x, weight, kernel: str) -> tuple[bool, bool]:
    """(dx, dW): whether each backward product runs on the Hopper split kernel, where the
    forward's rules would send a problem of its shape to the fused kernel (float32 models); else
    as PyTorch multiplies (eager's own result, and a 16-bit model's single product)."""
    (m, k), n = x.shape, weight.shape[0]
    # The portable kernel's products are not used: on one drawn chain (rdiv after a GroupNorm,
    # M = K = 1024, N = 600) its dx came out at 4.1e-3 relative error where eager's was 4.6e-7
    # (tests/gpu/test_autograd.py, commit 7eab5c0); not yet understood, so PyTorch multiplies.
    split_ok = (
        path == "fused" and x.dtype == torch.float32 and kernel != "portable"
        and _capability(x.device.index) == (9, 0)
    )  # fmt: skip

    def pays(rows, cols, depth):
        return split_ok and (kernel != "auto" or fused_pays(rows, cols, depth))

    return pays(m, k, n), pays(n, k, m)


def outer_layout(value: torch.Tensor, operand: torch.Tensor) -> tuple[bool, torch.Size] | None:
    """How PyTorch's broadcast of ``value`` against ``operand`` lays out its result, where it is
    an outer product's ``out[o, i]`` (#75's (M, 1) + (1, C, 1, 1) -> (1, C, M, 1)): (whether
    value's elements run along i, the inner and contiguous index; the result's shape). None
    where it is not one: the dimensions where each has more than one element overlap or
    interleave, or one of them has a single element (a plain elementwise op, which PyTorch
    vectorises)."""
    return _outer_layout(tuple(value.shape), tuple(operand.shape))


# A model's tail meets the same shapes call after call: kept per pair of shapes. Worked out
# afresh, #75's pair took 11.4 us a call against 0.5 kept (timeit, the 2-core CPU development
# machine, torch 2.13, 2026-11-28), host time after the kernels are queued but before the call
# returns.
@functools.lru_cache(maxsize=256)
def _outer_layout(value_shape: tuple, operand_shape: tuple) -> tuple[bool, torch.Size] | None:
    shape = torch.broadcast_shapes(value_shape, operand_shape)
    if 0 in shape:
        return None
    n = len(shape)
    value_shape = (1,) * (n - len(value_shape)) + value_shape
    operand_shape = (1,) * (n - len(operand_shape)) + operand_shape
    value_dims = [d for d in range(n) if value_shape[d] != 1]
    operand_dims = [d for d in range(n) if operand_shape[d] != 1]
    if not value_dims or not operand_dims:
        return None
    if max(operand_dims) < min(value_dims):
        return True, shape
    if max(value_dims) < min(operand_dims):
        return False, shape
    return None
