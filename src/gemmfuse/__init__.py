"""gemmfuse: fused CUDA kernels for Linear -> GroupNorm -> pointwise/reduction chains."""

import torch

import gemmfuse.library  # noqa: F401  (registers the gemmfuse:: torch.library ops)
from gemmfuse.build import BuildError
from gemmfuse.dispatch import FallbackWarning
from gemmfuse.epilogue import (
    POINTWISE,
    REDUCTIONS,
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    Value,
)
from gemmfuse.epilogue_op import fused_epilogue, fused_epilogue_with_path
from gemmfuse.modules import FusedLinear
from gemmfuse.ops import fused_linear, fused_linear_with_path
from gemmfuse.optimize import OptimizeReport, optimize
from gemmfuse.weight_cache import SplitWeightCache

__version__ = "0.1.0"


def __getattr__(name: str):
    # gemmfuse.parallelize imports torch.distributed's DTensor only when first asked for
    if name == "parallelize":
        from gemmfuse.parallel import parallelize

        return parallelize
    raise AttributeError(f"module 'gemmfuse' has no attribute {name!r}")


__all__ = [
    "POINTWISE",
    "REDUCTIONS",
    "BuildError",
    "Epilogue",
    "FallbackWarning",
    "FusedLinear",
    "GroupNormSpec",
    "OptimizeReport",
    "Param",
    "Pointwise",
    "Reduction",
    "SplitWeightCache",
    "Value",
    "fused_epilogue",
    "fused_epilogue_with_path",
    "fused_linear",
    "fused_linear_with_path",
    "optimize",
]
if torch.distributed.is_available():  # parallelize needs torch.distributed's DTensor
    __all__.append("parallelize")
