"""FusedLinear on CPU: shared state, settings read at each call, the exact fallback, repr."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from model_files import build

import gemmfuse.modules
from gemmfuse import Epilogue, FusedLinear, GroupNormSpec, Pointwise, optimize
from helpers import Chain, max_abs_err


def optimized(name):
    _, model, inputs = build(name)
    new, _ = optimize(model, inputs)
    return model, new, inputs


def test_registers_the_linears_own_parameters():
    model, new, _ = optimized("groupnorm_affine_post")
    fused = new.fc
    assert isinstance(fused, FusedLinear)
    assert fused.weight is model.fc.weight and fused.bias is model.fc.bias
    assert list(fused.state_dict()) == ["weight", "bias"]
    assert dict(fused.named_children()) == {}  # the GroupNorm and SiLU stay where they were
    fused.weight = nn.Parameter(torch.zeros_like(fused.weight))  # one dict: both views see it
    assert model.fc.weight is fused.weight


def test_repr_shows_the_chain():
    _, new, _ = optimized("gemm_groupnorm_min_bias")
    assert repr(new.gemm) == (
        "FusedLinear(in_features=96, out_features=128, bias=True, chain=gemm -> group_norm -> "
        "min(dim=1, keepdim=True) -> x + bias, kernel=auto, precision=fp32)"
    )
    assert new.gemm.epilogue == Epilogue(
        norm=GroupNormSpec(16, 1e-5, True),
        reduce=new.gemm.epilogue.reduce,
        tail=(Pointwise("add", (gemmfuse.Param(0),)),),
    )


def test_calls_fused_linear_with_its_operands_and_settings(monkeypatch):
    model, new, inputs = optimized("per_channel_operands")
    seen = {}

    def spy(x, weight, bias, epilogue, gn_weight, gn_bias, **kwargs):
        seen.update(kwargs, weight=weight, gn_weight=gn_weight, epilogue=epilogue)
        return torch.zeros(1), "fused"

    monkeypatch.setattr(gemmfuse.modules, "fused_linear_with_path", spy)
    new.fc.kernel, new.fc.precision = "portable", "tf32"
    new(*inputs)
    assert new.fc.last_path == "fused"
    assert seen["kernel"] == "portable" and seen["precision"] == "tf32"
    assert seen["weight"] is model.fc.weight and seen["gn_weight"] is model.gn.weight
    assert seen["weight_cache"] is new.fc.weight_split
    names = ["scale", "shift", "offset", "divisor", "numerator"]
    assert [p is getattr(model, n) for p, n in zip(seen["params"], names, strict=True)]
    assert seen["epilogue"] == new.fc.epilogue


def test_a_call_is_offered_to_the_plans_once():
    """FusedLinear offers a call to its weight cache's plans itself (what a plan's key does not
    see is checked there); where none serves it, fused_linear_with_path does not offer it
    again, and a chain FusedLinear does not offer (a pooling, a BatchNorm1d) is offered there."""
    model, new, inputs = optimized("gemm_groupnorm_min_bias")
    offers = []

    def declines(*args):
        offers.append(args[3].shape)  # x

    new.gemm.weight_split.plans = [declines]
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
    assert len(offers) == 1 and new.gemm.last_path == "torch"
    _, pooled, inputs = optimized("avg_pool_over_channels")
    fused = [m for m in pooled.modules() if isinstance(m, FusedLinear) and m.pool is not None]
    assert fused
    for m in fused:
        m.weight_split.plans = [declines]
    offers.clear()
    with torch.no_grad():
        pooled(*inputs)
    assert len(offers) == len(fused)  # once each, by fused_linear_with_path


def test_cpu_runs_the_reference_path():
    model, new, inputs = optimized("groupnorm_wide_functional")
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
    assert new.fc.last_path == "torch"


@pytest.mark.parametrize(
    "name, path",
    [
        ("activations_no_norm", "torch"),  # pointwise: the leading dimensions become rows
        ("max_values_tail", "fallback"),  # max over dim 1 of (B, T, N) reduces T, not features
    ],
)
def test_a_3d_input_runs_flattened_when_the_chain_is_pointwise(name, path):
    model, new, inputs = optimized(name)
    x = inputs[0].reshape(4, -1, inputs[0].shape[1])
    with torch.no_grad():
        got, expected = new.fc(x), model(x)  # the FusedLinear holds the whole chain
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert new.fc.last_path == path and got.shape == expected.shape


def test_groupnorm_settings_are_read_at_each_call():
    model, new, inputs = optimized("groupnorm_affine_post")
    for groups, eps in [(4, 1e-5), (2, 0.5), (128, 1e-5)]:
        model.gn.num_groups, model.gn.eps = groups, eps
        with torch.no_grad():
            torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
        assert new.fc.last_path == "torch"
        assert new.fc.epilogue.norm == GroupNormSpec(groups, eps, True)
    model.gn.num_groups = 3  # does not divide 128: PyTorch's own error, from the fallback
    with pytest.raises(RuntimeError) as expected:
        model(*inputs)
    with pytest.raises(RuntimeError, match=str(expected.value).splitlines()[0][:40]):
        new(*inputs)
    assert new.fc.last_path == "fallback"


def test_affine_removed_after_optimize():
    model, new, inputs = optimized("gemm_groupnorm_min_bias")
    model.group_norm.weight = None  # weight without bias: outside the grammar, PyTorch runs it
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
    assert new.gemm.last_path == "fallback"
    model.group_norm.bias = None  # now a plain GroupNorm: fused again
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
    assert new.gemm.last_path == "torch" and not new.gemm.epilogue.norm.affine


def test_activation_module_settings_are_read_at_each_call():
    model, new, inputs = optimized("groupnorm_one_group_plain")
    model.softplus.beta, model.relu6.max_val = 0.5, 4.0
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), model(*inputs), rtol=0, atol=0)
    assert new.fc.last_path == "torch"
    model2, new2, inputs2 = optimized("activations_no_norm")
    model2.gelu_tanh.approximate = "none"
    with torch.no_grad():
        torch.testing.assert_close(new2(*inputs2), model2(*inputs2), rtol=0, atol=0)
    assert [op.name for op in new2.fc.epilogue.pre].count("gelu") == 2
    model2.gelu_tanh.approximate = "sigmoid"  # outside the grammar (and PyTorch's)
    assert new2.fc.epilogue is None
    with pytest.raises(RuntimeError):
        new2(*inputs2)
    assert new2.fc.last_path == "fallback"


@pytest.mark.parametrize(
    "temperature, path",
    [
        (torch.rand(32, 64) + 1, "torch"),  # per row and channel: the IR keeps any (M, N)
        (torch.rand(2, 1, 64) + 1, "fallback"),  # grows the shape
        (torch.tensor(2.0, dtype=torch.float64), "fallback"),  # another dtype
        (torch.rand(64, dtype=torch.float64) + 1, "fallback"),  # promotes the result
    ],
)
def test_an_operand_that_no_longer_fits_runs_the_original_chain(temperature, path):
    model, new, inputs = optimized("scalar_tensor_attributes")
    model.temperature = temperature  # a buffer: the models share it
    with torch.no_grad():
        got, expect = new(*inputs), model(*inputs)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert new.fc.last_path == path


def test_constructor_arguments_are_checked():
    with pytest.raises(TypeError, match="give an nn.Linear as linear, or linear=None"):
        FusedLinear(nn.ReLU(), fallback=lambda *a: None)
    with pytest.raises(TypeError, match="linear=None needs weight"):
        FusedLinear(None, fallback=lambda *a: None)
    with pytest.raises(ValueError, match="stage must be one of"):
        gemmfuse.modules.ChainOp("middle", "relu")
    with pytest.raises(TypeError, match="module must be one of"):
        gemmfuse.modules.ChainOp("pre", module=nn.Softmax(1))


def test_an_operand_that_no_longer_broadcasts_runs_the_original_chain():
    model, new, inputs = optimized("scalar_tensor_attributes")
    model.temperature = torch.rand(3, 64) + 1  # does not broadcast against (32, 64)
    with pytest.raises(RuntimeError) as expected:
        model(*inputs)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        new(*inputs)  # the fallback's own error, as the model's
    assert new.fc.last_path == "fallback"


@pytest.mark.parametrize(
    "shape, fits",
    [((), True), ((64,), True), ((1, 64), True), ((32, 1), True), ((32, 64), True),
     ((3, 64), False), ((2, 1, 64), False), ((65,), False)],
)  # fmt: skip
def test_broadcast_check_keeps_the_shape(shape, fits):
    assert gemmfuse.epilogue.keeps_shape(shape, (32, 64)) is fits


@pytest.mark.parametrize("setting, value", [("eps", -1.0), ("eps", "small"), ("num_groups", 2.5)])
def test_group_norm_settings_outside_the_grammar_give_no_epilogue(setting, value):
    _, new, _ = optimized("groupnorm_affine_post")
    norm = new.fc._norm.module
    setattr(norm, setting, value)
    assert new.fc.epilogue is None


def test_a_weight_of_another_dtype_runs_the_original_chain():
    """fused_linear's own rules (validation.py) decide: x and the weight must share a dtype."""
    model, new, inputs = optimized("groupnorm_affine_post")
    model.fc.weight.data = model.fc.weight.data.double()  # the models share the parameter
    with pytest.raises(RuntimeError) as expected:
        model(*inputs)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value).splitlines()[0])):
        new(*inputs)
    assert new.fc.last_path == "fallback"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_rms_norm_eps_none_is_resolved_as_pytorch_does(dtype):
    """F.rms_norm's eps=None is float32's epsilon for a bfloat16 input (the dtype it computes
    in), float64's for float64: on rows of small values the two choices differ visibly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32)).to(dtype)
    x = (0.01 * torch.randn(8, 16)).to(dtype)
    new, report = gemmfuse.optimize(model, (x,))
    assert report.fused
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_an_eval_batch_norm_set_to_training_normalises_with_batch_statistics():
    """An eval-mode BatchNorm1d is per-channel ops read at each call; back in training mode it
    normalises with the batch's statistics: the fused call splits there, and the running
    statistics step as the model's do (once per call; a reference check steps nothing)."""
    model, new, inputs = optimized("batchnorm_eval")
    twin = copy.deepcopy(model)
    x = inputs[0]
    with torch.no_grad():
        model.bn1.running_var.mul_(1.5)  # a buffer changed after optimize: read at each call
        twin.bn1.running_var.mul_(1.5)
        torch.testing.assert_close(new(x), twin(x), rtol=1e-5, atol=1e-5)
        assert new.fc1.last_path == "torch"
        model.bn1.train()
        twin.bn1.train()
        for _ in range(2):
            want = torch.relu(twin.bn1(twin.fc1(x) * 2.0))  # the chain fc1 ends at
            torch.testing.assert_close(new.fc1(x), want, rtol=1e-5, atol=1e-5)
            assert new.fc1.last_path == "torch"
        torch.testing.assert_close(new.fc1.reference(x), want, rtol=1e-5, atol=1e-5)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn1, key), getattr(twin.bn1, key), msg=key)
    assert model.bn1.num_batches_tracked.item() == 2


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("track", [True, False])
def test_batch_statistics_forward_backward_and_running_statistics(momentum, track):
    """Linear -> * s -> BatchNorm1d (training mode, or no running statistics) -> GELU -> sum
    over the channels, three training steps: outputs, every gradient and the running
    statistics against the model's in float64, each at most twice as far as eager fp32's
    (two summation orders of the same terms; s's and the Linear bias's gradients are zero to
    rounding, the BatchNorm1d removing a per-channel scale and shift)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(24, momentum=momentum, track_running_stats=track)
    model = Chain(lambda s, x: F.gelu(s.bn(x * s.s)).sum(dim=1), n=24, bn=bn,
                  s=nn.Parameter(torch.rand(24) + 0.5))  # fmt: skip
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    new, report = optimize(model, (torch.randn(10, 8),))
    assert "bn (batch statistics: (x - mean) * scale + bias) -> gelu -> sum" in str(report)
    for _ in range(3):
        x = torch.randn(10, 8)
        outs = [m(t.clone().requires_grad_()) for m, t in
                ((new, x), (eager, x), (exact, x.double()))]  # fmt: skip
        assert max_abs_err(outs[0], outs[2]) <= 2 * max_abs_err(outs[1], outs[2]) + 1e-7
        for out in outs:
            out.square().sum().backward()
    named = zip(model.named_parameters(), eager.parameters(), exact.parameters(), strict=True)
    for (key, ours), theirs, want in named:
        assert max_abs_err(ours.grad, want.grad) <= 2 * max_abs_err(theirs.grad, want.grad), key
    named = zip(model.named_buffers(), eager.buffers(), exact.buffers(), strict=True)
    for (key, ours), theirs, want in named:
        assert max_abs_err(ours, want) <= 2 * max_abs_err(theirs, want) + 1e-7, key


def test_batch_statistics_of_one_row_run_the_model():
    """PyTorch refuses a training-mode BatchNorm1d on one row; so does the optimized model."""
    model = Chain(lambda s, x: torch.relu(s.bn(x)), n=24, bn=nn.BatchNorm1d(24))
    new, _ = optimize(model, (torch.randn(4, 8),))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        new(torch.randn(1, 8))
    assert new.fc.last_path == "fallback"


@pytest.mark.parametrize(
    "chain, stopped",
    [
        (lambda s, x: s.bn2(s.bn(x)), "a second BatchNorm1d with batch statistics in the chain"),
        (lambda s, x: s.bn(x) + x, "a value before it is read again after it"),
    ],
)  # fmt: skip
def test_batch_statistics_the_split_cannot_serve_stop_the_chain(chain, stopped):
    model = Chain(chain, n=24, bn=nn.BatchNorm1d(24), bn2=nn.BatchNorm1d(24))
    x = torch.randn(6, 8)
    new, report = optimize(model, (x,))
    assert stopped in report.linears[0].stopped, report.linears[0].stopped
    torch.testing.assert_close(new(x), copy.deepcopy(model)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bn, x, stopped",
    [
        (nn.BatchNorm1d(3).eval(), torch.randn(2, 3, 8),
         "a BatchNorm1d of (2, 3, 24) normalises dim 1, not the features"),
    ],
)  # fmt: skip
def test_batch_norms_that_do_not_fold_stop_the_chain(bn, x, stopped):
    model = Chain(lambda s, x: s.bn(x), n=24, bn=bn)
    new, report = optimize(model, (x,))
    assert report.linears[0].chain == ("fc",)
    assert stopped in report.linears[0].stopped, report.linears[0].stopped
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
