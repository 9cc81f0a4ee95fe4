"""KernelBench's own method, written again here: how its eval loads a solution and times it.

Read from ScalingIntelligence/KernelBench (``src/kernelbench/eval.py``, ``timing.py``):

- ``load_custom_model``: with a build directory (its batch scripts pass one) two lines go before
  the solution, ``import os`` and ``os.environ['TORCH_EXTENSIONS_DIR'] = '<dir>'``; then
  ``compile(src, "<string>", "exec")`` and ``exec(src, context)``; ``ModelNew`` is read from the
  context.
- ``time_execution_with_cuda_event``: 3 warm-up calls (each synchronised), then per trial:
  synchronise, clear the L2 (fill a 256 MB tensor), CUDA events around one call, synchronise;
  the first trial is discarded; the runtime reported is the mean. The model is called as
  constructed: its parameters require grad and no ``no_grad`` is around the call, so autograd
  records every forward.

The benchmark (bench_harness.py) and the GPU tests time and load solutions through these, so
what they report is what KernelBench's eval would see.
"""

import re
import statistics
from collections.abc import Callable

import torch


def load_custom_model(source: str, build_directory: str | None = None) -> type:
    """``ModelNew`` of a solution file's text, loaded as KernelBench's eval loads it."""
    if build_directory:
        source = f"import os\nos.environ['TORCH_EXTENSIONS_DIR'] = '{build_directory}'\n{source}"
    context: dict = {}
    exec(compile(source, "<string>", "exec"), context)
    return context["ModelNew"]


def clear_l2_cache(device) -> None:
    """KernelBench's L2 clear: a 256 MB tensor filled in place."""
    dummy = torch.empty((32, 1024, 1024), dtype=torch.int64, device=device)
    dummy.fill_(42)
    del dummy


def time_cuda_events(
    fn: Callable, args, trials: int = 100, warmup: int = 3, discard_first: int = 1
) -> dict[str, float]:
    """KernelBench's ``time_execution_with_cuda_event``: {"mean", "median", "min", "max"} in ms
    over ``trials`` calls, each after an L2 clear; ``fn(*args)`` runs as given (autograd as the
    caller leaves it)."""
    device = torch.cuda.current_device()
    for _ in range(warmup):
        fn(*args)
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    times = []
    for trial in range(trials + discard_first):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        clear_l2_cache(device)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        if trial >= discard_first:
            times.append(start.elapsed_time(end))
    return {
        "mean": statistics.fmean(times),
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
    }


def _strip_comments(source: str) -> str:
    """KernelBench's comment stripper: each line cut at its first ``#``, then at its first ``//``
    (inside strings too: it is line-based, not a tokenizer)."""
    lines = []
    for line in source.split("\n"):
        line = line.split("#", 1)[0]
        lines.append(line.split("//", 1)[0])
    return "\n".join(lines)


# KernelBench's strict checks (kernel_static_checker.STRICT_CHECKS plus the CUDA backend's
# cuda_impl), as (message, patterns): any pattern found in the stripped text is an error.
_STRICT_PATTERNS = (
    ("Contains try-except block (potential fallback bypass)",
     (r"\btry\s*:", r"\bexcept\s*:", r"\bexcept\s+\w+")),
    ("Contains 'pass' statement (inheritance bypass)", (r"\bpass\b",)),
    ("Reassigns timing function (monkey patch detected)",
     (r"torch\.cuda\.Event\.record\s*=", r"torch\.cuda\.Event\.elapsed_time\s*=",
      r"torch\.cuda\.synchronize\s*=", r"torch\.cuda\.Event\s*=", r"time\.perf_counter\s*=",
      r"time\.time\s*=")),
    ("Uses threading, multiprocessing or concurrent futures (potential timing manipulation)",
     (r"threading\.Thread\s*\(", r"import\s+threading", r"from\s+threading\s+import",
      r"multiprocessing\.(Process|Pool|Manager|Queue|Pipe)", r"import\s+multiprocessing",
      r"concurrent\.futures", r"ThreadPoolExecutor", r"ProcessPoolExecutor")),
    ("Lazy tensor construction (potential lazy tensor hack)",
     (r"_make_subclass", r"class\s+\w+.*\(torch\.Tensor\)", r"class\s+\w+.*\(Tensor\)",
      r"torch\.Tensor\.__new__")),
)  # fmt: skip


def static_check_errors(source: str) -> list[str]:
    """The errors KernelBench's ``validate_kernel_static(source, backend="cuda")`` reports (its
    strict checks; the warnings are left out), each with the first line that matched."""
    code = _strip_comments(source)
    errors = []
    for message, patterns in _STRICT_PATTERNS:
        for pattern in patterns:
            match = re.search(pattern, code)
            if match:
                line = code.count("\n", 0, match.start()) + 1
                errors.append(f"{message}: {match.group(0)!r} at line {line}")
                break
    if "__global__" not in code:
        errors.append("Missing __global__ kernel definition")
    elif "load_inline" not in code and "cpp_extension" not in code:
        errors.append("Missing load_inline or cpp_extension for compilation")
    return errors
