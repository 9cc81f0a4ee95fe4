"""The problems gemmfuse ships, by KernelBench Level-2 number."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from gemmfuse.epilogue import Epilogue
from gemmfuse.kernelbench.models import (
    ModelNew62,
    ModelNew75,
    epilogue_62,
    epilogue_75,
    traced_specs_62,
    traced_specs_75,
)


@dataclass(frozen=True)
class Problem:
    number: int
    name: str
    module: str  # under gemmfuse.kernelbench.problems
    model_new: type
    epilogue_fn: Callable[..., Epilogue]  # builds the chain ModelNew runs; exports copy it
    traced_specs_fn: Callable[..., tuple]  # the chain as a compiled graph holds it; copied too
    epilogue_args: tuple  # any valid arguments of epilogue_fn (values do not matter)
    small_init: tuple  # constructor arguments of a CPU-sized instance

    def load(self) -> ModuleType:
        return importlib.import_module(f"gemmfuse.kernelbench.problems.{self.module}")

    @property
    def structures(self) -> tuple[Epilogue, ...]:
        """Every kernel structure ModelNew can launch (the GPU scripts build and check these)."""
        return (self.epilogue_fn(*self.epilogue_args).structure,)


PROBLEMS = {
    62: Problem(
        number=62,
        name="Matmul_GroupNorm_LeakyReLU_Sum",
        module="p62_matmul_groupnorm_leakyrelu_sum",
        model_new=ModelNew62,
        epilogue_fn=epilogue_62,
        traced_specs_fn=traced_specs_62,
        epilogue_args=(8, 1e-5, True, 0.01),
        small_init=(96, 64, 8),
    ),
    75: Problem(
        number=75,
        name="Gemm_GroupNorm_Min_BiasAdd",
        module="p75_gemm_groupnorm_min_biasadd",
        model_new=ModelNew75,
        epilogue_fn=epilogue_75,
        traced_specs_fn=traced_specs_75,
        epilogue_args=(8, 1e-5, True),
        small_init=(96, 64, 8, (1, 64, 1, 1)),
    ),
}


def get_problem(number: int | str) -> Problem:
    try:
        return PROBLEMS[int(number)]
    except (KeyError, ValueError):
        raise ValueError(
            f"unknown problem {number!r}; gemmfuse ships problems {sorted(PROBLEMS)}"
        ) from None
