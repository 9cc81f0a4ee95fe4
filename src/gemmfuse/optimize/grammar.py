"""The epilogue grammar as torch.fx records it: call_function targets and call_method names,
and the graph patterns (in-place ops, ``x * sigmoid(x)``) a chain follows.

A node the chain cannot take is answered with a :class:`_Refusal` value (returned where the
result would be), whose text says why; nothing here raises for it.
"""

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse.epilogue import Reduction
from gemmfuse.modules import MODULE_OPS
from gemmfuse.pointwise import POINTWISE, Spelling
from gemmfuse.pooling import ChannelPool, single


@dataclass(frozen=True)
class _Refusal:
    """A node the chain cannot take; ``why`` says why."""

    why: str

    def __str__(self) -> str:
        return self.why


def _first_refusal(values) -> "_Refusal | None":
    return next((v for v in values if isinstance(v, _Refusal)), None)


def _number(value, what: str) -> "float | _Refusal":
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _Refusal(f"{what} is {value!r}, not a number")
    if isinstance(value, int) and abs(value) > 2**53:  # float(value) would round it
        return _Refusal(f"{what} {value} has no exact float value")
    return float(value)


def _op(name: str, *args) -> "tuple[str, tuple[float, ...]] | _Refusal":
    """The IR op (name, args), or the first refusal among args."""
    return _first_refusal(args) or (name, args)


@dataclass(frozen=True)
class _Act:
    """A unary op: its parameters after the input, their defaults, and its IR form."""

    params: tuple[str, ...]
    defaults: tuple
    make: Callable[[dict], "tuple[str, tuple[float, ...]] | _Refusal"]  # bound arguments -> op


def _act(name: str, spelling: Spelling) -> _Act:
    """The matcher's form of one of pointwise.py's spellings of op ``name``: every argument a
    number (a refusal names the first that is not)."""

    def make(bound: dict):
        if spelling.make is None:
            return _op(name, *(_number(bound[p], p) for p in spelling.args))
        made = spelling.make(bound)
        if isinstance(made, str):
            return _Refusal(made)
        op, args = made
        return _op(op, *(_number(a, f"{op}'s argument") for a in args))

    return _Act(spelling.params, spelling.defaults, make)


# Unary ops by call target, from pointwise.py's rows
_ACTS = {
    target: _act(op_name, spelling)
    for op_name, op_def in POINTWISE.items()
    if not op_def.tensor_arg
    for spelling in op_def.spellings
    for target in spelling.targets
}

# Binary arithmetic: target -> (op, its parameters after the input and the other operand).
_BINARY = {
    target: (op_name, spelling.params)
    for op_name, op_def in POINTWISE.items()
    if op_def.tensor_arg
    for spelling in op_def.spellings
    for target in spelling.targets
}
# The op when the chain's value is the second operand: o + v = v + o, o - v = rsub...
_SWAPPED = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv", "rsub": "sub",
            "minimum": "minimum", "maximum": "maximum"}  # fmt: skip
# torch.min / torch.max given a tensor (not a dim): elementwise
_ELEMENTWISE_EXTREMES = {"min": "minimum", "max": "maximum"}
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
_FRESH_MODULES = {nn.Linear, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d,
                  nn.Softmax, nn.LogSoftmax, *MODULE_OPS}  # fmt: skip
# Softmax over the channels: target -> (whether a log_softmax, its parameters after the input)
_SOFTMAXES = {
    F.softmax: (False, ("dim", "_stacklevel", "dtype")),
    torch.softmax: (False, ("dim", "dtype")),
    "softmax": (False, ("dim", "dtype")),
    F.log_softmax: (True, ("dim", "_stacklevel", "dtype")),
    torch.log_softmax: (True, ("dim", "dtype")),
    "log_softmax": (True, ("dim", "dtype")),
}
_SOFTMAX_DEFAULTS = {"dim": None, "_stacklevel": 3, "dtype": None}
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


def _swish(gm: fx.GraphModule, v: fx.Node) -> "tuple[fx.Node, fx.Node] | _Refusal | None":
    """(s, m) when v's two users are ``s = sigmoid(v)`` and ``m = v * s`` (or ``s * v``), s used
    by m alone: the op ``swish``. None when v's users are not a sigmoid of v and a
    multiplication reading it; a :class:`_Refusal` when they are but the rest does not hold."""
    users = list(v.users)
    if len(users) != 2:
        return None
    pairs = [
        (s, m)
        for s, m in (users, users[::-1])
        if _is_sigmoid_of(s, v, gm)
        and m.op in ("call_function", "call_method")
        and m.target in _MULS
        and s in m.all_input_nodes
    ]
    if not pairs:
        return None
    s, m = pairs[0]
    if s.op == "call_module" and _has_hooks(gm.get_submodule(s.target)):
        return _Refusal("x * sigmoid(x): the Sigmoid module has forward hooks")
    if len(s.users) != 1:
        return _Refusal(f"x * sigmoid(x): the sigmoid's result is used {len(s.users)} times")
    if m.kwargs or len(m.args) != 2 or set(m.args) != {v, s}:
        return _Refusal(f"x * sigmoid(x): {m.name} does not multiply x by its sigmoid alone")
    if m.args[0] is v and _is_inplace(m, gm):
        return _Refusal(
            f"x * sigmoid(x): {m.name} multiplies in place into x (swish is out of place)"
        )
    return s, m


def _next_in_chain(gm: fx.GraphModule, v: fx.Node, order) -> "fx.Node | None":
    """The node a chain at v may extend to, by the graph's shape alone: v's first user in the
    graph (``order``: a node's position) apart from detach/clone copies of v, as the analysis
    takes it (the multiplication of a swish is reached through its sigmoid); None where a
    chain must stop."""
    users = [u for u in v.users if _alias_of(u, v) is None]
    if not users:
        return None
    first = min(users, key=order)
    return None if first.op == "output" else first


def _alias_of(node: fx.Node, v: fx.Node) -> "bool | None":
    """For ``v.detach()`` / ``v.clone()`` (and torch.detach/torch.clone) of v: whether it drops
    v's gradient (detach) or keeps it (clone); None for any other node."""
    if node.args[:1] != (v,) or len(node.args) != 1 or node.kwargs:
        return None
    if node.op == "call_method" and node.target in ("detach", "clone"):
        return node.target == "detach"
    if node.op == "call_function" and node.target in (torch.detach, torch.clone):
        return node.target is torch.detach
    return None


_UNSQUEEZES = (torch.unsqueeze, "unsqueeze")
_SQUEEZES = (torch.squeeze, "squeeze")
_AVG_POOLS = (F.avg_pool1d, torch.avg_pool1d)
_MAX_POOLS = (F.max_pool1d, torch.max_pool1d, F.max_pool1d_with_indices, F.lp_pool1d)
_POOL_PARAMS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
_MAX_POOL_PARAMS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_NOT_A_DIM_OP = object()


def _dim_of(node: fx.Node, v: fx.Node, targets) -> object:
    """The ``dim`` of ``node`` when it is ``torch.unsqueeze(v, dim)`` / ``v.unsqueeze(dim)`` (or
    squeeze, by ``targets``); None for a squeeze without one; ``_NOT_A_DIM_OP`` for other nodes."""
    if node.op not in ("call_function", "call_method") or node.target not in targets:
        return _NOT_A_DIM_OP
    args = dict(zip(("input", "dim"), node.args, strict=False)) | node.kwargs
    if args.get("input") is not v or args.keys() - {"input", "dim"}:
        return _NOT_A_DIM_OP
    return args.get("dim")


def _sole_user(node: fx.Node) -> "fx.Node | None":
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _pooling(gm: fx.GraphModule, linear: fx.Node):
    """A pooling over the channels right after ``linear``: ``([unsqueeze, pool, squeeze] nodes,
    ChannelPool or MaxPool, (kernel_size, stride, padding, ceil_mode))`` where the Linear's one
    user is ``unsqueeze(1)``, its one user an average or max pooling (``nn.AvgPool1d``,
    ``F.avg_pool1d``, ``nn.MaxPool1d``, ``F.max_pool1d``), and that one's a ``squeeze(1)``. None
    where the Linear's one user is no ``unsqueeze(1)``; a :class:`_Refusal` where the rest does
    not hold."""
    u = _sole_user(linear)
    if u is None or _dim_of(u, linear, _UNSQUEEZES) not in (1, -2):
        return None
    pool = _sole_user(u)
    if pool is None:
        return _Refusal(f"stopped at {u.name}: x.unsqueeze(1) is used {len(u.users)} times")
    found = _channel_pool(gm, pool, u)
    if isinstance(found, _Refusal):
        return _Refusal(f"stopped at {pool.name} (channel pooling): {found}")
    squeeze = _sole_user(pool)
    dim = _NOT_A_DIM_OP if squeeze is None else _dim_of(squeeze, pool, _SQUEEZES)
    if dim not in (1, -2):
        where = f"{squeeze.name}: squeeze({'' if dim is None else dim})" if squeeze else pool.name
        return _Refusal(
            f"stopped at {where}: the pooled channels are not taken back by one squeeze(1) "
            "(squeeze() without a dim would also drop a batch of one row)"
        )
    return [u, pool, squeeze], *found


class MaxPool(NamedTuple):
    """A max pooling over the channels: the chain's reduction takes its windows' maxima
    (``Reduction.pool``); an ``nn.MaxPool1d`` is read again at each call
    (``FusedLinear(max_pool=)``), ``F.max_pool1d``'s settings are constants."""

    kernel_size: int
    module: nn.MaxPool1d | None = None
    dilation: object = 1
    return_indices: bool = False


def _channel_pool(gm: fx.GraphModule, node: fx.Node, v: fx.Node):
    """(ChannelPool or MaxPool, settings) when ``node`` is an average or max pooling of ``v``
    (as :func:`_pooling` returns them), else a :class:`_Refusal`."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) not in (nn.AvgPool1d, nn.MaxPool1d):
            return _Refusal(f"nn.{type(module).__name__} is not in the grammar (nn.AvgPool1d "
                            "and nn.MaxPool1d are)")  # fmt: skip
        if node.args != (v,) or node.kwargs or _has_hooks(module):
            return _Refusal(f"the {type(module).__name__} takes more than the chain's value, or "
                            "has hooks")  # fmt: skip
        settings = (module.kernel_size, module.stride, module.padding, module.ceil_mode)
        settings = tuple(single(a) for a in settings)
        if type(module) is nn.AvgPool1d:
            return ChannelPool(module=module), settings
        return MaxPool(settings[0], module, module.dilation, module.return_indices), settings
    is_max = node.op == "call_function" and node.target in _MAX_POOLS
    if node.op != "call_function" or node.target not in (*_AVG_POOLS, *_MAX_POOLS):
        return _Refusal("not an average or max pooling of x.unsqueeze(1)")
    if _input(node) is not v:
        return _Refusal("not an average or max pooling of x.unsqueeze(1)")
    if node.target is F.lp_pool1d:
        return _Refusal("an lp_pool1d is not in the grammar (avg_pool1d and max_pool1d are)")
    names = _MAX_POOL_PARAMS if is_max else _POOL_PARAMS
    bound = dict(zip(("input", *names), node.args, strict=False)) | node.kwargs
    if bound.keys() - {"input", *names}:
        return _Refusal(f"arguments beyond {_target_name(node.target)}'s")
    if any(isinstance(a, fx.Node) for k, a in bound.items() if k != "input"):
        return _Refusal("its settings are computed in the forward")
    k = single(bound.get("kernel_size"))
    settings = (k, single(bound.get("stride")), single(bound.get("padding", 0)),
                bound.get("ceil_mode", False))  # fmt: skip
    if not is_max:
        return ChannelPool(kernel_size=k), settings
    indices = node.target is F.max_pool1d_with_indices or bound.get("return_indices", False)
    return MaxPool(k, None, single(bound.get("dilation", 1)), bool(indices)), settings


def _input(node: fx.Node):
    return node.args[0] if node.args else node.kwargs.get("input")


def _linear_input(node: fx.Node, gm: fx.GraphModule):
    """A Linear call's input (addmm's is its second argument)."""
    spelled = _spelled_linear(node, gm)
    return _input(node) if spelled is None else spelled["input"]


def _linear_args(node: fx.Node, gm: fx.GraphModule) -> dict:
    """A functional Linear call's arguments by name (input, weight, bias): F.linear's, or another
    spelling's (``x @ W.T``, ``torch.addmm(b, x, W.T)``: W's and b's get_attr nodes)."""
    spelled = _spelled_linear(node, gm)
    if spelled is not None:
        return spelled
    bound = dict(zip(("input", "weight", "bias"), node.args, strict=False))
    return {"bias": None, **bound, **node.kwargs}


_MATMULS = (torch.matmul, operator.matmul, torch.mm)
_MATMUL_METHODS = ("matmul", "mm")


def _spelled_linear(node: fx.Node, gm: fx.GraphModule) -> "dict | None":
    """{input, weight, bias} when ``node`` is a Linear spelled as a product by a 2-D attribute W
    transposed: ``x @ W.T``, ``torch.matmul(x, W.t())``, ``x.mm(W.transpose(0, 1))``, ... (no
    bias; a following ``+ b`` is a chain op), or ``torch.addmm(b, x, W.T)`` with b a 1-D
    attribute (beta and alpha 1). None for anything else."""
    if node.kwargs:
        return None
    if len(node.args) == 2 and (
        (node.op == "call_function" and node.target in _MATMULS)
        or (node.op == "call_method" and node.target in _MATMUL_METHODS)
    ):
        w = _transposed_attribute(node.args[1], gm)
        return None if w is None else {"input": node.args[0], "weight": w, "bias": None}
    if node.op == "call_function" and node.target is torch.addmm and len(node.args) == 3:
        b, x, wt = node.args
        w = _transposed_attribute(wt, gm)
        if w is None or not (isinstance(b, fx.Node) and b.op == "get_attr"):
            return None
        bias, n = _attribute(gm, b.target), _attribute(gm, w.target).shape[0]
        if not (isinstance(bias, torch.Tensor) and tuple(bias.shape) == (n,)):
            return None
        return {"input": x, "weight": w, "bias": b}
    return None


def _owner(root: nn.Module, target: str) -> tuple[nn.Module, str]:
    prefix, _, name = target.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), name


def _attribute(root: nn.Module, target: str):
    """The attribute a get_attr ``target`` names (None where there is none)."""
    return getattr(*_owner(root, target), None)


def _transposed_attribute(node, gm: fx.GraphModule) -> "fx.Node | None":
    """W when ``node`` is a 2-D tensor attribute W transposed (W.T, W.mT, W.t(), torch.t(W),
    W.transpose(0, 1) in any order or sign of the dims, W.permute(1, 0)); else None."""
    if not isinstance(node, fx.Node) or node.kwargs or not node.args:
        return None
    w, rest = node.args[0], tuple(node.args[1:])
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return None
    value = _attribute(gm, w.target)
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    swaps = len(rest) == 2 and all(isinstance(d, int) for d in rest)
    swaps = swaps and sorted(d % 2 for d in rest) == [0, 1]
    if node.op == "call_function":
        transposed = (
            (node.target is getattr and rest in (("T",), ("mT",)))
            or (node.target is torch.t and not rest)
            or (node.target is torch.transpose and swaps)
            or (node.target is torch.permute and rest == ((1, 0),))
        )
    else:
        transposed = node.op == "call_method" and (
            (node.target == "t" and not rest)
            or (node.target == "transpose" and swaps)
            or (node.target == "permute" and rest in ((1, 0), ((1, 0),)))
        )
    return w if transposed else None


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


@dataclass
class _Step:
    """One recognised node: a pointwise op, a GroupNorm, LayerNorm, RMSNorm or softmax over
    the channels, or a reduction."""

    kind: str  # "op", "norm", "reduce" or "affine" (per-channel ops from a module: BatchNorm1d)
    label: str
    name: str = ""  # op: IR name; norm: "group_norm", "layer_norm", "rms_norm", "softmax"...
    args: tuple = ()  # op: floats and get_attr nodes; norm (functional): G, eps, weight, bias
    module: nn.Module | None = None
    inplace: bool = False
    reduction: Reduction | None = None
    selects: bool = False  # torch.min/max(dim): the values come from [0] or .values


def _op_label(name: str, args: tuple) -> str:
    shown = [
        a if isinstance(a, str)  # a name given by the caller
        else a.target if isinstance(a, fx.Node) and a.op == "get_attr"
        else f"input {a.name}" if isinstance(a, fx.Node) and a.op == "placeholder"
        else a.name if isinstance(a, fx.Node)  # computed in the forward
        else repr(a)
        for a in args
    ]  # fmt: skip
    if name == "add_self":
        return "x + x"
    if name in _SYMBOL:
        return f"x {_SYMBOL[name]} {shown[0]}"
    if name in ("rsub", "rdiv"):
        return f"{shown[0]} {_SYMBOL[name[1:]]} x"
    if name in ("minimum", "maximum"):
        return f"{name}(x, {shown[0]})"
    return f"{name}({', '.join(shown)})" if shown else name
