"""Recognising one fx node as a step of the epilogue grammar, and the graph facts that needs.

Each recognising method returns a :class:`_Step` or a :class:`_Refusal` saying why the node
cannot join the chain (analysis.py grows a Linear's chain from these steps).
"""

import builtins
import operator
from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse.epilogue import Reduction, Value
from gemmfuse.modules import MODULE_OPS, BatchNormAffine
from gemmfuse.optimize.grammar import (
    _ACTS,
    _BINARY,
    _ELEMENTWISE_EXTREMES,
    _FRESH_MODULES,
    _REDUCTIONS,
    _SOFTMAX_DEFAULTS,
    _SOFTMAXES,
    _SWAPPED,
    _SYMBOL,
    _first_refusal,
    _has_hooks,
    _input,
    _is_inplace,
    _linear_input,
    _number,
    _op_label,
    _Refusal,
    _spelled_linear,
    _Step,
)
from gemmfuse.optimize.tracing import _Meta, _source


@dataclass
class _Stretch:
    """The values of the chain's current stretch (pre, post or tail) that a later op may read
    again (:class:`gemmfuse.Value`): each node's value, and the nodes still to read one.

    ``values`` maps a chain node (or a ``detach``/``clone`` of one) to its Value; ``pending``
    maps a node to its users that have not joined the chain yet. The chain may end only where
    nothing is pending: its nodes other than the last are then used by the chain alone.
    """

    values: dict[fx.Node, Value] = field(default_factory=dict)
    names: dict[fx.Node, str] = field(default_factory=dict)  # how the report names each
    pending: dict[fx.Node, set[fx.Node]] = field(default_factory=dict)

    def joined(self, nodes: list[fx.Node]) -> None:
        """Marks ``nodes``' reads of pending values as done."""
        for n in nodes:
            for i in n.all_input_nodes:
                if n in self.pending.get(i, ()):
                    self.pending[i].discard(n)
                    if not self.pending[i]:
                        del self.pending[i]


class _NodeMatcher:
    """The graph's facts (which values in-place ops may write, each node's place) and the
    recognition of one node on the chain's value ``v``; ``linear`` and ``stretch`` are those of
    the chain being followed (analysis.py sets them)."""

    def __init__(self, gm: fx.GraphModule, meta: dict[fx.Node, _Meta]):
        self.gm = gm
        self.meta = meta
        self.written = self._written_nodes()
        self.mutated = {n.target for n in self.written if n.op == "get_attr"}
        self.linear: fx.Node | None = None  # the Linear of the chain being followed
        self.stretch = _Stretch()  # of the chain being followed
        # A node's place in the graph (the graph is not rewritten while chains are found)
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}.__getitem__

    def _fresh(self, node: fx.Node) -> bool:
        """Whether node's result is a new tensor (an out-of-place op of the grammar)."""
        if _is_inplace(node, self.gm):
            return False
        if node.op == "call_module":
            return type(self.gm.get_submodule(node.target)) in _FRESH_MODULES
        return node.op in ("call_function", "call_method") and (
            node.target in _ACTS
            or node.target in _BINARY
            or node.target in _REDUCTIONS
            or node.target in _SOFTMAXES
            or node.target in (F.linear, F.group_norm, F.layer_norm, F.rms_norm)
            or _spelled_linear(node, self.gm) is not None
        )

    def _written_nodes(self) -> set[fx.Node]:
        """The nodes whose values some in-place op may write: through any node that can alias
        its input, back to a get_attr or placeholder (chains never take those as operands)."""
        written = set()
        for node in self.gm.graph.nodes:
            if not _is_inplace(node, self.gm) or not node.args:
                continue
            stack, seen = [node.args[0]], set()
            while stack:
                a = stack.pop()
                if not isinstance(a, fx.Node) or a in seen:
                    continue
                seen.add(a)
                written.add(a)
                if a.op == "get_attr":
                    continue
                if _is_inplace(a, self.gm) and a.args:
                    stack.append(a.args[0])  # its result is its first argument
                elif a.op != "placeholder" and not self._fresh(a):
                    stack.extend(a.all_input_nodes)  # may alias any input
        return written

    # -- recognising one node

    def _bind(self, node: fx.Node, params: tuple[str, ...], defaults: tuple, v, tensors=()):
        """node's arguments after the input by name (a dict, or a :class:`_Refusal`); only
        ``tensors`` may be graph values."""
        if _input(node) is not v:
            return _Refusal("the chain's value is not its input")
        bound = dict(zip(params, defaults, strict=True))
        rest = node.args[1:]
        if len(rest) > len(params):
            return _Refusal("more arguments than the grammar's form of this op")
        bound.update(zip(params, rest, strict=False))
        for key, value in node.kwargs.items():
            if key not in bound and key != "input":
                return _Refusal(f"argument {key}= is not in the grammar's form of this op")
            bound[key] = value
        bound.pop("input", None)
        for key, value in bound.items():
            if isinstance(value, fx.Node) and key not in tensors:
                return _Refusal(f"argument {key} is computed in the forward")
        return bound

    def _operand(self, o):
        """A binary op's other operand: a float, or the get_attr node of a tensor (or why
        neither: a :class:`_Refusal`)."""
        if isinstance(o, fx.Node):
            if o.op != "get_attr" or o not in self.meta:
                return _Refusal(
                    f"operand {o.name} is computed in the forward (fused operands are numbers, "
                    f"parameters, buffers and tensor attributes){_source(o)}"
                )
            if o.target in self.mutated:
                return _Refusal(f"operand {o.target} is modified in place in the forward")
            return o
        return _number(o, "the operand")

    def _forward_operand(self, o: fx.Node) -> "fx.Node | _Refusal":
        """An operand the forward computes (a residual), taken as an argument of the fused
        call, which then runs where the chain ends: computed before the chain's Linear (so not
        from the chain's values, which are gone once fused, nor inside another chain that
        could claim the same node), and neither it nor the Linear's input possibly written in
        place in the forward (each is read where the chain ends, not where the model reads it).
        """
        if o not in self.meta:
            return _Refusal(f"operand {o.name} is not a tensor{_source(o)}")
        if self.order(o) > self.order(self.linear):
            return _Refusal(
                f"operand {o.name} is computed after the Linear (fused operands computed in the "
                f"forward come before it){_source(o)}"
            )
        x = _linear_input(self.linear, self.gm)
        for node, what in ((o, f"operand {o.name}"), (x, "the Linear's input")):
            if node in self.written:
                return _Refusal(f"{what} may be modified in place in the forward{_source(node)}")
        return o

    def _binary(self, node: fx.Node, v, op: str = "") -> "_Step | _Refusal":
        """A binary op of the chain's value and an operand (``op``: the IR op where the
        target alone does not say, torch.min of two tensors)."""
        op, extra = (op, ()) if op else _BINARY[node.target]
        names = ("input", "other", *extra)
        if len(node.args) > len(names):
            return _Refusal("more arguments than the grammar's form of this op")
        bound = dict(zip(names, node.args, strict=False))
        for key, value in node.kwargs.items():
            if key not in names or key in bound:
                return _Refusal(f"argument {key}= is not in the grammar's form of this op")
            bound[key] = value
        if "input" not in bound or "other" not in bound:
            return _Refusal("not a binary op of two operands")
        if bound.get("alpha", 1) != 1 or bound.get("rounding_mode") is not None:
            return _Refusal("alpha= or rounding_mode= is not in the grammar")
        args = bound["input"], bound["other"]
        inplace = _is_inplace(node, self.gm)
        a, b = args
        if a is v and b is v:
            if op == "add":
                return _Step("op", "x + x", name="add_self", inplace=inplace)
            if inplace:
                return _Refusal(f"x {_SYMBOL.get(op, op)}= x in place is not in the grammar")
            value = self.stretch.values[v]  # x op x: the op reading its own input again
            label = f"x {_SYMBOL[op]} x" if op in _SYMBOL else f"{op}(x, x)"
            return _Step("op", label, name=op, args=(value,))
        if a is v:
            name, other = op, b
        elif b is v:
            if inplace:
                return _Refusal("it writes its result into its other operand")
            name, other = _SWAPPED[op], a
        else:
            return _Refusal("the chain's value is not one of its operands")
        if isinstance(other, fx.Node) and other in self.stretch.values:
            if inplace:
                return _Refusal("an in-place op on a value the chain reads twice")
            value, shown = self.stretch.values[other], self.stretch.names.get(other, other.name)
            return _Step("op", _op_label(name, (shown,)), name=name, args=(value,))
        if isinstance(other, fx.Node) and other.op != "get_attr":
            operand = self._forward_operand(other)
        else:
            operand = self._operand(other)
        if isinstance(operand, _Refusal):
            return operand
        return _Step("op", _op_label(name, (operand,)), name=name, args=(operand,),
                     inplace=inplace)  # fmt: skip

    def _reduction(self, node: fx.Node, v) -> "_Step | _Refusal":
        op, returns_tuple = _REDUCTIONS[node.target]
        names = ("dim", "keepdim") + (("dtype",) if op in ("sum", "mean") else ())
        if returns_tuple and (
            isinstance(node.kwargs.get("other"), fx.Node)
            or (len(node.args) > 1 and isinstance(node.args[1], fx.Node))
        ):
            return self._binary(node, v, _ELEMENTWISE_EXTREMES[op])  # torch.min(x, t)
        bound = self._bind(node, names, (None, False, None)[: len(names)], v)
        if isinstance(bound, _Refusal):
            return bound
        dim, keepdim = bound["dim"], bound["keepdim"]
        if bound.get("dtype") is not None:
            return _Refusal("a reduction with dtype= is not in the grammar")
        if isinstance(dim, (tuple, list)) and len(dim) == 1:
            dim = dim[0]
        if dim is None or isinstance(dim, (tuple, list)):
            return _Refusal("it reduces over more than the channel dimension (dim=1)")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (1, -1):
            return _Refusal(f"it reduces over dim={dim!r}, not the channels (dim=1)")
        if not isinstance(keepdim, bool):
            return _Refusal(f"keepdim={keepdim!r} is not a bool")
        reduction = Reduction(op, keepdim)
        label = f"{op}(dim=1{', keepdim=True' if keepdim else ''})"
        return _Step("reduce", label, reduction=reduction, selects=returns_tuple)

    def _group_norm(self, node: fx.Node, v) -> "_Step | _Refusal":
        names = ("num_groups", "weight", "bias", "eps")
        bound = self._bind(node, names, (None, None, None, 1e-5), v, tensors=("weight", "bias"))
        if isinstance(bound, _Refusal):
            return bound
        groups = bound["num_groups"]
        if isinstance(groups, bool) or not isinstance(groups, int):
            return _Refusal(f"num_groups={groups!r} is not an int")
        if (bound["weight"] is None) != (bound["bias"] is None):
            return _Refusal("group_norm with a weight but no bias (or a bias but no weight)")
        return self._norm_step(bound, "group_norm", groups, f"group_norm({groups}, eps={{}})")

    def _layer_norm(self, node: fx.Node, v) -> "_Step | _Refusal":
        names = ("normalized_shape", "weight", "bias", "eps")
        bound = self._row_norm_bound(node, v, names, (None, None, None, 1e-5), "layer_norm")
        if isinstance(bound, _Refusal):
            return bound
        if bound["weight"] is None and bound["bias"] is not None:
            return _Refusal("layer_norm with a bias but no weight")
        return self._norm_step(bound, "layer_norm", 1, "layer_norm(eps={})")

    def _rms_norm(self, node: fx.Node, v) -> "_Step | _Refusal":
        names = ("normalized_shape", "weight", "eps")  # eps None: the dtype's, resolved per call
        bound = self._row_norm_bound(node, v, names, (None, None, None), "rms_norm")
        if isinstance(bound, _Refusal):
            return bound
        return self._norm_step({**bound, "bias": None}, "rms_norm", 1, "rms_norm(eps={})")

    def _softmax(self, node: fx.Node, v) -> "_Step | _Refusal":
        log, names = _SOFTMAXES[node.target]
        bound = self._bind(node, names, tuple(_SOFTMAX_DEFAULTS[n] for n in names), v)
        if isinstance(bound, _Refusal):
            return bound
        return self._softmax_step(bound["dim"], bound["dtype"], log, v)

    def _softmax_step(self, dim, dtype, log: bool, v, label: str = "") -> "_Step | _Refusal":
        """A softmax (``log``: log_softmax) over ``dim`` of the chain's value: a norm step when
        dim is the channels (the last dimension) and no dtype is given. An nn.Softmax's dim is
        read here, once (``label``: the module's name, as other norm modules are shown)."""
        name = "log_softmax" if log else "softmax"
        if dtype is not None:
            return _Refusal(f"{name} with dtype= is not in the grammar")
        rank = len(self.meta[v].shape)
        if dim is None:
            return _Refusal(f"{name} without a dim (PyTorch's implicit choice is deprecated)")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (-1, rank - 1):
            return _Refusal(f"{name} over dim={dim!r}, not the channels (the last dimension)")
        label = label or f"{name}(dim={dim})"
        return _Step("norm", label, name=name, args=(1, 0.0, None, None))

    def _row_norm_bound(self, node, v, names, defaults, what: str) -> "dict | _Refusal":
        """F.layer_norm's or F.rms_norm's arguments bound, refused unless the norm is over the
        channels alone."""
        tensors = tuple(n for n in names if n in ("weight", "bias"))
        bound = self._bind(node, names, defaults, v, tensors=tensors)
        if isinstance(bound, _Refusal):
            return bound
        shape = bound["normalized_shape"]
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if shape != self.meta[v].shape[-1:]:
            return _Refusal(f"{what} over {shape}, not the channels alone")
        return bound

    def _norm_step(self, bound: dict, name: str, groups: int, label: str) -> "_Step | _Refusal":
        """A functional norm's step from its bound arguments: eps a number (or, for rms_norm,
        None: the input dtype's epsilon), the affine weight and bias operands (or None);
        ``label`` gets eps's repr."""
        eps = None if bound["eps"] is None and name == "rms_norm" else _number(bound["eps"], "eps")
        if isinstance(eps, _Refusal):
            return eps
        affine = [None if a is None else self._operand(a) for a in (bound["weight"], bound["bias"])]
        refusal = _first_refusal(affine)
        if refusal is not None:
            return refusal
        return _Step("norm", label.format(repr(eps)), name=name, args=(groups, eps, *affine))

    def _norm_module(self, node: fx.Node, module: nn.Module, v) -> "_Step | _Refusal":
        """An nn.GroupNorm, nn.LayerNorm or nn.RMSNorm called on the chain's value."""
        kind = type(module)
        if kind is nn.GroupNorm and (module.weight is None) != (module.bias is None):
            return _Refusal("the GroupNorm has a weight but no bias (or the reverse)")
        if kind is not nn.GroupNorm and module.normalized_shape != self.meta[v].shape[-1:]:
            return _Refusal(f"the {kind.__name__} normalises {module.normalized_shape}, not the "
                            "channels alone")  # fmt: skip
        written = self._written(node, ("weight", "bias"))
        if written:
            return written
        name = {nn.LayerNorm: "layer_norm", nn.RMSNorm: "rms_norm"}.get(kind, "group_norm")
        return _Step("norm", node.target, name=name, module=module)

    def _written(self, node: fx.Node, members: tuple[str, ...]) -> "_Refusal | None":
        """A refusal naming the first of a module's ``members`` that the forward writes in
        place (None when it writes none)."""
        for p in members:
            if f"{node.target}.{p}" in self.mutated:
                return _Refusal(f"its {p} is modified in place in the forward")
        return None

    def _batch_norm(self, node: fx.Node, module: nn.BatchNorm1d, v) -> "_Step | _Refusal":
        """An nn.BatchNorm1d on (M, N): the per-channel ops ``(x - mean) * scale + bias``
        (:class:`BatchNormAffine`), as one step: in eval mode from the running statistics, else
        from the batch's (the chain splits there: modules.FusedLinear)."""
        affine = BatchNormAffine(module)
        problem = affine.problem(self.meta[v].dtype)
        if problem:
            return _Refusal(problem)
        if len(self.meta[v].shape) != 2:
            return _Refusal(f"a BatchNorm1d of {self.meta[v].shape} normalises dim 1, not the "
                            "features")  # fmt: skip
        written = self._written(node, ("weight", "bias", "running_mean", "running_var"))
        if written:
            return written
        ops = [("sub", "mean"), ("mul", "scale")] + ([("add", "bias")] if module.bias is not None
                                                    else [])  # fmt: skip
        args = tuple((op, (affine, name)) for op, name in ops)
        mode = "batch statistics" if affine.uses_batch_statistics else "eval"
        label = f"{node.target} ({mode}: (x - mean) * scale{' + bias' if len(ops) == 3 else ''})"
        return _Step("affine", label, args=args, module=module)

    def _match(self, node: fx.Node, v: fx.Node) -> "_Step | _Refusal":
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            if _has_hooks(module):
                return _Refusal("the module has forward hooks")
            if node.args != (v,) or node.kwargs:
                return _Refusal("the module takes more than the chain's value")
            if type(module) in (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm):
                return self._norm_module(node, module, v)
            if type(module) is nn.BatchNorm1d:
                return self._batch_norm(node, module, v)
            if type(module) in (nn.Softmax, nn.LogSoftmax):
                log = type(module) is nn.LogSoftmax
                return self._softmax_step(module.dim, None, log, v, node.target)
            if type(module) not in MODULE_OPS:
                return _Refusal("not in the epilogue grammar")
            name, args = MODULE_OPS[type(module)](module)
            if name is None:
                return _Refusal("these module settings are not in the grammar")
            return _Step("op", _op_label(name, args), name=name, args=args, module=module,
                         inplace=_is_inplace(node, self.gm))  # fmt: skip
        if node.op not in ("call_function", "call_method"):
            return _Refusal("not in the epilogue grammar")
        target = node.target
        if target in _BINARY:
            return self._binary(node, v)
        if target in _REDUCTIONS:
            return self._reduction(node, v)
        if target is F.group_norm:
            return self._group_norm(node, v)
        if target is F.layer_norm:
            return self._layer_norm(node, v)
        if target is F.rms_norm:
            return self._rms_norm(node, v)
        if target in _SOFTMAXES:
            return self._softmax(node, v)
        if target in _ACTS:
            act = _ACTS[target]
            bound = self._bind(node, act.params, act.defaults, v)
            made = bound if isinstance(bound, _Refusal) else act.make(bound)
            if isinstance(made, _Refusal):
                return made
            name, args = made
            return _Step("op", _op_label(name, args), name=name, args=args,
                         inplace=_is_inplace(node, self.gm))  # fmt: skip
        return _Refusal("not in the epilogue grammar")

    def _select(self, node: fx.Node) -> "fx.Node | _Refusal":
        """The ``[0]`` / ``.values`` node that takes torch.min/max's values."""
        users = list(node.users)
        if len(users) != 1:
            return _Refusal(f"its (values, indices) result is used {len(users)} times")
        u = users[0]
        if u.op == "call_function" and (
            (u.target is operator.getitem and u.args[1:] == (0,))
            or (u.target is builtins.getattr and u.args[1:] == ("values",))
        ):
            return u
        return _Refusal("its indices are used (the grammar takes the values only)")
