"""An average pooling over a Linear's output channels folded into its weights (pooling.py), and
optimize's matching of it, on the CPU."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse import Epilogue, FusedLinear, Reduction, optimize
from gemmfuse.pooling import ChannelPool, mean_rows, pool_problem, pooled_linear
from gemmfuse.weight_cache import SplitWeightCache
from helpers import Chain


@pytest.mark.parametrize(
    "settings, why",
    [
        ((4, None, 0, False), ""),
        (((4,), (4,), (0,), False), ""),  # nn.AvgPool1d keeps 1-tuples
        ((4, 4, 0, True), ""),  # 96 channels: ceil_mode adds no window
        ((5, None, 0, True), "ceil_mode=True adds a partial window"),
        ((4, 2, 0, False), "stride 2 is not its kernel_size 4"),
        ((4, None, 1, False), "padding 1 is not 0"),
        ((97, None, 0, False), "wider than the 96 channels"),
        ((0, None, 0, False), "kernel_size 0 is not a positive int"),
        ((True, None, 0, False), "kernel_size True is not a positive int"),
    ],
)
def test_pool_problem(settings, why):
    got = pool_problem(*settings, 96)
    assert (why in got and got) if why else got == "", got


def test_mean_rows_is_each_windows_mean_rounded_once():
    torch.manual_seed(0)
    t = torch.randn(10, 7)
    got = mean_rows(t, 3)  # rows 9: past the last whole window, dropped
    want = t.double()[:9].reshape(3, 3, 7).mean(1)
    assert got.dtype == torch.float32 and got.shape == (3, 7)
    assert torch.equal(got, want.float())
    assert torch.equal(mean_rows(t[:, 0], 3), want[:, 0].float())  # a bias: 1-D


def test_pooled_gradient_is_the_means():
    torch.manual_seed(0)
    w = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    # no cache: gradcheck perturbs the weight through .data, which keeps its version
    torch.autograd.gradcheck(lambda w, b: pooled_linear(w, b, 3, None), (w, b))
    pw, pb = pooled_linear(w, b, 3, SplitWeightCache())
    g = torch.randn_like(pw)
    got = torch.autograd.grad((pw * g).sum() + pb.sum(), (w, b))
    want = torch.autograd.grad(
        (w[:9].reshape(3, 3, 5).mean(1) * g).sum() + b[:9].reshape(3, 3).mean(1).sum(), (w, b)
    )
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_pooled_weights_are_kept_per_version_of_the_weight():
    torch.manual_seed(0)
    lin = nn.Linear(6, 8)
    cache = SplitWeightCache()
    with torch.no_grad():
        first, _ = pooled_linear(lin.weight, lin.bias, 2, cache)
        again, _ = pooled_linear(lin.weight, lin.bias, 2, cache)
        assert again is first  # unchanged weight: the kept tensor itself
        lin.weight.mul_(2)  # an in-place write (an optimizer step) bumps the version
        after, _ = pooled_linear(lin.weight, lin.bias, 2, cache)
    assert after is not first
    torch.testing.assert_close(after, mean_rows(lin.weight.detach(), 2), rtol=0, atol=0)
    tracked, _ = pooled_linear(lin.weight, lin.bias, 2, cache)  # autograd on: a new view
    assert tracked.grad_fn is not None and after.grad_fn is None
    assert tracked.data_ptr() == after.data_ptr()


def test_a_pooled_weight_kept_from_an_inference_mode_call_serves_training():
    """A validation pass under inference_mode, then a training step: the pooled weight the cache
    kept is an ordinary tensor (one made as an inference tensor cannot be saved for backward),
    and the gradient reaches the weight as the mean's."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 8)
    cache = SplitWeightCache()
    x = torch.randn(3, 6, requires_grad=True)
    with torch.inference_mode():
        kept, _ = pooled_linear(lin.weight, lin.bias, 2, cache)
    assert not kept.is_inference()
    weight, bias = pooled_linear(lin.weight, lin.bias, 2, cache)
    F.linear(x, weight, bias).sum().backward()
    expect = torch.autograd.grad(F.linear(x, mean_rows(lin.weight, 2)).sum(), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, expect, rtol=0, atol=0)


def test_an_inference_weight_is_pooled_at_every_call_and_its_slot_let_go():
    """An inference tensor has no version to key on: pooled afresh at each call, and what the
    slot kept for an earlier weight is dropped rather than held."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 8)
    cache = SplitWeightCache()
    with torch.no_grad():
        pooled_linear(lin.weight, lin.bias, 2, cache)
    assert cache._entries
    with torch.inference_mode():
        weight = torch.randn(8, 6)
        first, _ = pooled_linear(weight, None, 2, cache)
        second, _ = pooled_linear(weight, None, 2, cache)
    assert first is not second and torch.equal(first, mean_rows(weight, 2))
    assert ("pooled weight", 2) not in cache._entries


def pooled(pool) -> Chain:
    """Linear(8, 24) -> pool(x.unsqueeze(1)).squeeze(1) -> tanh."""
    return Chain(lambda s, x: torch.tanh(s.pool(x.unsqueeze(1)).squeeze(1)), n=24, pool=pool)


def test_a_pooling_module_changed_later_runs_the_model_instead():
    torch.manual_seed(0)
    model, x = pooled(nn.AvgPool1d(4)), torch.randn(5, 8)
    new, report = optimize(model, (x,))
    fused = new.fc
    assert isinstance(fused, FusedLinear) and fused.out_features == 6
    assert fused.pool == ChannelPool(module=model.pool)
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=1e-6, atol=1e-6)
        assert fused.last_path == "torch"
        model.pool.stride = (2,)  # overlapping windows: no longer a fold
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
        assert fused.last_path == "fallback"


@pytest.mark.parametrize(
    "pool, stopped",
    [
        (lambda y: F.avg_pool1d(y, 4, 2), "stopped at avg_pool1d (channel pooling): its stride 2 "
         "is not its kernel_size 4 (overlapping windows)"),
        (nn.AvgPool1d(5, ceil_mode=True), "stopped at pool (channel pooling): ceil_mode=True "
         "adds a partial window (24 channels, 5 a window)"),
        (nn.AvgPool1d(4, padding=1), "stopped at pool (channel pooling): its padding 1 is not 0"),
        (nn.MaxPool1d(2), "stopped at pool (channel pooling): a max pooling over the channels "
         "is fused where a channel reduction follows it at once"),
        (lambda y: F.max_pool1d(y, 2), "stopped at max_pool1d (channel pooling): a max pooling "
         "over the channels is fused where a channel reduction follows it at once"),
        (nn.LPPool1d(2, 2), "stopped at pool (channel pooling): nn.LPPool1d is not in the "
         "grammar (nn.AvgPool1d and nn.MaxPool1d are)"),
    ],
)  # fmt: skip
def test_poolings_that_do_not_fold_stop_the_chain(pool, stopped):
    model, x = pooled(pool), torch.randn(5, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.fused and entry.chain == ("fc",)
    assert entry.stopped.startswith(stopped), entry.stopped
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_squeeze_without_a_dim_stops_the_chain():
    model = Chain(lambda s, x: F.avg_pool1d(x.unsqueeze(1), 4).squeeze(), n=24)
    _, report = optimize(model, (torch.randn(5, 8),))
    assert report.linears[0].chain == ("fc",)
    assert "squeeze() without a dim would also drop a batch of one row" in report.linears[0].stopped


def max_pooled(pool, reduce) -> Chain:
    """Linear(8, 24) -> pool(x.unsqueeze(1)).squeeze(1) -> reduce."""
    return Chain(lambda s, x: reduce(s.pool(x.unsqueeze(1)).squeeze(1)), n=24, pool=pool)


@pytest.mark.parametrize(
    "pool, reduce, want",
    [
        (nn.MaxPool1d(2), lambda v: torch.sum(v, dim=1), Reduction("sum", pool=2)),
        (nn.MaxPool1d(8), lambda v: v.amax(dim=-1, keepdim=True), Reduction("max", True, 8)),
        (lambda y: F.max_pool1d(y, 4), lambda v: v.mean(1), Reduction("mean", pool=4)),
        (lambda y: F.max_pool1d(y, kernel_size=16, stride=16), lambda v: v.logsumexp(1),
         Reduction("logsumexp", pool=16)),
        (nn.MaxPool1d(16, ceil_mode=False), lambda v: v.min(dim=1).values,
         Reduction("min", pool=16)),
    ],
)  # fmt: skip
def test_a_max_pooling_before_a_reduction_joins_it(pool, reduce, want):
    """The reduction takes the windows' maxima (Reduction.pool), a partial last window dropped
    as max_pool1d drops it (24 channels in windows of 16)."""
    torch.manual_seed(0)
    model, x = max_pooled(pool, reduce), torch.randn(5, 8)
    new, report = optimize(model, (x,))
    assert new.fc.epilogue.reduce == want and new.fc.pool is None
    assert "over the channels" in report.linears[0].chain[1]
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "pool, stopped",
    [
        (nn.MaxPool1d(3), "a reduction's max-pooling window must be a power of two up to 128"),
        (nn.MaxPool1d(2, stride=1), "its stride 1 is not its kernel_size 2 (overlapping windows)"),
        (nn.MaxPool1d(2, padding=1), "its padding 1 is not 0"),
        (nn.MaxPool1d(2, dilation=2), "its dilation 2 is not 1"),
        (nn.MaxPool1d(16, ceil_mode=True), "ceil_mode=True adds a partial window (24 channels, "
         "16 a window)"),
    ],
)  # fmt: skip
def test_max_poolings_the_kernels_do_not_take_stop_the_chain(pool, stopped):
    model, x = max_pooled(pool, lambda v: v.sum(1)), torch.randn(5, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.chain == ("fc",) and new.fc.epilogue == Epilogue()
    assert entry.stopped.startswith(f"stopped at pool (channel pooling): {stopped}"), entry.stopped
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "after, stopped",
    [
        (lambda v: torch.relu(v).sum(1), "stopped at relu (torch.relu): not a channel reduction"),
        (lambda v: F.layer_norm(v, (12,)).sum(1), "stopped at layer_norm (F.layer_norm): not a "
         "channel reduction"),
        (lambda v: v, "ends at the model's output"),
    ],
)  # fmt: skip
def test_a_max_pooling_not_followed_by_a_reduction_stops_the_chain(after, stopped):
    """Only a channel reduction may come right after a max pooling: the kernels take the window
    maxima as they reduce a row (a norm after it, say, would need the pooled row)."""
    model, x = max_pooled(nn.MaxPool1d(2), after), torch.randn(5, 8)
    new, report = optimize(model, (x,))
    (entry,) = report.linears
    assert entry.chain == ("fc",) and new.fc.epilogue == Epilogue()
    assert entry.stopped.startswith(
        "stopped at pool (channel pooling): a max pooling over the channels is fused where a "
        f"channel reduction follows it at once, the kernels taking the windows' maxima as they "
        f"reduce a row ({stopped}"
    ), entry.stopped
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)


def test_a_max_pooling_module_changed_later_is_read_at_each_call():
    """An nn.MaxPool1d is read at each call, as an nn.AvgPool1d is: another window the kernels
    take is a new chain; settings they do not take run the model's own chain."""
    torch.manual_seed(0)
    model, x = max_pooled(nn.MaxPool1d(2), lambda v: v.sum(1)), torch.randn(5, 8)
    new, _ = optimize(model, (x,))
    fused = new.fc
    assert fused.epilogue.reduce == Reduction("sum", pool=2)
    with torch.no_grad():
        model.pool.kernel_size = model.pool.stride = 4
        torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
        assert fused.epilogue.reduce == Reduction("sum", pool=4)
        assert fused.last_path == "torch"
        for setting, value in (("dilation", 2), ("stride", 2), ("return_indices", True)):
            setattr(model.pool, setting, value)
            assert fused.epilogue is None
            if setting != "return_indices":  # the model itself cannot sum a tuple
                torch.testing.assert_close(new(x), model(x), rtol=0, atol=0)
                assert fused.last_path == "fallback"
            setattr(model.pool, setting, {"dilation": 1, "stride": 4}.get(setting, False))
        assert fused.epilogue.reduce == Reduction("sum", pool=4)
