"""The pointwise ops of the epilogue grammar: one row per op, every meaning of it in the row.

A row (:class:`PointwiseDef`) carries the op's CUDA expression and gradient (``cuda_epilogue``
generates the kernels' code from them), its PyTorch function (reference.py evaluates chains with
it), the ways models write it (``nn`` modules and the function and method spellings that
optimize's fx matcher recognises), the argument ranges the random chains draw from (chains.py)
and its entry in the README's list (``pointwise_markdown``). Adding an op is one row here and
its tests.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

import math
import operator
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

_INV_SQRT2 = "0.70710678118654752440f"
_SQRT_2_OVER_PI = "0.79788456080286535588f"
_CLAMP = "({v} != {v} ? {v} : fminf(fmaxf({v}, {a0}), {a1}))"  # hardtanh's and clamp's forward


@dataclass(frozen=True)
class Spelling:
    """One way models write an op, for optimize's fx matcher.

    ``targets``: the call targets (torch and ``torch.nn.functional`` functions, Tensor method
    names; in-place forms included). ``params``/``defaults``: the parameters after the input (a
    binary op's: after the other operand) and their defaults. The op's float arguments are the
    parameters ``args`` names, in order; or, where the op depends on a setting, ``make`` returns
    (op name, arguments) from the bound parameters, or a string saying why they are outside the
    grammar. The matcher checks that every argument is a number.
    """

    targets: tuple
    params: tuple[str, ...] = ()
    defaults: tuple = ()
    args: tuple[str, ...] = ()
    make: Callable[[dict], "tuple[str, tuple] | str"] | None = None


@dataclass(frozen=True)
class PointwiseDef:
    """One pointwise op: its argument count, its CUDA expression and its torch function.

    In ``cuda``, ``{v}`` is the input value and ``{a0}``, ``{a1}``... its arguments. Expressions
    follow PyTorch's float32 CUDA kernels (the same operations in the same order). ``cuda_scalar``,
    when given, replaces ``cuda`` for a float argument where PyTorch computes differently
    (``x / s`` multiplies by the reciprocal of ``s``), and ``scalar_value`` gives the number the
    kernel reads in that argument's place where it is not the float itself (that reciprocal,
    taken in float64 on the host as PyTorch takes it). ``tensor_arg`` says whether the argument
    may be a :class:`Param` (the binary arithmetic ops).

    ``grad`` is the CUDA expression of the gradient with respect to the input, PyTorch's formula
    (``tools/autograd/derivatives.yaml`` and its CUDA backward kernels): ``{g}`` the incoming
    gradient, ``{x}`` the op's input, ``{y}`` its output, ``{a0}``... its arguments;
    ``grad_scalar`` replaces it for a float argument where PyTorch differentiates another
    formula (``float / x`` is ``x.reciprocal() * float``). ``grad_arg`` is the gradient with
    respect to a tensor argument, per element (csrc/backward/chain_backward.cuh sums it over the
    rows).

    How models write it: ``spellings`` (functions and methods) and ``modules`` (an ``nn``
    class and the (op name, float arguments) of an instance, read at each call; a name of None
    when the instance's settings are outside the grammar). ``samples``: the argument ranges the
    random chains draw (one tuple per variant, each argument (is a tensor, low, high)).
    ``usage``: the README's words for it.
    """

    n_args: int
    cuda: str
    torch: Callable[..., torch.Tensor]
    tensor_arg: bool = False
    cuda_scalar: str | None = None
    scalar_value: Callable[[float], float] | None = None
    grad: str = ""
    grad_arg: str = ""
    grad_scalar: str | None = None
    spellings: tuple[Spelling, ...] = ()
    modules: tuple[tuple[type, Callable[[nn.Module], tuple]], ...] = ()
    samples: tuple[tuple[tuple[bool, float, float], ...], ...] = ()
    usage: str = ""


def _reciprocal(a: float) -> float:
    """1 / a in float64, which the host rounds to float32 with the chain's other scalars: what
    PyTorch's CUDA ``x / a`` multiplies by for a Python float ``a``, forward and backward (torch
    2.11, H200, 2026-11-29: ``x * float32(1 / a)`` gave its bits on 2^20 values at each of five
    ``a``, where ``x * (1.f / float32(a))``, this kernel's form before, differed in 79-86% of them
    at a = 1.1 and 1.2528 and in none at 0.7, 3 and 7.12). 1 / ±0 is ±inf, as in C."""
    return math.copysign(math.inf, a) if a == 0 else 1.0 / a


def _inplace_too(name: str, *functions) -> tuple:
    """A unary op's targets: the functions given, then the method ``name`` and its in-place
    form."""
    return (*functions, name, f"{name}_")


def _gelu_choice(a: dict) -> "tuple[str, tuple] | str":
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(a["approximate"])
    if name is None:
        return f"gelu(approximate={a['approximate']!r}) is not in the grammar"
    return name, ()


def _gelu_module(m: nn.Module) -> tuple:
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate), ()


def _clamp_bounds(a: dict) -> "tuple[str, tuple] | str":
    lo, hi = a.get("min"), a.get("max")
    if lo is None and hi is None:
        return "clamp without bounds"
    return "clamp", (-math.inf if lo is None else lo, math.inf if hi is None else hi)


def _extreme(fn: str) -> str:
    """minimum's or maximum's forward (``fn``: fminf or fmaxf): NaN from either side."""
    return f"({{v}} != {{v}} ? {{v}} : {{a0}} != {{a0}} ? {{a0}} : {fn}({{v}}, {{a0}}))"


def _operand_like(v: torch.Tensor, a) -> torch.Tensor:
    """minimum's or maximum's argument as a tensor of v's dtype on v's device. A float goes by a
    fill kernel: ``torch.as_tensor(float, device=cuda)`` copies from pageable host memory, which
    waits for the stream to drain first, so the GPU then idled while the host launched the rest
    (pool chain 2's tail: 0.93 ms a call, median of 30 with the L2 flushed, against 0.74 ms of
    kernels by torch.profiler; H100, 2026-11-27, fedfa53 with a chain-kernel trial not kept)."""
    if isinstance(a, torch.Tensor):
        return a.to(dtype=v.dtype, device=v.device)
    return torch.full((), a, dtype=v.dtype, device=v.device)


def _extreme_grad(loses: str) -> str:
    """Its gradient to the input: 0 where the input ``loses`` against the argument (``>`` for
    minimum), half at a tie, all of it otherwise (a NaN input included), as PyTorch's."""
    return f"({{x}} {loses} {{a0}} ? 0.f : {{x}} == {{a0}} ? {{g}} * 0.5f : {{g}})"


# A rounding in generated code: to the model's dtype, as the kernel instance's GeneratedEpilogueFor
# fixes it at compile time (a float32 instance's is one select; csrc/abi/fused_args.h).
ROUND = "gemmfuse::round_like_model<kModel>"


def _rounded_scalar(expression: str) -> str:
    """``expression`` with its float argument rounded as the model's dtype rounds it."""
    return expression.replace("{a0}", f"{ROUND}({{a0}}, p)")


def _float_arg(lo: float, hi: float) -> tuple:
    """A random chain's float argument drawn in [lo, hi]."""
    return ((False, lo, hi),)


def _float_or_tensor(lo: float, hi: float) -> tuple:
    """A binary op's two variants: a float argument, then a tensor one, drawn in [lo, hi]."""
    return ((False, lo, hi),), ((True, lo, hi),)


_NO_ARGS = ((),)  # one variant, no arguments
_INPLACE = (("inplace",), (False,))  # an F function's inplace flag: any value
_BINARY_USAGE = "with a float or a `gemmfuse.Param(i)` argument"

# The random chains draw the unary rows' variants in this table's order, then the binary ones':
# the order fixes chains.chain_pool(), whose kernels the GPU tests and benchmark build.
POINTWISE: dict[str, PointwiseDef] = {
    "relu": PointwiseDef(
        0, "(({v} > 0.f || {v} != {v}) ? {v} : 0.f)", F.relu, grad="({y} <= 0.f ? 0.f : {g})",
        spellings=(Spelling(_inplace_too("relu", torch.relu, F.relu, torch.relu_, F.relu_),
                            *_INPLACE),),
        modules=((nn.ReLU, lambda m: ("relu", ())),), samples=_NO_ARGS, usage="`relu`",
    ),
    "leaky_relu": PointwiseDef(
        1, "({v} > 0.f ? {v} : {v} * {a0})", F.leaky_relu, grad="({x} > 0.f ? {g} : {g} * {a0})",
        spellings=(Spelling((F.leaky_relu, F.leaky_relu_), ("negative_slope", "inplace"),
                            (0.01, False), ("negative_slope",)),),
        modules=((nn.LeakyReLU, lambda m: ("leaky_relu", (float(m.negative_slope),))),),
        samples=(_float_arg(0.01, 0.3),), usage="`leaky_relu(slope)`",
    ),
    "gelu": PointwiseDef(
        0, f"({{v}} * 0.5f * (1.f + erff({{v}} * {_INV_SQRT2})))", lambda v: F.gelu(v),
        grad="({g} * gemmfuse::gelu_grad({x}))",
        spellings=(Spelling((F.gelu,), ("approximate",), ("none",), make=_gelu_choice),),
        modules=((nn.GELU, _gelu_module),), samples=_NO_ARGS, usage="`gelu`",
    ),
    "gelu_tanh": PointwiseDef(
        0,
        f"(0.5f * {{v}} * (1.f + tanhf({_SQRT_2_OVER_PI} * "
        "({v} + 0.044715f * ({v} * {v} * {v})))))",
        lambda v: F.gelu(v, approximate="tanh"),
        grad="({g} * gemmfuse::gelu_tanh_grad({x}))",
        samples=_NO_ARGS, usage="`gelu_tanh` (GELU's `approximate='tanh'`)",
    ),
    "silu": PointwiseDef(
        0, "gemmfuse::silu_rn({v})", F.silu, grad="({g} * gemmfuse::silu_grad({x}))",
        spellings=(Spelling((F.silu,), *_INPLACE),),
        modules=((nn.SiLU, lambda m: ("silu", ())),), samples=_NO_ARGS, usage="`silu`",
    ),
    # x * sigmoid(x) as written in a model: two PyTorch ops, the sigmoid rounded in between
    # (optimize matches the pattern itself)
    "swish": PointwiseDef(
        0,
        f"({{v}} * {ROUND}(gemmfuse::sigmoid_rn({{v}}), p))",
        lambda v: v * torch.sigmoid(v),
        grad="gemmfuse::swish_grad<kModel>({x}, {g}, p)",
        samples=_NO_ARGS, usage="`swish` (x * sigmoid(x), as two ops)",
    ),
    "mish": PointwiseDef(
        0, "({v} * tanhf(gemmfuse::log1p_rn(expf({v}))))", F.mish,
        grad="({g} * gemmfuse::mish_grad({x}))",
        spellings=(Spelling((F.mish,), *_INPLACE),),
        modules=((nn.Mish, lambda m: ("mish", ())),), samples=_NO_ARGS, usage="`mish`",
    ),
    "tanh": PointwiseDef(
        0, "tanhf({v})", torch.tanh, grad="({g} * (1.f - {y} * {y}))",
        spellings=(Spelling(_inplace_too("tanh", torch.tanh, F.tanh, torch.tanh_)),),
        modules=((nn.Tanh, lambda m: ("tanh", ())),), samples=_NO_ARGS, usage="`tanh`",
    ),
    "sigmoid": PointwiseDef(
        0, "gemmfuse::sigmoid_rn({v})", torch.sigmoid, grad="({g} * (1.f - {y}) * {y})",
        spellings=(Spelling(_inplace_too("sigmoid", torch.sigmoid, F.sigmoid, torch.sigmoid_)),),
        modules=((nn.Sigmoid, lambda m: ("sigmoid", ())),), samples=_NO_ARGS, usage="`sigmoid`",
    ),
    # hardtanh and clamp are one op in PyTorch (NaN passes through); +-inf marks an open bound.
    # Their gradients differ at the bounds: hardtanh's is 0 there, clamp's passes.
    "hardtanh": PointwiseDef(
        2, _CLAMP, F.hardtanh, grad="(({x} <= {a0} || {x} >= {a1}) ? 0.f : {g})",
        spellings=(
            Spelling((F.hardtanh, F.hardtanh_), ("min_val", "max_val", "inplace"),
                     (-1.0, 1.0, False), ("min_val", "max_val")),
            Spelling((F.relu6,), *_INPLACE, make=lambda a: ("hardtanh", (0.0, 6.0))),
        ),
        modules=(
            (nn.ReLU6, lambda m: ("hardtanh", (float(m.min_val), float(m.max_val)))),
            (nn.Hardtanh, lambda m: ("hardtanh", (float(m.min_val), float(m.max_val)))),
        ),
        samples=(((False, -2, -0.5), (False, 0.5, 2)),), usage="`hardtanh(lo, hi)`",
    ),
    "hardswish": PointwiseDef(
        0,
        "({v} * fminf(fmaxf({v} + 3.f, 0.f), 6.f) * (1.f / 6.f))",
        F.hardswish,
        grad="({x} < -3.f ? 0.f : {x} <= 3.f ? {g} * ({x} / 3.f + 0.5f) : {g})",
        spellings=(Spelling((F.hardswish,), *_INPLACE),),
        modules=((nn.Hardswish, lambda m: ("hardswish", ())),), samples=_NO_ARGS,
        usage="`hardswish`",
    ),
    "hardsigmoid": PointwiseDef(
        0,
        "(fminf(fmaxf({v} + 3.f, 0.f), 6.f) * (1.f / 6.f))",
        F.hardsigmoid,
        grad="(({x} > -3.f && {x} < 3.f) ? {g} * (1.f / 6.f) : 0.f)",
        spellings=(Spelling((F.hardsigmoid,), *_INPLACE),),
        modules=((nn.Hardsigmoid, lambda m: ("hardsigmoid", ())),), samples=_NO_ARGS,
        usage="`hardsigmoid`",
    ),
    "clamp": PointwiseDef(
        2, _CLAMP, torch.clamp, grad="(({x} >= {a0} && {x} <= {a1}) ? {g} : 0.f)",
        spellings=(
            Spelling(_inplace_too("clamp", torch.clamp, torch.clip, torch.clamp_, torch.clip_)
                     + ("clip", "clip_"), ("min", "max"), (None, None), make=_clamp_bounds),
            Spelling(_inplace_too("clamp_min", torch.clamp_min, torch.clamp_min_), ("min",),
                     (None,), make=_clamp_bounds),
            Spelling(_inplace_too("clamp_max", torch.clamp_max, torch.clamp_max_), ("max",),
                     (None,), make=_clamp_bounds),
        ),
        samples=(((False, -1.5, -0.2), (False, 0.2, 1.5)),
                 ((False, -0.5, 0.5), (False, math.inf, math.inf))),
        usage="`clamp(lo, hi)` (±inf for an open side)",
    ),
    # softplus(beta, threshold): linear above threshold, as PyTorch
    "softplus": PointwiseDef(
        2,
        "gemmfuse::select_greater({v} * {a0}, {a1}, {v}, "
        "gemmfuse::log1p_rn(expf({v} * {a0})) / {a0})",
        F.softplus,
        grad="gemmfuse::softplus_grad({x}, {g}, {a0}, {a1})",
        spellings=(Spelling((F.softplus,), ("beta", "threshold"), (1.0, 20.0),
                            ("beta", "threshold")),),
        modules=((nn.Softplus, lambda m: ("softplus", (float(m.beta), float(m.threshold)))),),
        samples=(((False, 0.5, 2), (False, 5, 20)),), usage="`softplus(beta, threshold)`",
    ),
    "elu": PointwiseDef(
        1,
        "({v} <= 0.f ? expm1f({v}) * {a0} : {v})",
        lambda v, a: F.elu(v, a),
        grad="({x} <= 0.f ? {g} * {a0} * expf({x}) : {g})",
        spellings=(Spelling((F.elu, F.elu_), ("alpha", "inplace"), (1.0, False), ("alpha",)),),
        modules=((nn.ELU, lambda m: ("elu", (float(m.alpha),))),),
        samples=(_float_arg(0.5, 1.5),), usage="`elu(alpha)`",
    ),
    # x + x (optimize matches the pattern itself)
    "add_self": PointwiseDef(
        0, "({v} + {v})", lambda v: v + v, grad="({g} + {g})", samples=_NO_ARGS,
        usage="`add_self` (x + x)",
    ),
    # exp and log only in guarded pairs in the random chains (chains.py), away from overflow
    # and from the negatives
    "exp": PointwiseDef(
        0, "expf({v})", torch.exp, grad="({g} * {y})",
        spellings=(Spelling(_inplace_too("exp", torch.exp, torch.exp_)),), usage="`exp`",
    ),
    "log": PointwiseDef(
        0, "logf({v})", torch.log, grad="({g} / {x})",
        spellings=(Spelling(_inplace_too("log", torch.log, torch.log_)),), usage="`log`",
    ),
    # binary arithmetic with a float or a tensor operand (optimize swaps a - x to rsub, a / x
    # to rdiv); alpha and rounding_mode must keep their defaults
    "add": PointwiseDef(
        1, "({v} + {a0})", lambda v, a: v + a, True, grad="{g}", grad_arg="{g}",
        spellings=(Spelling((operator.add, torch.add, "add", "add_"), ("alpha",)),),
        samples=_float_or_tensor(-1, 1), usage="`add`",
    ),
    "sub": PointwiseDef(
        1, "({v} - {a0})", lambda v, a: v - a, True, grad="{g}", grad_arg="(-{g})",
        spellings=(Spelling((operator.sub, torch.sub, torch.subtract, "sub", "sub_", "subtract",
                             "subtract_"), ("alpha",)),),
        samples=_float_or_tensor(-1, 1), usage="`sub`",
    ),
    "rsub": PointwiseDef(
        1, "({a0} - {v})", lambda v, a: a - v, True, grad="(-{g})", grad_arg="{g}",
        spellings=(Spelling((torch.rsub,), ("alpha",)),),
        samples=_float_or_tensor(-1, 1), usage="`rsub` (a - x)",
    ),
    "mul": PointwiseDef(
        1, "({v} * {a0})", lambda v, a: v * a, True, grad="({g} * {a0})", grad_arg="({g} * {x})",
        spellings=(Spelling((operator.mul, torch.mul, torch.multiply, "mul", "mul_", "multiply",
                             "multiply_")),),
        samples=_float_or_tensor(-2, 2), usage="`mul`",
    ),
    "div": PointwiseDef(
        1,
        "({v} / {a0})",
        lambda v, a: v / a,
        True,
        cuda_scalar="({v} * {a0})",
        scalar_value=_reciprocal,
        grad="({g} / {a0})",
        grad_scalar="({g} * {a0})",
        grad_arg="(-{g} * {x} / ({a0} * {a0}))",
        spellings=(Spelling((operator.truediv, torch.div, torch.divide, torch.true_divide, "div",
                             "div_", "divide", "divide_", "true_divide", "true_divide_"),
                            ("rounding_mode",)),),
        samples=_float_or_tensor(0.5, 2), usage="`div`",
    ),
    # torch.minimum / torch.maximum (and torch.min / torch.max given a tensor, not a dim): NaN
    # propagates from either side; at a tie the gradient is split evenly, as PyTorch's. A float
    # argument means a 0-dim tensor of it in the input's dtype (rounded so in a bf16 model).
    "minimum": PointwiseDef(
        1, _extreme("fminf"),
        lambda v, a: torch.minimum(v, _operand_like(v, a)), True,
        cuda_scalar=_rounded_scalar(_extreme("fminf")),
        grad=_extreme_grad(">"),
        grad_arg="({a0} > {x} ? 0.f : {x} == {a0} ? {g} * 0.5f : {g})",
        grad_scalar=_rounded_scalar(_extreme_grad(">")),
        spellings=(Spelling((torch.minimum, "minimum")),),
        samples=_float_or_tensor(-1, 1), usage="`minimum`",
    ),
    "maximum": PointwiseDef(
        1, _extreme("fmaxf"),
        lambda v, a: torch.maximum(v, _operand_like(v, a)), True,
        cuda_scalar=_rounded_scalar(_extreme("fmaxf")),
        grad=_extreme_grad("<"),
        grad_arg="({a0} < {x} ? 0.f : {x} == {a0} ? {g} * 0.5f : {g})",
        grad_scalar=_rounded_scalar(_extreme_grad("<")),
        spellings=(Spelling((torch.maximum, "maximum")),),
        samples=_float_or_tensor(-1, 1),
        usage="`maximum` (`torch.minimum`/`maximum`, or `torch.min`/`max` given a tensor)",
    ),
    # PyTorch computes float / tensor as tensor.reciprocal() * float: two ops, the reciprocal
    # rounded in between in a 16-bit model (in a bf16 one, without that rounding 30% of 2^20
    # values differed by an ulp: a CPU emulation, torch's CPU kernels, 2026-11-29)
    "rdiv": PointwiseDef(
        1,
        "({a0} / {v})",
        lambda v, a: a / v,
        True,
        cuda_scalar=f"({ROUND}(1.f / {{v}}, p) * {{a0}})",
        grad="(-{g} * {a0} / ({x} * {x}))",
        grad_arg="({g} / {x})",
        grad_scalar="(-({g} * {a0}) * ((1.f / {x}) * (1.f / {x})))",
        usage="`rdiv` (a / x)",
    ),
}  # fmt: skip


def pointwise_markdown() -> str:
    """The README's list of the pointwise ops, from the table (tests/test_readme.py holds the
    README to it)."""
    binary = [d.usage for d in POINTWISE.values() if d.tensor_arg]
    unary = [d.usage for d in POINTWISE.values() if not d.tensor_arg]
    text = (
        f"Pointwise ops (`gemmfuse.POINTWISE`, one row each in `gemmfuse/pointwise.py`): "
        f"{', '.join(binary)} {_BINARY_USAGE} (the tensor `params[i]` of the call; in "
        "`pre`/`post` per channel, or of the chain's full (M, N) shape, read per element: a "
        f"residual or a gate computed elsewhere; any broadcastable shape in `tail`); "
        f"{', '.join(unary)}."
    )
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)
