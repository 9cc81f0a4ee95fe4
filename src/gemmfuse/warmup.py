"""Building a model's kernels ahead of time: ``python -m gemmfuse warmup 62|75|FILE.py``.

A chain's first call builds the parts of its library that it runs (seconds of nvcc each, beside
the host extension's build on a machine's first call). ``warmup`` finds every kernel structure a
model needs and builds them in parallel child processes into the disk cache that later processes
load from (a cached one is found, not rebuilt): the structures of a shipped problem, or those
``optimize`` swaps into a KernelBench problem file's Model (built on the meta device), and always
the plain GEMM's, on which the backward's products run (and the forward's GEMM of a chain run
apart, dispatch.chain_apart); of each, the parts that models of the dtypes and precisions asked
for run (parts_for_models; the CLI's default float32 at fp32).
"""

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gemmfuse.dispatch import MODEL16, PRECISIONS
from gemmfuse.epilogue import Epilogue
from gemmfuse.jit import CHAIN_PARTS
from gemmfuse.kernelbench.registry import get_problem
from gemmfuse.modules import FusedLinear

# The child's program: the structure arrives as its repr (an expression of gemmfuse.epilogue's
# names), the parts to build as their names, and build.py prints "gemmfuse: building ..." on
# stderr only when it compiles. {builder}: the package's (gemmfuse.jit: the parts named, where a
# call builds those it runs) or a standalone export's (gemmfuse.sources: one load_inline library
# holding every part, which an exported file then finds in the cache).
_BUILD_ONE = (
    "import sys\nfrom gemmfuse.epilogue import *\n"
    "from {builder} import extension_for\nextension_for(eval(sys.argv[1]), parts=sys.argv[2:])"
)


def structures_for(target: str) -> list[Epilogue]:
    """The kernel structures a shipped problem (its number) or a KernelBench problem file (its
    path) needs, the plain GEMM's first. Raises ValueError for an unknown problem number and
    ExportError for a file whose Model has nothing to swap."""
    if Path(target).is_file():
        from gemmfuse.kernelbench.export import optimize_problem_file

        found = model_structures(optimize_problem_file(target)[0])
    else:
        found = [s.structure for s in get_problem(target).structures]
    return list(dict.fromkeys([Epilogue(), *found]))


def model_structures(model) -> list[Epilogue]:
    """The kernel structures an optimized model's FusedLinears launch (as their settings are
    now: a BatchNorm1d in training mode splits its chain in two)."""
    return [s for m in model.modules() if isinstance(m, FusedLinear) for s in m.kernel_structures]


def parts_for_models(parts: tuple[str, ...], dtypes, precisions=("fp32",)) -> tuple[str, ...]:
    """Those of ``parts`` (files of csrc/chain/) that calls of models in ``dtypes`` at these
    ``precisions`` (optimize's; a sequence, or one name) may run: each that
    dispatch.forward_parts picks for such a dtype and precision on some path such a call can
    take, and a float32 backward's products. So it leaves out: the 16-bit instances of the
    dtypes not named; the portable kernel for bfloat16 alone; chain_sm90_one_pass.cu unless a
    float32 model runs at a precision that does not split; chain_gemv.cu and chain_epilogue.cu
    unless a model is float32 (the few-rows kernel runs float32 calls alone, dispatch.gemv_fits,
    as does the float32 chain kernel); chain_sm90_split.cu unless a float32 model runs at a
    precision that splits (a chain apart, dispatch.chain_apart, and the backward's split
    products both need one)."""
    precisions = (precisions,) if isinstance(precisions, str) else tuple(precisions)
    for p in precisions:
        if p not in PRECISIONS:
            raise ValueError(f"gemmfuse: precision {p!r} is not one of {tuple(PRECISIONS)}")
    dtypes = set(dtypes)
    float32, splits = torch.float32 in dtypes, {PRECISIONS[p] for p in precisions}
    needed = {
        "chain_gemv.cu": float32,
        "chain_epilogue.cu": float32,
        "chain_sm90_split.cu": float32 and True in splits,
        "chain_sm90_bf16.cu": torch.bfloat16 in dtypes,
        "chain_sm90_fp16.cu": torch.float16 in dtypes,
        "chain_epilogue_16bit.cu": bool(dtypes.intersection(MODEL16)),
        "chain_sm90_one_pass.cu": float32 and False in splits,
        # forward_parts sends bf16 to its own kernel whatever the kernel code (float16 off the
        # Hopper kernel too, where select_path gives such calls to PyTorch: kept, as it asks)
        "chain_sm80.cu": bool(dtypes - {torch.bfloat16}),
    }
    return tuple(p for p in parts if needed.get(p, True))


def build_in_processes(
    structures: Iterable[Epilogue | str],
    jobs: int | None = None,
    env: dict | None = None,
    on_done: Callable[[str, str, float], None] | None = None,
    standalone: bool = False,
    dtypes: Iterable[torch.dtype] | None = None,
    precisions: Iterable[str] | str = ("fp32",),
) -> list[str]:
    """Builds each structure (an Epilogue or its repr) into the disk cache in its own process,
    ``jobs`` at a time (default: one per core); ``on_done(structure, outcome, seconds)`` hears
    of each as it ends, outcome "built", "cached" or "FAILED". ``standalone``: build them as a
    standalone export does. ``dtypes``: build only the parts that models in these dtypes, at
    these ``precisions``, run (parts_for_models; default: every part). Returns an
    error message per failed build."""
    program = _BUILD_ONE.format(builder="gemmfuse.sources" if standalone else "gemmfuse.jit")
    parts = CHAIN_PARTS[1:]
    if dtypes is not None:
        parts = parts_for_models(parts, dtypes, precisions)

    def build(structure: str) -> str:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", program, structure, *parts], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            outcome = "FAILED"
        else:
            outcome = "built" if "gemmfuse: building" in proc.stderr else "cached"
        if on_done is not None:
            on_done(structure, outcome, time.perf_counter() - start)
        return f"BUILD FAILED {structure}\n{proc.stderr[-3000:]}" if proc.returncode else ""

    names = [s if isinstance(s, str) else repr(s) for s in structures]
    with ThreadPoolExecutor(jobs or os.cpu_count() or 4) as pool:
        return [error for error in pool.map(build, names) if error]
