"""Where a cold first call's seconds go: a timeline of every compiler job it ran.

For each problem named (62, 75; default both, in that order, sharing one empty cache as
gpu_check's cold builds do), runs KernelBench's ModelNew's first call in a fresh process with
autograd on, then reads the build directories it left: the host extension's ninja log (each
translation unit's start and end, the link) and each chain's parts that the call built (a
part's source is written just before its nvcc starts, its library when nvcc ends). Prints
one line per job, in seconds from the moment the first call began, and the call's total.
Its figures for commits since the parts became libraries of their own (gemmfuse/jit.py) are in
docs/measurements/cold_builds_session43.txt and cold_builds_session44.txt.

Usage: python scripts/cold_build_profile.py [62] [75]   (on the GPU machine; PYTHONPATH=src)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_check import ENV, FIRST_CALL_SNIPPET, ROOT  # this folder is on sys.path


def ninja_jobs(build_dir: Path, begin: float) -> list[tuple[float, float, str]]:
    """(start, end, target) of each job in a ninja log, in seconds from ``begin``: the log's
    times count from ninja's start, taken as build.ninja's mtime (written just before)."""
    log = build_dir / ".ninja_log"
    if not log.exists():
        return []
    origin = (build_dir / "build.ninja").stat().st_mtime - begin
    jobs = []
    for line in log.read_text().splitlines()[1:]:
        start, end, _, target, _ = line.split("\t")
        jobs.append((origin + int(start) / 1e3, origin + int(end) / 1e3, target))
    return jobs


def part_jobs(build_dir: Path, begin: float) -> list[tuple[float, float, str]]:
    """(start, end, part) of each part of a chain (one nvcc, compiling and linking), from the
    files' mtimes: its source is written just before nvcc starts, its library when it ends."""
    jobs = []
    for source in sorted(build_dir.glob("*.cu")):
        library = build_dir / f"lib{build_dir.name}_{source.stem}.so"
        if library.exists():
            start, end = source.stat().st_mtime - begin, library.stat().st_mtime - begin
            jobs.append((start, end, source.name))
    return jobs


def profile(number: str, cache: Path) -> list[str]:
    """Runs one first call over ``cache``; returns the timeline's lines."""
    env = {**ENV, "GEMMFUSE_CACHE_DIR": str(cache)}
    before = {d.name for d in cache.iterdir() if d.is_dir()}
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL_SNIPPET, number], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    begins = [ln for ln in proc.stdout.splitlines() if ln.startswith("begin ")]
    if proc.returncode or not begins:
        return [f"#{number}: FAILED (rc {proc.returncode}): {proc.stderr[-600:]}"]
    begin = float(begins[0].split()[1])
    lines = [f"#{number}: {proc.stdout.splitlines()[-1]}"]
    lines += [f"  {ln}" for ln in proc.stderr.splitlines() if ln.startswith("gemmfuse: built")]
    for build_dir in sorted(d for d in cache.iterdir() if d.is_dir() and d.name not in before):
        jobs = ninja_jobs(build_dir, begin) + part_jobs(build_dir, begin)
        lines.append(f"  {build_dir.name}: {len(jobs)} jobs")
        for start, end, what in sorted(jobs):
            lines.append(f"    {start:6.2f} -> {end:6.2f}  ({end - start:5.2f} s)  {what}")
    return lines


def main() -> None:
    numbers = sys.argv[1:] or ["62", "75"]
    with tempfile.TemporaryDirectory() as empty:
        for number in numbers:
            print("\n".join(profile(number, Path(empty))), flush=True)


if __name__ == "__main__":
    main()
