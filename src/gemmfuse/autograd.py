"""Gradients through the fused paths: ``FusedLinearFunction``.

The forward runs the fused kernel as without autograd and also stores the GEMM result
``z = x @ W.T + b`` (one extra write of (M, N) from the kernel's epilogue), which is all the
backward needs besides the inputs:

1. The chain's backward, ``dz``, with the gradients of the GroupNorm's affine vectors and the
   chain's tensor arguments: on CUDA one kernel (``chain_backward`` of the chain's kernels,
   csrc/backward/chain_backward.cuh; min/max over several column slabs first find each slab's
   extreme)
   that recomputes the chain from ``z``, a group-aligned slab of a row at a time, and takes the
   gradient back through it with PyTorch's formulas (epilogue.py's ``grad`` of each op;
   min/max routed as ``torch.amin`` / ``amax`` route them), summing the per-channel gradients
   over the rows as it goes. Elsewhere (CPU, float64, slabs too wide for a block's shared
   memory, a softmax over the channels) the chain is evaluated again in PyTorch
   (``gemmfuse.reference``) and differentiated by autograd (a float32 GroupNorm's formula
   written out, for speed).
2. The products ``dx = dz @ W`` and ``dW = dz.T @ x``. Where the chain ends in a min or max
   over the channels, dz is zero but for the extremes' GroupNorm groups (or columns): the
   sparse kernels (csrc/operands/sparse_products.cu) multiply its nonzero entries alone, in float32
   (``dispatch.sparse_gradient``). Otherwise on the tensor cores with the forward's
   split-fp16 scheme (``gemm_split`` of the plain GEMM's kernels, on operands split by rows or,
   for operands read down their columns, by ``split_cols``), where the forward's thresholds say
   the fused kernel pays; else PyTorch's own products (eager's result). ``W``'s transposed split
   is cached beside its forward split. bfloat16 and float16 models take PyTorch's products in
   their dtype (one product each, rounded as eager rounds).
3. ``db = dz.sum(0)`` (the kernel's column sum).

Tail ops (after a reduction) run outside this function (tail.py), with autograd's own backward.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from gemmfuse.build import BuildError
from gemmfuse.dispatch import (
    BACKWARD_DTYPES,
    MODEL16,
    SPLIT_COLS_MAX,
    norm_settings,
    split_padded,
)
from gemmfuse.epilogue import Epilogue, column_sum_slots, per_element
from gemmfuse.jit import extension_for
from gemmfuse.reference import apply_epilogue, apply_pointwise


class FusedCall(NamedTuple):
    """A fused call apart from its tensors: what the forward launches and how the backward
    multiplies.

    ``launch(x, weight, bias, gn_weight, gn_bias, params, save_z)`` returns ``(out, z)``: the
    chain up to its tail ops, and the GEMM result when ``save_z``. ``split_dx`` / ``split_dw``
    say whether each backward product runs on the split tensor-core kernel (``kernel`` its
    launch code, ``split`` three products or one) rather than PyTorch's; ``weight_cache`` keeps
    the weight's transposed split between calls. ``sparse`` (before the splits): dz is zero but
    for a few groups a row (dispatch.sparse_gradient), both products take its nonzero entries
    alone (the host extension's sparse_products). ``chain_kernel`` False keeps the chain's
    backward in PyTorch (a call whose forward ran the PyTorch path: its tensor arguments need
    not be per channel). A named tuple: made on every recorded call, it is built in one step.
    """

    epilogue: Epilogue
    launch: Callable
    weight_cache: object
    split_dx: bool = False
    split_dw: bool = False
    sparse: bool = False
    kernel: int = 0
    split: bool = True
    chain_kernel: bool = True

    @property
    def chain(self) -> Epilogue:
        """The epilogue without its tail ops: what the function's output holds."""
        return self.epilogue.untailed


class FusedLinearFunction(torch.autograd.Function):
    """``chain(x @ weight.T + bias)`` (tail ops excluded) with a recorded backward."""

    @staticmethod
    def forward(ctx, call: FusedCall, x, weight, bias, gn_weight, gn_bias, *params):
        out, z = call.launch(x, weight, bias, gn_weight, gn_bias, params, True)
        ctx.call = call
        ctx.save_for_backward(x, weight, z, gn_weight, gn_bias, *params)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, z, gn_weight, gn_bias, *params = ctx.saved_tensors
        tensors = (x, weight, z, gn_weight, gn_bias, params)
        return (None, *fused_backward(ctx.call, grad, *tensors, ctx.needs_input_grad[1:]))


def fused_backward(call: FusedCall, grad, x, weight, z, gn_weight, gn_bias, params, needs):
    """The gradients of (x, weight, bias, gn_weight, gn_bias, *params), None where ``needs``
    (one flag each) says no, from the forward's saved ``z`` and the output's ``grad``."""
    needs_x, needs_w, needs_b, *needs_chain = needs
    tensors = (gn_weight, gn_bias, *params)
    dz, chain_grads, db = chain_gradients(
        call.chain, z, grad, tensors, needs_chain, call.chain_kernel, call.weight_cache
    )
    if db is None and needs_b:
        db = dz.sum(0)
    if (needs_x or needs_w) and _sparse_fits(call, dz, weight, x):
        dx, dw = extension_for(call.epilogue).sparse_products(dz, weight, x, needs_x, needs_w)
    else:
        dx = grad_input(dz, weight, call) if needs_x else None
        dw = grad_weight(dz, x, call) if needs_w else None
    return (dx, dw, db.to(z.dtype) if needs_b else None, *chain_grads)


def chain_gradients(chain: Epilogue, z, grad, tensors, needs, kernel=True, cache=None):
    """(dz, the gradients of ``tensors`` (gn_weight, gn_bias, *params; None where ``needs``
    says no), dz's column sum or None): the chain backward kernel where ``kernel`` allows and
    it fits, else PyTorch (:func:`chain_backward`, no column sum)."""
    if (
        kernel
        and _kernel_backward_fits(chain, z, grad)
        and not _per_element_grads(chain, z, tensors[2:], needs[2:])
    ):
        return _kernel_chain_backward(chain, z, grad, tensors, needs, cache)
    return (*chain_backward(chain, z, grad, tensors, needs), None)


class FusedEpilogueFunction(torch.autograd.Function):
    """``chain(z)`` of a given tensor z (tail ops excluded; ``launch(z, gn_weight, gn_bias,
    params)`` runs it) with a recorded backward: dz and the chain's tensors' gradients, as
    ``FusedLinearFunction``'s chain part computes them."""

    @staticmethod
    def forward(ctx, chain: Epilogue, launch: Callable, z, gn_weight, gn_bias, *params):
        out = launch(z, gn_weight, gn_bias, params)
        ctx.chain = chain
        ctx.save_for_backward(z, gn_weight, gn_bias, *params)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        z, gn_weight, gn_bias, *params = ctx.saved_tensors
        needs_z, *needs_chain = ctx.needs_input_grad[2:]
        tensors = (gn_weight, gn_bias, *params)
        dz, grads, _ = chain_gradients(ctx.chain, z, grad, tensors, needs_chain)
        return (None, None, dz if needs_z else None, *grads)


def _kernel_backward_fits(chain: Epilogue, z: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the chain backward kernel takes this call (:func:`kernel_backward_serves`)."""
    return grad.dtype == z.dtype and kernel_backward_serves(chain, z.dtype, z.shape[1], z.device)


def kernel_backward_serves(chain: Epilogue, dtype: torch.dtype, n: int, device) -> bool:
    """Whether the chain backward kernel takes a chain's backward on n channels: CUDA float32,
    bfloat16 or float16, a column slab's working set within a block's shared memory, no softmax
    over the channels and no max pooling before the reduction (the kernel differentiates
    neither)."""
    if device.type != "cuda" or dtype not in BACKWARD_DTYPES:
        return False
    if chain.norm is not None and chain.norm.softmax:
        return False
    if chain.reduce is not None and chain.reduce.pool > 1:
        return False
    return _kernel_fits(chain.structure, n, norm_settings(chain, n)[0], device)


def _per_element_grads(chain: Epilogue, z, params, needs) -> bool:
    """Whether a per-element tensor argument (an (M, N) operand) wants its gradient: an (M, N)
    tensor, which the chain backward kernel's column sums do not give (PyTorch's backward of
    the chain does)."""
    m, n = z.shape
    return any(needs[i] and per_element(params[i].shape, m, n) for i in chain.channel_params)


@functools.cache
def _kernel_fits(structure: Epilogue, n: int, group_size: int, device: torch.device) -> bool:
    # the float32 plan: a 16-bit chain's kernels are another instance of the same code, with the
    # same static shared memory (its register kernel's sums plain, with none)
    return kernel_plan(structure, 1, n, group_size, device)[1] > 0


def kernel_plan(
    structure: Epilogue, m: int, n: int, group_size: int, device, dtype=torch.float32
) -> list[int]:
    """[column slabs, row blocks, 1 for the register kernel or 0 for the shared-memory one] of
    the chain backward for an (m, n) chain of ``dtype`` tensors; 0 row blocks where a slab's
    working set exceeds a block's shared memory. Raises BuildError where the chain backward's
    part could not be built (rather than reading as a plan that does not fit)."""
    with torch.cuda.device(device):
        plan = extension_for(structure).chain_backward_plan(m, n, group_size, dtype in MODEL16)
    if plan[1] < 0:  # row_blocks kBackwardPartMissing (csrc/abi/fused_args.h)
        raise BuildError(
            f"gemmfuse: the chain backward's part of {structure} could not be built (the "
            "compiler's errors are on stderr)"
        )
    return plan


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


def channel_vectors(epilogue: Epilogue, params, m: int, n: int) -> list[torch.Tensor]:
    """The pre/post ops' tensor arguments as the kernels read them, in generated-code order
    (``epilogue.channel_params``): dense float32 [n] vectors, or a per-element operand's
    contiguous float32 [m, n] (the kernels tell them apart by shape)."""
    return [
        _float32(t) if per_element(t.shape, m, n) else _float32(t.reshape(-1).expand(n))
        for t in (params[i] for i in epilogue.channel_params)
    ]


def _kernel_chain_backward(chain: Epilogue, z, grad, tensors, needs, cache=None):
    """chain_backward on the GPU in one kernel: (dz, the gradients of ``tensors``, db), each in
    z's dtype. ``cache`` (the forward's weight cache) keeps the GroupNorm vectors' float32
    copies of a 16-bit model between calls."""
    gn_weight, gn_bias, *params = tensors
    n = z.shape[1]
    if cache is not None:
        gn32 = cache.float32(gn_weight, "gn_weight"), cache.float32(gn_bias, "gn_bias")
    else:
        gn32 = _float32(gn_weight), _float32(gn_bias)
    # The column sums in float64 and rounded to z's dtype, which the per-channel gradients share
    # on this path; a scalar's gradient sums its columns in float64 first (they may cancel)
    dz, sums, rounded = extension_for(chain).chain_backward(
        z, grad, *gn32, channel_vectors(chain, params, z.shape[0], n), chain.scalars,
        *norm_settings(chain, n)[:2],
    )  # fmt: skip
    _, first = column_sum_slots(chain)
    grads = [rounded[1], rounded[2]] if gn_weight is not None else [None, None]
    grads += [None] * len(params)
    for slot, i in enumerate(chain.channel_params, start=first):
        shape = params[i].shape
        if per_element(shape, *z.shape):
            continue  # its column sums are no gradient; none is wanted (chain_gradients)
        g = sums[slot].sum().to(z.dtype) if math.prod(shape) == 1 else rounded[slot]
        grads[2 + i] = g.reshape(shape) if grads[2 + i] is None else grads[2 + i] + g.reshape(shape)
    return dz, [g if need else None for g, need in zip(grads, needs, strict=True)], rounded[0]


def chain_backward(chain: Epilogue, z, grad, tensors, needs) -> tuple[torch.Tensor, list]:
    """(dz, the gradients of ``tensors``: gn_weight, gn_bias, *params; None where not needed),
    in PyTorch: the path where the chain backward kernel cannot run, and the kernel's test
    oracle.

    The chain is evaluated again from ``z`` under autograd and differentiated: PyTorch's own
    backward formulas for every op of the grammar. A float32 (or float64) chain's GroupNorm is
    the exception (an RMSNorm and a softmax keep F.rms_norm's and F.softmax's): its backward
    is written out
    (``_group_norm_backward``), because PyTorch's GroupNorm kernels take 0.32 ms each way on
    #62's 1024 x 8192 with groups of 16 (measured, H100), a quarter of the whole training
    step, where a grouped ``var_mean`` and a few elementwise ops take a fraction of that.
    """
    leaves = [
        None if t is None else t.detach().requires_grad_(bool(need))
        for t, need in zip(tensors, needs, strict=True)
    ]
    gn_weight, gn_bias, *params = leaves
    z = z.detach().requires_grad_()
    with torch.enable_grad():
        norm = chain.norm
        if (
            norm is None
            or norm.rms
            or norm.softmax
            or z.dtype not in (torch.float32, torch.float64)
        ):
            out = apply_epilogue(z, chain, gn_weight, gn_bias, params)
            wanted = [z] + [t for t in leaves if t is not None and t.requires_grad]
            grads = list(torch.autograd.grad(out, wanted, grad, allow_unused=True))
            dz = grads.pop(0)
            rest = iter(grads)
            return dz, [next(rest) if t is not None and t.requires_grad else None for t in leaves]
        return _chain_backward_group_norm(chain, z, grad, gn_weight, gn_bias, params)


def _chain_backward_group_norm(chain, z, grad, gn_weight, gn_bias, params):
    """chain_backward of a chain with a GroupNorm: autograd through the ops before and after
    it, the GroupNorm's own backward by its formula (16-bit models keep PyTorch's kernels,
    which compute in float32 and round as eager does in their dtype)."""
    wanted = [t for t in params if t.requires_grad]
    u = apply_pointwise(z, chain.pre, params)
    norm = chain.norm
    m, n = u.shape
    grouped = u.detach().view(m, norm.num_groups, n // norm.num_groups)
    var, mean = torch.var_mean(grouped, dim=2, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + norm.eps)
    x_hat = ((grouped - mean) * rstd).view(m, n)
    y = x_hat if gn_weight is None else torch.addcmul(gn_bias.detach(), x_hat, gn_weight.detach())
    y = y.requires_grad_()
    out = apply_pointwise(y, chain.post, params)
    if chain.reduce is not None:
        out = apply_epilogue(out, Epilogue(reduce=chain.reduce))
    dy, *post_grads = torch.autograd.grad(out, [y, *wanted], grad, allow_unused=True)
    du, d_weight, d_bias = _group_norm_backward(dy, x_hat, rstd, gn_weight, norm.num_groups)
    dz, *pre_grads = torch.autograd.grad(u, [z, *wanted], du, allow_unused=True)
    if dz is None:  # no pre ops: u is z
        dz = du
    summed = iter([_add(a, b) for a, b in zip(post_grads, pre_grads, strict=True)])
    param_grads = [next(summed) if t.requires_grad else None for t in params]
    need_affine = gn_weight is not None and gn_weight.requires_grad
    return dz, [
        d_weight if need_affine else None,
        d_bias if gn_bias is not None and gn_bias.requires_grad else None,
        *param_grads,
    ]


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _group_norm_backward(dy, x_hat, rstd, weight, groups):
    """(d input, d weight, d bias) of ``y = x_hat * weight + bias`` with ``x_hat`` the input
    normalised over ``groups`` groups of each row: PyTorch's GroupNorm gradient, written out.
    d input = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), g = dy * weight, means per group.
    """
    m, n = dy.shape
    g = dy if weight is None else dy * weight.detach()
    g3, x3 = g.view(m, groups, n // groups), x_hat.view(m, groups, n // groups)
    c1 = g3.mean(dim=2, keepdim=True)
    c2 = (g3 * x3).mean(dim=2, keepdim=True)
    du = ((g3 - c1 - x3 * c2) * rstd).view(m, n)
    if weight is None:
        return du, None, None
    return du, (dy * x_hat).sum(0), dy.sum(0)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _sparse_fits(call: FusedCall, dz, weight, x) -> bool:
    """Whether the sparse products take this call's backward: the call's chain makes dz sparse,
    and the kernels' dtypes (float32, bfloat16 or float16, one for all three) on CUDA."""
    return (
        call.sparse
        and dz.is_cuda
        and dz.dtype in BACKWARD_DTYPES
        and weight.dtype == x.dtype == dz.dtype
    )


def grad_input(dz: torch.Tensor, weight: torch.Tensor, call: FusedCall) -> torch.Tensor:
    """dx = dz @ weight: contraction over the N output channels."""
    if not (call.split_dx and weight.shape[1] <= SPLIT_COLS_MAX):
        return dz.mm(weight)
    ext = extension_for(Epilogue())
    n_padded = split_padded(dz.shape[1])
    a = ext.split_rows(_unit_stride(dz), n_padded)
    # through the chain's extension, as the forward's split (an export's plain GEMM is a
    # module of its own, with another SplitCache type)
    b = call.weight_cache.transposed(extension_for(call.epilogue), weight, n_padded)
    return ext.gemm_split(*a, *b, call.kernel, call.split)


def grad_weight(dz: torch.Tensor, x: torch.Tensor, call: FusedCall) -> torch.Tensor:
    """dW = dz.T @ x: contraction over the M rows, both operands read down their columns."""
    if not (call.split_dw and max(dz.shape[1], x.shape[1]) <= SPLIT_COLS_MAX):
        return dz.t().mm(x)
    ext = extension_for(Epilogue())
    m_padded = split_padded(dz.shape[0])
    a = ext.split_cols(_unit_stride(dz), m_padded)
    b = ext.split_cols(_unit_stride(x), m_padded)
    return ext.gemm_split(*a, *b, call.kernel, call.split)
