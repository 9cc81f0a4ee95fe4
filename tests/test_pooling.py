"""An average pooling over a Linear's output channels folded into its weights (pooling.py), and
optimize's matching of it, on the CPU."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse import FusedLinear, optimize
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
        (nn.MaxPool1d(2), "stopped at pool (channel pooling): a max pooling (nn.MaxPool1d) is "
         "not in the grammar; an average pooling folds into the Linear's weights"),
        (lambda y: F.max_pool1d(y, 2), "stopped at max_pool1d (channel pooling): a max pooling "
         "is not in the grammar; an average pooling folds into the Linear's weights"),
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
