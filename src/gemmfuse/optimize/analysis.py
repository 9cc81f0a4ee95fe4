"""Finding chains: which Linear calls can be swapped, and how far the chain after each goes.

Each recognising step returns its result or a :class:`_Refusal` saying why the node cannot join
the chain; the chain stops at the first refusal and records it.
"""

import builtins
import operator
from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse.epilogue import MAX_SCALARS, MAX_TENSORS, Param, Reduction, Value, per_channel
from gemmfuse.modules import MODULE_OPS, BatchNormAffine, ChainNorm, ChainOp
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
    _alias_of,
    _first_refusal,
    _has_hooks,
    _input,
    _is_inplace,
    _linear_args,
    _linear_input,
    _number,
    _op_label,
    _pooling,
    _Refusal,
    _spelled_linear,
    _Step,
    _swish,
    _target_name,
)
from gemmfuse.optimize.tracing import _Meta, _source
from gemmfuse.pooling import ChannelPool, pool_problem


@dataclass
class _Chain:
    linear: fx.Node
    path: str
    input: fx.Node  # the Linear's input as traced (an earlier rewrite may replace it)
    nodes: list[fx.Node] = field(default_factory=list)  # after the Linear, in order
    ops: list[ChainOp] = field(default_factory=list)
    norm: ChainNorm | None = None
    reduce: Reduction | None = None
    # get_attr targets, (owner, attribute) of a tensor derived at each call, or the node of a
    # tensor the forward computes (an argument of the fused call); Param order
    operands: list = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    stopped: str = ""
    pool: ChannelPool | None = None  # folded into the Linear (pooling.py)
    gemm: _Meta | None = None  # the product's output as the kernel computes it (pooled)

    @property
    def end(self) -> fx.Node:
        return self.nodes[-1] if self.nodes else self.linear

    @property
    def forward_operands(self) -> list[fx.Node]:
        """The operands the forward computes, in Param order: the fused call's arguments."""
        return [o for o in self.operands if isinstance(o, fx.Node)]

    def operand(self, target) -> Param:
        if target not in self.operands:
            self.operands.append(target)
        return Param(self.operands.index(target))


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


@dataclass
class _Saved:
    """A chain as it stood where nothing was pending: where it ends if it stops later."""

    nodes: list
    ops: list
    operands: list
    labels: list
    norm: object
    reduce: object
    v: fx.Node  # the chain's value there

    @classmethod
    def of(cls, chain: _Chain, v: fx.Node) -> "_Saved":
        return cls(list(chain.nodes), list(chain.ops), list(chain.operands), list(chain.labels),
                   chain.norm, chain.reduce, v)  # fmt: skip

    def restore(self, chain: _Chain) -> None:
        chain.nodes, chain.ops, chain.operands = self.nodes, self.ops, self.operands
        chain.labels, chain.norm, chain.reduce = self.labels, self.norm, self.reduce


class _Analysis:
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

    # -- extending one Linear's chain

    def _accept(self, chain: _Chain, step: _Step, end: fx.Node, stage: str) -> "str | _Refusal":
        """Adds step to chain; returns the stage after it (or, leaving the chain as it was, a
        :class:`_Refusal`)."""
        linear = chain.gemm
        if end not in self.meta or self.meta[end].dtype != linear.dtype:
            return _Refusal(f"its result is not a {linear.dtype} tensor")
        softmax = step.name in ("softmax", "log_softmax")
        layer, rms = softmax or step.name in ("layer_norm", "rms_norm"), step.name == "rms_norm"
        if len(linear.shape) > 2 and step.kind != "op" and not layer:
            # The leading dimensions are flattened into rows: only ops on the features keep
            # their meaning (a GroupNorm of (B, T, N) normalises dim 1; reductions take dim 1)
            return _Refusal(f"{'GroupNorm' if step.kind == 'norm' else 'a reduction'} after a "
                            f"Linear on a {len(linear.shape)}-D input")  # fmt: skip
        if step.kind == "norm":
            if stage != "pre":
                return _Refusal("a second norm" if chain.norm else "a norm after the reduction")
            if step.module is not None:
                chain.norm = ChainNorm(module=step.module, layer=layer, rms=rms)
            else:
                groups, eps, weight, bias = step.args
                for a in (weight, bias):
                    if a is not None and self.meta[a].dtype != linear.dtype:
                        return _Refusal(f"{a.target} is {self.meta[a].dtype}, not {linear.dtype}")
                index = [None if a is None else chain.operand(a.target).index
                         for a in (weight, bias)]  # fmt: skip
                log = step.name == "log_softmax"
                chain.norm = ChainNorm(None, groups, eps, *index, layer, rms, softmax, log)
            return "post"
        if step.kind == "affine":
            return self._accept_affine(chain, step, stage)
        if step.kind == "reduce":
            if stage == "tail":
                return self._reduce_kept_dim(chain, step)
            chain.reduce = step.reduction
            return "tail"
        if stage != "tail":
            if self.meta[end].shape != linear.shape:
                return _Refusal(
                    f"it changes the shape {linear.shape} to {self.meta[end].shape} "
                    "before the reduction"
                )
            scalars = sum(self._floats(op.current()[1]) for op in chain.ops)
            tensors = self._tensor_count(chain)
            new_tensors = sum(isinstance(a, fx.Node) for a in step.args)
            if scalars + self._floats(step.args) > MAX_SCALARS:
                return _Refusal(f"the kernel takes at most {MAX_SCALARS} float arguments")
            if tensors + new_tensors > MAX_TENSORS:
                return _Refusal(f"the kernel takes at most {MAX_TENSORS} tensor arguments")
            n = linear.shape[-1]
            for a in step.args:
                shape = tuple(self.meta[a].shape) if isinstance(a, fx.Node) else ()
                if isinstance(a, fx.Node) and a.op != "get_attr" and shape == tuple(linear.shape):
                    continue  # computed in the forward, read per element (a residual)
                if not per_channel(shape, n):
                    # ops.py would route such a chain to PyTorch on every call
                    return _Refusal(
                        f"operand {a.target} of shape {shape} is not per channel (the kernel "
                        f"reads (), (1,), ({n},) or (1, {n}) before the reduction)"
                    )
        for a in step.args:
            if isinstance(a, fx.Node) and self.meta[a].dtype != linear.dtype:
                return _Refusal(f"operand {a.target} is {self.meta[a].dtype}, not {linear.dtype}")
            if isinstance(a, fx.Node) and stage == "tail" and step.inplace:
                return _Refusal("an in-place op with a tensor operand after the reduction")
        if step.module is not None:
            chain.ops.append(ChainOp(stage, module=step.module))
        else:
            args = tuple(chain.operand(a.target if a.op == "get_attr" else a)
                         if isinstance(a, fx.Node) else a for a in step.args)  # fmt: skip
            chain.ops.append(ChainOp(stage, step.name, args))
        return stage

    def _accept_affine(self, chain: _Chain, step: _Step, stage: str) -> "str | _Refusal":
        """Adds an eval-mode BatchNorm1d's ops, each reading an operand derived from the module
        at each call."""
        if stage == "tail":
            return _Refusal("a BatchNorm1d after the reduction")
        module = step.module
        for name in ("running_mean", "weight"):
            t = getattr(module, name)
            if t is not None and t.dtype != chain.gemm.dtype:
                return _Refusal(f"its {name} is {t.dtype}, not {chain.gemm.dtype}")
        if BatchNormAffine(module).uses_batch_statistics:
            # The chain splits at it (its statistics need the whole (M, N) value first): values
            # read again across the split, or a second split, are not supported
            if self.stretch.pending:
                return _Refusal("a value before it is read again after it (batch statistics)")
            if any(isinstance(t, tuple) and isinstance(t[0], BatchNormAffine)
                   and t[0].uses_batch_statistics for t in chain.operands):  # fmt: skip
                return _Refusal("a second BatchNorm1d with batch statistics in the chain")
        if self._tensor_count(chain) + len(step.args) > MAX_TENSORS:
            return _Refusal(f"the kernel takes at most {MAX_TENSORS} tensor arguments")
        for name, operand in step.args:
            chain.ops.append(ChainOp(stage, name, (chain.operand(operand),)))
        return stage

    def _reduce_kept_dim(self, chain: _Chain, step: _Step) -> "str | _Refusal":
        """A reduction after the chain's own, over the size-1 dimension it kept: the identity
        with keepdim (min, max, sum, mean, logsumexp of one value are that value, exactly), else
        the chain's reduction without keepdim, when no tail op came between."""
        rows = chain.gemm.shape[0]
        if not chain.reduce.keepdim or self.meta[chain.end].shape != (rows, 1):
            return _Refusal("a second reduction")
        if step.reduction.keepdim:
            return "tail"
        if any(op.stage == "tail" for op in chain.ops):
            return _Refusal("a reduction dropping the kept dimension after tail ops")
        chain.reduce = Reduction(chain.reduce.op, keepdim=False)
        return "tail"

    @staticmethod
    def _tensor_count(chain: _Chain) -> int:
        """The tensor arguments the chain's ops take so far."""
        return sum(isinstance(a, Param) for op in chain.ops for a in op.current()[1])

    @staticmethod
    def _floats(args) -> int:
        return sum(not isinstance(a, (Param, Value, fx.Node)) for a in args)

    def chain(self, linear: fx.Node, path: str, label: str) -> _Chain:
        """The chain after ``linear``: node by node while each joins the grammar. A value may
        be read again further on (a :class:`gemmfuse.Value` argument, in registers); the chain
        ends at the last node where every value it holds is read by the chain alone."""
        chain = _Chain(linear, path, _linear_input(linear, self.gm), labels=[label])
        self.linear = linear
        chain.gemm = self.meta[linear]
        stage, v = "pre", linear
        folded = self._fold_pool(chain)
        if isinstance(folded, _Refusal):
            chain.stopped = str(folded)
            return chain
        v = folded or v
        self.stretch = _Stretch({v: Value(0)})
        saved = _Saved.of(chain, v)
        while True:
            users = self._users(chain, v)
            # _swish's refusal: not swish, but maybe values read again further on
            pair = _swish(self.gm, v) if len(users) == 2 and not self.stretch.pending else None
            if isinstance(pair, tuple):
                extended = self._extend_swish(chain, *pair, stage)
                if isinstance(extended, _Refusal):
                    chain.stopped = f"stopped at {pair[1].name} (x * sigmoid(x)): {extended}"
                    break
            else:
                if not users:
                    chain.stopped = f"stopped after {v.name}: its result is not used{_source(v)}"
                    break
                u = users[0]  # the first in the graph; the others must read v again further on
                if len(users) > 1:
                    self.stretch.pending[v] = set(users[1:])
                if u.op == "output":
                    chain.stopped = "ends at the model's output"
                    break
                extended = self._extend(chain, u, v, stage)
                if isinstance(extended, _Refusal):
                    where = u.target if u.op == "call_module" else u.name  # a path, or fx's name
                    at = _source(u)  # where the node is (unless the refusal ends saying so)
                    at = "" if str(extended).endswith(at) else at
                    chain.stopped = f"stopped at {where} ({self._describe(u)}): {extended}{at}"
                    break
            stage, v = extended
            if not self.stretch.pending:
                saved = _Saved.of(chain, v)
        if self.stretch.pending:
            chain.stopped = self._unread(chain, saved)
        return chain

    def _fold_pool(self, chain: _Chain) -> "fx.Node | _Refusal | None":
        """Takes an average pooling over the channels right after the Linear (``unsqueeze(1)``,
        ``avg_pool1d``, ``squeeze(1)``) into the chain, to be folded into the weights: the
        squeeze's node (the chain's value from there on), None where there is no such pooling,
        or a :class:`_Refusal` where there is one the Linear cannot take."""
        found = _pooling(self.gm, chain.linear)
        if isinstance(found, _Refusal):  # the unsqueeze's line: where the pooling is written
            return _Refusal(f"{found}{_source(next(iter(chain.linear.users)))}")
        if found is None:
            return None
        nodes, pool, settings = found
        at = f"stopped at {nodes[1].name} (channel pooling)"
        # (M, N): avg_pool1d takes (M, 1, N), so a higher Linear output never gets here
        problem = pool_problem(*settings, chain.gemm.shape[-1])
        if problem:
            return _Refusal(f"{at}: {problem}{_source(nodes[1])}")
        if nodes[-1] not in self.meta or self.meta[nodes[-1]].dtype != chain.gemm.dtype:
            return _Refusal(f"{at}: its result is not a {chain.gemm.dtype} tensor")
        chain.pool = pool
        chain.gemm = self.meta[nodes[-1]]
        chain.nodes += nodes
        chain.labels.append(
            f"avg_pool1d({settings[0]}) over the channels (folded into the weights)"
        )
        return nodes[-1]

    def _extend_swish(self, chain: _Chain, s: fx.Node, m: fx.Node, stage: str):
        """Adds ``s = sigmoid(x)``, ``m = x * s`` as the one op swish: as :meth:`_extend`."""
        after = self._accept(chain, _Step("op", "x * sigmoid(x)", "swish"), m, stage)
        if isinstance(after, _Refusal):
            return after
        chain.nodes += [s, m]
        chain.labels.append("x * sigmoid(x)")
        return after, self._joined(chain, (stage, after), [s, m], m)

    def _extend(self, chain: _Chain, u: fx.Node, v: fx.Node, stage: str):
        """Adds ``u`` (the next node on the chain's value ``v``) to the chain: (the stage after
        it, the chain's new value), or a :class:`_Refusal` leaving the chain as it was."""
        step = self._match(u, v)
        end = u if isinstance(step, _Refusal) or not step.selects else self._select(u)
        refusal = _first_refusal((step, end))
        ends_stretch = refusal is None and (
            step.kind == "norm" or (step.kind == "reduce" and stage != "tail")
        )
        if ends_stretch and self.stretch.pending:
            # the kernels keep a stretch's values up to its norm or reduction, not past it
            pending = sorted(n.name for n in self.stretch.pending)
            refusal = _Refusal(f"{', '.join(pending)} is read again after it")
        if refusal is None and step.inplace and self.stretch.pending:
            refusal = _Refusal("an in-place op while a value is still to be read again")
        if refusal is None:
            after = self._accept(chain, step, end, stage)
            refusal = _first_refusal((after,))
        if refusal is not None:
            return refusal
        nodes = [u] if end is u else [u, end]
        chain.nodes += nodes
        chain.labels.append(step.label)
        return after, self._joined(chain, (stage, after), nodes, end)

    def _joined(self, chain: _Chain, stages, nodes: list[fx.Node], end: fx.Node) -> fx.Node:
        """Records ``nodes`` (ending at ``end``) as joined: their reads are done, and ``end``
        holds the stretch's latest value (value 0 of a new stretch where ``stages``, before and
        after, differ: after a norm or the reduction)."""
        before, after = stages
        self.stretch.joined(nodes)
        if after != before:
            self.stretch = _Stretch({end: Value(0)})
        else:  # an op's result, or (a reduction over a kept dimension) the value unchanged
            self.stretch.values[end] = Value(sum(op.stage == after for op in chain.ops))
        self.stretch.names[end] = nodes[0].name  # torch.max's node, not its [0] / .values
        return end

    def _users(self, chain: _Chain, v: fx.Node) -> list[fx.Node]:
        """v's users in graph order, apart from ``detach()`` / ``clone()`` copies of it: those
        join the chain as values to read again."""
        users = []
        for u in sorted(v.users, key=self.order):
            detach = _alias_of(u, v)
            if detach is None or v not in self.stretch.values:
                users.append(u)
            else:
                self._copy(chain, u, v, detach)
        return users

    def _copy(self, chain: _Chain, u: fx.Node, v: fx.Node, detach: bool) -> None:
        """Adds ``u``, a detach or clone of the chain value ``v``, as a value of the stretch
        (detached if either is); its users wait to read it, copies of it joining in turn."""
        base = self.stretch.values[v]
        self.stretch.values[u] = Value(base.index, base.detach or detach)
        base_name = self.stretch.names.get(v, v.name)
        self.stretch.names[u] = f"{base_name}.{'detach' if detach else 'clone'}()"
        chain.nodes.append(u)
        readers = set(self._users(chain, u))
        if readers:
            self.stretch.pending[u] = readers

    def _unread(self, chain: _Chain, saved: _Saved) -> str:
        """The chain cut back to ``saved``: the stop message saying why."""
        pending = sorted({n.name for n in self.stretch.pending})
        readers = sorted({u.name for us in self.stretch.pending.values() for u in us})
        saved.restore(chain)
        return (
            f"stopped after {saved.v.name}: {', '.join(pending)} is also read by "
            f"{', '.join(readers)}, which the chain does not reach ({chain.stopped})"
        )

    def _describe(self, node: fx.Node) -> str:
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            prefix = "nn." if type(module).__module__.startswith("torch.nn") else ""
            return prefix + type(module).__name__
        if node.op in ("call_function", "call_method"):
            return _target_name(node.target)
        return node.op

    def linear_problem(self, node: fx.Node) -> str:
        """Why this Linear call (a module's, F.linear's or a matmul by a transposed attribute)
        cannot be swapped ("" if it can)."""
        x = _linear_input(node, self.gm)
        if node.op != "call_module":  # F.linear: on the model's own tensors only
            args = _linear_args(node, self.gm)
            for key in ("weight", "bias"):
                t = args[key]
                if t is not None and not (isinstance(t, fx.Node) and t.op == "get_attr"):
                    return (
                        f"its {key} is computed in the forward (F.linear is fused on "
                        "parameters, buffers and tensor attributes)"
                    )
        else:
            module = self.gm.get_submodule(node.target)
            if type(module).forward is not nn.Linear.forward:
                return f"{type(module).__name__} overrides nn.Linear.forward"
            if _has_hooks(module):
                return "the module has forward hooks"
            if node.kwargs.keys() - {"input"} or len(node.args) > 1:
                return "its input is not a tensor of the forward"
        if x not in self.meta:
            return "its input is not a tensor of the forward"
        shape = self.meta[x].shape
        if len(shape) < 2:
            return f"its input is {len(shape)}-D {shape}; the fused kernel takes (batch, features)"
        return ""
