"""gemmfuse.optimize on CPU: the rewritten model computes what the model computes (the same torch
ops, so exactly), keeps its state, and reports each decision."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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


def test_a_parametrized_linear_is_read_through_its_parametrization():
    """A Linear whose weight a parametrization computes (weight_norm's) keeps its place, and
    its FusedLinear reads the weight at each call, as a shared module's does: a change to the
    parametrization's own parameters reaches the result."""
    from torch.nn.utils import parametrizations

    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU())
    x = torch.randn(4, 8)
    new, report = optimize(model, (x,))
    assert report.fused and isinstance(new.get_submodule("_0_fused"), FusedLinear)
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
        model[0].parametrizations.weight.original0.mul_(2.0)  # the norm g
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


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


FITS = "example_inputs do not fit Sequential.forward: "


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m, x: optimize("model", (x,)), TypeError, "model must be a torch.nn.Module"),
        (lambda m, x: optimize(m, x), TypeError, "example_inputs must be a tuple or list"),
        (lambda m, x: optimize(m, (x,), kernel="fast"), ValueError, "kernel must be one of"),
        (lambda m, x: optimize(m, (x,), precision="fp16"), ValueError, "precision must be"),
        (lambda m, x: optimize(m, (x,), forward=len), TypeError, "forward must be a Python"),
        (
            lambda m, x: optimize(m, (x,), precision=["fp32"]),
            ValueError,
            "precision must be one of",
        ),
        # the model itself would refuse these calls; the example run would drop the extra input
        (
            lambda m, x: optimize(m, (x, x)),
            TypeError,
            FITS + r"2 input\(s\) given, it takes 1 \(input\)",
        ),
        (
            lambda m, x: optimize(m, ()),
            TypeError,
            FITS + r"0 input\(s\) given, it takes 1 \(input\)",
        ),
        # the example run's own error (F.linear's), unchanged
        (lambda m, x: optimize(m, (x[:, :3],)), RuntimeError, "shapes cannot be multiplied"),
    ],
)
def test_bad_arguments_raise_naming_them(call, error, message):
    model = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(error, match=message):
        call(model, torch.randn(2, 8))


def test_example_inputs_are_checked_against_the_forwards_signature():
    """Defaults and *args take what the model's own call takes; a keyword-only argument with no
    default cannot come from positional inputs."""

    class Defaults(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, y=None, *rest):
            return self.fc(x)

    class Keyword(Defaults):
        def forward(self, x, *, scale):
            return self.fc(x) * scale

    x = torch.randn(2, 8)
    for inputs in ((x,), (x, x), (x, x, x)):
        optimize(Defaults(), inputs)
    with pytest.raises(
        TypeError, match=r"Keyword.forward: it needs keyword argument\(s\) \['scale'\]"
    ):
        optimize(Keyword(), (x,))


def test_untraceable_model_raises_the_tracers_own_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(TraceError, match="symbolically traced variables cannot be used as inputs"):
        optimize(Branchy(), (torch.randn(2, 4),))
