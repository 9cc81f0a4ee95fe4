"""``gemmfuse.optimize``: every Linear chain of a model as one fused call.

``optimize(model, example_inputs)`` traces the model's forward with ``torch.fx``, runs the trace
once on the example inputs (under no_grad; recording each value's shape and dtype; the model's
buffers are restored after it, so a forward that writes them is not stepped twice), and, for
every ``nn.Linear`` (or ``F.linear`` on the model's own tensors) applied to a 2-D input, extends
the chain after it as far as the epilogue grammar goes::

    Linear -> pointwise ops -> GroupNorm -> pointwise ops -> reduction over dim 1 -> tail ops

A chain stops at the first node that is not in the grammar, whose result has several users
(``x + x`` excepted, and ``x * sigmoid(x)``: x used by a sigmoid that only the multiplication
uses, the op ``swish``), that changes the (M, N) shape before the reduction or the dtype anywhere,
that would take the kernel past ``MAX_SCALARS``/``MAX_TENSORS`` arguments, or whose operands the
forward pass modifies in place. Each candidate is then checked on the example inputs: its
``FusedLinear.reference`` (``gemmfuse.reference``) must reproduce the model's own value at the
chain's end (``torch.testing.assert_close``, default tolerances), else the Linear stays PyTorch.
Meta tensors carry no values: their chains are not checked, and the report says so.

The result is an ``fx.GraphModule`` with a ``FusedLinear`` at each swapped Linear's path (for
an ``F.linear`` call, a new stateless submodule of the root, ``<call>_fused``). Its
module tree mirrors the model's: every submodule not on the way to a swapped Linear is the
model's own object, the rest are shallow copies that share their parameter and buffer dicts, so
every parameter and buffer keeps its state_dict key and is the model's own object (optimizer
steps and ``.to()`` reach both models).

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

from __future__ import annotations

import builtins
import copy
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse.epilogue import MAX_SCALARS, MAX_TENSORS, Param, Reduction, per_channel
from gemmfuse.modules import MODULE_OPS, ChainNorm, ChainOp, FusedLinear
from gemmfuse.ops import KERNELS, PRECISIONS

# ---- the grammar, as torch.fx records it: call_function targets and call_method names


class _Refused(Exception):
    """A node the chain cannot take; the message says why."""


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Refused(f"{what} is {value!r}, not a number")
    if isinstance(value, int) and abs(value) > 2**53:  # float(value) would round it
        raise _Refused(f"{what} {value} has no exact float value")
    return float(value)


def _clamp_bound(value, what: str, default: float) -> float:
    return default if value is None else _number(value, what)


def _clamp(a):
    if a.get("min") is None and a.get("max") is None:
        raise _Refused("clamp without bounds")
    return "clamp", (
        _clamp_bound(a.get("min"), "min", float("-inf")),
        _clamp_bound(a.get("max"), "max", float("inf")),
    )


def _gelu(a):
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(a["approximate"])
    if name is None:
        raise _Refused(f"gelu(approximate={a['approximate']!r}) is not in the grammar")
    return name, ()


@dataclass(frozen=True)
class _Act:
    """A unary op: its parameters after the input, their defaults, and its IR form."""

    params: tuple[str, ...]
    defaults: tuple
    make: Callable[[dict], tuple[str, tuple[float, ...]]]  # bound arguments -> IR op


def _fixed(name):
    return lambda a: (name, ())


_ACT_GROUPS = [
    ((torch.relu, F.relu, torch.relu_, F.relu_, "relu", "relu_"), ("inplace",), (False,),
     _fixed("relu")),
    ((F.leaky_relu, F.leaky_relu_), ("negative_slope", "inplace"), (0.01, False),
     lambda a: ("leaky_relu", (_number(a["negative_slope"], "negative_slope"),))),
    ((F.gelu,), ("approximate",), ("none",), _gelu),
    ((F.silu,), ("inplace",), (False,), _fixed("silu")),
    ((F.mish,), ("inplace",), (False,), _fixed("mish")),
    ((torch.tanh, F.tanh, torch.tanh_, "tanh", "tanh_"), (), (), _fixed("tanh")),
    ((torch.sigmoid, F.sigmoid, torch.sigmoid_, "sigmoid", "sigmoid_"), (), (),
     _fixed("sigmoid")),
    ((F.hardtanh, F.hardtanh_), ("min_val", "max_val", "inplace"), (-1.0, 1.0, False),
     lambda a: ("hardtanh", (_number(a["min_val"], "min_val"),
                             _number(a["max_val"], "max_val")))),
    ((F.relu6,), ("inplace",), (False,), lambda a: ("hardtanh", (0.0, 6.0))),
    ((F.hardswish,), ("inplace",), (False,), _fixed("hardswish")),
    ((F.hardsigmoid,), ("inplace",), (False,), _fixed("hardsigmoid")),
    ((F.softplus,), ("beta", "threshold"), (1.0, 20.0),
     lambda a: ("softplus", (_number(a["beta"], "beta"),
                             _number(a["threshold"], "threshold")))),
    ((F.elu, F.elu_), ("alpha", "inplace"), (1.0, False),
     lambda a: ("elu", (_number(a["alpha"], "alpha"),))),
    ((torch.exp, torch.exp_, "exp", "exp_"), (), (), _fixed("exp")),
    ((torch.log, torch.log_, "log", "log_"), (), (), _fixed("log")),
    ((torch.clamp, torch.clip, torch.clamp_, torch.clip_, "clamp", "clamp_", "clip", "clip_"),
     ("min", "max"), (None, None), _clamp),
    ((torch.clamp_min, torch.clamp_min_, "clamp_min", "clamp_min_"), ("min",), (None,), _clamp),
    ((torch.clamp_max, torch.clamp_max_, "clamp_max", "clamp_max_"), ("max",), (None,), _clamp),
]  # fmt: skip
_ACTS = {t: _Act(p, d, m) for targets, p, d, m in _ACT_GROUPS for t in targets}

# Binary arithmetic: target -> (op, its parameters after the input and the other operand).
_BINARY = {
    **dict.fromkeys((operator.add, torch.add, "add", "add_"), ("add", ("alpha",))),
    **dict.fromkeys(
        (operator.sub, torch.sub, torch.subtract, "sub", "sub_", "subtract", "subtract_"),
        ("sub", ("alpha",)),
    ),
    torch.rsub: ("rsub", ("alpha",)),
    **dict.fromkeys(
        (operator.mul, torch.mul, torch.multiply, "mul", "mul_", "multiply", "multiply_"),
        ("mul", ()),
    ),
    **dict.fromkeys(
        (
            operator.truediv,
            torch.div,
            torch.divide,
            torch.true_divide,
            "div",
            "div_",
            "divide",
            "divide_",
            "true_divide",
            "true_divide_",
        ),
        ("div", ("rounding_mode",)),
    ),  # fmt: skip
}
# The op when the chain's value is the second operand: o + v = v + o, o - v = rsub...
_SWAPPED = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv", "rsub": "sub"}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}

# Reductions: target -> (IR op, whether it returns (values, indices) when given a dim).
_REDUCTIONS = {
    **dict.fromkeys((torch.min, "min"), ("min", True)),
    **dict.fromkeys((torch.max, "max"), ("max", True)),
    **dict.fromkeys((torch.amin, "amin"), ("min", False)),
    **dict.fromkeys((torch.amax, "amax"), ("max", False)),
    **dict.fromkeys((torch.sum, "sum"), ("sum", False)),
    **dict.fromkeys((torch.mean, "mean"), ("mean", False)),
    **dict.fromkeys((torch.logsumexp, "logsumexp"), ("logsumexp", False)),
}
_SIGMOIDS = (torch.sigmoid, F.sigmoid, "sigmoid")  # out-of-place forms (swish's sigmoid)
_MULS = (operator.mul, torch.mul, torch.multiply, "mul", "multiply", operator.imul, "mul_",
         "multiply_")  # fmt: skip
_FRESH_MODULES = {nn.Linear, nn.GroupNorm, *MODULE_OPS}
_INPLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.setitem)  # fmt: skip


def _target_name(target) -> str:
    """How the model's source spells a function: torch.softmax, F.gelu, operator.add..."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    name = getattr(target, "__name__", repr(target))
    for prefix, namespace in (("torch", torch), ("F", F), ("operator", operator)):
        if getattr(namespace, name, None) is target:
            return f"{prefix}.{name}"
    return f"{getattr(target, '__module__', '?')}.{name}"


def _is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (
            node.target in _INPLACE_OPERATORS
            or (name.endswith("_") and not name.startswith("__"))
            or node.kwargs.get("inplace") is True
        )
    if node.op == "call_module":
        return getattr(gm.get_submodule(node.target), "inplace", False) is True
    return False


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _is_sigmoid_of(node: fx.Node, v: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether node is sigmoid(v), out of place, in any recognised form."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return type(module) is nn.Sigmoid and node.args == (v,) and not node.kwargs
    if node.op not in ("call_function", "call_method") or node.target not in _SIGMOIDS:
        return False
    return (node.args == (v,) and not node.kwargs) or (
        not node.args and node.kwargs == {"input": v}
    )


def _swish(gm: fx.GraphModule, v: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(s, m) when v's two users are ``s = sigmoid(v)`` and ``m = v * s`` (or ``s * v``), s used
    by m alone: the op ``swish``. None when v's users are not a sigmoid of v and a
    multiplication reading it; raises _Refused when they are but the rest does not hold."""
    users = list(v.users)
    if len(users) != 2:
        return None
    for s, m in (users, users[::-1]):
        if (
            _is_sigmoid_of(s, v, gm)
            and m.op in ("call_function", "call_method")
            and m.target in _MULS
            and s in m.all_input_nodes
        ):
            break
    else:
        return None
    if s.op == "call_module" and _has_hooks(gm.get_submodule(s.target)):
        raise _Refused("x * sigmoid(x): the Sigmoid module has forward hooks")
    if len(s.users) != 1:
        raise _Refused(f"x * sigmoid(x): the sigmoid's result is used {len(s.users)} times")
    if m.kwargs or len(m.args) != 2 or set(m.args) != {v, s}:
        raise _Refused(f"x * sigmoid(x): {m.name} does not multiply x by its sigmoid alone")
    if m.args[0] is v and _is_inplace(m, gm):
        raise _Refused(
            f"x * sigmoid(x): {m.name} multiplies in place into x (swish is out of place)"
        )
    return s, m


def _next_in_chain(gm: fx.GraphModule, v: fx.Node) -> fx.Node | None:
    """The node a chain at v may extend to, by the graph's shape alone (v's only user, or the
    multiplication of a swish); None where a chain must stop."""
    users = list(v.users)
    if len(users) == 1:
        return None if users[0].op == "output" else users[0]
    try:
        pair = _swish(gm, v)
    except _Refused:
        return None
    return None if pair is None else pair[1]


def _input(node: fx.Node):
    return node.args[0] if node.args else node.kwargs.get("input")


def _linear_args(node: fx.Node) -> dict:
    """An F.linear call's arguments by name (input, weight, bias)."""
    bound = dict(zip(("input", "weight", "bias"), node.args, strict=False))
    return {"bias": None, **bound, **node.kwargs}


def _thread_inplace(gm: fx.GraphModule) -> None:
    """Makes the uses of a tensor that follow an in-place op on it use the op's result (the same
    tensor), so ``x.mul_(2); x.add_(b); return x`` reads as the chain it is."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if not _is_inplace(node, gm) or node.target is operator.setitem or not node.args:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src in node.all_input_nodes[1:]:
            continue
        for user in list(src.users):
            if order[user] > order[node]:
                user.replace_input_with(src, node)


# ---- the report


@dataclass(frozen=True)
class LinearReport:
    """What ``optimize`` did with one Linear call."""

    name: str  # the Linear's module path (or the F.linear call's node name)
    fused: bool  # replaced by a FusedLinear
    chain: tuple[str, ...]  # the ops the FusedLinear runs, in model terms, the Linear first
    stopped: str  # where the chain stopped, and why
    reason: str = ""  # why the Linear was not swapped ("" when it was)
    verified: bool | None = None  # checked on example_inputs; None: not checked
    module: str = ""  # the FusedLinear's path in the result ("" when not swapped)

    def __str__(self) -> str:
        if not self.fused:
            return f"{self.name}: not swapped: {self.reason}"
        check = " [not verified: meta tensors]" if self.verified is None else ""
        return f"{self.name}: fused {' -> '.join(self.chain)}{check}; {self.stopped}"


@dataclass(frozen=True)
class OptimizeReport:
    """One :class:`LinearReport` per Linear call of the traced forward, in graph order."""

    model: str
    linears: tuple[LinearReport, ...] = field(default_factory=tuple)

    @property
    def fused(self) -> tuple[LinearReport, ...]:
        return tuple(r for r in self.linears if r.fused)

    def __str__(self) -> str:
        head = f"gemmfuse.optimize({self.model}): {len(self.fused)} of {len(self.linears)} "
        head += "Linear call(s) fused"
        return "\n".join([head, *(f"  {r}" for r in self.linears)])


# ---- tracing and recording


def _trace(model: nn.Module, forward) -> fx.GraphModule:
    """fx-traces ``forward`` (default: the model's own) on a shallow copy of the model, so the
    tracer's bookkeeping (constants it attaches) never touches the model itself."""
    cls = type(model)
    if forward is not None:
        cls = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    view = cls.__new__(cls)
    view.__dict__.update(model.__dict__)
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True  # record the forward's writes to buffers
    # Writes to other tensors (plain attributes) would run once, at trace time, unrecorded.
    plain = {
        f"{path}.{k}".lstrip("."): t
        for path, m in model.named_modules()
        for k, t in m.__dict__.items()
        if isinstance(t, torch.Tensor)
    }
    versions = {k: t._version for k, t in plain.items()}
    try:
        graph = tracer.trace(view)
    except Exception as exc:  # fx raises TraceError, TypeError, or whatever forward raises
        raise ValueError(
            f"gemmfuse.optimize: tracing {type(model).__name__}.forward with torch.fx failed "
            f"({type(exc).__name__}: {exc}); optimize rewrites models that "
            "torch.fx.symbolic_trace can trace (no control flow on tensor values)"
        ) from exc
    written = sorted(k for k, t in plain.items() if t._version != versions[k])
    if written:
        raise ValueError(
            f"gemmfuse.optimize: {type(model).__name__}.forward writes in place to the tensor "
            f"attribute(s) {written}, which torch.fx runs once while tracing instead of "
            "recording; register them as buffers"
        )
    return _OptimizedModule(view, graph, f"Optimized{type(model).__name__}")


class _OptimizedModule(fx.GraphModule):
    """A GraphModule whose module tree is the model's (see the module docstring)."""

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
    (copies: a later in-place op must not change what the chain is checked against)."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node]):
        super().__init__(gm)
        self.keep = keep
        self.meta: dict[fx.Node, _Meta] = {}
        self.values: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.meta[n] = _Meta(tuple(out.shape), out.dtype)
            if n in self.keep:
                self.values[n] = out.clone()
        return out


# ---- finding chains


@dataclass
class _Step:
    """One recognised node: a pointwise op, a GroupNorm or a reduction."""

    kind: str  # "op", "norm" or "reduce"
    label: str
    name: str = ""  # op: IR name
    args: tuple = ()  # op: floats and get_attr nodes; norm (functional): G, eps, weight, bias
    module: nn.Module | None = None
    inplace: bool = False
    reduction: Reduction | None = None
    selects: bool = False  # torch.min/max(dim): the values come from [0] or .values


@dataclass
class _Chain:
    linear: fx.Node
    path: str
    input: fx.Node  # the Linear's input as traced (an earlier rewrite may replace it)
    nodes: list[fx.Node] = field(default_factory=list)  # after the Linear, in order
    ops: list[ChainOp] = field(default_factory=list)
    norm: ChainNorm | None = None
    reduce: Reduction | None = None
    operands: list[str] = field(default_factory=list)  # get_attr targets; Param index order
    labels: list[str] = field(default_factory=list)
    stopped: str = ""

    @property
    def end(self) -> fx.Node:
        return self.nodes[-1] if self.nodes else self.linear

    def operand(self, target: str) -> Param:
        if target not in self.operands:
            self.operands.append(target)
        return Param(self.operands.index(target))


def _op_label(name: str, args: tuple) -> str:
    shown = [a.target if isinstance(a, fx.Node) else repr(a) for a in args]
    if name == "add_self":
        return "x + x"
    if name in _SYMBOL:
        return f"x {_SYMBOL[name]} {shown[0]}"
    if name in ("rsub", "rdiv"):
        return f"{shown[0]} {_SYMBOL[name[1:]]} x"
    return f"{name}({', '.join(shown)})" if shown else name


class _Analysis:
    def __init__(self, gm: fx.GraphModule, meta: dict[fx.Node, _Meta]):
        self.gm = gm
        self.meta = meta
        self.mutated = self._mutated_attributes()

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
            or node.target in (F.linear, F.group_norm)
        )

    def _mutated_attributes(self) -> set[str]:
        """get_attr targets that some in-place op may write: through any node that can alias
        its input, back to the attribute (chains never take those as operands)."""
        mutated = set()
        for node in self.gm.graph.nodes:
            if not _is_inplace(node, self.gm) or not node.args:
                continue
            stack, seen = [node.args[0]], set()
            while stack:
                a = stack.pop()
                if not isinstance(a, fx.Node) or a in seen:
                    continue
                seen.add(a)
                if a.op == "get_attr":
                    mutated.add(a.target)
                elif _is_inplace(a, self.gm) and a.args:
                    stack.append(a.args[0])  # its result is its first argument
                elif a.op != "placeholder" and not self._fresh(a):
                    stack.extend(a.all_input_nodes)  # may alias any input
        return mutated

    # -- recognising one node

    def _bind(self, node: fx.Node, params: tuple[str, ...], defaults: tuple, v, tensors=()):
        """node's arguments after the input by name; only ``tensors`` may be graph values."""
        if _input(node) is not v:
            raise _Refused("the chain's value is not its input")
        bound = dict(zip(params, defaults, strict=True))
        rest = node.args[1:]
        if len(rest) > len(params):
            raise _Refused("more arguments than the grammar's form of this op")
        bound.update(zip(params, rest, strict=False))
        for key, value in node.kwargs.items():
            if key not in bound and key != "input":
                raise _Refused(f"argument {key}= is not in the grammar's form of this op")
            bound[key] = value
        bound.pop("input", None)
        for key, value in bound.items():
            if isinstance(value, fx.Node) and key not in tensors:
                raise _Refused(f"argument {key} is computed in the forward pass")
        return bound

    def _operand(self, o):
        """A binary op's other operand: a float, or the get_attr node of a tensor."""
        if isinstance(o, fx.Node):
            if o.op != "get_attr" or o not in self.meta:
                raise _Refused(
                    f"operand {o.name} is computed in the forward pass (fused operands are "
                    "numbers, parameters, buffers and tensor attributes)"
                )
            if o.target in self.mutated:
                raise _Refused(f"operand {o.target} is modified in place in the forward pass")
            return o
        return _number(o, "the operand")

    def _binary(self, node: fx.Node, v) -> _Step:
        op, extra = _BINARY[node.target]
        names = ("input", "other", *extra)
        if len(node.args) > len(names):
            raise _Refused("more arguments than the grammar's form of this op")
        bound = dict(zip(names, node.args, strict=False))
        for key, value in node.kwargs.items():
            if key not in names or key in bound:
                raise _Refused(f"argument {key}= is not in the grammar's form of this op")
            bound[key] = value
        if "input" not in bound or "other" not in bound:
            raise _Refused("not a binary op of two operands")
        if bound.get("alpha", 1) != 1 or bound.get("rounding_mode") is not None:
            raise _Refused("alpha= or rounding_mode= is not in the grammar")
        args = bound["input"], bound["other"]
        inplace = _is_inplace(node, self.gm)
        a, b = args
        if a is v and b is v:
            if op != "add":
                raise _Refused(f"x {_SYMBOL.get(op, op)} x is not in the grammar (x + x is)")
            return _Step("op", "x + x", name="add_self", inplace=inplace)
        if a is v:
            name, other = op, b
        elif b is v:
            if inplace:
                raise _Refused("it writes its result into its other operand")
            name, other = _SWAPPED[op], a
        else:
            raise _Refused("the chain's value is not one of its operands")
        operand = self._operand(other)
        return _Step("op", _op_label(name, (operand,)), name=name, args=(operand,),
                     inplace=inplace)  # fmt: skip

    def _reduction(self, node: fx.Node, v) -> _Step:
        op, returns_tuple = _REDUCTIONS[node.target]
        names = ("dim", "keepdim") + (("dtype",) if op in ("sum", "mean") else ())
        if returns_tuple and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
            raise _Refused(f"{op} with a tensor operand is elementwise, not in the grammar")
        bound = self._bind(node, names, (None, False, None)[: len(names)], v)
        dim, keepdim = bound["dim"], bound["keepdim"]
        if bound.get("dtype") is not None:
            raise _Refused("a reduction with dtype= is not in the grammar")
        if isinstance(dim, (tuple, list)) and len(dim) == 1:
            dim = dim[0]
        if dim is None or isinstance(dim, (tuple, list)):
            raise _Refused("it reduces over more than the channel dimension (dim=1)")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (1, -1):
            raise _Refused(f"it reduces over dim={dim!r}, not the channels (dim=1)")
        if not isinstance(keepdim, bool):
            raise _Refused(f"keepdim={keepdim!r} is not a bool")
        reduction = Reduction(op, keepdim)
        label = f"{op}(dim=1{', keepdim=True' if keepdim else ''})"
        return _Step("reduce", label, reduction=reduction, selects=returns_tuple)

    def _group_norm(self, node: fx.Node, v) -> _Step:
        names = ("num_groups", "weight", "bias", "eps")
        bound = self._bind(node, names, (None, None, None, 1e-5), v, tensors=("weight", "bias"))
        groups, eps = bound["num_groups"], _number(bound["eps"], "eps")
        if isinstance(groups, bool) or not isinstance(groups, int):
            raise _Refused(f"num_groups={groups!r} is not an int")
        affine = [bound["weight"], bound["bias"]]
        if (affine[0] is None) != (affine[1] is None):
            raise _Refused("group_norm with a weight but no bias (or a bias but no weight)")
        affine = [None if a is None else self._operand(a) for a in affine]
        return _Step("norm", f"group_norm({groups}, eps={eps!r})", args=(groups, eps, *affine))

    def _match(self, node: fx.Node, v: fx.Node) -> _Step:
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            if _has_hooks(module):
                raise _Refused("the module has forward hooks")
            if node.args != (v,) or node.kwargs:
                raise _Refused("the module takes more than the chain's value")
            if type(module) is nn.GroupNorm:
                if (module.weight is None) != (module.bias is None):
                    raise _Refused("the GroupNorm has a weight but no bias (or the reverse)")
                for p in ("weight", "bias"):
                    if f"{node.target}.{p}" in self.mutated:
                        raise _Refused(f"its {p} is modified in place in the forward pass")
                return _Step("norm", node.target, module=module)
            if type(module) not in MODULE_OPS:
                raise _Refused("not in the epilogue grammar")
            name, args = MODULE_OPS[type(module)](module)
            if name is None:
                raise _Refused("these module settings are not in the grammar")
            return _Step("op", _op_label(name, args), name=name, args=args, module=module,
                         inplace=_is_inplace(node, self.gm))  # fmt: skip
        if node.op not in ("call_function", "call_method"):
            raise _Refused("not in the epilogue grammar")
        target = node.target
        if target in _BINARY:
            return self._binary(node, v)
        if target in _REDUCTIONS:
            return self._reduction(node, v)
        if target is F.group_norm:
            return self._group_norm(node, v)
        if target in _ACTS:
            act = _ACTS[target]
            name, args = act.make(self._bind(node, act.params, act.defaults, v))
            return _Step("op", _op_label(name, args), name=name, args=args,
                         inplace=_is_inplace(node, self.gm))  # fmt: skip
        raise _Refused("not in the epilogue grammar")

    def _select(self, node: fx.Node) -> fx.Node:
        """The ``[0]`` / ``.values`` node that takes torch.min/max's values."""
        users = list(node.users)
        if len(users) != 1:
            raise _Refused(f"its (values, indices) result is used {len(users)} times")
        u = users[0]
        if u.op == "call_function" and (
            (u.target is operator.getitem and u.args[1:] == (0,))
            or (u.target is builtins.getattr and u.args[1:] == ("values",))
        ):
            return u
        raise _Refused("its indices are used (the grammar takes the values only)")

    # -- extending one Linear's chain

    def _accept(self, chain: _Chain, step: _Step, end: fx.Node, stage: str) -> str:
        """Adds step to chain (or raises _Refused); returns the stage after it."""
        linear = self.meta[chain.linear]
        if end not in self.meta or self.meta[end].dtype != linear.dtype:
            raise _Refused(f"its result is not a {linear.dtype} tensor")
        if step.kind == "norm":
            if stage != "pre":
                raise _Refused("a second GroupNorm" if chain.norm else "GroupNorm after the "
                               "reduction")  # fmt: skip
            if step.module is not None:
                chain.norm = ChainNorm(module=step.module)
            else:
                groups, eps, weight, bias = step.args
                for a in (weight, bias):
                    if a is not None and self.meta[a].dtype != linear.dtype:
                        raise _Refused(f"{a.target} is {self.meta[a].dtype}, not {linear.dtype}")
                index = [None if a is None else chain.operand(a.target).index
                         for a in (weight, bias)]  # fmt: skip
                chain.norm = ChainNorm(None, groups, eps, *index)
            return "post"
        if step.kind == "reduce":
            if stage == "tail":
                raise _Refused("a second reduction")
            chain.reduce = step.reduction
            return "tail"
        if stage != "tail":
            if self.meta[end].shape != linear.shape:
                raise _Refused(
                    f"it changes the shape {linear.shape} to {self.meta[end].shape} "
                    "before the reduction"
                )
            scalars = sum(len(op.current()[1]) - self._tensors(op) for op in chain.ops)
            tensors = sum(self._tensors(op) for op in chain.ops)
            new_tensors = sum(isinstance(a, fx.Node) for a in step.args)
            if scalars + len(step.args) - new_tensors > MAX_SCALARS:
                raise _Refused(f"the kernel takes at most {MAX_SCALARS} float arguments")
            if tensors + new_tensors > MAX_TENSORS:
                raise _Refused(f"the kernel takes at most {MAX_TENSORS} tensor arguments")
            n = linear.shape[-1]
            for a in step.args:
                shape = tuple(self.meta[a].shape) if isinstance(a, fx.Node) else ()
                if not per_channel(shape, n):
                    # ops.py would route such a chain to PyTorch on every call
                    raise _Refused(
                        f"operand {a.target} of shape {shape} is not per channel (the kernel "
                        f"reads (), (1,), ({n},) or (1, {n}) before the reduction)"
                    )
        for a in step.args:
            if isinstance(a, fx.Node) and self.meta[a].dtype != linear.dtype:
                raise _Refused(f"operand {a.target} is {self.meta[a].dtype}, not {linear.dtype}")
            if isinstance(a, fx.Node) and stage == "tail" and step.inplace:
                raise _Refused("an in-place op with a tensor operand after the reduction")
        if step.module is not None:
            chain.ops.append(ChainOp(stage, module=step.module))
        else:
            args = tuple(chain.operand(a.target) if isinstance(a, fx.Node) else a
                         for a in step.args)  # fmt: skip
            chain.ops.append(ChainOp(stage, step.name, args))
        return stage

    @staticmethod
    def _tensors(op: ChainOp) -> int:
        return sum(isinstance(a, Param) for a in op.current()[1])

    def chain(self, linear: fx.Node, path: str, label: str) -> _Chain:
        chain = _Chain(linear, path, _input(linear), labels=[label])
        stage, v = "pre", linear
        while True:
            users = list(v.users)
            if len(users) == 2:
                try:
                    pair = _swish(self.gm, v)
                except _Refused as refused:
                    chain.stopped = f"stopped after {v.name}: its result is used 2 times "
                    chain.stopped += f"({refused})"
                    break
                if pair is not None:
                    s, m = pair
                    try:
                        stage = self._accept(chain, _Step("op", "x * sigmoid(x)", "swish"), m,
                                             stage)  # fmt: skip
                    except _Refused as refused:
                        chain.stopped = f"stopped at {m.name} (x * sigmoid(x)): {refused}"
                        break
                    chain.nodes += [s, m]
                    chain.labels.append("x * sigmoid(x)")
                    v = m
                    continue
            if len(users) != 1:
                chain.stopped = f"stopped after {v.name}: its result is used {len(users)} times"
                break
            u = users[0]
            if u.op == "output":
                chain.stopped = "ends at the model's output"
                break
            try:
                step = self._match(u, v)
                end = self._select(u) if step.selects else u
                stage = self._accept(chain, step, end, stage)
            except _Refused as refused:
                where = u.target if u.op == "call_module" else u.name  # a path, or fx's name
                chain.stopped = f"stopped at {where} ({self._describe(u)}): {refused}"
                break
            chain.nodes += [u] if end is u else [u, end]
            chain.labels.append(step.label)
            v = end
        return chain

    def _describe(self, node: fx.Node) -> str:
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            prefix = "nn." if type(module).__module__.startswith("torch.nn") else ""
            return prefix + type(module).__name__
        if node.op in ("call_function", "call_method"):
            return _target_name(node.target)
        return node.op

    def linear_problem(self, node: fx.Node, calls: int) -> str:
        """Why this Linear call (a module's, or F.linear's) cannot be swapped ("" if it can)."""
        x = _input(node)
        if node.op == "call_function":  # F.linear: on the model's own tensors only
            args = _linear_args(node)
            for key in ("weight", "bias"):
                t = args[key]
                if t is not None and not (isinstance(t, fx.Node) and t.op == "get_attr"):
                    return (
                        f"its {key} is computed in the forward pass (F.linear is fused on "
                        "parameters, buffers and tensor attributes)"
                    )
        else:
            module = self.gm.get_submodule(node.target)
            if type(module).forward is not nn.Linear.forward:
                return f"{type(module).__name__} overrides nn.Linear.forward"
            if _has_hooks(module):
                return "the module has forward hooks"
            if calls > 1:
                return f"the module is called {calls} times in forward (each call needs its chain)"
            if node.kwargs.keys() - {"input"} or len(node.args) > 1:
                return "its input is not a tensor of the forward pass"
        if x not in self.meta:
            return "its input is not a tensor of the forward pass"
        shape = self.meta[x].shape
        if len(shape) != 2:
            return (
                f"its input is {len(shape)}-D {shape}; the fused kernel takes (batch, "
                "features) inputs"
            )
        return ""


# ---- the rewrite


def _shared_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of module: its own children dict, the same parameter and buffer dicts."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    return new


def _mirror(src: nn.Module, dst: nn.Module, paths: set[str], prefix: str = "") -> None:
    """Gives dst src's children: src's own objects, or shared copies where a path in
    ``paths`` lies below."""
    dst._modules = {}
    for name, child in src._modules.items():
        here = prefix + name
        if child is not None and any(p.startswith(here + ".") for p in paths):
            copied = _shared_copy(child)
            _mirror(child, copied, paths, here + ".")
            child = copied
        dst._modules[name] = child


def _fallback(gm: fx.GraphModule, chain: _Chain) -> fx.GraphModule:
    """The chain's own nodes as ``fallback(x, weight, bias, *operands)``."""
    graph = fx.Graph()
    x, weight, bias = (graph.placeholder(n) for n in ("x", "weight", "bias"))
    operands = {t: graph.placeholder(f"operand_{i}") for i, t in enumerate(chain.operands)}
    env = {chain.linear: graph.call_function(F.linear, (x, weight, bias))}
    for node in chain.nodes:
        env[node] = graph.node_copy(node, lambda a: env[a] if a in env else operands[a.target])
    graph.output(env[chain.end])
    modules = {n.target: gm.get_submodule(n.target) for n in chain.nodes if n.op == "call_module"}
    return fx.GraphModule(modules, graph, class_name="FusedLinearFallback")


def _owner(root: nn.Module, target: str) -> tuple[nn.Module, str]:
    prefix, _, name = target.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), name


def _verify(fused: FusedLinear, x, expected) -> str:
    """Why fused's reference does not reproduce the model's value ("" when it does)."""
    try:
        got = fused.reference(x)
        torch.testing.assert_close(got, expected, equal_nan=True)
    except Exception as exc:  # a mismatch, or the chain failing where the model did not
        return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:300]
    return ""


def optimize(
    model: nn.Module,
    example_inputs: Sequence,
    *,
    kernel: str = "auto",
    precision: str = "fp32",
    forward: types.FunctionType | None = None,
) -> tuple[nn.Module, OptimizeReport]:
    """``model`` with each Linear chain replaced by a :class:`FusedLinear`, and a report.

    Args:
        model: the module to rewrite; it is left unchanged, and shares its parameters and
            buffers with the result.
        example_inputs: the forward's positional arguments (a tuple or list), used for shapes
            and to check each chain; meta tensors give shapes only (chains go unchecked).
        kernel, precision: the FusedLinears' settings (see ``fused_linear``).
        forward: the function to trace instead of ``type(model).forward``, e.g. a parent
            class's forward (a ModelNew that overrides forward to call optimize).

    Returns:
        (an ``fx.GraphModule`` computing what model computes, an :class:`OptimizeReport`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "example_inputs must be a tuple or list of the forward's positional arguments, "
            f"got {type(example_inputs).__name__}"
        )
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if forward is not None and not isinstance(forward, types.FunctionType):
        raise TypeError(f"forward must be a Python function, got {type(forward).__name__}")

    gm = _trace(model, forward)
    graph = gm.graph
    _thread_inplace(gm)
    linears = [
        n for n in graph.nodes
        if (n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear))
        or (n.op == "call_function" and n.target is F.linear)
    ]  # fmt: skip
    keep = set()
    for node in linears:  # the inputs, and every node a chain can end at
        if isinstance(_input(node), fx.Node):
            keep.add(_input(node))
        v = node
        while v is not None:
            keep.add(v)
            v = _next_in_chain(gm, v)
    recorder = _Recorder(gm, keep)
    # The example run must leave the model as it was: a forward that writes its buffers
    # (BatchNorm's running statistics in training mode, a counter) would otherwise take the
    # step twice when the caller then runs the result. Chains never read buffers that the
    # forward writes, so restoring them right after the run changes no check below.
    buffers = {id(b): (b, b.clone()) for b in model.buffers()}
    try:
        with torch.no_grad():
            recorder.run(*example_inputs)
    except Exception as exc:
        raise ValueError(
            f"example_inputs: running the traced {type(model).__name__}.forward on them "
            f"failed ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        with torch.no_grad():
            for b, saved in buffers.values():
                if b.device.type != "meta":
                    b.copy_(saved)

    analysis = _Analysis(gm, recorder.meta)
    calls = {}
    for node in linears:
        calls[node.target] = calls.get(node.target, 0) + 1
    decisions: dict[fx.Node, LinearReport | _Chain] = {}
    for node in linears:
        problem = analysis.linear_problem(node, calls[node.target])
        if node.op == "call_module":
            name, label = node.target, node.target
        else:
            name, label = node.name, f"F.linear({_linear_args(node)['weight'].target})"
        if problem:
            decisions[node] = LinearReport(name, False, (), "", problem)
        else:
            decisions[node] = analysis.chain(node, name, label)

    # The result's module tree: the model's own, with shared copies above swapped Linears.
    attributes = {n.target: _fetch(gm, n.target) for n in graph.nodes if n.op == "get_attr"}
    chains = [c for c in decisions.values() if isinstance(c, _Chain)]
    _mirror(model, gm, {c.path for c in chains if c.linear.op == "call_module"})
    gm._parameters, gm._buffers = model._parameters, model._buffers
    gm._non_persistent_buffers_set = model._non_persistent_buffers_set
    gm.training = model.training
    for target, value in attributes.items():
        # Unregistered tensors the graph reads (attributes, traced constants) stay plain
        # attributes; fx made them buffers, which would add state_dict keys.
        if isinstance(value, torch.Tensor) and "." not in target:
            if target not in gm._parameters and target not in gm._buffers:
                gm.__dict__[target] = value

    verify = all(t.device.type != "meta" for t in recorder.values.values())
    for node, chain in list(decisions.items()):
        if not isinstance(chain, _Chain):
            continue
        if chain.linear.op == "call_module":
            target = chain.path
            parent, name = _owner(gm, target)
            linear = {"linear": parent._modules[name]}
        else:  # F.linear: a new submodule of the root, reading the tensors from their owners
            args = _linear_args(chain.linear)
            parent, target = gm, f"{chain.path}_fused"
            while hasattr(gm, target):
                target += "_"
            name = target
            linear = {
                "linear": None,
                "weight": _owner(gm, args["weight"].target),
                "bias": None if args["bias"] is None else _owner(gm, args["bias"].target),
            }
        fused = FusedLinear(
            **linear,
            ops=chain.ops,
            norm=chain.norm,
            reduce=chain.reduce,
            operands=[_owner(gm, t) for t in chain.operands],
            fallback=_fallback(gm, chain),
            labels=chain.labels,
            kernel=kernel,
            precision=precision,
        )
        mismatch = ""
        if verify:
            with torch.no_grad():
                mismatch = _verify(fused, recorder.values[chain.input], recorder.values[chain.end])
        report = LinearReport(
            chain.path,
            not mismatch,
            tuple(chain.labels),
            chain.stopped,
            f"the fused chain did not reproduce the model on example_inputs: {mismatch}"
            if mismatch else "",
            (True if verify else None) if not mismatch else False,
            "" if mismatch else target,
        )  # fmt: skip
        decisions[node] = report
        if mismatch:
            continue
        parent._modules[name] = fused
        with graph.inserting_before(node):
            call = graph.call_module(target, (_input(node),))
        chain.end.replace_all_uses_with(call)
        for n in reversed([node, *chain.nodes]):
            graph.erase_node(n)
    for n in list(graph.nodes):
        if n.op == "get_attr" and not n.users:  # operands only the chains read
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm, OptimizeReport(type(model).__name__, tuple(decisions.values()))


def _fetch(root: nn.Module, target: str):
    owner, name = _owner(root, target)
    return getattr(owner, name)
