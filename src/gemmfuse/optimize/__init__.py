"""``gemmfuse.optimize``: every Linear chain of a model as one fused call.

``optimize(model, example_inputs)`` traces the model's forward with ``torch.fx`` (what the
tracer raises, e.g. ``torch.fx.proxy.TraceError`` for control flow on tensor values, reaches the
caller), runs the trace once on the example inputs (under no_grad, on a fork of the random
state; recording each value's shape and dtype; every buffer the run reads is a copy made for the
run, so a forward that writes them is not stepped twice, and what the forward raises on the
inputs reaches the caller), and, for every ``nn.Linear`` (or ``F.linear`` on the model's own
tensors, or a product by a 2-D tensor attribute transposed: ``x @ W.T``, ``torch.matmul(x,
W.t())``, ``x.mm(W.transpose(0, 1))`` and the like, W's Linear without a bias, a following
``+ b`` then being a chain op; ``torch.addmm(b, x, W.T)`` with a 1-D attribute b, the Linear
with bias b) applied to an input of two or more dimensions, extends the chain after it as far
as the epilogue grammar goes::

    Linear -> pointwise ops -> GroupNorm, LayerNorm or RMSNorm -> pointwise ops
    -> reduction over dim 1 -> tail ops

(a LayerNorm or RMSNorm over the channels alone, nn or functional; on a higher input, whose
leading dimensions the fused call takes as rows, the ops that act on each row alone: pointwise
ops and a LayerNorm or RMSNorm; GroupNorm and
the reductions act on dimension 1, not on the features). A reduction over
dimension 1 after the chain's own kept it (size 1) is the value itself, or drops it. An average
pooling over the channels right after the Linear (``avg_pool1d`` of ``x.unsqueeze(1)``, then
``squeeze(1)``; stride equal to the window, no padding) is folded into the Linear's weights
(gemmfuse/pooling.py), and the chain goes on over the pooled channels. A max pooling there
(``max_pool1d``, the same settings, a window of a power of two up to 128) joins the channel
reduction that must follow it at once (``Reduction.pool``: the kernels reduce window maxima).
An ``nn.BatchNorm1d`` in eval mode on the (M, N) value is per-channel ops read from the module
at each call (``modules.BatchNormAffine``); in training mode (or without running statistics)
the same ops with the batch's statistics, the fused call splitting there
(``modules.FusedLinear``).

A binary op's other operand may be a number, a parameter, buffer or tensor attribute, or a
tensor the forward computes before the Linear, of the chain's own shape (read per element: a
residual ``fc2(h) + x``) or per channel, or any shape after the reduction; such a tensor becomes
an argument of the fused call after x (``modules.ForwardInput``), and the call runs where the
chain ends, so the chain stops there if that tensor or the Linear's input may be written in
place anywhere in the forward.

A chain stops at the first node that is not in the grammar, whose result has several users
(``x + x`` excepted, and ``x * sigmoid(x)``: x used by a sigmoid that only the multiplication
uses, the op ``swish``), that changes the (M, N) shape before the reduction or the dtype anywhere,
that would take the kernel past ``MAX_SCALARS``/``MAX_TENSORS`` arguments, or whose operands the
forward modifies in place. Each candidate is then checked on the example inputs: its
``FusedLinear.reference`` (``gemmfuse.reference``) must reproduce the model's own value at the
chain's end (same shape, dtype and device, and close within ``torch.testing.assert_close``'s
default tolerances, NaN equal to NaN), else the Linear stays PyTorch. Meta tensors carry no
values: their chains are not checked, and the report says so.

The result is an ``fx.GraphModule`` with a ``FusedLinear`` at each swapped Linear's path (for
an ``F.linear`` call or a product, a new stateless submodule of the root, ``<call>_fused``). Its
module tree mirrors the model's: every submodule not on the way to a swapped Linear is the
model's own object, the rest are shallow copies that share their parameter and buffer dicts, so
every parameter and buffer keeps its state_dict key and is the model's own object (optimizer
steps and ``.to()`` reach both models).

The package's modules, each after those it imports from: ``grammar`` (the ops table and graph
patterns), ``tracing`` (fx tracing and the example run), ``analysis`` (finding chains),
``rewrite`` (checking, swapping, reporting). They import only torch and the standard library
(plus the package's own standalone-safe modules): ``gemmfuse export`` inlines them into
standalone files, in one namespace.
"""

from gemmfuse.optimize.rewrite import LinearReport, OptimizeReport, optimize

__all__ = ["LinearReport", "OptimizeReport", "optimize"]
