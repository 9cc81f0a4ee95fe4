"""How a call is served: which path it takes, and the thresholds and constants the rules use.

``select_path`` picks the path of a call (``fused``, ``epilogue`` or ``torch``; ops.py's module
docstring says what each runs) from its tensors, the GPU and ``kernel=``, and
``select_epilogue_path`` that of a ``fused_epilogue`` call (the chain on a given tensor);
``fused_pays`` holds the size thresholds of ``kernel="auto"``; ``backward_splits`` says which
backward products run on the split tensor-core kernel. Not yet here: the launch's own choices
(a wide GroupNorm's second sweep and the one-or-two-rows kernel in ops.launch_path, whether the
chain backward kernel fits in autograd.py, tiles and grids in csrc/). The constants that the
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
TILE = 128  # kTile in csrc/fused_args.h: groups that divide it are normalised in the tile
# kernel= choices: the fused kernels with launch_fused's codes (csrc/chain_table.h), and the
# epilogue path (PyTorch's GEMM, then the chain in one kernel).
FUSED_KERNELS = {"auto": 0, "portable": 1, "hopper": 2}
KERNELS = (*FUSED_KERNELS, "epilogue")
# "fp32": hi*hi + hi*lo + lo*hi, as accurate as PyTorch fp32. "tf32": hi*hi alone, operands with
# 11 significant bits like TF32's, one third of the tensor-core work (the backward's products too).
PRECISIONS = {"fp32": True, "tf32": False}
# kernel="auto" takes the fused kernel from these sizes up, and below them the epilogue path
# (float32) or the PyTorch path (bfloat16). Below MIN_FUSED_WORK = M*N*K the fused kernel's
# fixed cost (two launches) dominates; below MIN_FUSED_ROWS = M the GEMM is a matrix-vector
# product bound by reading W, where 128-row tiles waste their tensor work and a grid of N/128
# blocks leaves SMs idle (both set from the shape sweep of docs/PERFORMANCE.md, which times
# both paths on every row, H100). Below MIN_FUSED_K the split GEMM's error, about 2^-22 of
# |x||w| per product whatever K, is no longer reliably below eager fp32's accumulated
# rounding, which grows with K (scripts/small_shape_accuracy.py; docs/DESIGN.md).
MIN_FUSED_WORK = 1e8
MIN_FUSED_ROWS = 16
MIN_FUSED_K = 1024
GEMV_MAX_ROWS = 2  # kGemvMaxRows in csrc/fused_args.h
SPLIT_COLS_MAX = 65535 * 32  # kSplitColsMax in csrc/split.h: split_cols' grid bound on columns


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


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


def fused_pays(m: int, n: int, k: int) -> bool:
    """Whether kernel="auto" sends an (M, K) x (K, N) problem to the fused kernel."""
    return m * n * k >= MIN_FUSED_WORK and m >= MIN_FUSED_ROWS and k >= MIN_FUSED_K


def _device_problem(x) -> str:
    """Why no gemmfuse kernel runs on x's device ("" when one can)."""
    if x.device.type != "cuda":
        return f"{x.device.type} tensors run the PyTorch reference path"
    if _capability(x.device.index) < (8, 0):
        return "the fused kernels need compute capability 8.0 or newer"
    return ""


def select_path(x, weight, epilogue: Epilogue, kernel="auto", params=()) -> tuple[str, str]:
    """(path, reason) for this call; reason says why a faster path was not taken."""
    problem = _device_problem(x)
    if problem:
        return "torch", problem
    if x.dtype == torch.bfloat16:
        if _capability(x.device.index) != (9, 0) or kernel == "portable":
            return "torch", "bfloat16 models are fused by the Hopper kernel only (sm_90)"
        if x.shape[1] % 8 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            return "torch", "bfloat16 rows must be 16-byte aligned (in_features a multiple of 8)"
        if epilogue.reduce is not None:
            # Measured on #75: a one-ulp difference from eager at the reduced value (the GEMM
            # sums in another order) exceeds bf16's 1e-2 tolerance once a later add cancels it.
            return "torch", "bfloat16 chains with a reduction run the PyTorch path"
    elif x.dtype != torch.float32:
        return "torch", f"{x.dtype} inputs run the PyTorch path (fused: float32, bfloat16)"
    (m, k), n = x.shape, weight.shape[0]
    if 0 in (m, n, k):
        return "torch", "empty tensors run the PyTorch path"
    if max(m, n) >= 2**31 or k >= 2**31 - K_ALIGN or m * n >= 2**40:
        return "torch", "sizes beyond 32-bit indexing run the PyTorch path"
    problem = _channel_param_problem(epilogue, params, x, n)
    if problem:
        return "torch", problem
    if kernel == "epilogue":
        if x.dtype != torch.float32:
            return "torch", "the epilogue path takes float32 inputs"
        return "epilogue", ""
    if kernel == "auto" and not fused_pays(m, n, k):
        if x.dtype == torch.float32:
            return "epilogue", ""
        return "torch", (
            f"M={m}, N={n}, K={k} is below the fused kernel's thresholds (dispatch.MIN_FUSED_*), "
            'where eager bfloat16 is as fast; kernel="hopper" forces it'
        )
    return "fused", ""


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


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the epilogue path's one-or-two-rows kernel takes this float32 problem."""
    m, k = x.shape
    return (
        m <= GEMV_MAX_ROWS
        and k % 4 == 0
        and x.stride(1) == 1
        and x.stride(0) % 4 == 0
        and x.data_ptr() % 16 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
    )


def backward_splits(path: str, x, weight, kernel: str) -> tuple[bool, bool]:
    """(dx, dW): whether each backward product runs on the Hopper split kernel, where the
    forward's rules would send a problem of its shape to the fused kernel (float32 models); else
    as PyTorch multiplies (eager's own result, and a bf16 model's single product)."""
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
