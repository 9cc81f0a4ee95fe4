"""Calls decided once and run in C++: the plans a ``SplitWeightCache`` keeps for ``fused_linear``.

A ``fused_linear`` call's Python (validation, the path rules, the launch's arguments, autograd's
Function and its backward) costs more host time than the kernels it launches take to queue: at
KernelBench's #62 some 0.2 ms before the first launch (docs/DESIGN.md, "Host time"), GPU idle
time wherever a caller's timing starts on an idle GPU, as KernelBench's does, and the whole
step's time where host work outlasts GPU work (a bfloat16 training step).

So a call that took the fused or the epilogue path with a weight cache (PyTorch's GEMM, then the
chain kernel: a float32 call below the fused kernel's sizes, or a 16-bit model's chain that norms
or reduces in tiles) leaves a plan in it: the host
extension's ``Plan`` (csrc/host/host_plan.h), holding every decision the Python made (the chain's
table, the launch's arguments, which backward products run split) with the kinds of tensors it
made them for (dtype, device, shape, strides, 16-byte alignment of each). A later call of the
same epilogue object, kernel and precision is offered to the plans first: one whose kinds match
runs the whole call in one host call (the weight's split from the cache, the input's split, the
launch) and, where autograd records, attaches a C++ node whose backward (the chain backward
kernel, the products, the column sums) runs without Python. A call of another kind (any
tensor's dtype, device, shape, strides or alignment, a CUDA graph being captured, a gradient
the plan does not give) gets None from every plan and is decided afresh by the Python rules,
which keep a plan for its kind too (``MAX_PLANS`` per cache, the most recent first). Results are
the Python path's, bit for bit: the same kernels on the same arguments
(tests/gpu/test_plan.py).

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import torch

from gemmfuse.autograd import kernel_backward_serves
from gemmfuse.dispatch import (
    MODEL16,
    PLAIN_GEMM,
    PRECISIONS,
    backward_products,
    chain_apart,
    forward_parts,
    fused_k_splits,
    fused_kernel_code,
    gemv_fits,
    group_stats_mode,
    norm_settings,
)
from gemmfuse.epilogue import Epilogue, column_sum_slots, per_element
from gemmfuse.jit import extension_for, extensions_for

MAX_PLANS = 4  # per weight cache: the kinds of call one module meets (a last, shorter batch...)
# What a plan takes (csrc/host/bind_plan_call.cpp): a call with a tensor subclass is decided afresh
# each time by the Python rules (its own torch function is seen there; the kernels, and the
# executor's GEMM on the epilogue path, take it as the tensor it holds).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def planned_call(cache, epilogue, kernel, precision, x, weight, bias, gn_weight, gn_bias, params):
    """(the chain's output up to its tail ops, the path) by the first of ``cache``'s plans that
    serves the call, or None where none does."""
    for plan in cache.plans:
        out = plan(epilogue, kernel, precision, x, weight, bias, gn_weight, gn_bias, params)
        if out is not None:
            return out, plan.path
    return None


def planned_saving_z(cache, epilogue, kernel, precision, x, weight, bias, gn_weight, gn_bias,
                     params):  # fmt: skip
    """(out, z) as the op ``gemmfuse::fused_linear_saving_z`` returns them (library.py), by the
    first of ``cache``'s plans that serves the call (the same launch, no autograd node), or
    None where none does."""
    for plan in cache.plans:
        out = plan.saving_z(epilogue, kernel, precision, x, weight, bias, gn_weight, gn_bias,
                            params)  # fmt: skip
        if out is not None:
            return out
    return None


def plannable(path: str) -> bool:
    """Whether a call that took ``path`` leaves a plan: the fused and the epilogue paths (not
    PyTorch's)."""
    return path in ("fused", "epilogue")


def forward_spec(path: str, epilogue: Epilogue, x, weight, kernel: str, precision: str) -> dict:
    """What the forward of a ``fused`` or ``epilogue`` path call runs (dispatch.py's rules, in
    one place): the host extension's ``PlanSpec`` fields that its executor (csrc/host/
    host_plan.cpp's ``launch_spec``) reads. A call decided afresh (ops.launch_path) and a plan
    (keep_plan, which adds the backward's fields) run the same kernels from it."""
    n = weight.shape[0]
    group_size, eps, norm_wide = norm_settings(epilogue, n)
    apart = chain_apart(path, epilogue, x, n, kernel, precision)
    kernel_code = fused_kernel_code(kernel, x)
    split, gemv = PRECISIONS[precision], gemv_fits(path, x, weight)
    parts = forward_parts(path, apart, kernel_code, split, x.dtype, norm_wide, gemv)
    # a chain apart's GEMM is the plain GEMM's library: its parts and the chain's built at once
    # on a first call
    if apart:
        ext, plain = extensions_for(epilogue, PLAIN_GEMM, parts=parts)
    else:
        ext, plain = extension_for(epilogue, parts=parts[0]), None
    return dict(
        table=ext.table,
        plain_table=plain.table if plain else 0,
        model16=x.dtype in MODEL16, kernel_code=kernel_code,
        split=split, scalars=list(epilogue.scalars), group_size=group_size,
        eps=eps, norm_wide=norm_wide,
        keepdim=epilogue.reduce is not None and epilogue.reduce.keepdim,
        channel_params=list(epilogue.channel_params), epilogue_path=path == "epilogue",
        group_stats=group_stats_mode(epilogue, x) if path == "epilogue" else 0,
        gemv=gemv, chain_apart=apart,
        k_splits=fused_k_splits(path, x, n, kernel_code, precision),
    )  # fmt: skip


def keep_plan(cache, epilogue: Epilogue, kernel: str, precision: str, tensors, grad: bool,
              path: str = "fused"):  # fmt: skip
    """Puts the plan of a call that just took ``path`` (:func:`plannable`) with ``cache`` first
    among its plans, where the plan would serve that call again. ``tensors``: (x, weight, bias,
    gn_weight, gn_bias, params) as the call got them; ``grad``: whether autograd recorded it."""
    x, weight, bias, gn_weight, gn_bias, params = tensors
    every = [x, weight, bias, gn_weight, gn_bias, *params]
    if any(t is not None and type(t) not in _PLAIN for t in every):
        return
    # A plan of this kind already kept refused the call for a reason its key does not see
    # (saved-tensor hooks, a forward-mode tangent, graph capture): another would refuse too,
    # and prepending it each call would evict the plans of other kinds.
    kind = _kind(epilogue, kernel, precision, path, grad, every)
    if kind in cache.plan_kinds:
        return
    (m, _), n = x.shape, weight.shape[0]
    chain = epilogue.untailed
    serves_backward = kernel_backward_serves(chain, x.dtype, n, x.device)
    if grad and not serves_backward:
        return
    wants_operand_grad = any(
        params[i].requires_grad and per_element(params[i].shape, m, n)
        for i in epilogue.channel_params
    )
    if grad and wants_operand_grad:
        return  # an (M, N) operand's gradient: PyTorch's backward of the chain gives it
    sparse, split_dx, split_dw = backward_products(path, x, weight, kernel, epilogue)
    spec = forward_spec(path, epilogue, x, weight, kernel, precision)
    if grad and (split_dx or split_dw):  # the backward's split products: the plain GEMM's library
        spec["plain_table"] = extension_for(PLAIN_GEMM).table
    spec.update(first_slot=column_sum_slots(chain)[1], backward=serves_backward,
                split_dx=split_dx, split_dw=split_dw, sparse=sparse)  # fmt: skip
    ext = extension_for(epilogue)
    plan = ext.host.Plan(cache.native(ext), epilogue, kernel, precision, every,
                         ext.host.PlanSpec(**spec))  # fmt: skip
    cache.plans = [plan, *cache.plans[: MAX_PLANS - 1]]
    cache.plan_kinds = [kind, *cache.plan_kinds[: MAX_PLANS - 1]]


def _kind(epilogue, kernel, precision, path, grad, tensors) -> tuple:
    """What a plan's key compares (csrc/host/host_plan.h's TensorKey: dtype, device, sizes, strides,
    16-byte alignment of each tensor), with the Python side's part and how the call recorded."""
    return (epilogue, kernel, precision, path, grad, *(
        None if t is None
        else (t.dtype, t.device, tuple(t.shape), t.stride(), t.data_ptr() % 16 == 0)
        for t in tensors
    ))  # fmt: skip
