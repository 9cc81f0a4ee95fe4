"""An average pooling over a Linear's output channels, folded into the Linear; the settings of a
max pooling that a channel reduction takes (``Reduction.pool``).

``avg_pool1d(linear(x, W, b).unsqueeze(1), k).squeeze(1)`` (stride k, no padding) is
``linear(x, W', b')`` where row j of W' is the mean of rows jk .. jk+k-1 of W (b' likewise;
channels past the last whole window dropped, as the pooling drops them): the same value, from a
product with k times fewer output channels. ``optimize`` folds such a pooling right after a
Linear (KernelBench #98's ``avg_pool(x.unsqueeze(1)).squeeze(1)``); the chain after it runs on
the pooled channels.

W' is computed in float64 and rounded once, then kept per version of W (the weight cache's
rules: ``weight_cache.cache_for_call``), so a call on unchanged weights reads it as it is. Its
gradient is the mean's: the gradient of row j spread over its window, divided by k.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from gemmfuse.epilogue import max_pool_problem
from gemmfuse.weight_cache import SplitWeightCache, cache_for_call


def single(value):
    """A 1-tuple's element (nn.AvgPool1d keeps its settings as 1-tuples); other values as they
    are."""
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def pool_problem(kernel_size, stride, padding, ceil_mode, channels: int) -> str:
    """Why an avg_pool1d with these settings over ``channels`` channels does not fold into the
    Linear ("" when it does): a window of an int k <= channels, stride k, no padding, and
    ceil_mode only where it adds no partial window. 1-tuples stand for their element."""
    kernel_size, stride, padding = single(kernel_size), single(stride), single(padding)
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
        return f"its kernel_size {kernel_size!r} is not a positive int"
    if kernel_size > channels:
        return f"its window of {kernel_size} is wider than the {channels} channels"
    if stride not in (None, kernel_size):
        return f"its stride {stride!r} is not its kernel_size {kernel_size} (overlapping windows)"
    if padding != 0:
        return f"its padding {padding!r} is not 0"
    if ceil_mode and channels % kernel_size:
        return f"ceil_mode=True adds a partial window ({channels} channels, {kernel_size} a window)"
    return ""


@dataclass(frozen=True)
class ChannelPool:
    """The pooling of a chain: an ``nn.AvgPool1d`` read at each call, or ``F.avg_pool1d``'s
    constant ``kernel_size`` (stride, padding and ceil_mode checked when ``optimize`` ran)."""

    module: nn.AvgPool1d | None = None
    kernel_size: int = 1

    def current(self, channels: int) -> int | None:
        """The window (and stride) now; None where the module's settings no longer fold."""
        m = self.module
        if m is None:
            return self.kernel_size
        if pool_problem(m.kernel_size, m.stride, m.padding, m.ceil_mode, channels):
            return None
        return single(m.kernel_size)


def max_pool_settings_problem(settings: tuple, dilation, return_indices, channels: int) -> str:
    """Why a max_pool1d with these settings (kernel_size, stride, padding, ceil_mode) over
    ``channels`` channels is not a window the kernels take before a reduction
    (``Reduction.pool``; "" when it is): :func:`pool_problem`'s rules, dilation 1, no indices,
    a power of two up to 128."""
    if return_indices:
        return "a max pooling that returns its indices"
    if single(dilation) != 1:
        return f"its dilation {dilation!r} is not 1"
    return pool_problem(*settings, channels) or max_pool_problem(single(settings[0]))


def max_pool_window(module: nn.MaxPool1d, channels: int) -> int | None:
    """An ``nn.MaxPool1d``'s window now, as a reduction takes it (``Reduction.pool``); None
    where its current settings are no such window. Read at each call, as an ``nn.AvgPool1d``'s
    (:class:`ChannelPool`) is."""
    m = module
    settings = (m.kernel_size, m.stride, m.padding, m.ceil_mode)
    if max_pool_settings_problem(settings, m.dilation, m.return_indices, channels):
        return None
    return single(m.kernel_size)


def mean_rows(t: torch.Tensor, kernel: int) -> torch.Tensor:
    """The mean of each ``kernel`` consecutive rows of t (the rows past the last whole window
    dropped), summed in float64 and rounded once to t's dtype; differentiable."""
    n = t.shape[0] // kernel
    rows = t[: n * kernel].reshape(n, kernel, *t.shape[1:])
    return rows.sum(1, dtype=torch.float64).div(kernel).to(t.dtype)


class _PooledRows(torch.autograd.Function):
    """``mean_rows(t, kernel)`` given its value (a cached tensor): the backward of the mean."""

    @staticmethod
    def forward(ctx, t, kernel, pooled):
        ctx.kernel, ctx.rows = kernel, t.shape[0]
        return pooled.view_as(pooled)  # a new tensor object: the cached one keeps no grad_fn

    @staticmethod
    def backward(ctx, grad):
        n, k = grad.shape[0], ctx.kernel
        full = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        full[: n * k].view(n, k, *grad.shape[1:]).copy_((grad / k).unsqueeze(1))
        return full, None, None


def pooled_linear(weight, bias, kernel: int, cache: SplitWeightCache | None):
    """(W', b') of the Linear (weight, bias) with the pooling of window ``kernel`` folded in;
    kept in ``cache`` per version of each tensor (see the module docstring)."""
    if torch.compiler.is_compiling():  # no cache lookups in a traced graph: the mean itself
        return mean_rows(weight, kernel), None if bias is None else mean_rows(bias, kernel)
    cache = cache_for_call(cache)
    return tuple(
        None if t is None else _pooled(t, kernel, cache, slot)
        for t, slot in ((weight, "pooled weight"), (bias, "pooled bias"))
    )


def _pooled(t: torch.Tensor, kernel: int, cache: SplitWeightCache, slot: str) -> torch.Tensor:
    pooled = cache.derived(t, (slot, kernel), lambda: mean_rows(t.detach(), kernel))
    if torch.is_grad_enabled() and t.requires_grad:
        return _PooledRows.apply(t, kernel, pooled)
    return pooled
