"""Functional entry point: ``fused_linear`` and its dispatch.

Paths, in the order they are tried:

``fused``
    One CUDA kernel (plus the activation's split pre-sweep): split-fp16 tensor-core GEMM with the
    chain up to its reduction in its epilogue. GroupNorm groups that fit a 128-channel output
    tile are normalised in the tile; wider groups (or groups that straddle tiles) get their
    statistics from each tile, merged by a light second kernel that normalises the output in
    place (one extra read and write of it). Needs a CUDA float32 2-D input on an sm_80+ GPU and
    tensor arguments of ``pre``/``post`` ops that are per channel and of x's dtype.
    The kernel is the Hopper one (wgmma + TMA) on sm_90, the portable one (mma.sync + cp.async)
    elsewhere. bfloat16 models are fused on sm_90 too (one tensor-core product on their bf16
    operands, fp32 epilogue); ``kernel="portable"`` / ``"hopper"`` forces one. ``tail`` ops
    (after a reduction) run in PyTorch on the reduced (M,) values.
``epilogue``
    PyTorch's own fp32 GEMM (``F.linear``: cuBLAS, eager's exact result), then one CUDA kernel
    that applies the whole chain tile by tile (csrc/norm_finalize.cuh): two launches where eager
    makes one per op. At up to ``GEMV_MAX_ROWS`` rows (K a multiple of 4, 16-byte aligned rows)
    one kernel does both (csrc/gemv_epilogue.cuh): a matrix-vector product with compensated
    sums, at least as accurate as PyTorch's, then the chain. Groups wider than a 128-channel
    tile add the second kernel. ``kernel="auto"`` takes this path for float32 problems below
    the fused kernel's size thresholds (``fused_pays``: small or few-row problems, where the
    fused kernel's fixed cost and idle tile rows cost more than its tensor cores save, and
    K < 1024, where the split GEMM's error is not reliably below eager's);
    ``kernel="epilogue"`` forces it.
``torch``
    The PyTorch reference (reference.py): CPU tensors, fp16/fp64 (and bf16 off sm_90 or with a
    reduction, or below the fused kernel's size thresholds), GPUs older than sm_80, tensor
    arguments that are not per channel.

A CUDA call that runs the ``torch`` path emits a :class:`FallbackWarning` saying why. With
autograd recording, the ``fused`` and ``epilogue`` paths run through
:class:`gemmfuse.autograd.FusedLinearFunction`: the same kernels, plus a saved GEMM result and a
backward (autograd.py).

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gemmfuse.autograd import FusedCall, FusedLinearFunction, channel_vectors
from gemmfuse.epilogue import Epilogue, epilogue_spec, per_channel
from gemmfuse.reference import apply_pointwise, linear_epilogue
from gemmfuse.sources import extension_for
from gemmfuse.validation import validate

K_ALIGN = 64  # the Hopper kernel's k-tile: operands are zero-padded in K to a multiple of it
TILE = 128  # kTile in csrc/tile_epilogue.cuh: groups that divide it are normalised in the tile
# kernel= choices: the fused kernels with launch_fused's codes (csrc/fused_args.h), and the
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
GEMV_MAX_ROWS = 2  # kGemvMaxRows in csrc/gemv_epilogue.cuh


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


class FallbackWarning(UserWarning):
    """A CUDA call ran on a slower gemmfuse path than the fully fused kernel."""


class SplitWeightCache:
    """The fp16 hi/lo split of a weight, computed once and recomputed when the weight changes.

    A change is any of: another tensor or storage (``.to()``, ``load_state_dict`` with
    ``assign=True``, ``param.data = ...``), or an in-place write through the parameter itself
    (optimizer steps, ``load_state_dict``), which bumps its version counter. The cache holds the
    storage it was built from, so that address cannot be reused by a new weight unnoticed.
    Writes through ``param.data`` bypass the version counter: call :meth:`clear` after them.
    Memory: 4 bytes per weight element (two fp16 copies), plus 4 bytes per output channel; as
    much again once a backward has run (the transposed split its input gradient reads).

    It also keeps, by the same rules, dense float32 copies of the per-channel vectors the
    kernels read (:meth:`float32`) where they are not already (a bfloat16 model's bias and
    GroupNorm affine): 4 bytes per channel and vector, one copy per vector slot.
    """

    # Every live cache by its token: the torch.library ops (library.py) take a token, as a
    # compiled graph or an exported program holds ints, not Python objects.
    _live = weakref.WeakValueDictionary()
    # Tokens that no live cache holds (a program exported by another process), the oldest
    # dropped beyond _MAX_ADOPTED: a dropped token's next call splits its weight afresh.
    _adopted = {}
    _MAX_ADOPTED = 64
    _tokens = itertools.count()

    def __init__(self):
        self.token = next(self._tokens)
        self._live[self.token] = self
        self.clear()

    @classmethod
    def for_token(cls, token: int) -> "SplitWeightCache":
        """The cache of ``token``: a new one for -1 (no cache), and one kept (the last
        ``_MAX_ADOPTED`` of them) for a token no live cache holds (a program exported by another
        process)."""
        if token < 0:
            return cls()
        cache = cls._live.get(token)
        if cache is None:
            cache = cls._adopted.get(token)
        if cache is None:
            if len(cls._adopted) >= cls._MAX_ADOPTED:
                del cls._adopted[next(iter(cls._adopted))]
            cache = cls._adopted[token] = cls()
        return cache

    def clear(self) -> None:
        self._entries = {}

    def _lookup(self, t: torch.Tensor, slot, make):
        """``make()``, made once per version of ``t`` for this slot."""
        storage = t.untyped_storage()
        # data_ptr: a storage freed and re-allocated (resize_) keeps its object but may move.
        # FSDP2's refills keep address and version alike: cache_for_call keeps no cache then.
        key = (t._version, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype, t.device)  # fmt: skip
        hit = self._entries.get(slot)
        if hit is None or hit[0] is not storage or hit[1] != key:
            hit = (storage, key, make())
            self._entries[slot] = hit
        return hit[2]

    def float32(self, t: torch.Tensor | None, slot: str) -> torch.Tensor | None:
        """``t`` as a contiguous float32 tensor, converted once per version of ``t``; ``slot``
        names its role ("bias", ...), so a new tensor in a slot replaces the old copy."""
        if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
            return t
        return self._lookup(t, slot, lambda: t.detach().to(torch.float32).contiguous())

    def get(self, ext, weight: torch.Tensor, k_padded: int):
        """The weight's rows split: (hi, lo) [N, k_padded] and scales [N] (the forward's B)."""
        return self._split(weight, ("rows", k_padded), ext.split_rows)

    def transposed(self, ext, weight: torch.Tensor, n_padded: int):
        """The weight's columns split: (hi, lo) [K, n_padded] and scales [K] (dx's B)."""
        return self._split(weight, ("cols", n_padded), ext.split_cols)

    def _split(self, weight: torch.Tensor, slot: tuple[str, int], split):
        """``split(weight, padded)`` (an extension's split_rows or split_cols), on a unit-stride
        copy where the rows are strided, made once per version of the weight."""
        w = weight.detach()
        return self._lookup(
            weight, slot, lambda: split(w if w.stride(1) == 1 else w.contiguous(), slot[1])
        )


def cache_for_call(cache: SplitWeightCache | None) -> SplitWeightCache:
    """The cache a call uses: ``cache``, or a new one (the split made in the call) where there is
    none, a CUDA graph is being captured, or FSDP2 manages modules (:func:`fsdp_in_use`). A graph
    captured with the cache's split would replay on that split after the weight changed in
    place; captured with a new one, the split is part of the graph and redone at each replay."""
    if cache is None or fsdp_in_use():
        return SplitWeightCache()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return SplitWeightCache()
    return cache


def fsdp_in_use() -> bool:
    """Whether a composable ``torch.distributed`` API (FSDP2's ``fully_shard``, among others)
    manages modules in this process.

    FSDP2 refills a module's unsharded parameters before each use in the same storage, from the
    second step on at the same address, without bumping their version counters (measured with
    torch 2.13, one rank: version 0 and one data pointer across SGD steps that changed every
    value), so no key the weight cache can read sees the new values. While FSDP2 is in use each
    call splits its weight afresh: training loses nothing by it (an optimizer step changes the
    weights between any two steps' calls), a forward repeated on unchanged weights pays the
    split (docs/PERFORMANCE.md's "weights changed" column).
    """
    state = sys.modules.get("torch.distributed._composable_state")
    return state is not None and len(getattr(state, "_module_state_mapping", ())) > 0


def _channel_param_problem(epilogue: Epilogue, params, x, n: int) -> str:
    """Why the kernel cannot read the pre/post tensor arguments per channel ("" if it can)."""
    for i in sorted(set(epilogue.channel_params)):
        t = params[i]
        if not per_channel(tuple(t.shape), n):
            return (
                f"params[{i}] of shape {tuple(t.shape)} is not per channel (expected (), (1,), "
                f"({n},) or (1, {n})), so the chain runs in PyTorch"
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


def select_path(x, weight, epilogue: Epilogue, kernel="auto", params=()) -> tuple[str, str]:
    """(path, reason) for this call; reason says why a faster path was not taken."""
    if x.device.type != "cuda":
        return "torch", f"{x.device.type} tensors run the PyTorch reference path"
    if _capability(x.device.index) < (8, 0):
        return "torch", "the fused kernels need compute capability 8.0 or newer"
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
            f"M={m}, N={n}, K={k} is below the fused kernel's thresholds (ops.MIN_FUSED_*), "
            'where eager bfloat16 is as fast; kernel="hopper" forces it'
        )
    return "fused", ""


def take_path(x, weight, epilogue: Epilogue, kernel: str, params) -> str:
    """The path a validated call takes (:func:`select_path`), after refusing a forced kernel the
    GPU lacks; a CUDA call sent to the PyTorch path warns (:class:`FallbackWarning`) why."""
    path, reason = select_path(x, weight, epilogue, kernel, params)
    if path == "fused" and kernel == "hopper" and _capability(x.device.index) != (9, 0):
        raise ValueError('kernel="hopper" needs an sm_90 GPU (H100/H200)')
    if path == "torch" and x.device.type == "cuda":
        warnings.warn(f"gemmfuse: {reason}", FallbackWarning, stacklevel=4)
    return path


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
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


def launch_path(path, epilogue, cache, kernel, precision, x, weight, bias, gn_weight, gn_bias,
                params, save_z):  # fmt: skip
    """(the chain's output up to its tail ops, z) for a ``fused`` or ``epilogue`` path call; z, the
    GEMM result x @ W.T + b that the backward starts from, only when ``save_z`` (else None)."""
    # Runs once per forward: keep it lean.
    ext = extension_for(epilogue)
    norm = epilogue.norm
    (m, _), n = x.shape, weight.shape[0]
    group_size = n // norm.num_groups if norm else 1
    eps = norm.eps if norm else 0.0
    # Groups that straddle 128-channel tiles get cross-tile statistics and a second sweep.
    norm_wide = norm is not None and TILE % group_size != 0
    # The kernels read the channel vectors as dense float32 arrays.
    bias, gn_weight, gn_bias = (
        cache.float32(t, slot)
        for t, slot in ((bias, "bias"), (gn_weight, "gn_weight"), (gn_bias, "gn_bias"))
    )
    vectors = channel_vectors(epilogue, params, n)
    chain = (vectors, epilogue.scalars, group_size, eps, norm_wide)
    fused_z = save_z and path == "fused"  # the epilogue path's z is a copy of F.linear's
    z = torch.empty((m, n), dtype=x.dtype, device=x.device) if fused_z else None
    if path == "epilogue" and not save_z and _gemv_fits(x, weight):
        out = ext.gemv_forward(x, weight, bias, gn_weight, gn_bias, *chain)
    elif path == "epilogue":  # the chain kernel works in place: z keeps its own copy
        y = F.linear(x, weight, bias)
        z = y.clone() if save_z else None
        out = ext.epilogue_forward(y, gn_weight, gn_bias, *chain)
    elif x.dtype == torch.bfloat16:  # a bf16 model: its own operands, one tensor-core product
        w = weight if weight.is_contiguous() else weight.contiguous()
        out = ext.fused_forward_bf16(x, w, bias, gn_weight, gn_bias, *chain, z)
    else:
        k_padded = -(-weight.shape[1] // K_ALIGN) * K_ALIGN
        w_hi, w_lo, w_inv = cache.get(ext, weight, k_padded)
        out = ext.fused_forward(
            x, w_hi, w_lo, w_inv, bias, gn_weight, gn_bias, vectors, epilogue.scalars,
            group_size, eps, FUSED_KERNELS[kernel], PRECISIONS[precision], norm_wide, z,
        )  # fmt: skip
    if epilogue.reduce is not None and epilogue.reduce.keepdim:
        out = out.view(m, 1)
    return out, z


def _records_grad(x, weight, bias, gn_weight, gn_bias, params, epilogue: Epilogue) -> bool:
    """Whether autograd records this call through the chain up to its tail ops."""
    # Runs on every call before the launch: plain tests, no containers built.
    if not torch.is_grad_enabled():
        return False
    if x.requires_grad or weight.requires_grad:
        return True
    for t in (bias, gn_weight, gn_bias):
        if t is not None and t.requires_grad:
            return True
    return any(params[i].requires_grad for i in epilogue.channel_params)


def backward_plan(path, x, weight, epilogue, launch, cache, kernel, precision) -> FusedCall:
    """The autograd plan: each backward product runs on the Hopper split kernel where the
    forward's rules would send a problem of its shape to the fused kernel (float32 models),
    else as PyTorch multiplies (eager's own result, and a bf16 model's single product)."""
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

    return FusedCall(
        epilogue,
        launch,
        cache,
        split_dx=pays(m, k, n),
        split_dw=pays(n, k, m),
        kernel=FUSED_KERNELS.get(kernel, 0),
        split=PRECISIONS[precision],
        chain_kernel=path != "torch",
    )  # fmt: skip  (kernel="epilogue" splits nothing: its code is never read)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: Epilogue,
    gn_weight: torch.Tensor | None = None,
    gn_bias: torch.Tensor | None = None,
    *,
    params: Sequence[torch.Tensor] = (),
    weight_cache: SplitWeightCache | None = None,
    kernel: str = "auto",
    precision: str = "fp32",
) -> torch.Tensor:
    """``epilogue(x @ weight.T + bias)`` as PyTorch computes it, in one fused kernel where it can.

    Args:
        x: (M, K) input.
        weight, bias: the Linear's (N, K) weight and (N,) bias (or None).
        epilogue: the chain after the GEMM (:class:`gemmfuse.Epilogue`).
        gn_weight, gn_bias: the GroupNorm's affine parameters, when it is affine.
        params: the tensors the epilogue's :class:`gemmfuse.Param` arguments refer to; those
            of ops before the reduction must broadcast to (M, N) without changing it (a
            ValueError names one that does not).
        weight_cache: keeps the weight's fp16 split between calls; without one the weight is
            split on every call (correct, slower).
        kernel: "auto" (by problem size and GPU), "portable" (sm_80+ mma.sync), "hopper"
            (sm_90 wgmma) or "epilogue" (PyTorch's GEMM, then the chain in one kernel).
        precision: "fp32" (default; PyTorch fp32's accuracy) or "tf32" (opt-in: one tensor-core
            product on 11-bit operands, about TF32's error, for speed; the backward's products
            too). Applies to float32 inputs; a bfloat16 model (sm_90) always runs one product
            on its own bf16 operands.

    Returns what the chain returns in PyTorch: (M, N), or the reduction's (M,) / (M, 1) after
    any tail ops (broadcast as PyTorch broadcasts). With autograd recording, the result has a
    backward: gradients for x, weight, bias, the GroupNorm's affine vectors and ``params``
    (gemmfuse/autograd.py).
    """
    return fused_linear_with_path(
        x, weight, bias, epilogue, gn_weight, gn_bias,
        params=params, weight_cache=weight_cache, kernel=kernel, precision=precision,
    )[0]  # fmt: skip


def fused_linear_with_path(
    x, weight, bias, epilogue, gn_weight=None, gn_bias=None, *,
    params=(), weight_cache=None, kernel="auto", precision="fp32",
) -> tuple[torch.Tensor, str]:  # fmt: skip
    """:func:`fused_linear`, also returning the path taken: "fused", "epilogue" or "torch"."""
    validate(x, weight, bias, epilogue, gn_weight, gn_bias, params)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if torch.compiler.is_compiling():
        out = _traced_call(x, weight, bias, epilogue, gn_weight, gn_bias, params,
                           weight_cache, kernel, precision)  # fmt: skip
        return out, "compiled"
    path = take_path(x, weight, epilogue, kernel, params)
    if path == "torch":
        return linear_epilogue(x, weight, bias, epilogue, gn_weight, gn_bias, params), path
    cache = cache_for_call(weight_cache)
    launch = functools.partial(launch_path, path, epilogue, cache, kernel, precision)
    if _records_grad(x, weight, bias, gn_weight, gn_bias, params, epilogue):
        call = backward_plan(path, x, weight, epilogue, launch, cache, kernel, precision)
        out = FusedLinearFunction.apply(call, x, weight, bias, gn_weight, gn_bias, *params)
    else:
        out = launch(x, weight, bias, gn_weight, gn_bias, params, False)[0]
    return apply_pointwise(out, epilogue.tail, params), path


def _traced_call(x, weight, bias, epilogue, gn_weight, gn_bias, params, cache, kernel, precision):
    """The call as torch.compile and torch.export record it: the ``gemmfuse::`` torch.library
    op (library.py), whose implementation is this module's eager call, then the tail ops in
    PyTorch. The extension's functions are opaque to tracing; the op has a fake implementation
    (the output's shape) and an autograd formula. The weight cache goes by its token."""
    token = -1 if cache is None else cache.token
    chain = epilogue_spec(epilogue, tail=False)  # a string constant of the traced graph
    args = (x, weight, bias, gn_weight, gn_bias, list(params), chain, kernel, precision, token)
    if _records_grad(x, weight, bias, gn_weight, gn_bias, params, epilogue):
        out = torch.ops.gemmfuse.fused_linear_saving_z(*args)[0]
    else:
        out = torch.ops.gemmfuse.fused_linear(*args)
    return apply_pointwise(out, epilogue.tail, params)
