"""gemmfuse: fused CUDA kernels for Linear -> GroupNorm -> pointwise/reduction chains."""

from gemmfuse.build import BuildError
from gemmfuse.epilogue import POINTWISE, Epilogue, GroupNormSpec, Pointwise, Reduction
from gemmfuse.ops import FallbackWarning, SplitWeightCache, fused_linear, fused_linear_with_path

__version__ = "0.1.0"

__all__ = [
    "POINTWISE",
    "BuildError",
    "Epilogue",
    "FallbackWarning",
    "GroupNormSpec",
    "Pointwise",
    "Reduction",
    "SplitWeightCache",
    "fused_linear",
    "fused_linear_with_path",
]
