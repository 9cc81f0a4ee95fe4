"""ModelNew for KernelBench L2 #62 and #75.

Each class takes its problem Model's constructor arguments and creates the same parameters, in
the same order, with the same initialisers and names, so seeded construction gives identical
weights and state_dicts load either way. Forward runs ``fused_linear``: one fused kernel on a
CUDA float32 input, the PyTorch reference elsewhere. ``last_path`` records the path taken;
setting ``kernel`` to "portable" or "hopper" forces that fused kernel, and ``precision`` to
"tf32" opts into the one-pass speed mode (see ``fused_linear``).

``gemmfuse export`` copies these classes (renamed ``ModelNew``) into standalone files, so they
use only torch and names from the standalone-safe modules.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from gemmfuse.epilogue import Epilogue, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.ops import SplitWeightCache, fused_linear_with_path


@functools.lru_cache(maxsize=64)
def epilogue_62(num_groups, eps, affine, negative_slope) -> Epilogue:
    """#62's chain; one object per distinct value set, so its derived data is computed once."""
    return Epilogue(
        norm=GroupNormSpec(num_groups, eps, affine),
        post=(Pointwise("leaky_relu", (negative_slope,)), Pointwise("add_self")),
    )


@functools.lru_cache(maxsize=64)
def epilogue_75(num_groups, eps, affine) -> Epilogue:
    """#75's chain: the row minimum in the kernel, then the bias add as PyTorch broadcasts it,
    (M, 1) + (1, C, 1, 1) -> (1, C, M, 1)."""
    return Epilogue(
        norm=GroupNormSpec(num_groups, eps, affine),
        reduce=Reduction("min", keepdim=True),
        tail=(Pointwise("add", (Param(0),)),),
    )


class ModelNew62(nn.Module):
    """#62: Linear -> GroupNorm -> LeakyReLU -> x + x."""

    def __init__(self, input_size, hidden_size, num_groups, eps=1e-5, negative_slope=0.01):
        super().__init__()
        self.fc = nn.Linear(input_size, hidden_size)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=hidden_size, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)
        self.weight_split = SplitWeightCache()
        self.kernel = "auto"
        self.precision = "fp32"
        self.last_path = None

    def forward(self, x):
        gn = self.gn
        epilogue = epilogue_62(
            gn.num_groups, gn.eps, gn.affine, float(self.leaky_relu.negative_slope)
        )
        out, self.last_path = fused_linear_with_path(
            x, self.fc.weight, self.fc.bias, epilogue, gn.weight, gn.bias,
            weight_cache=self.weight_split, kernel=self.kernel, precision=self.precision,
        )  # fmt: skip
        return out


class ModelNew75(nn.Module):
    """#75: Linear -> GroupNorm -> min over channels (keepdim) -> + bias (1, C, 1, 1)."""

    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.weight_split = SplitWeightCache()
        self.kernel = "auto"
        self.precision = "fp32"
        self.last_path = None

    def forward(self, x):
        gn = self.group_norm
        epilogue = epilogue_75(gn.num_groups, gn.eps, gn.affine)
        out, self.last_path = fused_linear_with_path(
            x, self.gemm.weight, self.gemm.bias, epilogue, gn.weight, gn.bias,
            params=(self.bias,), weight_cache=self.weight_split, kernel=self.kernel,
            precision=self.precision,
        )  # fmt: skip
        return out
