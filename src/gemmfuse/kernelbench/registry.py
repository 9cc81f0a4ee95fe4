"""The problems gemmfuse ships, by KernelBench Level-2 number."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from gemmfuse.epilogue import Epilogue, GroupNormSpec, Pointwise, Reduction
from gemmfuse.kernelbench.models import ModelNew62, ModelNew75


@dataclass(frozen=True)
class Problem:
    number: int
    name: str
    module: str  # under gemmfuse.kernelbench.problems
    model_new: type
    # Every kernel structure ModelNew can launch: the fused chain, and the GEMM-only kernel of
    # the fallback for groups that do not fit a tile. Exports embed exactly these.
    structures: tuple[Epilogue, ...]
    small_init: tuple  # constructor arguments of a CPU-sized instance

    def load(self) -> ModuleType:
        return importlib.import_module(f"gemmfuse.kernelbench.problems.{self.module}")


_NORM = GroupNormSpec(1)
PROBLEMS = {
    62: Problem(
        62, "Matmul_GroupNorm_LeakyReLU_Sum", "p62_matmul_groupnorm_leakyrelu_sum", ModelNew62,
        (
            Epilogue(norm=_NORM, post=(Pointwise("leaky_relu", (0.0,)), Pointwise("add_self"))),
            Epilogue(),
        ),
        (96, 64, 8),
    ),
    75: Problem(
        75, "Gemm_GroupNorm_Min_BiasAdd", "p75_gemm_groupnorm_min_biasadd", ModelNew75,
        (Epilogue(norm=_NORM, reduce=Reduction("min", keepdim=True)), Epilogue()),
        (96, 64, 8, (1, 64, 1, 1)),
    ),
}  # fmt: skip


def get_problem(number: int | str) -> Problem:
    try:
        return PROBLEMS[int(number)]
    except (KeyError, ValueError):
        raise ValueError(
            f"unknown problem {number!r}; gemmfuse ships problems {sorted(PROBLEMS)}"
        ) from None
