"""Random chains from the epilogue grammar, for property tests and the chain benchmark.

A :class:`ChainSpec` is a chain's shape: which ops, in which order, and for each argument
whether it is a float or a per-channel tensor and the range its values are drawn from. The
kernel a chain compiles to depends on its spec alone (argument values are run-time), so a fixed
pool of specs (:func:`chain_pool`) costs a fixed number of builds, while every test run draws
fresh argument values, tensors, shapes and data.

Ops are drawn in "units" that keep values where fp32 is well conditioned: ``exp`` follows a
``tanh``, ``log`` a ``sigmoid``, ``rdiv`` a ``sigmoid`` plus a positive constant, and ``div``
divides by magnitudes in [0.5, 2]; without that, eager fp32 itself would not be a usable oracle.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from gemmfuse.epilogue import (
    MAX_SCALARS,
    MAX_TENSORS,
    POINTWISE,
    REDUCTIONS,
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    Value,
)
from gemmfuse.reference import apply_epilogue, linear_epilogue


@dataclass(frozen=True)
class ArgSpec:
    tensor: bool  # a Param (per channel before the reduction, broadcast after it) or a float
    lo: float
    hi: float
    value: int | None = None  # else: the stretch's value of that index (a Value), not drawn
    detach: bool = False


@dataclass(frozen=True)
class OpSpec:
    name: str
    args: tuple[ArgSpec, ...] = ()


def _units() -> list[tuple[OpSpec, ...]]:
    """Every variant of every op with its argument ranges (pointwise.py's ``samples``), the
    unary rows first, then the guarded pairs and triples of exp, log and rdiv."""
    rows = sorted(POINTWISE.items(), key=lambda row: row[1].tensor_arg)  # stable: table order
    units = [
        (OpSpec(name, tuple(ArgSpec(*arg) for arg in sample)),)
        for name, d in rows
        for sample in d.samples
    ]
    positive = OpSpec("add", (ArgSpec(False, 0.5, 1),))
    units += [
        (OpSpec("tanh"), OpSpec("exp")),
        (OpSpec("sigmoid"), OpSpec("log")),
        (OpSpec("sigmoid"), positive, OpSpec("rdiv", (ArgSpec(False, -2, 2),))),
        (OpSpec("sigmoid"), positive, OpSpec("rdiv", (ArgSpec(True, -2, 2),))),
    ]
    return units


UNITS = _units()


@dataclass(frozen=True)
class ChainSpec:
    pre: tuple[OpSpec, ...]
    norm: bool
    affine: bool
    post: tuple[OpSpec, ...]
    reduce: str | None
    keepdim: bool
    tail: tuple[OpSpec, ...]
    pool: int = 1  # the reduction's max-pooling window (Reduction.pool; chains without a norm)

    def instantiate(
        self, gen: torch.Generator, n: int, num_groups: int = 1, eps: float = 1e-5
    ) -> tuple[Epilogue, list[torch.Tensor]]:
        """(epilogue, params) with argument values drawn from ``gen``; params on the CPU.

        Per-channel tensors take one of the shapes PyTorch broadcasts along channels; tail
        tensors broadcast against the reduced (M,) / (M, 1) value, growing it as #75's bias does.
        """
        params: list[torch.Tensor] = []

        def uniform(lo, hi, shape=()):
            return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)

        def ops(specs, tail=False):
            out = []
            for op in specs:
                args = []
                for a in op.args:
                    if a.value is not None:
                        args.append(Value(a.value, a.detach))
                    elif a.tensor:
                        choices = [(1, 3, 1, 1), (1,), (3, 1, 1)] if tail else [(n,), (1, n), (1,)]
                        shape = choices[int(torch.randint(len(choices), (), generator=gen))]
                        params.append(uniform(a.lo, a.hi, shape).float())
                        args.append(Param(len(params) - 1))
                    else:
                        args.append(a.lo if a.lo == a.hi else float(uniform(a.lo, a.hi)))
                out.append(Pointwise(op.name, tuple(args)))
            return tuple(out)

        pre, post = ops(self.pre), ops(self.post)
        tail = ops(self.tail, tail=True)
        norm = GroupNormSpec(num_groups, eps, self.affine) if self.norm else None
        reduce = Reduction(self.reduce, self.keepdim, self.pool) if self.reduce else None
        return Epilogue(pre, norm, post, reduce, tail), params

    @property
    def structure(self) -> Epilogue:
        """The kernel structure every instance of this spec shares."""
        return self.instantiate(torch.Generator().manual_seed(0), 8)[0].structure

    def describe(self) -> str:
        def names(ops):
            return [op.name + "".join(_marks(a) for a in op.args) for op in ops]

        parts = names(self.pre)
        if self.norm:
            parts.append("group_norm" + ("" if self.affine else "[no affine]"))
        parts += names(self.post)
        if self.pool > 1:
            parts.append(f"max_pool1d({self.pool})")
        if self.reduce:
            parts.append(f"{self.reduce}{'[keepdim]' if self.keepdim else ''}")
        parts += names(self.tail)
        return " -> ".join(["linear", *parts])


def _marks(a: ArgSpec) -> str:
    """describe's note of an argument: [t] a tensor, [v1] value 1, [v1 detached]."""
    if a.value is not None:
        return f"[v{a.value}{' detached' if a.detach else ''}]"
    return "[t]" if a.tensor else ""


# The binary ops whose float argument a value may replace: values of any sign and size are safe
# operands for them (div, rdiv and the log/exp units keep their guarded arguments).
_VALUE_OPS = ("add", "sub", "rsub", "mul", "minimum", "maximum")


def _read_values(rng: random.Random, ops: tuple[OpSpec, ...]) -> tuple[OpSpec, ...]:
    """``ops`` with about half of the _VALUE_OPS' float arguments replaced by a read of an
    earlier value of the stretch (a third of them detached); not the positive constant that
    keeps an rdiv's divisor away from zero."""
    out = []
    for k, op in enumerate(ops, start=1):
        guards = k < len(ops) and ops[k].name == "rdiv"  # the positive constant before an rdiv
        if (op.name in _VALUE_OPS and op.args and not op.args[0].tensor and not guards
                and rng.random() < 0.5):  # fmt: skip
            op = OpSpec(op.name, (ArgSpec(False, 0.0, 0.0, rng.randint(0, k - 1),
                                          rng.random() < 1 / 3),))  # fmt: skip
        out.append(op)
    return tuple(out)


def value_chain_pool(size: int = 3, seed: int = 1) -> list[ChainSpec]:
    """``size`` random chains each reading at least one value again, before or after a norm:
    the GPU tests' pool of drawn graphs (kept apart from :func:`chain_pool`, whose kernels a
    change would all rebuild)."""
    rng = random.Random(seed)
    pool: list[ChainSpec] = []
    while len(pool) < size:
        spec = random_chain(rng, (2, 4))
        spec = replace(spec, pre=_read_values(rng, spec.pre), post=_read_values(rng, spec.post))
        if any(a.value is not None for op in spec.pre + spec.post for a in op.args):
            pool.append(spec)
    return pool


def _fits(pre, post) -> bool:
    ops = [op for unit in pre + post for op in unit]
    floats = sum(1 for op in ops for a in op.args if not a.tensor)
    tensors = sum(1 for op in ops for a in op.args if a.tensor)
    return floats <= MAX_SCALARS and tensors <= MAX_TENSORS


def random_chain(rng: random.Random, units: tuple[int, int] = (0, 3)) -> ChainSpec:
    """One chain drawn from the grammar, with ``units`` (low, high) op units before and after
    the GroupNorm (argument values are drawn later, per instance)."""
    while True:
        pre = [rng.choice(UNITS) for _ in range(rng.randint(*units))]
        norm = rng.random() < 0.8
        post = [rng.choice(UNITS) for _ in range(rng.randint(*units))] if norm else []
        if _fits(pre, post):
            break
    reduce = rng.choice(sorted(REDUCTIONS)) if rng.random() < 0.4 else None
    tail = []
    if reduce:
        scalar_units = [u for u in UNITS if not any(a.tensor for op in u for a in op.args)]
        tail = [rng.choice(scalar_units) for _ in range(rng.randint(0, 1))]
        if rng.random() < 0.5:
            tail.append((OpSpec("add", (ArgSpec(True, -1, 1),)),))
    affine, keepdim = rng.random() < 0.5, rng.random() < 0.5
    # a max pooling over the channels before the reduction, in chains without a norm; windows
    # of at most 16 channels, the fewest the GPU tests draw (a window wider than the row raises,
    # as max_pool1d does: the CPU tests that draw fewer channels check that)
    pool = rng.choice((2, 4, 8, 16)) if reduce and not norm and rng.random() < 0.5 else 1
    return ChainSpec(
        pre=tuple(op for u in pre for op in u),
        norm=norm,
        affine=affine,
        post=tuple(op for u in post for op in u),
        reduce=reduce,
        keepdim=keepdim,
        tail=tuple(op for u in tail for op in u),
        pool=pool,
    )


def chain_pool(size: int = 2, seed: int = 0) -> list[ChainSpec]:
    """``size`` random chains, then longer ones (the best of 50 draws each) until every
    pointwise op appears in a kernel (before the reduction), every reduction appears and a max
    pooling before one: a small pool, so few kernels to build (each takes seconds of nvcc)."""
    rng = random.Random(seed)
    pool: list[ChainSpec] = []
    missing = set(POINTWISE) | set(REDUCTIONS) | {"max_pool1d"}

    def covers(spec):
        pooled = {"max_pool1d"} if spec.pool > 1 else set()
        return ({op.name for op in spec.pre + spec.post} | {spec.reduce} | pooled) & missing

    while len(pool) < size or missing:
        spec = random_chain(rng)
        if len(pool) >= size:
            draws = [random_chain(rng, (1, 4)) for _ in range(50)]
            spec = max(draws, key=lambda s: len(covers(s)))
            reductions = sorted(missing & set(REDUCTIONS))
            if reductions and spec.reduce not in reductions:
                spec = replace(spec, reduce=rng.choice(reductions))
        missing -= covers(spec)
        pool.append(spec)
    return pool


def value_chains(num_groups: int = 4) -> list[Epilogue]:
    """Chains that read values again (:class:`gemmfuse.Value`), as the GPU tests and the
    hand-written model values_read_again.py / values_around_norm.py build them: #70's
    ``sigmoid(x) * s + x``; #40's ``x * s + x.detach()``; and ``sigmoid(x) + x`` -> GroupNorm
    -> ``t = tanh(x); (t * params[0] + x) * t.detach()`` -> logsumexp, values read on both
    sides of the norm, one of them detached."""
    return [
        Epilogue(pre=(Pointwise("sigmoid"), Pointwise("mul", (2.0,)),
                      Pointwise("add", (Value(0),)))),
        Epilogue(pre=(Pointwise("mul", (0.5,)), Pointwise("add", (Value(0, detach=True),)))),
        Epilogue(
            pre=(Pointwise("sigmoid"), Pointwise("add", (Value(0),))),
            norm=GroupNormSpec(num_groups, 1e-5, True),
            post=(Pointwise("tanh"), Pointwise("mul", (Param(0),)), Pointwise("add", (Value(0),)),
                  Pointwise("mul", (Value(1, detach=True),))),
            reduce=Reduction("logsumexp", keepdim=True),
        ),
    ]  # fmt: skip


def layer_norm_chain(affine: bool, rms: bool = False) -> Epilogue:
    """x * p[0] -> LayerNorm (or RMSNorm) over the channels -> GELU: the GPU tests' row-norm
    chain."""
    return Epilogue(
        pre=(Pointwise("mul", (Param(0),)),),
        norm=GroupNormSpec(1, 1e-5, affine, layer=True, rms=rms),
        post=(Pointwise("gelu"),),
    )


def softmax_chains() -> list[Epilogue]:
    """The GPU tests' softmax chains: #99's GELU -> softmax over the channels; #84's
    x * p[0] -> softmax (after its BatchNorm1d); x * p[0] -> log_softmax -> x * 0.5 -> sum over
    the channels (keepdim): a log_softmax with ops on both sides and a reduction after it."""
    softmax = GroupNormSpec(1, 0.0, False, layer=True, softmax=True)
    return [
        Epilogue(pre=(Pointwise("gelu"),), norm=softmax),
        Epilogue(pre=(Pointwise("mul", (Param(0),)),), norm=softmax),
        Epilogue(
            pre=(Pointwise("mul", (Param(0),)),),
            norm=replace(softmax, log=True),
            post=(Pointwise("mul", (0.5,)),),
            reduce=Reduction("sum", keepdim=True),
        ),
    ]


def linear_data(gen: torch.Generator, m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    """(x, weight, bias, gn_weight, gn_bias) on the CPU: x ~ randn(m, k), the Linear's weight and
    bias uniform in +-1/sqrt(k) as nn.Linear initialises them, the GroupNorm's affine parameters
    near (1, 0) so the affine part is exercised."""
    bound = k**-0.5
    x = torch.randn(m, k, generator=gen)
    w = (torch.rand(n, k, generator=gen) * 2 - 1) * bound
    b = (torch.rand(n, generator=gen) * 2 - 1) * bound
    gn_w = 1 + 0.1 * torch.randn(n, generator=gen)
    gn_b = 0.1 * torch.randn(n, generator=gen)
    return x, w, b, gn_w, gn_b


def chain_references(x, w, b, epilogue: Epilogue, gn_w, gn_b, params) -> tuple[torch.Tensor, ...]:
    """(eager fp32, float64, fp32 ops alone) results of ``epilogue(x @ w.T + b)``. The last runs
    the chain's fp32 ops on the float64 GEMM result rounded to fp32: the part of any fp32
    evaluation's error that does not come from the GEMM."""

    def f64(t):
        return None if t is None else t.double()

    eager = linear_epilogue(x, w, b, epilogue, gn_w, gn_b, params)
    exact = linear_epilogue(
        f64(x), f64(w), f64(b), epilogue, f64(gn_w), f64(gn_b), [f64(p) for p in params]
    )
    ops_alone = apply_epilogue(
        F.linear(f64(x), f64(w), f64(b)).float(), epilogue, gn_w, gn_b, params
    )
    return eager, exact, ops_alone
