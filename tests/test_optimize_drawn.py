"""gemmfuse.optimize on CPU, a property: any chain of the grammar, written any supported way,
is fused whole and computes what the model computes."""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmfuse import optimize
from gemmfuse.epilogue import MAX_SCALARS, MAX_TENSORS

ACTIVATIONS = ["relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "swish", "mish", "tanh",
               "sigmoid",
               "hardtanh", "relu6", "hardswish", "hardsigmoid", "softplus", "elu", "exp",
               "log", "clamp"]  # fmt: skip


class Drawn(nn.Module):
    """Linear (the module, or F.linear on its tensors), then ``steps`` applied in turn (fx
    traces through the Python loop)."""

    def __init__(self, k, n, functional):
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.functional = functional
        self.steps = []
        self.registered = 0

    def register(self, value) -> str:
        self.registered += 1
        name = f"r{self.registered}"
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            self.register_buffer(name, value)
        else:
            setattr(self, name, value)
        return name

    def forward(self, x):
        x = F.linear(x, self.fc.weight, self.fc.bias) if self.functional else self.fc(x)
        for step in self.steps:
            x = step(self, x)
        return x


def module_step(model, module):
    name = model.register(module)
    return lambda s, v: getattr(s, name)(v)


def floats(lo, hi):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


def draw_activation(draw, model):
    """(step, float arguments) for one activation, in a form drawn among its spellings."""
    name = draw(st.sampled_from(ACTIVATIONS))
    a = draw(floats(0.05, 2.0))
    b = a + draw(floats(0.1, 2.0))
    forms = {
        "relu": [lambda: module_step(model, nn.ReLU()),
                 lambda: module_step(model, nn.ReLU(inplace=True)),
                 lambda: lambda s, v: F.relu(v), lambda: lambda s, v: torch.relu(v),
                 lambda: lambda s, v: v.relu(), lambda: lambda s, v: v.relu_(),
                 lambda: lambda s, v: F.relu(v, inplace=True)],
        "leaky_relu": [lambda: module_step(model, nn.LeakyReLU(a)),
                       lambda: lambda s, v: F.leaky_relu(v, a),
                       lambda: lambda s, v: F.leaky_relu(v, negative_slope=a, inplace=True)],
        "gelu": [lambda: module_step(model, nn.GELU()), lambda: lambda s, v: F.gelu(v)],
        "gelu_tanh": [lambda: module_step(model, nn.GELU(approximate="tanh")),
                      lambda: lambda s, v: F.gelu(v, approximate="tanh")],
        "silu": [lambda: module_step(model, nn.SiLU()), lambda: lambda s, v: F.silu(v)],
        "swish": [lambda: lambda s, v: v * torch.sigmoid(v),
                  lambda: lambda s, v: torch.sigmoid(v) * v,
                  lambda: lambda s, v: torch.mul(v, F.sigmoid(v)),
                  lambda: lambda s, v: v.mul(v.sigmoid()),
                  lambda: lambda s, v: v.sigmoid().mul_(v),
                  lambda: (lambda name: lambda s, v: v * getattr(s, name)(v))(
                      model.register(nn.Sigmoid()))],
        "mish": [lambda: module_step(model, nn.Mish()), lambda: lambda s, v: F.mish(v)],
        "tanh": [lambda: module_step(model, nn.Tanh()), lambda: lambda s, v: torch.tanh(v),
                 lambda: lambda s, v: v.tanh_()],
        "sigmoid": [lambda: module_step(model, nn.Sigmoid()),
                    lambda: lambda s, v: torch.sigmoid(v), lambda: lambda s, v: v.sigmoid()],
        "hardtanh": [lambda: module_step(model, nn.Hardtanh(-a, b)),
                     lambda: lambda s, v: F.hardtanh(v, -a, b)],
        "relu6": [lambda: module_step(model, nn.ReLU6()), lambda: lambda s, v: F.relu6(v)],
        "hardswish": [lambda: module_step(model, nn.Hardswish()),
                      lambda: lambda s, v: F.hardswish(v)],
        "hardsigmoid": [lambda: module_step(model, nn.Hardsigmoid()),
                        lambda: lambda s, v: F.hardsigmoid(v)],
        "softplus": [lambda: module_step(model, nn.Softplus(a, 10 * b)),
                     lambda: lambda s, v: F.softplus(v, beta=a, threshold=10 * b)],
        "elu": [lambda: module_step(model, nn.ELU(a)), lambda: lambda s, v: F.elu(v, a)],
        "exp": [lambda: lambda s, v: torch.exp(v), lambda: lambda s, v: v.exp()],
        "log": [lambda: lambda s, v: torch.log(v), lambda: lambda s, v: v.log_()],
        "clamp": [lambda: lambda s, v: torch.clamp(v, -a, b),
                  lambda: lambda s, v: v.clamp(min=-a), lambda: lambda s, v: v.clamp_max(b),
                  lambda: lambda s, v: torch.clip(v, max=b), lambda: lambda s, v: v.clamp_(-a, b)],
    }  # fmt: skip
    n_floats = {"leaky_relu": 1, "hardtanh": 2, "relu6": 2, "softplus": 2, "elu": 1, "clamp": 2}
    return draw(st.sampled_from(forms[name]))(), n_floats.get(name, 0)


def draw_arithmetic(draw, model, shapes, tail):
    """(step, floats, tensors) for one binary op with a float or a tensor of a drawn shape
    (after the reduction, in-place forms take floats only: the grammar's rule)."""
    op = draw(st.sampled_from(["add", "sub", "mul", "div", "x + x"]))
    if op == "x + x":
        return draw(st.sampled_from([lambda s, v: v + v, lambda s, v: torch.add(v, v)])), 0, 0
    if draw(st.booleans()):
        t = torch.randn(draw(st.sampled_from(shapes)))
        holder = draw(st.sampled_from([nn.Parameter, lambda t: t]))  # a parameter or a buffer
        name = model.register(holder(t))
        operand, tensors = (lambda s: getattr(s, name)), 1
    else:
        value = draw(floats(-3.0, 3.0))
        operand, tensors = (lambda s: value), 0
    fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op]
    method = {"add": "add", "sub": "sub", "mul": "mul", "div": "div"}[op]
    symbol = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
              "div": operator.truediv}[op]  # fmt: skip
    forms = [
        lambda s, v: symbol(v, operand(s)),
        lambda s, v: symbol(operand(s), v),
        lambda s, v: fn(v, operand(s)),
        lambda s, v: getattr(v, method)(operand(s)),
    ]
    if not (tail and tensors):
        forms.append(lambda s, v: getattr(v, method + "_")(operand(s)))
    if op == "sub":
        forms.append(lambda s, v: torch.rsub(v, operand(s)))
    return draw(st.sampled_from(forms)), 1 - tensors, tensors


def draw_pointwise(draw, model, shapes, tail):
    if draw(st.booleans()):
        step, n_floats = draw_activation(draw, model)
        return step, n_floats, 0
    return draw_arithmetic(draw, model, shapes, tail)


REDUCTION_FORMS = {
    "min": [lambda v, k: torch.min(v, 1, keepdim=k)[0],
            lambda v, k: v.min(dim=-1, keepdim=k).values,
            lambda v, k: torch.amin(v, dim=1, keepdim=k), lambda v, k: v.amin(1, k)],
    "max": [lambda v, k: torch.max(v, dim=1, keepdim=k).values, lambda v, k: v.max(1, k)[0],
            lambda v, k: torch.amax(v, (1,), k)],
    "sum": [lambda v, k: torch.sum(v, 1, keepdim=k), lambda v, k: v.sum(dim=-1, keepdim=k)],
    "mean": [lambda v, k: torch.mean(v, dim=1, keepdim=k), lambda v, k: v.mean(1, k)],
    "logsumexp": [lambda v, k: torch.logsumexp(v, 1, k),
                  lambda v, k: v.logsumexp(dim=1, keepdim=k)],
}  # fmt: skip


@st.composite
def drawn_chains(draw):
    m, k = draw(st.integers(2, 7)), draw(st.integers(1, 12))
    n = draw(st.sampled_from([8, 12, 16, 24]))
    model = Drawn(k, n, draw(st.booleans()))
    budget = {"floats": MAX_SCALARS, "tensors": MAX_TENSORS}
    per_channel = [(n,), (1, n), (), (1,)]

    def pointwise(count, shapes, limited=True):
        for _ in range(count):
            step, n_floats, n_tensors = draw_pointwise(draw, model, shapes, not limited)
            if limited:
                if n_floats > budget["floats"] or n_tensors > budget["tensors"]:
                    continue
                budget["floats"] -= n_floats
                budget["tensors"] -= n_tensors
            model.steps.append(step)

    pointwise(draw(st.integers(0, 3)), per_channel)
    if draw(st.booleans()):
        groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if n % g == 0]))
        if draw(st.booleans()):
            model.steps.append(
                module_step(model, nn.GroupNorm(groups, n, affine=draw(st.booleans())))
            )
        else:
            w, b = (model.register(nn.Parameter(torch.randn(n))) for _ in range(2))
            eps = draw(st.sampled_from([1e-5, 1e-3]))
            model.steps.append(
                lambda s, v: F.group_norm(v, groups, getattr(s, w), getattr(s, b), eps)
            )
        pointwise(draw(st.integers(0, 3)), per_channel)
    if draw(st.booleans()):
        op = draw(st.sampled_from(sorted(REDUCTION_FORMS)))
        form, keepdim = draw(st.sampled_from(REDUCTION_FORMS[op])), draw(st.booleans())
        model.steps.append(lambda s, v: form(v, keepdim))
        pointwise(draw(st.integers(0, 2)), [(), (1,), (1, 1), (3, 1, 1)], limited=False)
    return model, torch.randn(m, k)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn_chains())
def test_every_drawn_chain_is_fused_whole_and_computes_the_same(drawn):
    model, x = drawn
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused and entry.stopped == "ends at the model's output", str(report)
    assert len(entry.chain) == 1 + len(model.steps), str(report)
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0, equal_nan=True)
