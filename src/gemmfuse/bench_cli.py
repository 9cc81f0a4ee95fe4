"""``python -m gemmfuse bench``: every table of bench.py and bench_harness.py, printed and
written as JSON (the input of scripts/performance_doc.py)."""

import json
from dataclasses import asdict

import torch

from gemmfuse import bench_harness
from gemmfuse.bench import (
    check_reference_path,
    format_chains,
    format_modes,
    format_sweep,
    format_table,
    git_commit,
    run_chains,
    run_problem,
    run_speed_modes,
    run_sweep,
)


def main(
    numbers: list[int], json_path: str | None, seeds: int, iters: int, compile_: bool,
    modes: bool = True, sweep: bool = False, chains: bool = False, harness_trials: int = 100,
) -> int:  # fmt: skip
    if not torch.cuda.is_available():
        print("no CUDA GPU: checking the reference path on small shapes only; no timing")
        return 0 if check_reference_path(numbers) else 1
    results = [run_problem(n, seeds, iters, compile_) for n in numbers]
    harness_rows = [
        row for n in numbers if harness_trials for row in
        bench_harness.run_problem(n, harness_trials, compile_)
    ]  # fmt: skip
    mode_results = [m for n in numbers for m in run_speed_modes(n, iters)] if modes else []
    sweep_rows = run_sweep(iters) if sweep else []
    chain_rows = run_chains(iters) if chains else []
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "method": f"median of {iters} calls, CUDA events, L2 flushed before each call",
    }
    print(" | ".join(f"{k}: {v}" for k, v in meta.items()))
    print(format_table(results))
    if harness_rows:
        print(f"KernelBench's method: mean and median of {harness_trials} calls, L2 cleared")
        print(bench_harness.format_rows(harness_rows))
    if mode_results:
        print(format_modes(mode_results))
    if sweep_rows:
        print(format_sweep(sweep_rows))
    if chain_rows:
        print(format_chains(chain_rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {**meta, "results": [asdict(r) for r in results],
                 "modes": [asdict(m) for m in mode_results], "sweep": sweep_rows,
                 "harness": harness_rows, "harness_trials": harness_trials,
                 "chains": chain_rows},
                f, indent=2,
            )  # fmt: skip
    ok = all(r.correct for r in results) and all(r["correct"] for r in sweep_rows + chain_rows)
    return 0 if ok else 1
