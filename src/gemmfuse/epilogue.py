"""What runs after the GEMM, described once.

An :class:`Epilogue` is the chain applied to ``y = x @ W.T + b`` of shape (M, N)::

    pre ops -> GroupNorm (optional) -> post ops -> reduction over channels (optional) -> tail ops

Each pointwise op is one row of ``POINTWISE`` (pointwise.py) with all its meanings: the
PyTorch function (reference.py evaluates chains with it), the CUDA expression (``cuda_epilogue``
turns a chain into the ``GeneratedEpilogueFor`` struct template the kernels are compiled with)
and the ways models write it. An op's arguments are
Python floats (a LeakyReLU slope, a multiplier) or :class:`Param` references to tensors passed
with the call (``fused_linear(..., params=...)``). Both are run-time kernel arguments, so one
compiled kernel serves every value of a chain: the build cache is keyed by
``Epilogue.structure``, which zeroes the floats. A binary op's argument may also be a
:class:`Value`, an earlier value of the same stretch of the chain (``x * sigmoid(x)`` written
as ``sigmoid`` then ``mul`` by the stretch's input): the chain is then a graph whose values
the kernels keep in registers, and the structure keeps the references.

In ``pre`` and ``post`` a tensor operand is per channel (it broadcasts against (M, N) along the
channels only: shape (), (1,), (N,), (1, N); the kernel reads it at the output column) or per
element (shape (M, N) itself, say a residual ``fc2(h) + x``; the kernel reads it at the output's
row and column). Which one is a run-time matter: the kernel reads ``vec[row * stride + col]``
with a row stride of 0 or N, so one compiled chain serves both.
``tail`` ops act on the reduction's (M,) or (M, 1) result with PyTorch's own broadcasting, any
shape allowed (for instance #75's (M, 1) + (1, C, 1, 1) -> (1, C, M, 1)); they run after the
kernel, in PyTorch, but for an outer broadcast like #75's, which has a kernel (tail.py).

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

import dataclasses
import functools
import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gemmfuse.pointwise import POINTWISE, ROUND

MAX_SCALARS = 8  # kMaxParams in csrc/abi/fused_args.h: float arguments per chain
MAX_TENSORS = 8  # kMaxParams: per-channel tensor arguments per chain (pre and post)


@dataclass(frozen=True)
class Param:
    """A tensor argument of an op: ``params[index]`` of the call."""

    index: int

    def __post_init__(self):
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ValueError(f"Param index must be an int >= 0, got {self.index!r}")


@dataclass(frozen=True)
class Value:
    """An earlier value of the same stretch of the chain as an op's tensor argument.

    The stretches are ``pre`` (value 0 the GEMM result), ``post`` (value 0 the normalised
    result) and ``tail`` (value 0 the reduction's result); value ``i`` is the result of the
    stretch's ``i``-th op, so an op at position ``k`` (from 1) may read values 0 to ``k - 1``.
    ``detach``: the value enters without its gradient (a model's ``.detach()``).
    """

    index: int
    detach: bool = False

    def __post_init__(self):
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ValueError(f"Value index must be an int >= 0, got {self.index!r}")
        if not isinstance(self.detach, bool):
            raise ValueError(f"Value detach must be a bool, got {self.detach!r}")


def per_channel(shape: tuple[int, ...], n: int) -> bool:
    """Whether a tensor argument of this shape is one the kernels read per channel: it
    broadcasts against (M, n) along the channels only, (), (1,), (n,) or (1, n)."""
    return len(shape) <= 2 and math.prod(shape) in (1, n) and shape[:-1] in ((), (1,))


def per_element(shape: tuple[int, ...], m: int, n: int) -> bool:
    """Whether a tensor argument of this shape is one the kernels read at each (row, column):
    the chain's full (m, n) shape itself, an operand computed elsewhere (a residual). With one
    row it is per channel (:func:`per_channel`)."""
    return tuple(shape) == (m, n) and m > 1


def keeps_shape(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts against ``target`` leaving it ``target`` (what a
    pre or post op's tensor argument must do: those ops keep the GEMM's (M, N))."""
    return len(shape) <= len(target) and all(
        a in (1, b) for a, b in zip(reversed(shape), reversed(target), strict=False)
    )


# kReduce codes in csrc/epilogue/tile_epilogue.cuh, and the PyTorch meaning of each (dim=1).
REDUCTIONS = {"min": 1, "max": 2, "sum": 3, "mean": 4, "logsumexp": 5}
REDUCTION_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "min": torch.amin,
    "max": torch.amax,
    "sum": torch.sum,
    "mean": torch.mean,
    "logsumexp": torch.logsumexp,
}


# A problem with arguments or a description: the exception it raises, and its message (here,
# and validation.py's for a call's tensors).
Problem = tuple[type[Exception], str]


def raise_problem(problem: "Problem | None") -> None:
    """Raises the problem's exception (nothing for None)."""
    if problem is not None:
        kind, message = problem
        raise kind(message)


def _op_problem(name, args) -> "Problem | None":
    """The first problem with a :class:`Pointwise`'s name and arguments (a tuple), or None."""
    if not isinstance(name, str) or name not in POINTWISE:
        return ValueError, f"unknown pointwise op {name!r}; expected one of {sorted(POINTWISE)}"
    if not isinstance(args, tuple):
        return TypeError, f"pointwise op {name!r}: args must be a tuple, got {type(args).__name__}"
    d = POINTWISE[name]
    if len(args) != d.n_args:
        return ValueError, f"pointwise op {name!r} takes {d.n_args} argument(s), got {args!r}"
    for a in args:
        if isinstance(a, (Param, Value)):
            if not d.tensor_arg:
                return ValueError, f"pointwise op {name!r} takes float arguments only"
        elif not isinstance(a, (int, float)) or isinstance(a, bool):
            return ValueError, (
                f"pointwise op {name!r}: arguments must be floats, Param or Value, got {a!r}"
            )
    if name == "hardtanh" and not any(isinstance(a, (Param, Value)) for a in args):
        if args[0] > args[1]:  # as F.hardtanh refuses them
            return ValueError, "hardtanh: min_val cannot be greater than max_val"
    return None


def _groups_eps_problem(groups, eps) -> "Problem | None":
    """The first problem with a :class:`GroupNormSpec`'s group count and eps, or None."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        return ValueError, f"num_groups must be a positive int, got {groups!r}"
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        return TypeError, f"eps must be a real number, got {type(eps).__name__}"
    if not eps >= 0:
        return ValueError, f"eps must be >= 0, got {eps!r}"
    return None


@dataclass(frozen=True)
class Pointwise:
    """One pointwise op of ``POINTWISE`` with its arguments (floats, :class:`Param` or
    :class:`Value`)."""

    name: str
    args: tuple[float | Param | Value, ...] = ()

    def __post_init__(self):
        if isinstance(self.args, list):  # as a list is written; kept as a tuple (hashable)
            object.__setattr__(self, "args", tuple(self.args))
        raise_problem(_op_problem(self.name, self.args))

    @property
    def scalars(self) -> tuple[float, ...]:
        """The numbers the kernels read for the float arguments (PointwiseDef.scalar_value)."""
        value = POINTWISE[self.name].scalar_value or float
        return tuple(value(float(a)) for a in self.args if not isinstance(a, (Param, Value)))

    @property
    def params(self) -> tuple[int, ...]:
        return tuple(a.index for a in self.args if isinstance(a, Param))


@dataclass(frozen=True)
class GroupNormSpec:
    """The chain's normalisation over channel groups of each row (PyTorch's ``F.group_norm``),
    with per-channel affine vectors when ``affine``.

    ``layer=True`` is a LayerNorm over the channels (``F.layer_norm`` of the last dimension):
    one group, the same statistics and affine, so the kernels run it as ``num_groups=1``; the
    reference evaluates ``F.layer_norm``, and a 3-D input keeps the meaning with its rows
    flattened (a GroupNorm's dim 1 would not).

    ``rms=True`` (with ``layer=True``) is an RMSNorm over the channels (``F.rms_norm`` of the
    last dimension): each row divided by its root mean square, ``sqrt(mean(u**2) + eps)``, with
    no mean subtracted; the affine vectors as for a LayerNorm (an ``nn.RMSNorm`` has a weight
    alone: give it a zero bias). ``eps`` is a number here; PyTorch's ``eps=None`` (the machine
    epsilon of the dtype F.rms_norm computes in: float64's for float64 inputs, float32's for
    the rest) is resolved by the caller.

    ``softmax=True`` (with ``layer=True``, ``affine=False``) is a softmax over the channels
    (``F.softmax`` of the last dimension): ``exp(u - max) / sum(exp(u - max))`` per row, with
    ``log=True`` a log_softmax, ``(u - max) - log(sum(exp(u - max)))``, each as PyTorch's CUDA
    kernels compute them. The row's statistics are its largest value and that sum, gathered
    per tile and merged as a wide GroupNorm's moments are; ``eps`` is not read.
    """

    num_groups: int
    eps: float = 1e-5
    affine: bool = True
    layer: bool = False
    rms: bool = False
    softmax: bool = False
    log: bool = False

    def __post_init__(self):
        raise_problem(_groups_eps_problem(self.num_groups, self.eps))
        for flag in ("affine", "layer", "rms", "softmax", "log"):
            object.__setattr__(self, flag, _flag("GroupNormSpec", flag, getattr(self, flag)))
        if self.layer and self.num_groups != 1:
            raise ValueError(f"a LayerNorm (layer=True) is one group, got {self.num_groups}")
        if self.rms and not self.layer:
            raise ValueError("an RMSNorm (rms=True) normalises rows: it needs layer=True")
        if self.log and not self.softmax:
            raise ValueError("log=True (a log_softmax) goes with softmax=True")
        if self.softmax and (not self.layer or self.affine or self.rms):
            raise ValueError(
                "a softmax over the channels (softmax=True) is a row op without affine "
                "vectors: it needs layer=True, affine=False and rms=False"
            )


@dataclass(frozen=True)
class Reduction:
    """A reduction over the channel dimension (dim 1) of the (M, N) result.

    ``pool`` > 1: the reduction takes the maxima of windows of ``pool`` consecutive channels
    instead of the channels themselves, as a model writes a max pooling over the channels right
    before it (``F.max_pool1d(x.unsqueeze(1), pool).squeeze(1)``: a window's stride its size,
    no padding, a partial last window dropped; a mean divides by the N // pool windows). A power
    of two up to 128, so that no window straddles two of the kernels' 128-column tiles, and in
    chains without a norm (the kernels pool where they reduce a row's values themselves).
    """

    op: str
    keepdim: bool = False
    pool: int = 1

    def __post_init__(self):
        if not isinstance(self.op, str) or self.op not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.op!r}; expected one of {sorted(REDUCTIONS)}")
        object.__setattr__(self, "keepdim", _flag("Reduction", "keepdim", self.keepdim))
        problem = max_pool_problem(self.pool)
        if problem:
            raise ValueError(problem)


MAX_POOL = 128  # kTile in csrc/abi/fused_args.h: a max-pooling window stays within one tile


def max_pool_problem(pool) -> str:
    """Why ``pool`` is not a :class:`Reduction`'s max-pooling window ("" where it is)."""
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1:
        return f"a reduction's pool must be an int >= 1, got {pool!r}"
    if pool > MAX_POOL or pool & (pool - 1):
        return (
            f"a reduction's max-pooling window must be a power of two up to {MAX_POOL} (no "
            f"window then straddles two of the kernels' {MAX_POOL}-channel tiles), got {pool}"
        )
    return ""


_POOL_WITH_NORM = "a max pooling before the reduction (Reduction.pool > 1) is fused without a norm"


def _is_flag(value) -> bool:
    """Whether a spec's on/off setting is a bool or equals one (1, numpy's bools), not a string
    such as "no" (which would read as on), None or a tensor."""
    if value is True or value is False:
        return True
    return not isinstance(value, (str, bytes, torch.Tensor)) and value in (True, False)


def _flag(owner: str, name: str, value) -> bool:
    """A spec's on/off setting as a bool, or TypeError naming it (:func:`_is_flag`)."""
    if not _is_flag(value):
        raise TypeError(f"{owner} {name} must be a bool, got {value!r}")
    return bool(value)


def _ops_of(stretch: str, ops) -> tuple:
    """An Epilogue's ``pre``/``post``/``tail`` as a tuple of Pointwise (a list is taken as
    written), or TypeError naming the stretch."""
    if isinstance(ops, list):
        ops = tuple(ops)
    if not isinstance(ops, tuple):
        raise TypeError(
            f"Epilogue {stretch} must be a tuple of Pointwise ops, got {type(ops).__name__}"
        )
    for op in ops:
        if not isinstance(op, Pointwise):
            raise TypeError(f"Epilogue {stretch} holds Pointwise ops, got {op!r}")
    return ops


@dataclass(frozen=True)
class Epilogue:
    pre: tuple[Pointwise, ...] = ()
    norm: GroupNormSpec | None = None
    post: tuple[Pointwise, ...] = ()
    reduce: Reduction | None = None
    tail: tuple[Pointwise, ...] = ()

    def __post_init__(self):
        for stretch in ("pre", "post", "tail"):
            object.__setattr__(self, stretch, _ops_of(stretch, getattr(self, stretch)))
        if self.norm is not None and not isinstance(self.norm, GroupNormSpec):
            raise TypeError(f"Epilogue norm must be a GroupNormSpec or None, got {self.norm!r}")
        if self.reduce is not None and not isinstance(self.reduce, Reduction):
            raise TypeError(f"Epilogue reduce must be a Reduction or None, got {self.reduce!r}")
        if self.norm is None and self.post:
            raise ValueError("post ops need a GroupNorm; put ops without one in `pre`")
        if self.reduce is None and self.tail:
            raise ValueError("tail ops need a reduction; put ops without one in `pre`/`post`")
        if self.norm is not None and self.reduce is not None and self.reduce.pool > 1:
            raise ValueError(_POOL_WITH_NORM)
        # Plain attributes set once, not cached_property: torch.compile traces a chain built
        # inside forward (a ModelNew's), and cannot trace a cached_property's lock (Python 3.11).
        for stretch, ops in (("pre", self.pre), ("post", self.post), ("tail", self.tail)):
            problem = _values_problem(stretch, ops)
            if problem:
                raise ValueError(problem)
        chain = self.pre + self.post
        object.__setattr__(self, "_scalars", tuple(s for op in chain for s in op.scalars))
        object.__setattr__(self, "_channel_params", tuple(i for op in chain for i in op.params))
        object.__setattr__(self, "_tail_params", tuple(i for op in self.tail for i in op.params))
        if len(self.scalars) > MAX_SCALARS:
            raise ValueError(
                f"an epilogue takes at most {MAX_SCALARS} float arguments before its "
                f"reduction, got {len(self.scalars)}"
            )
        if len(self.channel_params) > MAX_TENSORS:
            raise ValueError(
                f"an epilogue takes at most {MAX_TENSORS} tensor arguments before its "
                f"reduction, got {len(self.channel_params)}"
            )

    @property
    def scalars(self) -> tuple[float, ...]:
        """The kernel's float arguments, in the order the generated code reads them."""
        return self._scalars

    @property
    def channel_params(self) -> tuple[int, ...]:
        """The ``params`` indices the kernel reads (per channel or per element: epilogue.py's
        module docstring), in generated-code order."""
        return self._channel_params

    @property
    def tail_params(self) -> tuple[int, ...]:
        return self._tail_params

    @functools.cached_property
    def untailed(self) -> "Epilogue":
        """This chain without its tail ops (what the fused kernels compute): ``self`` where
        there are none. Made once per chain object: a backward reads it on every call."""
        return dataclasses.replace(self, tail=()) if self.tail else self

    @functools.cached_property
    def structure(self) -> "Epilogue":
        """This chain with every run-time value zeroed: what a compiled kernel depends on.

        Tail ops run outside the chain's kernels (tail.py) and the kernel reads tensor arguments
        in order whatever their index, so the structure leaves both out.
        """

        def strip(ops):
            return tuple(
                Pointwise(
                    op.name,
                    tuple(
                        a if isinstance(a, Value) else Param(0) if isinstance(a, Param) else 0.0
                        for a in op.args
                    ),
                )
                for op in ops
            )

        norm = self.norm
        if norm is not None:  # a LayerNorm is a one-group GroupNorm to the kernels
            row_op = norm.rms or norm.softmax
            norm = GroupNormSpec(1, 0.0, norm.affine, row_op, norm.rms, norm.softmax, norm.log)
        reduce = None if self.reduce is None else Reduction(self.reduce.op, pool=self.reduce.pool)
        return Epilogue(strip(self.pre), norm, strip(self.post), reduce)


@functools.lru_cache(maxsize=256)
def split_epilogue(epilogue: Epilogue, at: int) -> tuple[Epilogue, Epilogue]:
    """(head, rest): the chain up to its ``at``-th op of ``pre + post`` (from 0), and from there
    on, so that ``rest`` applied to ``head``'s (M, N) result is ``epilogue``. ``rest``'s ops
    read their stretch's values counted from its new start; a value from before ``at`` is
    refused (ValueError). Cached: a module splits its chain on every call."""
    pre, post = epilogue.pre, epilogue.post
    if not 0 <= at <= len(pre) + len(post):
        raise ValueError(f"at must be in [0, {len(pre) + len(post)}], got {at}")
    if at <= len(pre):
        head = Epilogue(pre=pre[:at])
        rest = dataclasses.replace(epilogue, pre=_rebased(pre[at:], at))
    else:
        at -= len(pre)
        head = Epilogue(pre=pre, norm=epilogue.norm, post=post[:at])
        rest = Epilogue(pre=_rebased(post[at:], at), reduce=epilogue.reduce, tail=epilogue.tail)
    return head, rest


def _rebased(ops: tuple[Pointwise, ...], start: int) -> tuple[Pointwise, ...]:
    """``ops`` with each :class:`Value` index moved back by ``start`` (the stretch's values
    before ``start`` are gone)."""

    def moved(a):
        if not isinstance(a, Value):
            return a
        if a.index < start:
            raise ValueError(f"an op after the split reads value {a.index}, from before it")
        return Value(a.index - start, a.detach)

    return tuple(Pointwise(op.name, tuple(moved(a) for a in op.args)) for op in ops)


# Dynamo traces guard_scalar from torch 2.8 on (before, a skipped function: a graph break, which
# fullgraph refuses); dynamic=True's symbolic settings are not taken there.
_DYNAMO_TRACES_GUARD_SCALAR = torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)


def traced_constant(a):
    """A number as the constant it is: while torch.compile traces with ``dynamic=True``, Dynamo
    makes a number read from an object's attribute (a GroupNorm's eps and num_groups, a
    LeakyReLU's slope, an Epilogue's fields) symbolic, which the chain's spec, text, and the
    functions that hold it as a constant cannot take; the graph then guards on its value.
    Elsewhere, and with torch before 2.8, ``a`` itself (symbolic_shapes is imported only
    while tracing)."""
    if not torch.compiler.is_compiling() or not _DYNAMO_TRACES_GUARD_SCALAR:
        return a
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    return guard_scalar(a)


def _number_spec(a) -> str:
    """A float argument as JSON (Python's json spelling of inf and NaN)."""
    a = traced_constant(a)
    if a != a:
        return "NaN"
    if a in (math.inf, -math.inf):
        return "Infinity" if a > 0 else "-Infinity"
    return repr(float(a))


def _arg_spec(a) -> str:
    if isinstance(a, Param):
        return f'{{"param": {a.index}}}'
    if isinstance(a, Value):
        return f'{{"value": {a.index}, "detach": {"true" if a.detach else "false"}}}'
    return _number_spec(a)


def _ops_spec(ops: tuple[Pointwise, ...]) -> str:
    return "[" + ", ".join(
        f'["{op.name}", [' + ", ".join(_arg_spec(a) for a in op.args) + "]]" for op in ops
    ) + "]"  # fmt: skip


def epilogue_spec(epilogue: "Epilogue", tail: bool = True) -> str:
    """The chain as a string (JSON; floats exactly, inf and NaN included; the tail ops left out
    when ``tail`` is False): how the ``torch.library`` ops (library.py) take it, a constant that a
    torch.compile graph or a torch.export program can hold. :func:`epilogue_from_spec` reads it
    back. Plain string building, which torch.compile traces into a constant (json.dumps, a C
    function, it cannot), for a chain built inside the traced forward too."""
    norm, reduce = epilogue.norm, epilogue.reduce
    norm_spec = "null"
    if norm is not None:
        flags = (norm.affine, norm.layer, norm.rms, norm.softmax, norm.log)
        flags = ", ".join("true" if f else "false" for f in flags)
        norm_spec = f"[{traced_constant(norm.num_groups)}, {_number_spec(norm.eps)}, {flags}]"
    reduce_spec = "null"
    if reduce is not None:
        keepdim, pool = "true" if reduce.keepdim else "false", traced_constant(reduce.pool)
        reduce_spec = f'["{reduce.op}", {keepdim}, {pool}]'
    return (
        f'{{"pre": {_ops_spec(epilogue.pre)}, "norm": {norm_spec}, '
        f'"post": {_ops_spec(epilogue.post)}, "reduce": {reduce_spec}, '
        f'"tail": {_ops_spec(epilogue.tail if tail else ())}}}'
    )


def _arg_from_spec(a):
    if isinstance(a, dict) and "value" in a:
        return Value(a["value"], a["detach"])
    return Param(a["param"]) if isinstance(a, dict) else a


def _ops_from_spec(spec: list) -> tuple[Pointwise, ...]:
    return tuple(Pointwise(name, tuple(_arg_from_spec(a) for a in args)) for name, args in spec)


@functools.cache
def epilogue_from_spec(spec: str) -> Epilogue:
    """The :class:`Epilogue` that :func:`epilogue_spec` wrote (its checks run again)."""
    d = json.loads(spec)
    return Epilogue(
        pre=_ops_from_spec(d["pre"]),
        norm=None if d["norm"] is None else GroupNormSpec(*d["norm"]),
        post=_ops_from_spec(d["post"]),
        reduce=None if d["reduce"] is None else Reduction(*d["reduce"]),
        tail=_ops_from_spec(d["tail"]),
    )


def epilogue_problem(pre=(), norm=None, post=(), reduce=None, tail=()) -> str:
    """Why ``Epilogue`` built from these parts would raise ("" when it would not),
    checked without raising: ``pre``/``post``/``tail`` hold ``(name, args)`` of each
    :class:`Pointwise`, ``norm`` is None or ``(num_groups, eps, affine)`` of a
    :class:`GroupNormSpec`, ``reduce`` None or a :class:`Reduction`. The same rules as the
    classes' own checks."""
    pre, post, tail = ([(n, tuple(a) if isinstance(a, list) else a) for n, a in ops]
                       for ops in (pre, post, tail))  # fmt: skip
    for name, args in (*pre, *post, *tail):
        problem = _op_problem(name, args)
        if problem:
            return problem[1]
    for stretch, ops in (("pre", pre), ("post", post), ("tail", tail)):
        problem = _values_problem(stretch, [Pointwise(name, args) for name, args in ops])
        if problem:
            return problem
    if norm is not None:
        problem = _groups_eps_problem(norm[0], norm[1])
        if problem:
            return problem[1]
        if len(norm) > 2 and not _is_flag(norm[2]):
            return f"GroupNormSpec affine must be a bool, got {norm[2]!r}"
    if norm is None and post:
        return "post ops need a GroupNorm"
    if reduce is None and tail:
        return "tail ops need a reduction"
    if norm is not None and reduce is not None and reduce.pool > 1:
        return _POOL_WITH_NORM
    args = [a for _, op_args in (*pre, *post) for a in op_args if not isinstance(a, Value)]
    if sum(not isinstance(a, Param) for a in args) > MAX_SCALARS:
        return f"an epilogue takes at most {MAX_SCALARS} float arguments before its reduction"
    if sum(isinstance(a, Param) for a in args) > MAX_TENSORS:
        return f"an epilogue takes at most {MAX_TENSORS} tensor arguments before its reduction"
    return ""


def _values_problem(stretch: str, ops) -> str:
    """Why a stretch's :class:`Value` arguments are out of range ("" when none is): the op at
    position k (from 1) reads values 0 to k - 1."""
    for k, op in enumerate(ops, start=1):
        for a in op.args:
            if isinstance(a, Value) and a.index >= k:
                return (
                    f"{stretch} op {k} ({op.name}) reads Value({a.index}); an op at position {k} "
                    f"reads values 0 to {k - 1} of its stretch"
                )
    return ""


@dataclass
class _CodeCursor:
    """Where the next op's arguments are in ``EpilogueParams``: generated code reads floats
    and tensors by position, pre ops first, then post ops."""

    scalar: int = 0
    vec: int = 0


def _op_code(op: Pointwise, at: _CodeCursor) -> tuple[str, str, str, int | None]:
    """(forward, gradient, argument-gradient templates, the tensor argument's vec index) of one
    op, its arguments bound to where the kernel reads them; the cursor moves past them. A
    :class:`Value` argument reads the register ``v<index>`` of the stretch's values."""
    d = POINTWISE[op.name]
    names, fwd, grad, vec = {}, d.cuda, d.grad, None
    for i, a in enumerate(op.args):
        if isinstance(a, Value):
            names[f"a{i}"] = f"v{a.index}"
        elif isinstance(a, Param):
            names[f"a{i}"] = f"__ldg(p.vec[{at.vec}] + row * p.vec_row_stride[{at.vec}] + col)"
            vec = at.vec
            at.vec += 1
        else:
            names[f"a{i}"] = f"p.scalar[{at.scalar}]"
            at.scalar += 1
            fwd, grad = d.cuda_scalar or fwd, d.grad_scalar or grad
    bind = {"g": "d", "x": "x", "y": "y", **names}
    return fwd.format(v="{v}", **names), grad.format(**bind), d.grad_arg.format(**bind), vec


def _value_args(op: Pointwise) -> list[Value]:
    return [a for a in op.args if isinstance(a, Value)]


def _forward_body(ops: tuple[Pointwise, ...], at: _CodeCursor) -> list[str]:
    """The stretch's ops on v in turn; where one reads an earlier value, each value in its own
    register (v0 the input, v<k> the k-th op's result)."""
    if not any(_value_args(op) for op in ops):
        return [f"    v = {ROUND}({_op_code(op, at)[0].format(v='v')}, p);" for op in ops]
    lines = ["    const float v0 = v;"]
    for k, op in enumerate(ops, start=1):
        fwd = _op_code(op, at)[0].format(v=f"v{k - 1}")
        lines.append(f"    const float v{k} = {ROUND}({fwd}, p);")
    return [*lines, f"    v = v{len(ops)};"]


def _backward_body(
    ops: tuple[Pointwise, ...], at: _CodeCursor, param_slot: int, sums: int
) -> list[str]:
    """Recomputes each op's input v{i} from v, then takes d back through the ops, last first;
    a tensor argument's gradient is added to its column sum, slot ``param_slot`` + its index
    (compensated: the errors follow the ``sums`` slots). A value read again later gathers
    those reads' gradients in d<index>, added to d when the walk back reaches it."""
    codes = [_op_code(op, at) for op in ops]
    lines = ["    const float v0 = v;"] if codes else []
    for i, (fwd, *_) in enumerate(codes):
        lines.append(f"    const float v{i + 1} = {ROUND}({fwd.format(v=f'v{i}')}, p);")
    read = sorted({a.index for op in ops for a in _value_args(op) if not a.detach})
    lines += [f"    float d{j} = 0.f;" for j in read]
    for i in reversed(range(len(codes))):
        _, grad, grad_arg, vec = codes[i]
        lines.append(f"    {{  // {ops[i].name}")
        if i + 1 in read:
            lines.append(f"      d += d{i + 1};")
        lines.append(f"      const float x = v{i}, y = v{i + 1};")
        lines.append("      (void)x;")
        lines.append("      (void)y;")
        for a in _value_args(ops[i]):
            if not a.detach:
                lines.append(f"      d{a.index} += {grad_arg};")
        if vec is not None:
            lines.append(
                f"      gemmfuse::column_add(acc, {param_slot + vec} * acc_stride + acc_col, "
                f"{sums} * acc_stride, {grad_arg});"
            )
        if grad != "d":
            lines.append(f"      d = {grad};")
        lines.append("    }")
    if 0 in read:
        lines.append("    d += d0;")
    return lines


def column_sum_slots(epilogue: Epilogue) -> tuple[int, int]:
    """(how many column sums the chain's backward kernel accumulates, the first tensor
    argument's slot). Slot 0 is the bias gradient (dz summed over rows), 1 and 2 the GroupNorm's
    weight and bias (when affine), then one per tensor argument read in pre/post."""
    first = 3 if epilogue.norm is not None and epilogue.norm.affine else 1
    return first + len(epilogue.channel_params), first


def _device_fn(name: str, args: str, body: list[str], result: str) -> str:
    names = [a.split()[-1].lstrip("*&") for a in args.split(", ")]
    return "\n".join(
        [
            f"  static __device__ __forceinline__ float {name}(",
            f"      {args}) {{",
            *(f"    (void){a};" for a in names[1:]),
            *body,
            f"    return {result};",
            "  }",
        ]
    )


def cuda_epilogue(epilogue: Epilogue) -> str:
    """The ``GeneratedEpilogueFor<kModel>`` struct template the kernels in csrc/ are
    instantiated with: the ops forward (``pre``, ``post``) and backward (``pre_backward``,
    ``post_backward``), rounding as the model dtype ``kModel`` rounds; ``GeneratedEpilogue`` is
    its instance for any dtype (chosen at run time)."""
    reduce = 0 if epilogue.reduce is None else REDUCTIONS[epilogue.reduce.op]
    pool = 1 if epilogue.reduce is None else epilogue.reduce.pool
    plain = epilogue.structure == Epilogue()
    norm = epilogue.norm or GroupNormSpec(1, affine=False)
    sums, param_slot = column_sum_slots(epilogue)
    pre_at = _CodeCursor()
    pre = _forward_body(epilogue.pre, pre_at)
    post = _forward_body(epilogue.post, dataclasses.replace(pre_at))
    pre_bwd = _backward_body(epilogue.pre, _CodeCursor(), param_slot, sums)
    post_bwd = _backward_body(epilogue.post, dataclasses.replace(pre_at), param_slot, sums)
    fwd_args = "float v, int row, int col, const gemmfuse::EpilogueParams& p"
    # acc: the block's column sums, slot-major, acc_stride columns a slot, then their rounding
    # errors in the same layout; acc_col: this column's.
    bwd_args = f"{fwd_args}, float d, float* acc, int acc_col, int acc_stride"
    return "\n".join(
        [
            f"// Generated by gemmfuse.epilogue from: {epilogue.structure}",
            "#pragma once",
            # kModel: the model dtype the kernel instance serves (csrc/abi/fused_args.h's
            # ModelDtype, or kAnyModel: params.model16's, at run time)
            "template <int kModel>",
            "struct GeneratedEpilogueFor {",
            "  static constexpr int kModelDtype = kModel;",
            f"  static constexpr bool kNorm = {'true' if epilogue.norm else 'false'};",
            # RMSNorm: rows scaled by 1 / sqrt(mean(u^2) + eps), no mean subtracted.
            f"  static constexpr bool kRms = {'true' if norm.rms else 'false'};",
            # Softmax over the channels: rows scaled to exp(u - max) / sum (a log_softmax:
            # (u - max) - log(sum)).
            f"  static constexpr bool kSoftmax = {'true' if norm.softmax else 'false'};",
            f"  static constexpr bool kLogSoftmax = {'true' if norm.log else 'false'};",
            f"  static constexpr int kReduce = {reduce};",
            # The reduction's max-pooling window (Reduction.pool): 1, or it takes window maxima.
            f"  static constexpr int kPool = {pool};",
            # A plain GEMM (+ bias): the backward's matrix products run on this structure.
            f"  static constexpr bool kPlain = {'true' if plain else 'false'};",
            # The backward's column sums (chain_backward.cuh): see column_sum_slots.
            f"  static constexpr int kColumnSums = {sums};",
            _device_fn("pre", fwd_args, pre, "v"),
            _device_fn("post", fwd_args, post, "v"),
            _device_fn("pre_backward", bwd_args, pre_bwd, "d"),
            _device_fn("post_backward", bwd_args, post_bwd, "d"),
            "};",
            "using GeneratedEpilogue = GeneratedEpilogueFor<gemmfuse::kAnyModel>;",
            "",
        ]
    )
