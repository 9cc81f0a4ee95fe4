"""gemmfuse: fused CUDA kernels for Linear -> GroupNorm -> pointwise/reduction chains."""

from gemmfuse.build import BuildError
from gemmfuse.epilogue import (
    POINTWISE,
    REDUCTIONS,
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
)
from gemmfuse.ops import FallbackWarning, SplitWeightCache, fused_linear, fused_linear_with_path

__version__ = "0.1.0"

__all__ = [
    "POINTWISE",
    "REDUCTIONS",
    "BuildError",
    "Epilogue",
    "FallbackWarning",
    "GroupNormSpec",
    "Param",
    "Pointwise",
    "Reduction",
    "SplitWeightCache",
    "fused_linear",
    "fused_linear_with_path",
]
