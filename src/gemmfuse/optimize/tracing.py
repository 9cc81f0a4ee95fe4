"""Tracing a model with torch.fx, and the example run that records each value's shape and dtype.

The example run never writes the model's state: the recorder answers every read of a buffer
(a ``get_attr`` node, or a leaf module such as BatchNorm that reads its own) with a copy made for
that run, one copy per buffer, so a forward that writes its buffers (running statistics, a
counter) writes the copies and the model is not stepped twice.
"""

import copy
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from gemmfuse.optimize.state import _AttributeWrites


def _trace(model: nn.Module, forward) -> fx.GraphModule:
    """fx-traces ``forward`` (default: the model's own) on a shallow copy of the model, so the
    tracer's bookkeeping (constants it attaches) never touches the model itself. What the
    tracer raises (``torch.fx.proxy.TraceError`` for control flow on tensor values, or what the
    forward raises) reaches the caller unchanged."""
    cls = type(model)
    if forward is not None:
        cls = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    view = cls.__new__(cls)
    view.__dict__.update(model.__dict__)
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True  # record the forward's writes to buffers
    tracer.record_stack_traces = True  # the report names nodes by their source line (_source)
    with _AttributeWrites(view) as writes:
        writes.graph = tracer.trace(view)
    if writes.in_place:
        raise ValueError(
            f"gemmfuse.optimize: {type(model).__name__}.forward writes in place to the tensor "
            f"attribute(s) {writes.in_place}, which torch.fx runs once while tracing instead of "
            "recording; register them as buffers"
        )
    if writes.frozen:
        raise ValueError(
            f"gemmfuse.optimize: {type(model).__name__}.forward changes {writes.frozen} after "
            "reading them (state carried from one call to the next), or where the graph reads "
            "them by name; torch.fx runs such a change once, while tracing, so the result would "
            "keep what the first call left. Keep such state in buffers updated in place "
            "(`buf.add_(1)`, `buf.copy_(y)`)"
        )
    return _OptimizedModule(view, writes.graph, f"Optimized{type(model).__name__}")


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)')


def _source(node: fx.Node) -> str:
    """`` [line N: `code`]`` of the model's line that made ``node`` (its stack trace's first
    frame outside torch and gemmfuse), or "" where the trace recorded none."""
    for path, line, code in _FRAME.findall(node.stack_trace or ""):
        if not any(part in path for part in ("/torch/", "/gemmfuse/")):
            return f" [line {line}: `{code.strip()}`]"
    return ""


class _OptimizedModule(fx.GraphModule):
    """A GraphModule whose module tree is the model's (see the package docstring)."""

    def __deepcopy__(self, memo):
        # GraphModule's own deepcopy rebuilds the tree from the graph's references only,
        # dropping the submodules and buffers the graph does not use; copy it as a Module.
        res = type(self).__new__(type(self))
        memo[id(self)] = res
        res.__dict__.update(copy.deepcopy(self.__dict__, memo))
        res.graph = res._graph  # owning module, generated forward
        return res


@dataclass(frozen=True)
class _Meta:
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Recorder(fx.Interpreter):
    """Runs the trace, noting each tensor's shape/dtype and keeping copies of ``keep``'s values
    (copies: a later in-place op must not change what the chain is checked against).

    ``buffers`` holds the model's buffers: each read of one sees this run's copy of it (see the
    module docstring), so the run leaves them as they were."""

    def __init__(self, gm: fx.GraphModule, keep: set, buffers):
        super().__init__(gm)
        self.keep = keep
        self.buffer_ids = {id(b) for b in buffers}
        self.copies: dict[int, torch.Tensor] = {}  # id of a buffer -> this run's copy
        self.module_views: dict[int, nn.Module] = {}  # id of a module -> its view on the copies
        self.meta: dict[fx.Node, _Meta] = {}
        self.values: dict[fx.Node, torch.Tensor] = {}

    def _copy_of(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.copies:
            self.copies[id(t)] = t.clone()
        return self.copies[id(t)]

    def _module_view(self, module: nn.Module) -> nn.Module:
        """module itself if its tree holds no buffers, else a shallow copy (recursively) that
        holds this run's copies of its buffers and shares everything else."""
        if next(module.buffers(), None) is None:
            return module
        if id(module) not in self.module_views:
            view = copy.copy(module)
            view._buffers = {k: None if b is None else self._copy_of(b)
                             for k, b in module._buffers.items()}  # fmt: skip
            view._modules = {k: None if c is None else self._module_view(c)
                             for k, c in module._modules.items()}  # fmt: skip
            self.module_views[id(module)] = view
        return self.module_views[id(module)]

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and id(value) in self.buffer_ids:
            return self._copy_of(value)
        return value

    def call_module(self, target, args, kwargs):
        return self._module_view(self.fetch_attr(target))(*args, **kwargs)

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.meta[n] = _Meta(tuple(out.shape), out.dtype)
            if n in self.keep:
                self.values[n] = out.clone()
        return out
