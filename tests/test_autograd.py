"""FusedLinearFunction's backward against torch.autograd.gradcheck, in float64 on the CPU.

The function's forward is given a PyTorch launch (the GEMM by F.linear, the chain by the
reference), so these tests check the backward's own machinery: the chain differentiated again
from the saved GEMM result, the routing of gradients to the GroupNorm's affine vectors and to
the chain's tensor arguments, and the products dx = dz @ W, dW = dz.T @ x, db = sum(dz). The
GPU tests check the same function with the kernels' launch and the split products.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gemmfuse import (
    POINTWISE,
    REDUCTIONS,
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    Value,
)
from gemmfuse.autograd import FusedCall, FusedLinearFunction, chain_backward
from gemmfuse.chains import softmax_chains, value_chain_pool, value_chains
from gemmfuse.reference import apply_epilogue, apply_pointwise, linear_epilogue
from gemmfuse.weight_cache import SplitWeightCache

M, K, N = 3, 5, 8


def torch_launch(epilogue: Epilogue):
    chain = dataclasses.replace(epilogue, tail=())

    def launch(x, weight, bias, gn_weight, gn_bias, params, save_z):
        z = F.linear(x, weight, bias)
        return apply_epilogue(z, chain, gn_weight, gn_bias, params), z if save_z else None

    return launch


def fused(epilogue: Epilogue):
    call = FusedCall(epilogue, torch_launch(epilogue), SplitWeightCache())

    def f(x, weight, bias, gn_weight, gn_bias, *params):
        out = FusedLinearFunction.apply(call, x, weight, bias, gn_weight, gn_bias, *params)
        return apply_pointwise(out, epilogue.tail, params)

    return f


def tensors(epilogue: Epilogue, n_params: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        return t.requires_grad_()

    affine = epilogue.norm is not None and epilogue.norm.affine
    gn = (1 + draw(N, scale=0.1), draw(N, scale=0.1)) if affine else (None, None)
    gn = tuple(None if t is None else t.detach().requires_grad_() for t in gn)
    params = [(draw(N, scale=0.5).detach() + 1.5).requires_grad_() for _ in range(n_params)]
    return [draw(M, K), draw(N, K, scale=0.5), draw(N), *gn, *params]


def check(epilogue: Epilogue, n_params: int = 0, seed: int = 0, numeric: bool = True):
    """gradcheck (where ``numeric``: a chain with a detached read has gradients that are not
    its derivative, by design), and the gradients of autograd through the reference."""
    inputs = tensors(epilogue, n_params, seed)
    f = fused(epilogue)
    if numeric:
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)
    # and the same gradients as autograd through the reference
    x, w, b, gw, gb, *params = inputs
    grad = torch.randn_like(f(*inputs))
    ours = torch.autograd.grad(f(*inputs), [t for t in inputs if t is not None], grad)
    ref = linear_epilogue(x, w, b, epilogue, gw, gb, params)
    theirs = torch.autograd.grad(ref, [t for t in inputs if t is not None], grad)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e)


def op(name: str, arg=None) -> Pointwise:
    """``name`` with typical float arguments, or ``arg`` (a Param) for the binary ops."""
    d = POINTWISE[name]
    defaults = {"leaky_relu": (0.1,), "hardtanh": (-0.5, 0.5), "clamp": (-0.7, 0.4),
                "softplus": (1.5, 20.0), "elu": (0.8,)}  # fmt: skip
    if arg is not None:
        return Pointwise(name, (arg,))
    return Pointwise(name, defaults.get(name, (0.75,) * d.n_args))


# Ops whose input must stay away from zero or the negatives: fed a positive value.
POSITIVE = (Pointwise("sigmoid"), Pointwise("add", (0.5,)))
NEEDS_POSITIVE = {"log", "rdiv", "div"}


@pytest.mark.parametrize("index", range(3))
def test_values_read_again(index):
    """Chains reading values again (gemmfuse.chains.value_chains): a read's gradient joins the
    value's, a detached read's does not (gradcheck, and autograd through the reference)."""
    epilogue = value_chains(num_groups=4)[index]
    check(epilogue, n_params=len(epilogue.channel_params), seed=index, numeric=False)
    attached = Epilogue(*(_attached(getattr(epilogue, s)) for s in ("pre", "norm", "post")),
                        epilogue.reduce)  # fmt: skip
    check(attached, n_params=len(epilogue.channel_params), seed=index)


@pytest.mark.parametrize("index", range(3))
def test_value_pool_chains(index):
    """The GPU tests' drawn graphs (chains.value_chain_pool) on the CPU: the gradients of
    autograd through the reference."""
    spec = value_chain_pool()[index]
    gen = torch.Generator().manual_seed(index)
    epilogue, params = spec.instantiate(gen, N, 2 if spec.norm else 1)
    epilogue = dataclasses.replace(epilogue, tail=())
    check(epilogue, n_params=len(params), seed=index, numeric=False)


def _attached(ops):
    """ops with every Value read keeping its gradient (a GroupNorm passes through)."""
    if not isinstance(ops, tuple):
        return ops
    return tuple(
        Pointwise(op.name, tuple(Value(a.index) if isinstance(a, Value) else a for a in op.args))
        for op in ops
    )


@pytest.mark.parametrize("name", sorted(POINTWISE))
@pytest.mark.parametrize("reduce", [None, *sorted(REDUCTIONS)])
def test_every_op_and_reduction(name, reduce):
    ops = (op(name),) if name not in NEEDS_POSITIVE else (*POSITIVE, op(name))
    epilogue = Epilogue(
        pre=ops,
        norm=GroupNormSpec(2),
        post=ops,
        reduce=None if reduce is None else Reduction(reduce, keepdim=reduce == "max"),
    )
    check(epilogue, seed=len(name))


@pytest.mark.parametrize("name", sorted(n for n, d in POINTWISE.items() if d.tensor_arg))
def test_tensor_arguments_get_gradients(name):
    """Per-channel Params before and after the GroupNorm, and a broadcasting one in the tail."""
    pre = (*POSITIVE, op(name, Param(0))) if name in NEEDS_POSITIVE else (op(name, Param(0)),)
    epilogue = Epilogue(
        pre=pre,
        norm=GroupNormSpec(4, eps=1e-3),
        post=(op(name, Param(1)),),
        reduce=Reduction("logsumexp", keepdim=True),
        tail=(Pointwise("add", (Param(2),)),),
    )
    check(epilogue, n_params=3)


def test_no_norm_and_no_affine():
    check(Epilogue(pre=(Pointwise("gelu"),)))
    check(Epilogue(norm=GroupNormSpec(1, affine=False), post=(Pointwise("tanh"),)))


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine, rms):
    """A LayerNorm over the channels: the reference's F.layer_norm, the backward's one-group
    GroupNorm formula; an RMSNorm: F.rms_norm and its own backward."""
    epilogue = Epilogue(
        pre=(Pointwise("mul", (Param(0),)),),
        norm=GroupNormSpec(1, eps=1e-3, affine=affine, layer=True, rms=rms),
        post=(Pointwise("silu"),),
        reduce=Reduction("logsumexp"),
    )
    check(epilogue, n_params=1)


@pytest.mark.parametrize("index", range(len(softmax_chains())))
def test_softmax(index):
    """A softmax or log_softmax over the channels (chains.softmax_chains): PyTorch's own
    backward of the reference, from the saved GEMM result."""
    epilogue = softmax_chains()[index]
    check(epilogue, n_params=len(epilogue.channel_params), seed=index)


def test_only_what_needs_grad_is_computed():
    """Inputs that do not require grad get None (no product is run for them)."""
    epilogue = Epilogue(norm=GroupNormSpec(2), post=(Pointwise("silu"),))
    x, w, b, gw, gb = tensors(epilogue, 0, 1)
    x = x.detach()
    out = fused(epilogue)(x, w, b.detach(), gw, gb)
    grads = torch.autograd.grad(out.sum(), [w, gw, gb])
    assert all(g is not None for g in grads)
    assert x.grad is None


@pytest.mark.parametrize("groups, affine", [(1, True), (4, True), (8, False)])
def test_float32_group_norm_backward_is_as_accurate_as_pytorchs(groups, affine):
    """The written-out GroupNorm backward (float32 chains) against PyTorch's kernels, both
    against float64: at most 2x PyTorch's error, plus one ulp of the gradient."""
    epilogue = Epilogue(
        pre=(Pointwise("mul", (Param(0),)),),
        norm=GroupNormSpec(groups, affine=affine),
        post=(Pointwise("leaky_relu", (0.1,)), Pointwise("add_self")),
    )
    g = torch.Generator().manual_seed(groups)
    z = torch.randn(64, 32, generator=g, dtype=torch.float64) * 3 + 1
    grad = torch.randn(64, 32, generator=g, dtype=torch.float64)
    gn = [1 + 0.1 * torch.randn(32, generator=g, dtype=torch.float64) for _ in range(2)]
    gn = gn if affine else [None, None]
    params = [torch.rand(32, generator=g, dtype=torch.float64) + 0.5]
    needs = [affine, affine, True]

    def run(dtype, generic):
        ts = [None if t is None else t.to(dtype) for t in (*gn, *params)]
        if generic:  # PyTorch's GroupNorm under autograd
            leaves = [z.to(dtype).requires_grad_()] + [
                None if t is None else t.requires_grad_() for t in ts
            ]
            out = apply_epilogue(leaves[0], epilogue, *leaves[1:3], leaves[3:])
            wanted = [t for t in leaves if t is not None]
            return list(torch.autograd.grad(out, wanted, grad.to(dtype)))
        dz, rest = chain_backward(epilogue, z.to(dtype), grad.to(dtype), ts, needs)
        return [dz, *[t for t in rest if t is not None]]

    exact, ours, pytorch = (
        run(torch.float64, True),
        run(torch.float32, False),
        run(torch.float32, True),
    )
    for e, a, p in zip(exact, ours, pytorch, strict=True):
        err, err_pytorch = (a.double() - e).abs().max(), (p.double() - e).abs().max()
        assert err <= 2 * err_pytorch + torch.finfo(torch.float32).eps * e.abs().max()
