"""Functional entry point: ``fused_linear`` and its dispatch.

Paths, in the order they are tried:

``fused``
    One CUDA kernel (plus the activation's split pre-sweep): split-fp16 tensor-core GEMM with the
    chain up to its reduction in its epilogue. Under ``kernel="auto"``, a float32 call on sm_90 from
    M*N = 2^23 with K >= 4096 (``dispatch.chain_apart``) runs the chain in the chain kernel right
    after the GEMM instead (the GEMM stores z), faster there with autograd recording and for costly
    chains; where the chain norms in groups of 8 or 16, that kernel starts under the GEMM's last
    wave and normalises (and reduces) each tile once stored (csrc/epilogue/group_tiles.cuh). In
    the fused kernel, GroupNorm groups that fit a 128-channel output tile are normalised in the
    tile; wider groups (or groups that straddle tiles) get their statistics from
    each tile, merged by a light second kernel that normalises the output in place (one extra read
    and write of it); a chain run apart takes the epilogue path's chain kernel below. Needs a CUDA
    float32 2-D input on an sm_80+ GPU and tensor arguments of ``pre``/``post`` ops that are per
    channel and of x's dtype. The kernel is the Hopper one (wgmma + TMA) on sm_90, the portable one
    (mma.sync + cp.async) elsewhere. bfloat16 and float16 models are fused on sm_90 too (one
    tensor-core product on their own operands, fp32 epilogue rounded where eager rounds);
    ``kernel="portable"`` / ``"hopper"`` forces one. ``tail`` ops (after a reduction) run in PyTorch
    on the reduced (M,) values.
``epilogue``
    PyTorch's own GEMM (``F.linear``: cuBLAS, eager's exact result), then one CUDA kernel
    that applies the whole chain (csrc/epilogue/norm_finalize.cuh: tile by tile, or a group a
    thread for GroupNorm groups of 8 and 16, csrc/epilogue/group_rows.cuh): two launches
    where eager makes one per op. At up to ``GEMV_MAX_ROWS`` rows (K a multiple of 4, 16-byte
    aligned rows) one kernel does both (csrc/gemm/gemv_epilogue.cuh): a matrix-vector product
    with compensated sums, at least as accurate as PyTorch's, then the chain. Groups wider than
    a 128-channel tile take one kernel a row where it holds the row (float32 groups of whole
    tiles on aligned rows of up to 8192 channels, csrc/epilogue/wide_rows.cuh; other groups on
    rows of up to 2048), else add a second kernel. ``kernel="auto"`` takes this path for float32
    problems below the fused kernel's size thresholds (``fused_pays``: small or few-row
    problems, where the fused kernel's fixed cost and idle tile rows cost more than its tensor
    cores save, and K < 1024, where the split GEMM's error is not reliably below eager's);
    ``kernel="epilogue"`` forces it. bfloat16 and float16 models on sm_90 above those
    thresholds take it under ``kernel="auto"`` where the chain norms or reduces within
    128-channel tiles (``dispatch.model16_in_tiles``): PyTorch's GEMM in their dtype, then the
    chain kernel on its 16-bit result. bfloat16 chains with a min or max reduction take it
    whatever ``kernel`` says: PyTorch's bf16 GEMM, then the chain with eager bf16's GroupNorm
    arithmetic, so the reduced value is eager's to the bit (dispatch.py's
    ``_bf16_reduction_problem`` says why, and which such chains stay on PyTorch).
``torch``
    The PyTorch reference (reference.py): CPU tensors, fp64 (and bf16/fp16 off sm_90 or below
    the fused kernel's size thresholds; bf16 with a sum, mean or logsumexp reduction, or with a
    min or max after a norm the epilogue path does not reproduce), GPUs older than sm_80, tensor
    arguments that are not per channel.

A CUDA call that runs the ``torch`` path emits a :class:`FallbackWarning` saying why. With
autograd recording, the ``fused`` and ``epilogue`` paths run through
:class:`gemmfuse.autograd.FusedLinearFunction`: the same kernels, plus a saved GEMM result and a
backward (autograd.py).

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import functools
from collections.abc import Sequence

import torch

from gemmfuse.autograd import FusedCall, FusedLinearFunction, channel_vectors
from gemmfuse.dispatch import (
    PRECISIONS,
    backward_products,
    check_settings,
    fused_kernel_code,
    norm_settings,
    splits_no_weight,
    take_path,
)
from gemmfuse.epilogue import Epilogue, epilogue_spec
from gemmfuse.jit import extension_for
from gemmfuse.plan import forward_spec, keep_plan, plannable, planned_call
from gemmfuse.reference import apply_plain_ops, linear_epilogue, plain_ops
from gemmfuse.tail import apply_tail
from gemmfuse.validation import validate
from gemmfuse.weight_cache import SplitWeightCache, cache_for_call, fsdp_in_use


def launch_path(path, epilogue, cache, kernel, precision, x, weight, bias, gn_weight, gn_bias,
                params, save_z):  # fmt: skip
    """(the chain's output up to its tail ops, z) for a ``fused`` or ``epilogue`` path call; z, the
    GEMM result x @ W.T + b that the backward starts from, only when ``save_z`` (else None). The
    launch is decided by plan.forward_spec and run by the host extension's executor, the one a
    plan runs (csrc/host/host_plan.cpp's ``launch_spec``). A tensor subclass's own torch
    function is not consulted there: the epilogue path's GEMM is ``at::linear`` in C++ (before
    2853e70 ``F.linear`` in Python), as the fused kernels never consulted it."""
    # Runs once per forward decided afresh: keep it lean. forward_spec first: on a first call it
    # builds the libraries the call needs at once (a chain apart's and the plain GEMM's), where
    # extension_for first would build the chain's alone, then forward_spec the plain GEMM's.
    fields = forward_spec(path, epilogue, x, weight, kernel, precision)
    ext = extension_for(epilogue)
    spec = ext.host.PlanSpec(**fields)
    tensors = [x, weight, bias, gn_weight, gn_bias, *params]
    return ext.host.launch(spec, cache.native(ext), tensors, save_z)


def chain_arguments(epilogue: Epilogue, params, m: int, n: int) -> tuple:
    """What every chain kernel takes after its tensors: (the pre/post ops' tensor arguments,
    the chain's scalars, the group size, eps, whether groups straddle output tiles)."""
    group_size, eps, norm_wide = norm_settings(epilogue, n)
    return channel_vectors(epilogue, params, m, n), epilogue.scalars, group_size, eps, norm_wide


def records_grad(channel_params: tuple[int, ...], params, *tensors) -> bool:
    """Whether autograd records a call on ``tensors`` (None for an absent one) and the chain's
    ``params`` through the chain up to its tail ops (``channel_params``: the indices of those
    the chain reads, ``Epilogue.channel_params``)."""
    # Runs on every call before the launch: plain tests, no containers built.
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return any(params[i].requires_grad for i in channel_params)


def backward_plan(path, x, weight, epilogue, launch, cache, kernel, precision) -> FusedCall:
    """The autograd plan: the launch, the weight cache, and the backward products' kernels
    (:func:`gemmfuse.dispatch.backward_products`)."""
    sparse, split_dx, split_dw = backward_products(path, x, weight, kernel, epilogue)
    return FusedCall(
        epilogue,
        launch,
        cache,
        split_dx=split_dx,
        split_dw=split_dw,
        sparse=sparse,
        kernel=fused_kernel_code(kernel, x),
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
    """``epilogue(x @ weight.T + bias)`` as PyTorch computes it, in one fused kernel where it can
    (or, where that is faster, the fused path's GEMM and then the chain in a kernel of its own:
    the module docstring).

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
            (sm_90 wgmma, the chain in its epilogue) or "epilogue" (PyTorch's GEMM, then the
            chain in one kernel).
        precision: "fp32" (default; PyTorch fp32's accuracy) or "tf32" (opt-in: one tensor-core
            product on 11-bit operands, about TF32's error, for speed; the backward's products
            too). Applies to float32 inputs; a bfloat16 or float16 model (sm_90) always runs
            one product on its own operands.

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
    params=(), weight_cache=None, kernel="auto", precision="fp32", offer_plans=True,
) -> tuple[torch.Tensor, str]:  # fmt: skip
    """:func:`fused_linear`, also returning the path taken: "fused", "epilogue" or "torch".
    ``offer_plans=False``: the caller has offered this very call to ``weight_cache``'s plans
    and none served it (FusedLinear), so it is not offered again."""
    if weight_cache is not None and not isinstance(weight_cache, SplitWeightCache):
        raise TypeError(
            f"weight_cache must be a SplitWeightCache or None, got {type(weight_cache).__name__}"
        )
    # A call of a kind seen before runs in C++ (plan.py); the rules below decide the others.
    # plans_apply() first: torch.compile then never reads the plans (nor guards on them).
    if offer_plans and plans_apply() and weight_cache is not None and weight_cache.plans:
        planned = planned_call(weight_cache, epilogue, kernel, precision, x, weight, bias,
                               gn_weight, gn_bias, params)  # fmt: skip
        if planned is not None:
            out, path = planned
            return (apply_tail(out, epilogue, params) if epilogue.tail else out), path
    check_arguments(x, weight, bias, epilogue, gn_weight, gn_bias, params, kernel, precision)
    if torch.compiler.is_compiling():
        out = _traced_call(x, weight, bias, epilogue, gn_weight, gn_bias, params,
                           weight_cache, kernel, precision)  # fmt: skip
        return out, "compiled"
    path = take_path(x, weight, epilogue, kernel, params)
    if path == "torch":
        return linear_epilogue(x, weight, bias, epilogue, gn_weight, gn_bias, params), path
    cache = cache_for_call(weight_cache)
    launch = functools.partial(launch_path, path, epilogue, cache, kernel, precision)
    grad = records_grad(epilogue.channel_params, params, x, weight, bias, gn_weight, gn_bias)
    if grad:
        call = backward_plan(path, x, weight, epilogue, launch, cache, kernel, precision)
        out = FusedLinearFunction.apply(call, x, weight, bias, gn_weight, gn_bias, *params)
    else:
        out = launch(x, weight, bias, gn_weight, gn_bias, params, False)[0]
    if plannable(path) and cache is weight_cache:
        tensors = (x, weight, bias, gn_weight, gn_bias, params)
        keep_plan(weight_cache, epilogue, kernel, precision, tensors, grad, path)
    return apply_tail(out, epilogue, params), path


def check_arguments(x, weight, bias, epilogue, gn_weight, gn_bias, params, kernel, precision):
    """Raises TypeError/ValueError naming the first bad argument of a ``fused_linear`` call
    (validation.validate, then ``kernel`` and ``precision``)."""
    validate(x, weight, bias, epilogue, gn_weight, gn_bias, params)
    check_settings(kernel, precision)


def plans_apply() -> bool:
    """Whether a plan may run this call: not while torch.compile traces it (the
    ``gemmfuse::`` op stands for the call there) nor while FSDP2 manages modules (their
    weights change without a version the cache could see: weight_cache.fsdp_in_use)."""
    return not torch.compiler.is_compiling() and not fsdp_in_use()


def _traced_call(x, weight, bias, epilogue, gn_weight, gn_bias, params, cache, kernel, precision):
    """The call as torch.compile and torch.export record it (:func:`traced_chain_call`)."""
    specs = chain_call_specs(epilogue)
    return traced_chain_call(specs, x, weight, bias, gn_weight, gn_bias, params, cache, kernel,
                             precision)  # fmt: skip


def exporting() -> bool:
    """Whether torch.export traces this call. Under torch 2.11 Dynamo answers
    ``torch.compiler.is_exporting()`` with True in every trace, torch.compile's too (it reads
    the flag from 2.13 on), so the flag that function returns is read here directly; a torch
    without it (before 2.7) counts as exporting, which keeps the op with a formula."""
    return getattr(torch.compiler, "_is_exporting_flag", True)


def chain_call_specs(epilogue: Epilogue) -> tuple:
    """What :func:`traced_chain_call` needs of a chain, as plain constants: (the chain's spec
    without its tail ops, ``channel_params``, the tail ops as ``reference.plain_ops``).

    A module whose chain follows from a few settings (kernelbench/models.py) computes these in
    a function marked ``torch.compiler.assume_constant_result``: torch.compile then holds them
    as constants instead of tracing the chain's construction, whose frozen dataclasses each add
    a guard that costs a Python call at every compiled call under torch 2.11 (#62, H200, an
    experiment calling the op this way: 146 us of guard evaluation against 39 us, the compiled
    call's host time 152 against 99 us)."""
    return epilogue_spec(epilogue, tail=False), epilogue.channel_params, plain_ops(epilogue.tail)


def traced_chain_call(specs, x, weight, bias, gn_weight, gn_bias, params, cache, kernel,
                      precision):  # fmt: skip
    """The call as torch.compile and torch.export record it: the ``gemmfuse::`` torch.library
    op (library.py), whose implementation is this module's eager call, then the tail ops in
    PyTorch. The extension's functions are opaque to tracing; the op has a fake implementation
    (the output's shape, and the arguments' checks) and, where autograd records the call or
    torch.export traces it, an autograd formula (library.py says which op). The weight cache
    goes by its token; ``specs`` is :func:`chain_call_specs` of the chain."""
    chain, channel_params, tail = specs
    token = -1 if cache is None else cache.token
    args = (x, weight, bias, gn_weight, gn_bias, list(params), chain, kernel, precision, token)
    if records_grad(channel_params, params, x, weight, bias, gn_weight, gn_bias):
        out = torch.ops.gemmfuse.fused_linear_saving_z(*args)[0]
    elif torch.is_grad_enabled() or exporting():
        # autograd may record through the op (a tail op's tensor, a parameter whose
        # requires_grad changed without a recompile; an exported program run later): keep
        # the formula. torch.compile guards grad mode, so a no_grad graph stays no_grad.
        out = torch.ops.gemmfuse.fused_linear(*args)
    else:
        out = _inference_op(x, weight, kernel)(*args)
    return apply_plain_ops(out, tail, params)


def _inference_op(x, weight, kernel: str):
    """The op of a traced call that autograd does not record: ``gemmfuse::fused_linear_graph_safe``
    where the call takes no weight split (dispatch.splits_no_weight), which torch.compile's CUDA
    graphs record whole; else ``gemmfuse::fused_linear_inference``, which they leave out of the
    graph and run with the weight cache. With dynamic sizes the choice guards the graph on the
    side of the fused kernel's thresholds its sizes fall (Dynamo compiles again for a call on
    the other side)."""
    (m, k), n = x.shape, weight.shape[0]
    if splits_no_weight(m, n, k, x.dtype == torch.float32, kernel):
        return torch.ops.gemmfuse.fused_linear_graph_safe
    return torch.ops.gemmfuse.fused_linear_inference
