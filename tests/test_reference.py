import random

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmfuse import fused_linear
from gemmfuse.chains import random_chain
from gemmfuse.epilogue import Epilogue, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.reference import linear_epilogue


@pytest.mark.parametrize("m,k,n,groups", [(1, 5, 6, 3), (7, 33, 64, 8), (64, 128, 96, 1)])
def test_matches_torch_modules(m, k, n, groups):
    torch.manual_seed(m + k + n)
    fc, gn = nn.Linear(k, n), nn.GroupNorm(groups, n, eps=1e-3)
    nn.init.normal_(gn.weight, 1.0, 0.1)
    nn.init.normal_(gn.bias, 0.0, 0.1)
    x = torch.randn(max(m, 2), k)
    epi = Epilogue(
        pre=(Pointwise("mul", (0.5,)),),
        norm=GroupNormSpec(groups, 1e-3),
        post=(Pointwise("leaky_relu", (0.2,)), Pointwise("add_self")),
    )
    y = nn.functional.leaky_relu(gn(fc(x) * 0.5), 0.2)
    torch.testing.assert_close(
        linear_epilogue(x, fc.weight, fc.bias, epi, gn.weight, gn.bias), y + y, rtol=0, atol=0
    )


@pytest.mark.parametrize("op", ["min", "max", "sum", "mean", "logsumexp"])
@pytest.mark.parametrize("keepdim", [True, False])
def test_reductions(op, keepdim):
    torch.manual_seed(0)
    fc, gn = nn.Linear(16, 32), nn.GroupNorm(4, 32, affine=False)
    x = torch.randn(9, 16)
    fn = {"min": torch.amin, "max": torch.amax, "sum": torch.sum, "mean": torch.mean,
          "logsumexp": torch.logsumexp}[op]  # fmt: skip
    expect = fn(gn(fc(x)), dim=1, keepdim=keepdim)
    epi = Epilogue(norm=GroupNormSpec(4, affine=False), reduce=Reduction(op, keepdim))
    got = linear_epilogue(x, fc.weight, fc.bias, epi)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["min", "max", "sum", "mean", "logsumexp"])
@pytest.mark.parametrize("pool, n", [(2, 32), (4, 30), (16, 40)])
def test_pooled_reductions_take_the_windows_maxima(op, pool, n):
    """Reduction.pool: max_pool1d over the channels first, a partial last window dropped (a
    mean divides by the whole windows)."""
    torch.manual_seed(0)
    fc, x = nn.Linear(16, n), torch.randn(9, 16)
    fn = {"min": torch.amin, "max": torch.amax, "sum": torch.sum, "mean": torch.mean,
          "logsumexp": torch.logsumexp}[op]  # fmt: skip
    windows = torch.relu(fc(x))[:, : n // pool * pool].view(9, n // pool, pool).amax(2)
    epi = Epilogue(pre=(Pointwise("relu"),), reduce=Reduction(op, pool=pool))
    got = linear_epilogue(x, fc.weight, fc.bias, epi)
    torch.testing.assert_close(got, fn(windows, dim=1), rtol=0, atol=0)


def test_per_channel_params_and_tail_broadcast_like_75():
    """#75's tail: (M, 1) + (1, C, 1, 1) -> (1, C, M, 1), and per-channel operands before it."""
    torch.manual_seed(1)
    fc, gn = nn.Linear(16, 32), nn.GroupNorm(4, 32)
    scale, shift, bias = torch.randn(32), torch.randn(1, 32), torch.randn(1, 5, 1, 1)
    x = torch.randn(7, 16)
    epi = Epilogue(
        pre=(Pointwise("mul", (Param(0),)),),
        norm=GroupNormSpec(4),
        post=(Pointwise("rsub", (Param(1),)), Pointwise("div", (3.0,))),
        reduce=Reduction("min", keepdim=True),
        tail=(Pointwise("add", (Param(2),)),),
    )
    got = linear_epilogue(x, fc.weight, fc.bias, epi, gn.weight, gn.bias, (scale, shift, bias))
    expect = torch.min((shift - gn(fc(x) * scale)) / 3.0, dim=1, keepdim=True)[0] + bias
    assert got.shape == expect.shape == (1, 5, 7, 1)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


# Each op through PyTorch's module or method API, written independently of POINTWISE.
def independent_op(name, args):
    a = args[0] if args else None
    ops = {
        "relu": lambda v: nn.ReLU()(v), "leaky_relu": lambda v: nn.LeakyReLU(a)(v),
        "gelu": lambda v: nn.GELU()(v), "gelu_tanh": lambda v: nn.GELU("tanh")(v),
        "silu": lambda v: nn.SiLU()(v), "swish": lambda v: v * nn.Sigmoid()(v),
        "mish": lambda v: nn.Mish()(v),
        "tanh": lambda v: nn.Tanh()(v), "sigmoid": lambda v: nn.Sigmoid()(v),
        "hardtanh": lambda v: nn.Hardtanh(*args)(v), "clamp": lambda v: v.clamp(*args),
        "hardswish": lambda v: nn.Hardswish()(v), "hardsigmoid": lambda v: nn.Hardsigmoid()(v),
        "softplus": lambda v: nn.Softplus(*args)(v), "elu": lambda v: nn.ELU(a)(v),
        "exp": torch.exp, "log": torch.log, "add_self": lambda v: v.add(v),
        "add": lambda v: torch.add(v, a), "sub": lambda v: torch.sub(v, a),
        "rsub": lambda v: torch.rsub(v, a), "mul": lambda v: torch.mul(v, a),
        "div": lambda v: torch.div(v, a),
        "rdiv": lambda v: torch.div(a, v) if isinstance(a, torch.Tensor) else v.reciprocal() * a,
        "minimum": lambda v: torch.min(v, a) if isinstance(a, torch.Tensor) else v.clamp(max=a),
        "maximum": lambda v: torch.max(v, a) if isinstance(a, torch.Tensor) else v.clamp(min=a),
    }  # fmt: skip
    return ops[name]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 9), groups=st.integers(1, 4),
       group_size=st.integers(2, 12))  # fmt: skip
def test_random_chains_match_pytorch_modules(seed, m, groups, group_size):
    """Chains drawn from the grammar: the reference (CPU path) against module-by-module torch."""
    spec = random_chain(random.Random(seed))
    gen = torch.Generator().manual_seed(seed)
    n, k = groups * group_size, 6
    epi, params = spec.instantiate(gen, n, groups)
    fc, gn = nn.Linear(k, n), nn.GroupNorm(groups, n, affine=spec.affine)
    x = torch.randn(m, k, generator=gen)

    def run(ops, v):
        for op in ops:
            args = tuple(params[a.index] if isinstance(a, Param) else a for a in op.args)
            v = independent_op(op.name, args)(v)
        return v

    v = run(epi.pre, fc(x))
    if epi.norm:
        v = run(epi.post, gn(v))
    gn_args = (gn.weight, gn.bias) if epi.norm else (None, None)
    if epi.reduce and epi.reduce.pool > 1:  # max_pool1d over the channels, as a model writes it
        pool = nn.MaxPool1d(epi.reduce.pool)
        if epi.reduce.pool > n:  # a window wider than the row: PyTorch refuses, and so must we
            with pytest.raises(RuntimeError):
                pool(v.unsqueeze(1))
            with pytest.raises(ValueError, match="wider than the chain's"):
                fused_linear(x, fc.weight, fc.bias, epi, *gn_args, params=params)
            return
        v = pool(v.unsqueeze(1)).squeeze(1)
    if epi.reduce:
        reduce = {"min": lambda t, d, kd: torch.min(t, d, kd)[0],
                  "max": lambda t, d, kd: torch.max(t, d, kd)[0],
                  "sum": torch.sum, "mean": torch.mean, "logsumexp": torch.logsumexp}  # fmt: skip
        v = run(epi.tail, reduce[epi.reduce.op](v, 1, epi.reduce.keepdim))
    with torch.no_grad():
        got = fused_linear(x, fc.weight, fc.bias, epi, *gn_args, params=params)
    torch.testing.assert_close(got, v.detach(), rtol=0, atol=0, equal_nan=True)


def test_plain_arguments_are_told_from_numbers_by_their_tag():
    """plain_ops writes a Param as ("param", i) and a Value as ("value", i, detach); any other
    argument, a tuple of numbers included, passes through as it is."""
    from gemmfuse.reference import op_argument

    p, v = torch.randn(3), torch.randn(3, requires_grad=True)
    assert op_argument(("param", 0), [p], [v]) is p
    assert op_argument(("value", 0, False), [p], [v]) is v
    assert not op_argument(("value", 0, True), [p], [v]).requires_grad
    assert op_argument((0.5, 2.0), [p], [v]) == (0.5, 2.0)
    assert op_argument(0.5, [p], [v]) == 0.5
