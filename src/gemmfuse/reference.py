"""The PyTorch semantics of a fused linear chain: the test oracle and the portable fallback.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemmfuse.epilogue import POINTWISE, Epilogue, Pointwise


def apply_pointwise(v: torch.Tensor, ops: tuple[Pointwise, ...]) -> torch.Tensor:
    for op in ops:
        v = POINTWISE[op.name].torch(v, *op.scalars)
    return v


def apply_epilogue(
    y: torch.Tensor,
    epilogue: Epilogue,
    gn_weight: torch.Tensor | None = None,
    gn_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Applies ``epilogue`` to the GEMM result ``y`` of shape (M, N), as PyTorch would."""
    y = apply_pointwise(y, epilogue.pre)
    if epilogue.norm is not None:
        y = F.group_norm(y, epilogue.norm.num_groups, gn_weight, gn_bias, epilogue.norm.eps)
        y = apply_pointwise(y, epilogue.post)
    if epilogue.reduce is not None:
        reduce = {"min": torch.amin, "max": torch.amax, "sum": torch.sum}[epilogue.reduce.op]
        y = reduce(y, dim=1, keepdim=epilogue.reduce.keepdim)
    return y


def linear_epilogue(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: Epilogue,
    gn_weight: torch.Tensor | None = None,
    gn_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``epilogue(x @ weight.T + bias)`` in plain PyTorch."""
    return apply_epilogue(F.linear(x, weight, bias), epilogue, gn_weight, gn_bias)
