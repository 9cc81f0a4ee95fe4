"""gemmfuse.optimize on CPU: where a Linear's chain stops and what it takes along (ops of the
grammar written each supported way, operands computed in the forward, values read again, the
matmul spellings of a Linear), each optimized output equal to the model's."""

from __future__ import annotations

import logging
import types
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.proxy import TraceError

from gemmfuse import FusedLinear, optimize
from gemmfuse.epilogue import MAX_SCALARS, MAX_TENSORS
from helpers import Chain


def stops(body, n=16, m=6, **members):
    """(the report entry, the optimized output equals the model's) for Linear -> body."""
    model = Chain(body, n, **members)
    x = torch.randn(m, 8)
    new, report = optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0, equal_nan=True)
    (entry,) = report.linears
    return entry


def p(*shape, dtype=torch.float32):
    return nn.Parameter(torch.rand(*shape, dtype=dtype) + 0.5)


def buffer(*shape):  # Chain registers plain tensors as buffers
    return torch.rand(*shape) + 0.5


@pytest.mark.parametrize(
    "body, members, chain, stopped",
    [
        (lambda s, x: torch.cumsum(x, 1), {}, "fc", "stopped at cumsum (torch.cumsum): "
         "not in the epilogue grammar"),
        (lambda s, x: torch.softmax(x, 0), {}, "fc", "stopped at softmax (torch.softmax): "
         "softmax over dim=0, not the channels (the last dimension)"),
        (lambda s, x: F.log_softmax(x, 1, dtype=torch.float64), {}, "fc",
         "log_softmax with dtype= is not in the grammar"),
        (lambda s, x: F.softmax(s.g(x), -1), {"g": nn.GroupNorm(4, 16)}, "fc -> g",
         "stopped at softmax (F.softmax): a second norm"),
        # every spelling of a softmax over the channels is a norm of the chain
        (lambda s, x: F.log_softmax(x * 2.0, dim=-1).sum(1), {},
         "fc -> x * 2.0 -> log_softmax(dim=-1) -> sum(dim=1)", "ends at the model's output"),
        (lambda s, x: torch.tanh(x.softmax(1)), {}, "fc -> softmax(dim=1) -> tanh",
         "ends at the model's output"),
        (lambda s, x: torch.log_softmax(x, dim=1), {}, "fc -> log_softmax(dim=1)",
         "ends at the model's output"),
        (lambda s, x: s.act(x).log_softmax(-1), {"act": nn.Softmax(dim=-1)}, "fc -> act",
         "stopped at log_softmax (Tensor.log_softmax): a second norm"),
        (lambda s, x: x.mul_(x), {}, "fc", "x *= x in place is not in the grammar"),
        (lambda s, x: x * s.g(x), {"g": nn.Identity()}, "fc", "stopped after fc: fc is also "
         "read by mul, which the chain does not reach (stopped at g (nn.Identity): not in the "
         "epilogue grammar"),
        (lambda s, x: x + 2 * x.mean(), {}, "fc", "fc is also read by add, which the chain "
         "does not reach (stopped at mean (Tensor.mean): it reduces over more than"),
        (lambda s, x: torch.relu(x) + s.b * 2.0, {"b": p(16)}, "fc -> relu", "stopped at add "
         "(operator.add): operand mul is computed after the Linear"),
        (lambda s, x: s.g2(s.g1(x)), {"g1": nn.GroupNorm(4, 16), "g2": nn.GroupNorm(2, 16)},
         "fc -> g1", "stopped at g2 (nn.GroupNorm): a second norm"),
        (lambda s, x: x.sum(1).amax(-1), {}, "fc -> sum(dim=1)",
         "stopped at amax (Tensor.amax): a second reduction"),
        (lambda s, x: torch.sigmoid(x.amax(1, keepdim=True)).sum(1), {},
         "fc -> max(dim=1, keepdim=True) -> sigmoid",
         "a reduction dropping the kept dimension after tail ops"),
        (lambda s, x: torch.max(x, 1)[1], {}, "fc", "its indices are used"),
        # torch.max of two tensors is elementwise: the op maximum (fx keeps the zeros as a
        # constant tensor attribute)
        (lambda s, x: torch.max(x, torch.zeros(1)), {}, "fc -> maximum(x, _tensor_constant0)",
         "ends at the model's output"),
        (lambda s, x: x.sum(0), {}, "fc", "dim=0, not the channels"),
        (lambda s, x: x.sum(), {}, "fc", "more than the channel dimension"),
        (lambda s, x: torch.add(x, 1.0, alpha=2), {}, "fc", "alpha= or rounding_mode="),
        (lambda s, x: x + s.t3, {"t3": p(2, 1, 16)}, "fc", "changes the shape (6, 16) to "
         "(2, 6, 16) before the reduction"),
        (lambda s, x: x * s.d, {"d": p(16, dtype=torch.float64)}, "fc", "its result is not a "
         "torch.float32 tensor"),
        (lambda s, x: x + s.b.add_(0.0), {"b": buffer(16)}, "fc", "computed in the forward"),
        (lambda s, x: (s.b.mul_(1.0), x + s.b)[1], {"b": buffer(16)}, "fc",
         "computed in the forward"),
        (lambda s, x: F.group_norm(x, 4, s.w), {"w": p(16)}, "fc", "a weight but no bias"),
        (lambda s, x: s.act(x), {"act": nn.Softmax(0)}, "fc", "stopped at act (nn.Softmax): "
         "softmax over dim=0"),
        (lambda s, x: s.act(x), {"act": nn.LogSoftmax()}, "fc", "stopped at act "
         "(nn.LogSoftmax): log_softmax without a dim"),
        (lambda s, x: torch.clamp(x, min=s.w), {"w": p(16)}, "fc", "argument min is computed"),
        (lambda s, x: torch.min(x, 1, True)[0] + s.t.add_(0.0), {"t": buffer(1)},
         "fc -> min(dim=1, keepdim=True)", "computed in the forward"),
        (lambda s, x: torch.relu(x) * s.full, {"full": p(6, 16)}, "fc -> relu",
         "operand full of shape (6, 16) is not per channel"),
        (lambda s, x: x - s.row, {"row": p(6, 1)}, "fc", "row of shape (6, 1) is not per channel"),
    ],
)  # fmt: skip
def test_where_chains_stop(body, members, chain, stopped):
    entry = stops(body, **members)
    assert entry.fused and " -> ".join(entry.chain) == chain
    assert stopped in entry.stopped


class _Residual(nn.Module):
    """fc(x) plus an operand the forward computes before the Linear (``r``): read per element
    by the fused chain, unless the forward writes ``r`` (or the Linear's input) in place, or
    it comes after the Linear."""

    def __init__(self, write: str = ""):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.write = write

    def forward(self, x):
        r = x * 2.0
        if self.write == "input":
            x = x.clone()
        y = self.fc(x)
        if self.write == "after":
            r = torch.tanh(x)
        out = torch.relu(y) + r
        if self.write == "operand":
            r.add_(1.0)
        if self.write == "input":
            x.mul_(3.0)
        return out + r


@pytest.mark.parametrize(
    "write, chain, stopped",
    [("", "fc -> relu -> x + mul -> x + mul", "ends at the model's output"),
     ("operand", "fc -> relu", "operand mul may be modified in place in the forward"),
     ("input", "fc -> relu", "the Linear's input may be modified in place in the forward"),
     ("after", "fc -> relu", "operand tanh is computed after the Linear")],
)  # fmt: skip
def test_operands_computed_in_the_forward(write, chain, stopped):
    model = _Residual(write)
    x = torch.randn(6, 16)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused and " -> ".join(entry.chain) == chain and stopped in entry.stopped, entry
    torch.testing.assert_close(new(x.clone()), model(x.clone()), rtol=0, atol=0)


def test_a_fused_linear_with_computed_operands_takes_them_after_x():
    new, _ = optimize(_Residual(), (torch.randn(6, 16),))
    with pytest.raises(TypeError, match="takes x and 1 operand"):
        new.fc(torch.randn(6, 16))


SWISH_FORMS = [
    lambda s, x: x * torch.sigmoid(x),
    lambda s, x: torch.sigmoid(x) * x,
    lambda s, x: torch.mul(x, F.sigmoid(x)),
    lambda s, x: x.mul(x.sigmoid()),
    lambda s, x: torch.multiply(torch.sigmoid(input=x), x),
    lambda s, x: s.sig(x).mul(x),
    lambda s, x: x * s.sig(x),
    lambda s, x: x.sigmoid().mul_(x),  # in place into the sigmoid, not into x
]


@pytest.mark.parametrize("form", SWISH_FORMS)
def test_x_times_its_sigmoid_is_one_swish_step_in_every_form(form):
    model = Chain(lambda s, x: form(s, form(s, x).amax(1)) + 1.0, sig=nn.Sigmoid())
    x = torch.randn(6, 8)
    new, report = optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
    (entry,) = report.linears
    assert entry.chain == ("fc", "x * sigmoid(x)", "max(dim=1)", "x * sigmoid(x)", "x + 1.0")
    assert entry.stopped == "ends at the model's output" and entry.verified
    epilogue = new.fc.epilogue
    assert [op.name for op in epilogue.pre] == ["swish"]
    assert [op.name for op in epilogue.tail] == ["swish", "add"]


def swish(x):
    return x * torch.sigmoid(x)


def test_x_times_sigmoid_around_a_groupnorm_and_twice_in_a_row():
    entry = stops(lambda s, x: swish(swish(s.gn(swish(x)))), gn=nn.GroupNorm(4, 16))
    assert entry.chain == ("fc", "x * sigmoid(x)", "gn", "x * sigmoid(x)", "x * sigmoid(x)")
    assert entry.stopped == "ends at the model's output"


def _swish_shared(s, x):
    y = torch.sigmoid(x)
    return x * y + y


def _swish_into_x(s, x):
    x.mul_(torch.sigmoid(x))
    return x + 1.0


@pytest.mark.parametrize(
    "body, chain",
    [
        (_swish_shared, ("fc", "sigmoid", "x * fc", "x + sigmoid")),
        (lambda s, x: x * torch.sigmoid(x) * x, ("fc", "sigmoid", "x * fc", "x * fc")),
        (lambda s, x: torch.sigmoid(x) + x, ("fc", "sigmoid", "x + fc")),
        (lambda s, x: x * x, ("fc", "x * x")),
        (lambda s, x: torch.tanh(x) * x.detach() - x.clone(), ("fc", "tanh", "x * fc.detach()",
                                                                  "x - fc.clone()")),
    ],
)  # fmt: skip
def test_values_read_again_join_the_chain(body, chain):
    """x * sigmoid(x) that is not swish, x * x, a detach or clone read later: the chain reads
    the earlier value again (a Value argument) and goes to the model's output; ``stops``
    checks the result equal to the model's."""
    entry = stops(body)
    assert entry.fused and entry.chain == chain
    assert entry.stopped == "ends at the model's output"


@pytest.mark.parametrize(
    "body, why",
    [
        (_swish_into_x, "mul_ (Tensor.mul_): it writes its result into its other operand"),
        (lambda s, x: torch.mul(x, torch.sigmoid(x), out=torch.empty(6, 16)),
         "argument out= is not in the grammar's form of this op"),
    ],
)  # fmt: skip
def test_a_value_read_again_by_an_op_outside_the_grammar_ends_the_chain_before_it(body, why):
    entry = stops(body)
    assert entry.fused and entry.chain == ("fc",)
    assert entry.stopped.startswith("stopped after fc: fc is also read by ")
    assert why in entry.stopped


@pytest.mark.parametrize(
    "body",
    [
        lambda s, x: (x.clone(), torch.relu(x))[1],  # an unused copy
        lambda s, x: (setattr(s, "kept", x.detach()), torch.relu(x))[1],  # a copy kept aside
    ],
)  # fmt: skip
def test_a_copy_that_nothing_reads_does_not_end_the_chain(body):
    """A detach/clone copy of a chain value that no later node reads joins nothing: the chain
    goes on past it (it had ended at the copy and the rewrite failed: KeyError, then
    RuntimeError erasing the Linear)."""
    entry = stops(body)
    assert entry.fused and entry.chain[:2] == ("fc", "relu")


def test_an_operand_modified_in_place_elsewhere_in_forward_is_not_fused():
    def body(s, x):
        y = x * s.scale
        s.scale.mul_(1.0)  # the forward writes the parameter after the op read it
        return y

    entry = stops(body, scale=buffer(16))
    assert entry.chain == ("fc",)
    assert "operand scale is modified in place in the forward" in entry.stopped


def test_a_forward_writing_a_plain_tensor_attribute_is_refused():
    model = Chain(lambda s, x: x + s.t.add_(1.0))
    model.t = torch.zeros(16)  # not a buffer: fx would run the write once, while tracing
    with pytest.raises(ValueError, match=r"writes in place to the tensor attribute\(s\) \['t'\]"):
        optimize(model, (torch.randn(2, 8),))


@pytest.mark.parametrize(
    "body, named",
    [
        (lambda s, x: (setattr(s, "t", s.t + 1.0), x + s.t)[1], "t"),  # computed while tracing
        (lambda s, x: (setattr(s, "t", s.t + x), x * s.t)[1], "t"),  # traced, old t read by name
        (lambda s, x: (setattr(s, "n", s.n + 1), x * s.n)[1], "n"),  # a Python counter
        (lambda s, x: (setattr(s, "b", torch.zeros(16)), x + s.b)[1], "b"),  # a buffer rebound
        (lambda s, x: (setattr(s.fc, "seen", s.fc.seen + 1.0), x + s.fc.seen)[1], "fc.seen"),
        # hidden state starting as None; a float rebound to a traced value; a traced count
        (lambda s, x: (y := x if s.h is None else x + s.h, setattr(s, "h", y))[0], "h"),
        (lambda s, x: (y := x * s.n, setattr(s, "n", y.abs().amax()))[0], "n"),
        (lambda s, x: (setattr(s, "n", s.n + x.shape[0]), x * s.n)[1], "n"),
        # in containers the model keeps, one level down too, or a plain object's attribute
        (lambda s, x: (s.cache.__setitem__("h", x), x + s.cache["h"])[1], "cache (its contents)"),
        (lambda s, x: (s.nested["l0"].__setitem__("h", x), x)[1], "nested['l0'] (its contents)"),
        (lambda s, x: (setattr(s.box, "h", x), x)[1], "box (its contents)"),
        (lambda s, x: (s.pair[0].append(x), x)[1], "pair[0] (its contents)"),  # through a tuple
        # a submodule swapped after it was read; one registered lazily
        (lambda s, x: (s.act(x), setattr(s, "act", nn.Tanh()))[0], "act"),
        (lambda s, x: (hasattr(s, "head") or setattr(s, "head", nn.Linear(16, 16)), x)[1], "head"),
    ],
)  # fmt: skip
def test_a_forward_assigning_an_attribute_fx_cannot_follow_is_refused(body, named):
    """fx runs such a write once, while tracing, and the graph would keep what the first call
    left (a tensor counted up by the model would stay at its first value): refused, and the
    model's submodules, which the trace shares, are left as they were."""
    model = Chain(body, b=torch.ones(16), act=nn.ReLU())
    model.t, model.n, model.h, model.cache = torch.zeros(16), 1, None, {}  # plain attributes
    model.nested, model.box, model.pair = {"l0": {}}, types.SimpleNamespace(), ([],)
    seen, act = model.fc.seen, model.act = torch.zeros(16), model.act
    with pytest.raises(ValueError, match="forward changes") as refused:
        optimize(model, (torch.randn(2, 8),))
    assert repr(named) in str(refused.value).split(" after reading them")[0]
    assert model.fc.seen is seen and torch.equal(model.get_buffer("b"), torch.ones(16))
    assert model.act is act and not hasattr(model, "head")
    assert model.cache == {} and model.nested == {"l0": {}} and vars(model.box) == {}
    assert model.pair == ([],)


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
def test_a_forward_writing_traced_values_to_attributes_is_optimized():
    """A traced value written before it is read is in the graph: a weight computed from
    parameters by a hook (weight_norm on a model's own module), a value kept for inspection, an
    attribute added in the forward. The result equals the model call after call,
    and optimize leaves the model's existing attributes as they were."""

    class Projection(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return F.linear(x, self.weight)

    def body(s, x):
        s.fc.kept = x  # a traced value, kept for inspection
        s.fc.scratch = torch.ones(16)  # added to a submodule
        s.log.debug("a call")  # a logger's own caches change, and a registry shared by all
        return s.proj(torch.relu(x)) * s.scales["proj"] + s.fc.scratch  # a defaultdict fills

    model = Chain(body)
    model.proj = nn.utils.weight_norm(Projection())  # its hook assigns proj.weight each call
    model.fc.kept = None
    model.log, model.scales = logging.getLogger("gemmfuse.test"), defaultdict(lambda: 2.0)
    loggers = dict(logging.Logger.manager.loggerDict)
    weight = model.proj.weight
    x = torch.randn(2, 8)
    new, report = optimize(model, (x,))
    assert model.fc.kept is None and not hasattr(model.fc, "scratch")
    assert model.proj.weight is weight  # not the trace's value (an fx Proxy)
    assert all(logging.Logger.manager.loggerDict.get(k) is v for k, v in loggers.items())
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_attributes_are_put_back_when_the_trace_fails():
    def body(s, x):
        s.fc.seen = x
        return x if x.sum() > 0 else -x  # control flow on a traced value: fx's TraceError

    model = Chain(body)
    seen = model.fc.seen = torch.zeros(16)
    with pytest.raises(TraceError):
        optimize(model, (torch.randn(2, 8),))
    assert model.fc.seen is seen


def test_too_many_float_or_tensor_arguments_stop_the_chain():
    def floats(s, x):
        for i in range(MAX_SCALARS + 1):
            x = x + float(i)
        return x

    entry = stops(floats)
    assert len(entry.chain) == 1 + MAX_SCALARS
    assert f"the kernel takes at most {MAX_SCALARS} float arguments" in entry.stopped

    def tensors(s, x):
        for t in s.ts:
            x = x * t
        return x

    entry = stops(tensors, ts=nn.ParameterList(p(16) for _ in range(MAX_TENSORS + 1)))
    assert len(entry.chain) == 1 + MAX_TENSORS
    assert f"at most {MAX_TENSORS} tensor arguments" in entry.stopped

    def after_reduction(s, x):  # tail ops run in PyTorch: no limit there
        x = x.amax(1)
        for i in range(MAX_SCALARS + 2):
            x = x * float(i + 1)
        return x

    assert stops(after_reduction).stopped == "ends at the model's output"


def test_consecutive_linears_are_each_fused_and_checked():
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.Linear(16, 4), nn.Tanh())
    x = torch.randn(5, 8)
    new, report = optimize(model, (x,))
    assert [(r.chain, r.verified) for r in report.linears] == [
        (("0", "sigmoid"), True),
        (("2", "tanh"), True),
    ]
    assert "stopped at 2 (nn.Linear): not in the epilogue grammar" in report.linears[0].stopped
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_f_linear_on_the_models_tensors_is_fused_reading_them_at_each_call():
    def body(s, x):
        return torch.relu(F.linear(x, s.w, s.b)) * 2.0

    model = Chain(body, w=p(16, 8), b=p(16))
    model.fc = nn.Identity()  # the F.linear is the only Linear
    x = torch.randn(5, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.name == "linear" and entry.chain == ("F.linear(w)", "relu", "x * 2.0")
    assert list(new.state_dict()) == list(model.state_dict()) == ["w", "b"]
    fused = new.linear_fused
    assert isinstance(fused, FusedLinear) and "bias=True" in repr(fused)
    with torch.no_grad():
        model.w.mul_(-1.0)
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
    new.double()
    with torch.no_grad():
        torch.testing.assert_close(new(x.double()), model(x.double()), rtol=0, atol=0)

    computed = Chain(lambda s, x: F.linear(x, s.w.t()), w=p(8, 16))
    computed.fc = nn.Identity()
    _, report = optimize(computed, (x,))
    assert report.linears[0].reason == (
        "its weight is computed in the forward (F.linear is fused on parameters, buffers "
        "and tensor attributes)"
    )


MATMUL_SPELLINGS = {
    "x @ w.T": lambda s, x: x @ s.w.T,
    "torch.matmul(x, w.t())": lambda s, x: torch.matmul(x, s.w.t()),
    "torch.mm(x, torch.t(w))": lambda s, x: torch.mm(x, torch.t(s.w)),
    "x.mm(w.transpose(0, 1))": lambda s, x: x.mm(s.w.transpose(0, 1)),
    "x.matmul(w.transpose(-1, -2))": lambda s, x: x.matmul(s.w.transpose(-1, -2)),
    "x @ w.permute(1, 0)": lambda s, x: x @ s.w.permute(1, 0),
    "x @ w.mT": lambda s, x: x @ s.w.mT,
}


@pytest.mark.parametrize("spelling", MATMUL_SPELLINGS)
def test_a_matmul_by_a_transposed_attribute_is_a_linear(spelling):
    """``x @ W.T`` (+ a bias as a chain op) in every spelling: fused as F.linear(x, W) is."""
    product = MATMUL_SPELLINGS[spelling]

    def body(s, x):
        return torch.relu(product(s, x) + s.b)

    model = Chain(body, w=p(16, 8), b=p(16))
    model.fc = nn.Identity()
    x = torch.randn(5, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused, entry
    assert entry.chain == ("x @ w.T", "x + b", "relu")
    assert list(new.state_dict()) == list(model.state_dict()) == ["w", "b"]
    assert not any(n.op in ("call_method", "call_function") for n in new.graph.nodes), new.code
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
        model.w.mul_(-1.0)
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_addmm_of_a_bias_and_a_transposed_attribute_is_a_linear_with_bias():
    model = Chain(lambda s, x: torch.relu(torch.addmm(s.b, x, s.w.t())), w=p(16, 8), b=p(16))
    model.fc = nn.Identity()
    x = torch.randn(5, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused and entry.chain == ("addmm(b, x, w.T)", "relu"), entry
    assert "bias=True" in repr(new.addmm_fused)
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "body",
    [
        lambda s, x: torch.relu(x @ s.w),  # not transposed: x @ W is not W's Linear
        lambda s, x: torch.addmm(s.w[0], x, s.w.T),  # a bias computed in the forward
        lambda s, x: torch.addmm(s.b2, x, s.w.T),  # a (1, N) bias: not a Linear's
        lambda s, x: torch.addmm(s.b, x, s.w.T, beta=2.0),  # a scaled bias
        lambda s, x: torch.relu(x @ (s.w * 2.0).T),  # a weight computed in the forward
        lambda s, x: torch.relu(torch.matmul(x, s.w.T, out=None)),  # a keyword argument
    ],
)
def test_other_matmuls_are_left_alone(body):
    model = Chain(body, w=p(8, 8), b=p(8), b2=p(1, 8))
    model.fc = nn.Identity()
    x = torch.randn(5, 8)
    new, report = optimize(model, (x,))
    assert report.linears == ()
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_reductions_over_the_kept_dimension_are_identities_or_drop_it():
    """KernelBench #18's and #51's forms: after a reduction with keepdim, min/max/sum/mean/
    logsumexp over dim 1 (of size 1) are the value itself; without keepdim, and before any tail
    op, the chain's reduction drops the dimension."""

    def body(s, x):
        x = torch.max(torch.sum(x, dim=1, keepdim=True), dim=1, keepdim=True)[0]
        x = torch.logsumexp(torch.mean(x, dim=1, keepdim=True), dim=1, keepdim=True)
        return torch.sigmoid(x.amin(dim=1)) * 2.0

    entry = stops(body)
    assert entry.fused and entry.stopped == "ends at the model's output"
    assert entry.chain == (
        "fc", "sum(dim=1, keepdim=True)", "max(dim=1, keepdim=True)", "mean(dim=1, keepdim=True)",
        "logsumexp(dim=1, keepdim=True)", "min(dim=1)", "sigmoid", "x * 2.0",
    )  # fmt: skip


def test_a_linear_on_a_3d_input_takes_pointwise_ops_and_stops_at_a_groupnorm():
    """(B, T, N): the leading dimensions become rows; GroupNorm would normalise dim 1 (T)."""
    norm = nn.GroupNorm(4, 16)
    model = Chain(lambda s, x: s.norm(torch.relu(x) * 2.0), norm=norm)
    x = torch.randn(2, 16, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused and entry.chain == ("fc", "relu", "x * 2.0")
    assert entry.stopped.startswith(
        "stopped at norm (nn.GroupNorm): GroupNorm after a Linear on a 3-D input [line "
    )
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_a_linear_module_called_twice_is_fused_at_each_call_sharing_its_weight_split():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(torch.relu(self.fc(x))))

    model, x = Twice(), torch.randn(3, 8)
    new, report = optimize(model, (x,))
    got = [(r.name, r.fused, r.chain, r.module) for r in report.linears]
    assert got == [("fc", True, ("fc", "relu"), "fc_fused"),
                   ("fc_1", True, ("fc", "tanh"), "fc_1_fused")]  # fmt: skip
    assert new.fc is model.fc and list(new.state_dict()) == list(model.state_dict())
    assert new.fc_fused.weight_split is new.fc_1_fused.weight_split
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
        model.fc.weight.mul_(-1.0)
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_linears_that_are_not_swapped():
    hooked = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    hooked[0].register_forward_hook(lambda m, i, o: o * 2)
    new, report = optimize(hooked, (torch.randn(3, 8),))
    assert report.linears[0].reason == "the module has forward hooks"
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(new(x), hooked(x), rtol=0, atol=0)


def test_a_chain_module_with_hooks_stops_the_chain():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.ReLU())
    model[2].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
    x = torch.randn(3, 8)
    new, report = optimize(model, (x,))
    assert report.linears[0].chain == ("0", "tanh")
    assert "the module has forward hooks" in report.linears[0].stopped
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
