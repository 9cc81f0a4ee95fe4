"""``python -m gemmfuse bench|export|warmup``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from gemmfuse.dispatch import PRECISIONS
from gemmfuse.kernelbench.registry import PROBLEMS, get_problem

WARMUP_DTYPES = ("float32", "bfloat16", "float16")


def _problem(text: str) -> int:
    try:
        return get_problem(text.strip()).number
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _problem_list(text: str) -> list[int]:
    return [_problem(p) for p in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gemmfuse", description="Fused GEMM epilogues.")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="check and time ModelNew against PyTorch (needs a GPU)")
    bench.add_argument(
        "--problems", type=_problem_list, default=sorted(PROBLEMS),
        help="comma-separated KernelBench L2 numbers (default: all shipped)",
    )  # fmt: skip
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument("--seeds", type=int, default=10, help="correctness seeds (default 10)")
    bench.add_argument("--iters", type=int, default=30, help="timed calls per median (>= 30)")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    bench.add_argument(
        "--no-modes", action="store_true", help='skip the precision="tf32", bf16 and fp16 rows'
    )
    bench.add_argument(
        "--trials", type=int, default=100,
        help="timed calls per row of the KernelBench-method table (default 100)",
    )  # fmt: skip
    bench.add_argument(
        "--no-harness", action="store_true",
        help="skip the KernelBench-method (autograd on) and training-step table",
    )  # fmt: skip
    bench.add_argument(
        "--sweep", action="store_true", help="also time #62's chain over a grid of shapes"
    )
    bench.add_argument(
        "--chains", action="store_true",
        help="also time random chains from the epilogue grammar at M=1024, K=N=8192",
    )  # fmt: skip
    export = sub.add_parser("export", help="print a standalone KernelBench ModelNew file")
    export.add_argument(
        "problem",
        help=f"a shipped problem ({', '.join(map(str, sorted(PROBLEMS)))}) or the path of a "
        "KernelBench problem file",
    )
    warmup = sub.add_parser(
        "warmup", help="build every kernel a model needs into the cache, in parallel (needs a GPU)"
    )
    warmup.add_argument(
        "targets", nargs="+", metavar="target",
        help=f"a shipped problem ({', '.join(map(str, sorted(PROBLEMS)))}) or the path of a "
        "KernelBench problem file; several are built together, each structure once",
    )  # fmt: skip
    warmup.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 4,
        help="builds at once (default: one per core)",
    )  # fmt: skip
    warmup.add_argument(
        "--dtype", action="append", choices=WARMUP_DTYPES, dest="dtypes",
        help="a dtype the model will run in, once per dtype (default: float32, a KernelBench "
        "problem's own); a kernel part for a dtype not named is built at its first call",
    )  # fmt: skip
    warmup.add_argument(
        "--precision", action="append", choices=tuple(PRECISIONS), dest="precisions",
        help="optimize's precision of its float32 models, once per precision (default: fp32, "
        "optimize's own)",
    )  # fmt: skip
    return p


def _warmup(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from gemmfuse.kernelbench.export import ExportError
    from gemmfuse.warmup import build_in_processes, structures_for

    jobs, targets = args.jobs, args.targets
    if jobs < 1:
        p.error(f"--jobs must be at least 1, got {jobs}")
    names = list(dict.fromkeys(args.dtypes or ["float32"]))
    if args.precisions and "float32" not in names:
        p.error("--precision is optimize's precision of float32 models: add --dtype float32")
    structures = []
    for target in targets:
        try:
            structures += structures_for(target)
        except ExportError as exc:
            print(f"gemmfuse warmup: {target}: {exc}", file=sys.stderr)
            return 2
        except ValueError as exc:
            p.error(f"{exc}, and {target!r} is not a file")
    structures = list(dict.fromkeys(structures))
    if not torch.cuda.is_available():
        print(
            "gemmfuse warmup: kernels are built for this machine's GPU, and torch sees no CUDA "
            "device",
            file=sys.stderr,
        )
        return 2
    precisions = list(dict.fromkeys(args.precisions or ["fp32"]))
    print(
        f"gemmfuse warmup: {len(structures)} kernel structure(s) for {', '.join(names)} "
        f"models (precision {', '.join(precisions)}), {jobs} at a time",
        file=sys.stderr,
    )
    start = time.perf_counter()

    def done(structure: str, outcome: str, seconds: float) -> None:
        print(f"gemmfuse warmup: {outcome} in {seconds:.1f} s: {structure}", file=sys.stderr)

    dtypes = [getattr(torch, name) for name in names]
    errors = build_in_processes(
        structures, jobs, on_done=done, dtypes=dtypes, precisions=precisions
    )
    for error in errors:
        print(error, file=sys.stderr)
    print(f"gemmfuse warmup: {len(structures) - len(errors)} of {len(structures)} ready in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)  # fmt: skip
    return 1 if errors else 0


def _export(p: argparse.ArgumentParser, problem: str) -> int:
    from gemmfuse.kernelbench.export import (
        ExportError,
        standalone_source,
        standalone_source_for_file,
    )

    if Path(problem).is_file():
        try:
            source, report = standalone_source_for_file(problem)
        except ExportError as exc:
            print(f"gemmfuse export: {exc}", file=sys.stderr)
            return 2
        print(report, file=sys.stderr)  # stdout is the file
        sys.stdout.write(source)
        return 0
    try:
        number = get_problem(problem).number
    except ValueError as exc:
        p.error(f"{exc}, and {problem!r} is not a file")
    sys.stdout.write(standalone_source(number))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "export":
        return _export(p, args.problem)
    if args.command == "warmup":
        return _warmup(p, args)
    if args.iters < 30 or args.seeds < 1:
        parser().error("--iters must be >= 30 and --seeds >= 1")
    from gemmfuse.bench_cli import main as bench_main

    return bench_main(
        args.problems, args.json, args.seeds, args.iters, not args.no_compile,
        modes=not args.no_modes, sweep=args.sweep, chains=args.chains,
        harness_trials=0 if args.no_harness else args.trials,
    )  # fmt: skip
