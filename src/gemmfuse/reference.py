"""The PyTorch semantics of a fused linear chain: the test oracle and the portable fallback.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gemmfuse.epilogue import POINTWISE, REDUCTION_FNS, Epilogue, Param, Pointwise, Value


def apply_pointwise(
    v: torch.Tensor, ops: tuple[Pointwise, ...], params: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """A stretch of ops on ``v`` in turn; a :class:`Value` argument reads the stretch's earlier
    value (0: ``v`` itself), detached where it says."""
    return apply_plain_ops(v, ((op.name, op.args) for op in ops), params)


def plain_ops(ops: tuple[Pointwise, ...]) -> tuple:
    """``ops`` as plain tuples ``(name, args)``: a :class:`Param` argument becomes
    ``("param", index)``, a :class:`Value` ``("value", index, detach)``, a number stays. What a
    torch.compile graph holds as constants (ops.chain_call_specs)."""
    return tuple((op.name, tuple(_plain_argument(a) for a in op.args)) for op in ops)


def _plain_argument(a):
    if isinstance(a, Param):
        return ("param", a.index)
    if isinstance(a, Value):
        return ("value", a.index, a.detach)
    return a


def apply_plain_ops(v: torch.Tensor, ops, params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """:func:`apply_pointwise` of ``(name, args)`` pairs, their arguments as :func:`plain_ops`
    writes them or as :class:`Param` / :class:`Value` objects."""
    values = [v]
    for name, args in ops:
        v = POINTWISE[name].torch(v, *(op_argument(a, params, values) for a in args))
        values.append(v)
    return v


def op_argument(a, params, values):
    """An op's argument as :func:`apply_plain_ops` passes it: a number as it is, a parameter from
    ``params``, an earlier value of the stretch from ``values`` (detached where it says)."""
    if isinstance(a, (Param, Value)):
        a = _plain_argument(a)
    if not (isinstance(a, tuple) and a and a[0] in ("param", "value")):  # a number (or a list)
        return a
    if a[0] == "param":
        return params[a[1]]
    return values[a[1]].detach() if a[2] else values[a[1]]  # ("value", index, detach)


def apply_epilogue(
    y: torch.Tensor,
    epilogue: Epilogue,
    gn_weight: torch.Tensor | None = None,
    gn_bias: torch.Tensor | None = None,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Applies ``epilogue`` to the GEMM result ``y`` of shape (M, N), as PyTorch would."""
    y = apply_pointwise(y, epilogue.pre, params)
    norm = epilogue.norm
    if norm is not None and norm.softmax:
        y = (F.log_softmax if norm.log else F.softmax)(y, dim=-1)
    elif norm is not None and norm.rms:
        y = F.rms_norm(y, y.shape[-1:], gn_weight, norm.eps)
        y = y if gn_bias is None else y + gn_bias
    elif norm is not None and norm.layer:
        y = F.layer_norm(y, y.shape[-1:], gn_weight, gn_bias, norm.eps)
    elif norm is not None:
        y = F.group_norm(y, norm.num_groups, gn_weight, gn_bias, norm.eps)
    if norm is not None:
        y = apply_pointwise(y, epilogue.post, params)
    if epilogue.reduce is not None:
        if epilogue.reduce.pool > 1:
            y = F.max_pool1d(y.unsqueeze(1), epilogue.reduce.pool).squeeze(1)
        y = REDUCTION_FNS[epilogue.reduce.op](y, dim=1, keepdim=epilogue.reduce.keepdim)
        y = apply_pointwise(y, epilogue.tail, params)
    return y


def linear_epilogue(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: Epilogue,
    gn_weight: torch.Tensor | None = None,
    gn_bias: torch.Tensor | None = None,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``epilogue(x @ weight.T + bias)`` in plain PyTorch."""
    return apply_epilogue(F.linear(x, weight, bias), epilogue, gn_weight, gn_bias, params)
