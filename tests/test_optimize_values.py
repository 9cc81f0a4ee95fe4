"""optimize on random chains that read values again: models drawn by hypothesis, each a Linear
followed by a program of ops whose second operand is a number, a per-channel parameter, or an
earlier value of the same stretch (as it is, ``.detach()``-ed or ``.clone()``-d), with a
GroupNorm and a logsumexp over the channels in between at random.

Bar: the chain is fused to the model's output; the optimized model's output equals the model's
(the CPU path runs the same ops: exactly); the gradients of every parameter and of x are at most
twice as far from the float64 model's as eager fp32's are, plus one fp32 ulp of the largest.
The gradients' bar was allclose(1e-6) to eager fp32's own until commit 9380b36: autograd sums a
value's several readers' contributions in its own order on each side, and a drawn program
(sigmoid -> GroupNorm -> sub(value 0 cloned) -> sigmoid -> mul(value 0), seed 0) differed from
eager by 3.8e-6 (1.4e-5 relative) in the Linear's weight gradient while both were as far from
float64 (1.19e-5 ours, 1.24e-5 eager): two draws of the same rounding, not an error of ours.
"""

import copy
import operator

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmfuse import optimize
from helpers import max_abs_err

K, N, GROUPS = 8, 12, 3
UNARY = ("sigmoid", "tanh", "relu")
BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
          "maximum": torch.maximum, "minimum": torch.minimum}  # fmt: skip


class Program(nn.Module):
    """Linear, then ``program``'s instructions on a list of the current stretch's values."""

    def __init__(self, program):
        super().__init__()
        self.fc = nn.Linear(K, N)
        self.norm = nn.GroupNorm(GROUPS, N)
        self.scale = nn.Parameter(torch.rand(N) + 0.5)
        self.program = program

    def forward(self, x):
        values = [self.fc(x)]
        for kind, *args in self.program:
            v = values[-1]
            if kind == "unary":
                v = getattr(torch, args[0])(v)
            elif kind == "binary":
                name, other, swapped = args
                other = self._operand(other, values)
                v = BINARY[name](other, v) if swapped else BINARY[name](v, other)
            elif kind == "norm":
                values = []
                v = self.norm(v)
            else:  # the reduction: a new stretch of (M, 1) values
                values = []
                v = torch.logsumexp(v, dim=1, keepdim=True)
            values.append(v)
        return values[-1]

    def _operand(self, other, values):
        kind, arg = other
        if kind == "number":
            return arg
        if kind == "param":
            return self.scale
        index, copy = arg
        value = values[index % len(values)]
        return value.detach() if copy == "detach" else value.clone() if copy == "clone" else value


@st.composite
def programs(draw):
    program, stage, ops = [], "pre", 0
    for _ in range(draw(st.integers(1, 7))):
        choice = draw(st.sampled_from(["unary", "binary", "binary", "norm", "reduce"]))
        if choice == "norm" and stage == "pre":
            program.append(("norm",))
            stage, ops = "post", 0
        elif choice == "reduce" and stage != "tail":
            program.append(("reduce",))
            stage, ops = "tail", 0
        elif choice == "unary":
            program.append(("unary", draw(st.sampled_from(UNARY))))
            ops += 1
        else:
            kinds = ["number", "value", "value"] + (["param"] if stage != "tail" else [])
            kind = draw(st.sampled_from(kinds))
            if kind == "value":
                arg = (draw(st.integers(0, ops)), draw(st.sampled_from(["", "detach", "clone"])))
            else:
                arg = draw(st.floats(-2, 2).filter(lambda a: abs(a) > 0.1))
            names = sorted(BINARY) if kind != "number" else ["add", "mul", "sub"]  # tensors
            name = draw(st.sampled_from(names))
            program.append(("binary", name, (kind, arg), draw(st.booleans())))
            ops += 1
    return program


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), seed=st.integers(0, 2**16))
def test_random_value_programs_fuse_to_the_end_with_the_models_gradients(program, seed):
    torch.manual_seed(seed)
    model = Program(program)
    x = torch.randn(5, K)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused and entry.stopped == "ends at the model's output", (program, report)
    exact = copy.deepcopy(model).double()
    xs = [x.clone().requires_grad_() for _ in range(2)] + [x.double().requires_grad_()]
    outs = [new(xs[0]), model(xs[1]), exact(xs[2])]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)
    grad = torch.randn_like(outs[1])
    got, want, want64 = (
        torch.autograd.grad(out, [t, *m.parameters()], g, allow_unused=True)
        for out, t, m, g in zip(
            outs, xs, (model, model, exact), (grad, grad, grad.double()), strict=True
        )
    )
    for a, b, c in zip(got, want, want64, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            ulp = torch.finfo(torch.float32).eps * c.abs().max().item()
            assert max_abs_err(a, c) <= 2 * max_abs_err(b, c) + ulp, (program, seed)
