"""The fused call as ``torch.library`` ops, so torch.compile and torch.export can hold it.

The extension's functions are opaque to tracing. Under ``torch.compiler.is_compiling()``
(torch.compile, torch.export), ``fused_linear`` calls these ops instead (``ops._traced_call``);
in eager mode it keeps calling the extension directly, without the dispatcher's overhead.

``gemmfuse::fused_linear(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision,
cache) -> Tensor``
    The chain up to its tail ops, as ``fused_linear`` computes it without autograd. ``chain`` is
    ``epilogue.epilogue_spec`` of the chain (no tail ops), ``cache`` a
    :class:`~gemmfuse.weight_cache.SplitWeightCache` token (-1: none).
``gemmfuse::fused_linear_inference(...) -> Tensor``
    The same call, for graphs traced with grad mode off (``ops.traced_chain_call`` under
    ``torch.compile``, which guards grad mode; ``torch.export`` keeps ``fused_linear``, whose
    program may later run where autograd records). It has no autograd formula, so the
    dispatcher runs no Python autograd layer around it, and a call of a kind seen before goes
    straight to the weight cache's C++ plans (plan.py): the compiled call's host time is what
    issue 12's 5% bar measures. Called with grad mode on and an input requiring grad, it
    raises.
``gemmfuse::fused_linear_graph_safe(...) -> Tensor``
    fused_linear_inference for a call that takes no split of its weight on any path
    (``dispatch.splits_no_weight``: a float32 call below the fused kernel's thresholds, or on
    kernel="epilogue"; a 16-bit model's), which a CUDA graph may record: it keeps nothing
    between calls but its plans (``SplitWeightCache.graph_safe``), so torch.compile's
    ``mode="reduce-overhead"`` records it in its graph, and a replay reads the weight as it is
    then. Its per-channel vectors that are not float32 already (a 16-bit model's bias and
    GroupNorm affine) are converted at every call.
``gemmfuse::fused_linear_saving_z(...) -> (Tensor out, Tensor z)``
    The same, also returning the GEMM result ``z = x @ W.T + b`` that the backward starts from;
    its autograd formula is ``gemmfuse::fused_linear_backward``.
``gemmfuse::fused_linear_backward(grad, x, weight, z, gn_weight, gn_bias, params, chain,
kernel, precision, cache, needs) -> Tensor[]``
    The gradients of (x, weight, bias, gn_weight, gn_bias, *params) that ``needs`` asks for, an
    empty tensor for the others: ``autograd.fused_backward``, on the path the forward took.

Each op runs on any device: its implementation is the eager call, which picks the path (the
fused kernel, the epilogue path, PyTorch) from its inputs as it always does. The ops but
fused_linear_graph_safe are tagged ``cudagraph_unsafe``: torch.compile's CUDA graphs
(``mode="reduce-overhead"``) leave them out of the recorded graph and run them as eager calls,
with the weight-split cache. Where a CUDA graph
is captured around them by hand (``torch.cuda.graph``), the weight's split is made inside the
graph, not taken from the cache, so a replay after the weight changed splits the new weight
(``weight_cache.cache_for_call``, as for eager calls).

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files, where it registers the ops once
per process however often the file is executed.
"""

import functools

import torch
import torch.nn.functional as F

from gemmfuse.autograd import fused_backward
from gemmfuse.dispatch import select_path, take_path
from gemmfuse.epilogue import Epilogue, epilogue_from_spec
from gemmfuse.ops import (
    backward_plan,
    check_arguments,
    fused_linear_with_path,
    launch_path,
    plans_apply,
    records_grad,
)
from gemmfuse.plan import keep_plan, plannable, planned_call, planned_saving_z
from gemmfuse.reference import apply_epilogue
from gemmfuse.weight_cache import SplitWeightCache, cache_for_call

_FORWARD_ARGS = (
    "Tensor x, Tensor weight, Tensor? bias, Tensor? gn_weight, Tensor? gn_bias, Tensor[] params, "
    "str chain, str kernel, str precision, int cache"
)
FORWARD_SCHEMA = f"({_FORWARD_ARGS}) -> Tensor"
SAVING_Z_SCHEMA = f"({_FORWARD_ARGS}) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor x, Tensor weight, Tensor z, Tensor? gn_weight, Tensor? gn_bias, "
    "Tensor[] params, str chain, str kernel, str precision, int cache, bool[] needs) -> Tensor[]"
)


def _cache(token: int) -> SplitWeightCache:
    return cache_for_call(SplitWeightCache.for_token(token))


def _owned(out: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``out``, copied where it is a view or shares storage with ``others`` (an op's outputs
    must not alias)."""
    ptr = out.untyped_storage().data_ptr()
    if out._base is not None or any(t.untyped_storage().data_ptr() == ptr for t in others):
        return out.clone()
    return out


def _forward_output(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """A forward op's result, aliasing none of its ``inputs``: copied where it shares their
    storage; a view of a tensor the call made itself (a keepdim reduction's (M, 1) of the
    kernel's (M,)) becomes the same memory under a tensor that is not a view, where a copy
    would be one more kernel launch on the compiled call's host path."""
    ptr = out.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    if out._base is not None:
        return out.new_empty(0).set_(
            out.untyped_storage(), out.storage_offset(), out.shape, out.stride()
        )
    return out


def _forward(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache):
    return _forward_in(_cache(cache), x, weight, bias, gn_weight, gn_bias, params, chain, kernel,
                       precision)  # fmt: skip


def _forward_in(weight_cache, x, weight, bias, gn_weight, gn_bias, params, chain, kernel,
                precision):  # fmt: skip
    with torch.no_grad():  # the op's own formula covers the call (the inference ops': none)
        out = fused_linear_with_path(
            x, weight, bias, epilogue_from_spec(chain), gn_weight, gn_bias, params=params,
            weight_cache=weight_cache, kernel=kernel, precision=precision,
        )[0]  # fmt: skip
    return _forward_output(out, x, weight, bias, gn_weight, gn_bias, *params)


def _inference(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache):
    """fused_linear_inference's implementation: a call of a kind seen before runs one C++
    plan with as little Python around it as the eager call has (this runs at every compiled
    call); the others take fused_linear's implementation."""
    weight_cache = SplitWeightCache.for_token(cache) if cache >= 0 else None
    return _inference_in("fused_linear_inference", weight_cache, x, weight, bias, gn_weight,
                         gn_bias, params, chain, kernel, precision)  # fmt: skip


def _graph_safe(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache):
    """fused_linear_graph_safe's implementation: fused_linear_inference's, with the weight
    cache's twin that keeps no tensor past the call (SplitWeightCache.graph_safe)."""
    weight_cache = SplitWeightCache.for_token(cache).graph_safe()
    return _inference_in("fused_linear_graph_safe", weight_cache, x, weight, bias, gn_weight,
                         gn_bias, params, chain, kernel, precision)  # fmt: skip


def _inference_in(name, weight_cache, x, weight, bias, gn_weight, gn_bias, params, chain, kernel,
                  precision):  # fmt: skip
    # every params tensor, a tail op's too: PyTorch's fallback would record a node without a
    # gradient
    if records_grad(range(len(params)), params, x, weight, bias, gn_weight, gn_bias):
        raise RuntimeError(
            f"gemmfuse::{name} has no gradient, and autograd records this call "
            "(grad mode is on and an input requires grad): call gemmfuse::fused_linear or "
            "gemmfuse.fused_linear instead"
        )
    if weight_cache is not None and weight_cache.plans and plans_apply():
        planned = planned_call(weight_cache, epilogue_from_spec(chain), kernel, precision, x,
                               weight, bias, gn_weight, gn_bias, params)  # fmt: skip
        if planned is not None:  # a tensor the plan allocated (host_plan.cpp): no alias
            return planned[0]
    return _forward_in(cache_for_call(weight_cache), x, weight, bias, gn_weight, gn_bias, params,
                       chain, kernel, precision)  # fmt: skip


def _saving_z(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache):
    epilogue = epilogue_from_spec(chain)
    tensors = (x, weight, bias, gn_weight, gn_bias, params)
    # A call of a kind seen before runs in C++ (plan.py), as the eager call does: the op under
    # autograd (torch.compile of a training step, KernelBench's timing of a compiled model)
    weight_cache = SplitWeightCache.for_token(cache) if cache >= 0 else None
    if weight_cache is not None and weight_cache.plans and plans_apply():
        planned = planned_saving_z(weight_cache, epilogue, kernel, precision, *tensors)
        if planned is not None:
            return planned
    path = take_path(x, weight, epilogue, kernel, params)
    with torch.no_grad():
        if path == "torch":
            z = F.linear(x, weight, bias)
            out = apply_epilogue(z, epilogue, gn_weight, gn_bias, params)
        else:
            launch_cache = cache_for_call(weight_cache)
            out, z = launch_path(path, epilogue, launch_cache, kernel, precision, *tensors, True)
            if plannable(path) and launch_cache is weight_cache:
                keep_plan(weight_cache, epilogue, kernel, precision, tensors, False, path)
    return _forward_output(out, z, x, weight, bias, gn_weight, gn_bias, *params), z


def _backward(grad, x, weight, z, gn_weight, gn_bias, params, chain, kernel, precision, cache,
              needs):  # fmt: skip
    epilogue = epilogue_from_spec(chain)
    path = select_path(x, weight, epilogue, kernel, params)[0]  # the forward's path
    call = backward_plan(path, x, weight, epilogue, None, _cache(cache), kernel, precision)
    with torch.no_grad():
        grads = fused_backward(call, grad, x, weight, z, gn_weight, gn_bias, params, needs)
    like = _grad_likes(x, weight, z, gn_weight, gn_bias, params)
    inputs = [grad, x, weight, z, *(t for t in (gn_weight, gn_bias, *params) if t is not None)]
    return [  # a gradient may be an input itself (autograd passes grad through an add)
        _owned(g.contiguous(), *inputs) if g is not None
        else _zero_grad(t) if need else _empty_like_grad(x)
        for g, t, need in zip(grads, like, needs, strict=True)
    ]  # fmt: skip


def _grad_likes(x, weight, z, gn_weight, gn_bias, params) -> list:
    """A tensor shaped like each input's gradient (the bias's: one value per channel, as
    ``z[0]``)."""
    return [x, weight, z[0], gn_weight, gn_bias, *params]


def _zero_grad(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t, memory_format=torch.contiguous_format)


def _empty_like_grad(x: torch.Tensor) -> torch.Tensor:
    """What the backward op returns for a gradient not asked for (a Tensor[] holds no None)."""
    return x.new_empty(0)


def _chain_shape(x: torch.Tensor, weight: torch.Tensor, epilogue: Epilogue) -> tuple[int, ...]:
    m, n = x.shape[0], weight.shape[0]
    if epilogue.reduce is None:
        return (m, n)
    return (m, 1) if epilogue.reduce.keepdim else (m,)


def _forward_fake(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache):
    epilogue = epilogue_from_spec(chain)
    # A traced call that built its chain as constants (ops.chain_call_specs) is checked here,
    # when torch.compile or torch.export traces it; the eager call checks again when it runs.
    check_arguments(x, weight, bias, epilogue, gn_weight, gn_bias, params, kernel, precision)
    dtype = functools.reduce(  # a chain tensor of another dtype promotes as PyTorch does
        torch.promote_types, [params[i].dtype for i in epilogue.channel_params], x.dtype
    )
    return x.new_empty(_chain_shape(x, weight, epilogue), dtype=dtype)


def _saving_z_fake(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache):
    out = _forward_fake(x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, 0)
    return out, x.new_empty((x.shape[0], weight.shape[0]))


def _backward_fake(grad, x, weight, z, gn_weight, gn_bias, params, chain, kernel, precision,
                   cache, needs):  # fmt: skip
    like = _grad_likes(x, weight, z, gn_weight, gn_bias, params)
    return [
        torch.empty_like(t, memory_format=torch.contiguous_format) if need else _empty_like_grad(x)
        for t, need in zip(like, needs, strict=True)
    ]


def _setup_context(ctx, inputs, output):
    """fused_linear_saving_z's: the backward starts from the forward's z."""
    x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache = inputs
    ctx.save_for_backward(x, weight, output[1], gn_weight, gn_bias, *params)
    ctx.mark_non_differentiable(output[1])  # z is saved for the backward, not a result
    ctx.settings = (chain, kernel, precision, cache)


def _setup_context_recompute(ctx, inputs, output):
    """fused_linear's (called directly under autograd): the backward recomputes z."""
    x, weight, bias, gn_weight, gn_bias, params, chain, kernel, precision, cache = inputs
    ctx.save_for_backward(x, weight, bias, gn_weight, gn_bias, *params)
    ctx.settings = (chain, kernel, precision, cache)


def _autograd_backward(ctx, grad, _grad_z=None):
    x, weight, z, gn_weight, gn_bias, *params = ctx.saved_tensors
    return _grads(ctx, grad, x, weight, z, gn_weight, gn_bias, params)


def _autograd_backward_recompute(ctx, grad):
    x, weight, bias, gn_weight, gn_bias, *params = ctx.saved_tensors
    z = F.linear(x, weight, bias)
    return _grads(ctx, grad, x, weight, z, gn_weight, gn_bias, params)


def _grads(ctx, grad, x, weight, z, gn_weight, gn_bias, params) -> tuple:
    """The forward op's input gradients through fused_linear_backward: None where not needed;
    a tail op's tensor (not read by the chain) gets its gradient from autograd outside."""
    if torch.is_grad_enabled():  # a backward with create_graph=True (traced ones run without)
        raise RuntimeError(
            "gemmfuse: the fused call's gradients are differentiable once; a backward with "
            "create_graph=True (double backward) through it is not supported"
        )
    chain, *_ = ctx.settings
    used = set(epilogue_from_spec(chain).channel_params)
    needs = [bool(n) for n in ctx.needs_input_grad[:5]]
    needs += [bool(n) and i in used for i, n in enumerate(ctx.needs_input_grad[5])]
    grads = torch.ops.gemmfuse.fused_linear_backward(
        grad, x, weight, z, gn_weight, gn_bias, params, *ctx.settings, needs
    )
    grads = [g if need else None for g, need in zip(grads, needs, strict=True)]
    return (*grads[:5], grads[5:], None, None, None, None)


# CUDA graphs (torch.compile's reduce-overhead mode) run these ops outside the recorded graph:
# the weight-split cache allocates when a weight changes, and inductor's CUDA-graph warm-up would
# put those lasting tensors in its private pool, whose memory it hands out again ("tensors in the
# cudagraph pool not tracked as outputs", its debug check says). Outside the graph the cache
# serves as in eager mode; the ops around are still graphed (inductor partitions the graph at an
# op so tagged). fused_linear_graph_safe keeps no tensor (SplitWeightCache.graph_safe) and is not
# tagged: graphs record it.
_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _define(name: str, schema: str, impl, fake, backward=None, setup_context=None,
            tags=_UNSAFE) -> None:  # fmt: skip
    """Defines ``gemmfuse::name`` unless this process has (an exported file executed again, or
    after the package: the first definition serves both)."""
    if hasattr(torch.ops.gemmfuse, name):
        return
    torch.library.define(f"gemmfuse::{name}", schema, tags=tags)
    torch.library.impl(f"gemmfuse::{name}", "default", impl)
    torch.library.register_fake(f"gemmfuse::{name}", fake)
    if backward is not None:
        torch.library.register_autograd(f"gemmfuse::{name}", backward, setup_context=setup_context)


_define("fused_linear", FORWARD_SCHEMA, _forward, _forward_fake, _autograd_backward_recompute,
        _setup_context_recompute)  # fmt: skip
_define("fused_linear_inference", FORWARD_SCHEMA, _inference, _forward_fake)
_define("fused_linear_graph_safe", FORWARD_SCHEMA, _graph_safe, _forward_fake, tags=())
_define("fused_linear_saving_z", SAVING_Z_SCHEMA, _saving_z, _saving_z_fake, _autograd_backward,
        _setup_context)  # fmt: skip
_define("fused_linear_backward", BACKWARD_SCHEMA, _backward, _backward_fake)
