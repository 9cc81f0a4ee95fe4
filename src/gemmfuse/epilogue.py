"""What runs after the GEMM, described once.

An :class:`Epilogue` is the chain applied to ``y = x @ W.T + b``::

    pre ops -> GroupNorm (optional) -> post ops -> reduction over channels (optional)

Each pointwise op is defined once in ``POINTWISE`` with both meanings: the PyTorch function
(reference.py evaluates chains with it) and the CUDA expression (``cuda_epilogue`` turns a chain
into the ``GeneratedEpilogue`` struct the kernel is compiled with). Scalars such as a LeakyReLU
slope are run-time kernel arguments, so one compiled kernel serves a chain's every scalar value:
the build cache is keyed by ``Epilogue.structure``, which leaves the values out.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

MAX_PARAMS = 8  # kMaxParams in csrc/fused_args.h


@dataclass(frozen=True)
class PointwiseDef:
    """One pointwise op: its scalar count, the CUDA expression of ``v`` and the torch function.

    In ``cuda``, ``{v}`` is the input value and ``{s0}``, ``{s1}``... its scalars. Expressions
    follow PyTorch's float32 CUDA arithmetic exactly (the same operations in the same order).
    """

    n_scalars: int
    cuda: str
    torch: Callable[..., torch.Tensor]


POINTWISE: dict[str, PointwiseDef] = {
    "relu": PointwiseDef(0, "({v} > 0.f ? {v} : 0.f)", lambda v: F.relu(v)),
    "leaky_relu": PointwiseDef(
        1, "({v} > 0.f ? {v} : {v} * {s0})", lambda v, s: F.leaky_relu(v, s)
    ),
    "add_self": PointwiseDef(0, "({v} + {v})", lambda v: v + v),
    "add_scalar": PointwiseDef(1, "({v} + {s0})", lambda v, s: v + s),
    "mul_scalar": PointwiseDef(1, "({v} * {s0})", lambda v, s: v * s),
}

REDUCTIONS = {"min": 1, "max": 2, "sum": 3}  # kReduce codes in csrc/gemm_gn_sm80.cuh


@dataclass(frozen=True)
class Pointwise:
    name: str
    scalars: tuple[float, ...] = ()

    def __post_init__(self):
        if self.name not in POINTWISE:
            raise ValueError(
                f"unknown pointwise op {self.name!r}; expected one of {sorted(POINTWISE)}"
            )
        want = POINTWISE[self.name].n_scalars
        if len(self.scalars) != want:
            raise ValueError(
                f"pointwise op {self.name!r} takes {want} scalar(s), got {len(self.scalars)}"
            )


@dataclass(frozen=True)
class GroupNormSpec:
    num_groups: int
    eps: float = 1e-5
    affine: bool = True

    def __post_init__(self):
        if not isinstance(self.num_groups, int) or self.num_groups < 1:
            raise ValueError(f"num_groups must be a positive int, got {self.num_groups!r}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")


@dataclass(frozen=True)
class Reduction:
    op: str
    keepdim: bool = False

    def __post_init__(self):
        if self.op not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.op!r}; expected one of {sorted(REDUCTIONS)}")


@dataclass(frozen=True)
class Epilogue:
    pre: tuple[Pointwise, ...] = ()
    norm: GroupNormSpec | None = None
    post: tuple[Pointwise, ...] = ()
    reduce: Reduction | None = None

    def __post_init__(self):
        if self.norm is None and self.post:
            raise ValueError("post ops need a GroupNorm; put ops without one in `pre`")
        if len(self.scalars) > MAX_PARAMS:
            raise ValueError(
                f"an epilogue takes at most {MAX_PARAMS} scalars, got {len(self.scalars)}"
            )

    @functools.cached_property
    def scalars(self) -> tuple[float, ...]:
        """The run-time scalar arguments, in the order the generated code reads them."""
        return tuple(s for op in self.pre + self.post for s in op.scalars)

    @functools.cached_property
    def structure(self) -> Epilogue:
        """This chain with every run-time value zeroed: what a compiled kernel depends on."""

        def strip(ops):
            return tuple(Pointwise(op.name, (0.0,) * len(op.scalars)) for op in ops)

        norm = None if self.norm is None else GroupNormSpec(1, 0.0, self.norm.affine)
        return replace(self, pre=strip(self.pre), norm=norm, post=strip(self.post))

    def up_to_norm(self) -> Epilogue:
        """The part that runs before the GroupNorm (for kernels that stop there)."""
        return Epilogue(pre=self.pre)


def _cuda_ops(ops: tuple[Pointwise, ...], first_scalar: int) -> tuple[list[str], int]:
    lines, s = [], first_scalar
    for op in ops:
        d = POINTWISE[op.name]
        names = {f"s{i}": f"p.scalar[{s + i}]" for i in range(d.n_scalars)}
        lines.append(f"    v = round_like_model({d.cuda.format(v='v', **names)}, p);")
        s += d.n_scalars
    return lines, s


def cuda_epilogue(epilogue: Epilogue) -> str:
    """The ``GeneratedEpilogue`` struct that csrc/gemm_gn_sm80.cuh is instantiated with."""
    pre, s = _cuda_ops(epilogue.pre, 0)
    post, _ = _cuda_ops(epilogue.post, s)
    reduce = 0 if epilogue.reduce is None else REDUCTIONS[epilogue.reduce.op]

    def fn(name, body):
        return "\n".join(
            [
                f"  static __device__ __forceinline__ float {name}(",
                "      float v, int col, const gemmfuse::EpilogueParams& p) {",
                "    (void)col;",
                "    (void)p;",
                *body,
                "    return v;",
                "  }",
            ]
        )

    return "\n".join(
        [
            f"// Generated by gemmfuse.epilogue from: {epilogue.structure}",
            "#pragma once",
            "struct GeneratedEpilogue {",
            f"  static constexpr bool kNorm = {'true' if epilogue.norm else 'false'};",
            f"  static constexpr int kReduce = {reduce};",
            fn("pre", pre),
            fn("post", post),
            "};",
            "",
        ]
    )
