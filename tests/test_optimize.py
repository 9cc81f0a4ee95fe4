"""gemmfuse.optimize on CPU: the rewritten model computes what the model computes (the same torch
ops, so exactly), keeps its state, and reports each decision."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_files import (
    FIT,
    REORDERED,
    UNFIT,
    assert_as_accurate,
    assert_computes_the_model,
    build,
)
from torch.fx.proxy import TraceError

from gemmfuse import POINTWISE, REDUCTIONS, FusedLinear, OptimizeReport, optimize
from gemmfuse.epilogue import MAX_SCALARS, MAX_TENSORS
from helpers import Chain

# Per model file: (Linear, fused, chain, how the chain ended or why it was not swapped).
EXPECTED = {
    "activations_no_norm": [
        ("fc", True, "fc -> relu -> x * 0.5 -> gelu -> gelu_tanh -> x * sigmoid(x) -> tanh "
         "-> sigmoid -> x - 0.25", "ends at the model's output"),
    ],
    "avg_pool_over_channels": [
        ("fc1", True, "fc1 -> avg_pool1d(4) over the channels (folded into the weights) -> gelu "
         "-> x * 2.0 -> max(dim=1)",
         "stopped at add (operator.add): operand sum_1 is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 24: `b = "
         "torch.tanh(b).sum(dim=1)`] [line 26: `return a + b + c.sum(dim=1)`]"),
        ("fc2", True, "fc2 -> avg_pool1d(3) over the channels (folded into the weights) -> tanh "
         "-> sum(dim=1)",
         "stopped at add (operator.add): operand getattr_1 is computed after the Linear (fused"
         " operands computed in the forward come before it) [line 26: `return a + b + "
         "c.sum(dim=1)`]"),
        ("fc3", True, "fc3 -> max_pool1d(2) over the channels -> sum(dim=1)",
         "stopped at add_1 (operator.add): operand add is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 26: `return a + b + "
         "c.sum(dim=1)`]"),
    ],
    "max_pool_over_channels": [
        ("fc1", True, "fc1 -> max_pool1d(2) over the channels -> sum(dim=1) -> x * 0.5",
         "stopped at add (operator.add): operand mean is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 26: `b = "
         "F.max_pool1d(self.fc2(x).unsqueeze(1), 4).squeeze(1).mean(dim=1)`] [line 29: `return "
         "a + b + c + d`]"),
        ("fc2", True, "fc2 -> max_pool1d(4) over the channels -> mean(dim=1) -> x + mul",
         "stopped at add_1 (operator.add): operand logsumexp is computed after the Linear "
         "(fused operands computed in the forward come before it) [line 27: `c = "
         "torch.logsumexp(self.wide_pool(self.fc3(x).unsqueeze(1)).squeeze(1), dim=1)`] [line "
         "29: `return a + b + c + d`]"),
        ("fc3", True, "fc3 -> max_pool1d(8) over the channels -> logsumexp(dim=1)",
         "stopped at add_1 (operator.add): operand add is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 29: `return a + b + c + d`]"),
        ("fc4", True, "fc4",
         "stopped at max_pool_1 (channel pooling): a max pooling over the channels is fused "
         "where a channel reduction follows it at once, the kernels taking the windows' maxima "
         "as they reduce a row (stopped at relu (torch.relu): not a channel reduction [line 28: "
         "`d = torch.relu(self.max_pool(self.fc4(x).unsqueeze(1)).squeeze(1)).sum(dim=1)`])"),
    ],
    "batchnorm_eval": [
        ("fc1", True, "fc1 -> x * 2.0 -> bn1 (eval: (x - mean) * scale + bias) -> relu",
         "stopped at add (operator.add): operand tanh is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 33: `b = "
         "torch.tanh(self.bn2(self.gn(self.fc2(x))))`] [line 35: `return a + b + c`]"),
        ("fc2", True, "fc2 -> gn -> bn2 (eval: (x - mean) * scale) -> tanh -> x + relu",
         "stopped at add_1 (operator.add): operand relu_1 is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 34: `c = "
         "torch.relu(torch.nn.functional.gelu(self.bn3(self.fc3(x))))`] [line 35: `return a + "
         "b + c`]"),
        ("fc3", True, "fc3 -> bn3 (batch statistics: (x - mean) * scale + bias) -> gelu -> relu",
         "stopped at add_1 (operator.add): operand add is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 35: `return a + b + c`]"),
    ],
    "batched_linear_gelu": [
        ("fc", True, "fc -> gelu -> x * 0.5 -> softmax(dim=-1)", "ends at the model's output"),
    ],
    "elementwise_min_parameter": [
        ("linear", True, "linear -> minimum(x, constant) -> x - constant -> maximum(x, floor)",
         "ends at the model's output"),
    ],
    "gemm_groupnorm_min_bias": [
        ("gemm", True, "gemm -> group_norm -> min(dim=1, keepdim=True) -> x + bias",
         "ends at the model's output"),
    ],
    "groupnorm_affine_post": [
        ("fc", True, "fc -> gn -> silu -> clamp(-0.5, 2.0) -> hardsigmoid -> 2.0 - x -> x + x",
         "ends at the model's output"),
    ],
    "groupnorm_one_group_plain": [
        ("fc", True, "fc -> x + 1.0 -> gn -> softplus(2.0, 10.0) -> elu(0.5) -> "
         "hardtanh(0.0, 6.0) -> x / 3.0", "ends at the model's output"),
    ],
    "groupnorm_wide_functional": [
        ("fc", True, "fc -> group_norm(2, eps=0.0001) -> leaky_relu(0.2) -> hardswish -> mish "
         "-> x * scale", "ends at the model's output"),
    ],
    "inplace_methods": [
        ("fc", True, "fc -> x * 2.0 -> x + bias2 -> relu -> sigmoid -> clamp(0.1, 0.9) -> log "
         "-> exp -> x / 3.0 -> clamp(-0.05, inf) -> clamp(-inf, 0.2)",
         "ends at the model's output"),
    ],
    "matmul_transposed_weight": [
        ("matmul", True, "x @ weight.T -> x / 2.0 -> sum(dim=1, keepdim=True) -> x * 1.5",
         "ends at the model's output"),
    ],
    "values_around_norm": [
        ("fc", True, "fc -> sigmoid -> x + fc -> norm -> tanh -> x * scale -> x + norm -> "
         "x * tanh.detach() -> logsumexp(dim=1, keepdim=True) -> mish -> x * logsumexp",
         "ends at the model's output"),
    ],
    "values_read_again": [
        ("fc1", True, "fc1 -> sigmoid -> x * 2.0 -> x + fc1",
         "stopped at fc2 (nn.Linear): not in the epilogue grammar [line 19: `y = self.fc2(x)`]"),
        ("fc2", True, "fc2 -> x * 2.0 -> x + fc2.clone().detach()", "ends at the model's output"),
    ],
    "max_values_tail": [
        ("fc", True, "fc -> relu -> max(dim=1) -> x * 2.0 -> sigmoid -> x - shift",
         "ends at the model's output"),
    ],
    "mixed_blocks": [
        ("fc1", True, "fc1 -> relu -> softmax(dim=1)",
         "stopped at add (operator.add): operand squeeze is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 31: `b = "
         "self.fc2(x.unsqueeze(1)).squeeze(1)`] [line 36: `return a + b + c + d`]"),
        ("fc2", True, "fc2",
         "stopped at squeeze (Tensor.squeeze): not in the epilogue grammar [line 31: `b = "
         "self.fc2(x.unsqueeze(1)).squeeze(1)`]"),
        ("fc3", True, "fc3 -> x * sigmoid(x)",
         "stopped after mul: mul is also read by sub, which the chain does not reach (stopped "
         "at mean (Tensor.mean): mul is read again after it [line 34: `c = c - c.mean(dim=1, "
         "keepdim=True)  # c used twice: the chain stops before`])"),
        ("block.fc", True, "block.fc -> block.norm -> tanh",
         "stopped at linear (F.linear): not in the epilogue grammar [line 35: `d = "
         "F.linear(self.block(x), self.proj)`]"),
        ("linear", True, "F.linear(proj)",
         "stopped at add_2 (operator.add): operand add_1 is computed after the Linear (fused "
         "operands computed in the forward come before it) [line 36: `return a + b + c + d`]"),
    ],
    "residual_operands": [
        ("fc1", True, "fc1 -> gelu",
         "stopped at fc2 (nn.Linear): not in the epilogue grammar [line 25: `h = "
         "self.fc2(F.gelu(self.fc1(self.norm(x)))) + x`]"),
        ("fc2", True, "fc2 -> x + input x",
         "stopped after add: add is also read by reshape, which the chain does not reach "
         "(stopped at getattr_1 (builtins.getattr): not in the epilogue grammar [line 26: "
         "`flat = h.reshape(-1, h.shape[-1])`])"),
        ("proj", True, "proj -> x * sigmoid -> proj_norm -> x + reshape",
         "stopped at head (nn.Linear): not in the epilogue grammar [line 30: `y = "
         "torch.logsumexp(torch.mean(self.head(g) - self.shift, dim=1, keepdim=True), dim=1,`]"),
        ("head", True, "head -> x - shift -> mean(dim=1, keepdim=True) -> "
         "logsumexp(dim=1, keepdim=True) -> gelu -> x + detach",
         "ends at the model's output"),
    ],
    "per_channel_operands": [
        ("fc", True, "fc -> x * scale -> x + shift -> offset - x -> tanh -> exp -> gn -> sigmoid "
         "-> x + 0.5 -> 1.5 / x -> x / divisor -> x + 1.0 -> numerator / x -> sigmoid -> log",
         "ends at the model's output"),
    ],
    "layernorm_functional_min": [
        ("fc", True, "fc -> layer_norm(eps=1e-05) -> tanh -> min(dim=1, keepdim=True) -> "
         "x + offset", "ends at the model's output"),
    ],
    "layernorm_sequence_gelu": [
        ("fc", True, "fc -> ln -> gelu", "ends at the model's output"),
    ],
    "rmsnorm_functional_max": [
        ("fc", True, "fc -> rms_norm(eps=1e-06) -> x * 2.0 -> max(dim=1, keepdim=True)",
         "ends at the model's output"),
    ],
    "rmsnorm_sequence_silu": [
        ("fc", True, "fc -> norm -> silu", "ends at the model's output"),
    ],
    "reductions": [
        (f"fcs.{i}", True, f"fcs.{i} -> {chain}",
         f"stopped at reshape{f'_{i}' if i else ''} (Tensor.reshape): not in the epilogue grammar "
         "[line 28: `return torch.cat([o.reshape(-1) for o in outs])`]")
        for i, chain in enumerate([
            "min(dim=1)", "min(dim=1, keepdim=True)", "max(dim=1)", "max(dim=1, keepdim=True)",
            "gn -> sum(dim=1)", "sum(dim=1, keepdim=True)", "mean(dim=1)",
            "tanh -> mean(dim=1, keepdim=True)", "logsumexp(dim=1)",
            "logsumexp(dim=1, keepdim=True)",
        ])
    ],
    "shared_linear": [
        ("fc", True, "fc -> relu", "stopped at fc (nn.Linear): not in the epilogue grammar "
         "[line 14: `return torch.softmax(self.fc(torch.relu(self.fc(x))), dim=-1)`]"),
        ("fc_1", True, "fc -> softmax(dim=-1)", "ends at the model's output"),
    ],
    "reductions_of_one": [
        ("linear", True, "linear -> sum(dim=1, keepdim=True) -> max(dim=1, keepdim=True) -> "
         "mean(dim=1, keepdim=True) -> logsumexp(dim=1, keepdim=True) -> "
         "logsumexp(dim=1, keepdim=True)", "ends at the model's output"),
    ],
    "scalar_tensor_attributes": [
        ("fc", True, "fc -> x / temperature -> x * factor -> relu", "ends at the model's output"),
    ],
    "unfit_computed_weight": [
        ("linear", False, "", "its weight is computed in the forward (F.linear is fused on "
         "parameters, buffers and tensor attributes)"),
    ],
}  # fmt: skip


def test_every_model_file_has_expectations():
    assert sorted(EXPECTED) == sorted(FIT + UNFIT)


@pytest.mark.parametrize("name", FIT)
def test_optimized_model_computes_what_the_model_computes(name):
    _, model, inputs = build(name)
    new, _ = optimize(model, inputs)
    fewer_rows = [t[:5] for t in inputs]  # another batch size than the example's
    with torch.no_grad():
        for batch in (inputs, fewer_rows):
            assert_computes_the_model(name, model, new(*batch), batch)


@pytest.mark.parametrize("name", FIT + UNFIT)
def test_report_says_what_happened_to_each_linear(name):
    _, model, inputs = build(name)
    new, report = optimize(model, inputs)
    assert isinstance(report, OptimizeReport)
    got = [(r.name, r.fused, " -> ".join(r.chain), r.stopped if r.fused else r.reason)
           for r in report.linears]  # fmt: skip
    assert got == EXPECTED[name]
    assert all(r.verified is (True if r.fused else None) for r in report.linears)
    fused = {path for path, m in new.named_modules() if isinstance(m, FusedLinear)}
    assert fused == {r.module for r in report.fused}
    for r in report.fused:  # a module's at its path; a functional or shared call's, a new one
        assert r.module in (r.name, f"{r.name}_fused"), r
    text = str(report)
    assert f"{len(report.fused)} of {len(report.linears)} Linear call(s) fused" in text
    bare = [r for r in report.fused if len(r.chain) == 1]
    assert list(report.bare) == bare
    assert (f"{len(bare)} bare GEMM" in text.splitlines()[0]) == bool(bare)
    for line, entry in zip(text.splitlines()[1:], report.linears, strict=True):
        assert line.strip() == str(entry)


@pytest.mark.parametrize("name", FIT)
def test_state_dict_keys_and_parameters_are_the_models(name):
    _, model, inputs = build(name)
    new, _ = optimize(model, inputs)
    assert list(new.state_dict()) == list(model.state_dict())
    ours = dict(new.named_parameters(remove_duplicate=False))
    for key, p in model.named_parameters(remove_duplicate=False):
        assert ours[key] is p, key
    theirs = dict(model.named_buffers())
    for key, b in new.named_buffers():
        assert theirs[key] is b, key


def test_every_grammar_op_and_reduction_appears_in_the_model_files():
    ops, reductions, norms = set(), set(), set()
    for name in FIT:
        _, model, inputs = build(name)
        new, _ = optimize(model, inputs)
        for m in new.modules():
            if isinstance(m, FusedLinear):
                epi = m.epilogue
                ops |= {op.name for op in epi.pre + epi.post + epi.tail}
                if epi.reduce:
                    reductions.add((epi.reduce.op, epi.reduce.keepdim))
                if epi.norm:
                    n = m.out_features // epi.norm.num_groups
                    norms |= {("affine", epi.norm.affine), ("one group", epi.norm.num_groups == 1)}
                    norms.add(("wider than 128", n > 128))
    assert ops >= set(POINTWISE)
    assert reductions == {(op, keepdim) for op in REDUCTIONS for keepdim in (True, False)}
    assert norms == {(k, v) for k in ("affine", "one group", "wider than 128") for v in (0, 1)}


def test_in_place_updates_to_the_models_parameters_reach_the_optimized_model():
    _, model, inputs = build("gemm_groupnorm_min_bias")
    new, _ = optimize(model, inputs)
    with torch.no_grad():
        before = new(*inputs).clone()
        model.gemm.weight.add_(0.5)  # an optimizer step, as far as the tensors know
        model.group_norm.bias.sub_(0.25)
        model.bias.mul_(2.0)
        after = new(*inputs)
        assert not torch.equal(before, after)
        torch.testing.assert_close(after, model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name",
    [
        "groupnorm_wide_functional",
        "values_read_again",
        "values_around_norm",
        "avg_pool_over_channels",
        "max_pool_over_channels",
    ],
)
def test_gradients_reach_the_models_parameters(name):
    """The optimized model's gradients are the model's: its parameters' and the input's, values
    read again and detached reads included."""
    _, model, inputs = build(name)
    x = inputs[0].requires_grad_()
    new, _ = optimize(model, inputs)
    new(x).square().sum().backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    got["x"], x.grad = x.grad.clone(), None
    model.zero_grad()
    model(x).square().sum().backward()
    want = {**{k: p.grad for k, p in model.named_parameters()}, "x": x.grad}
    if name not in REORDERED:
        for k in want:
            torch.testing.assert_close(got[k], want[k], msg=k)
        return
    exact_model, exact_x = copy.deepcopy(model).double(), x.detach().double().requires_grad_()
    exact_model(exact_x).square().sum().backward()
    exact = {**{k: p.grad for k, p in exact_model.named_parameters()}, "x": exact_x.grad}
    for k in want:  # another order of the same sums: the float64 bar (model_files.REORDERED)
        assert_as_accurate(got[k], want[k], exact[k], k)


def test_to_moves_parameters_and_buffers_of_both_views():
    """.to() replaces buffers: the chain reads its operands from their owner at each call."""
    _, model, inputs = build("per_channel_operands")
    new, _ = optimize(model, inputs)
    new.double()
    assert model.shift.dtype == model.fc.weight.dtype == torch.float64
    x = [t.double() for t in inputs]
    with torch.no_grad():
        torch.testing.assert_close(new(*x), model(*x), rtol=0, atol=0)
    assert new.fc.last_path == "torch"


def test_unused_modules_plain_attributes_and_non_persistent_buffers_are_kept():
    _, model, inputs = build("scalar_tensor_attributes")
    new, _ = optimize(model, inputs)
    assert new.unused is model.unused
    assert "temperature" not in new.state_dict() and new.temperature is model.temperature
    assert new.factor is model.factor and "factor" not in new.state_dict()
    assert list(new.state_dict()) == ["fc.weight", "unused.weight", "unused.bias"]


def test_the_model_itself_is_left_unchanged():
    _, model, inputs = build("mixed_blocks")
    before = {k: type(m) for k, m in model.named_modules()}
    attributes = set(model.__dict__)
    optimize(model, inputs)
    assert {k: type(m) for k, m in model.named_modules()} == before
    assert set(model.__dict__) == attributes
    assert type(model.block.fc) is nn.Linear


class _WritesBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)  # training mode: running statistics updated per call
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1.0)
        return torch.relu(self.bn(self.fc(x))) * self.calls


def test_the_example_run_leaves_the_models_buffers_as_they_were():
    torch.manual_seed(0)
    model, twin = _WritesBuffers(), _WritesBuffers()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    new, _ = optimize(model, (x,))
    for (k, b), t in zip(model.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, t, rtol=0, atol=0, msg=k)
    with torch.no_grad():  # one call of each takes one step, not two
        # the BatchNorm1d's batch statistics: var_mean's rounding, not the module's kernel's
        torch.testing.assert_close(new(x), twin(x), rtol=1e-5, atol=1e-5)
    assert model.calls.item() == twin.calls.item() == 1.0
    assert model.bn.num_batches_tracked.item() == twin.bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(model.bn.running_var, twin.bn.running_var)


class _Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return F.dropout(self.drop(torch.relu(self.fc(x))), 0.25, self.training)


def test_optimize_leaves_the_random_stream_as_it_was():
    """The example run and the checks draw on a fork of the random state: a model with random
    ops (dropout in training mode) sees the same random numbers after optimize as without."""
    torch.manual_seed(0)
    model, x = _Dropout(), torch.randn(4, 8)
    assert model.training
    torch.manual_seed(1)
    expected = [model(x) for _ in range(3)]
    torch.manual_seed(1)
    new, report = optimize(model, (x,))
    assert [r.chain for r in report.linears] == [("fc", "relu")]
    got = [new(x) for _ in range(3)]
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.manual_seed(1)
    torch.testing.assert_close(model(x), expected[0], rtol=0, atol=0)


def test_deepcopy_keeps_the_whole_tree():
    _, model, inputs = build("scalar_tensor_attributes")
    new, _ = optimize(model, inputs)
    twin = copy.deepcopy(new)
    assert list(twin.state_dict()) == list(new.state_dict())
    assert twin.fc.weight is not model.fc.weight
    with torch.no_grad():
        torch.testing.assert_close(twin(*inputs), new(*inputs), rtol=0, atol=0)
        twin.fc.weight.add_(1.0)  # the copy's chain reads the copy's parameters
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
        assert not torch.equal(twin(*inputs), new(*inputs))


def test_training_mode_is_the_models():
    _, model, inputs = build("activations_no_norm")
    model.eval()
    new, _ = optimize(model, inputs)
    assert not new.training


def test_meta_tensors_give_an_unverified_report():
    module = __import__("model_files").load("gemm_groupnorm_min_bias")
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs())
        inputs = module.get_inputs()
    new, report = optimize(model, inputs)
    assert [r.verified for r in report.linears] == [None]
    assert "not verified: meta tensors" in str(report)
    assert isinstance(new.gemm, FusedLinear)


def test_a_chain_that_does_not_reproduce_the_model_keeps_pytorch(monkeypatch):
    _, model, inputs = build("groupnorm_affine_post")
    monkeypatch.setattr(FusedLinear, "reference", lambda self, x: torch.zeros(1))
    new, report = optimize(model, inputs)
    (entry,) = report.linears
    assert not entry.fused and entry.verified is False
    assert "did not reproduce the model on example_inputs" in entry.reason
    assert type(new.fc) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)


def test_forward_traces_the_given_function():
    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Child(Base):
        def forward(self, x):
            raise AssertionError("optimize must trace Base.forward")

    model = Child()
    x = torch.randn(4, 8)
    new, report = optimize(model, (x,), forward=Base.forward)
    assert [r.chain for r in report.linears] == [("fc", "relu")]
    with torch.no_grad():
        torch.testing.assert_close(new(x), Base.forward(model, x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m, x: optimize("model", (x,)), TypeError, "model must be a torch.nn.Module"),
        (lambda m, x: optimize(m, x), TypeError, "example_inputs must be a tuple or list"),
        (lambda m, x: optimize(m, (x,), kernel="fast"), ValueError, "kernel must be one of"),
        (lambda m, x: optimize(m, (x,), precision="fp16"), ValueError, "precision must be"),
        (lambda m, x: optimize(m, (x,), forward=len), TypeError, "forward must be a Python"),
        # the example run's own error (F.linear's), unchanged
        (lambda m, x: optimize(m, (x[:, :3],)), RuntimeError, "shapes cannot be multiplied"),
    ],
)
def test_bad_arguments_raise_naming_them(call, error, message):
    model = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(error, match=message):
        call(model, torch.randn(2, 8))


def test_untraceable_model_raises_the_tracers_own_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(TraceError, match="symbolically traced variables cannot be used as inputs"):
        optimize(Branchy(), (torch.randn(2, 4),))


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


# ---- property: any chain of the grammar, written any supported way, is fused whole

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
