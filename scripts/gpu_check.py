"""Everything the GPU must confirm, in one call; a short summary last.

First the cold builds of issue 12's bar, each in a fresh process with an empty cache: #62's
chain (with the host extension, built at the same time) and then #75's (its chain alone). Then
builds every kernel structure the tests and benchmark use (the shipped problems', the
random-chain pool's and the hand-written test models'), one process per structure and as many
at once as there are cores, times a second process's load from the cache, runs the GPU tests
(pytest -m gpu) and the benchmark (with the chain table). Output files go to $OUT (or
./gpu-check-out). Usage: python scripts/gpu_check.py [--quick] [--sweep] [--no-bench]
[--no-tests] [--no-cold] [--lazy-builds] [-k EXPR] [--files A,B] [--skip-files A,B]
[--workers N] [--split-gpus] [--test-timeout S].
- -k selects GPU tests as pytest's -k does; --files runs only those files of tests/gpu and
  --skip-files all but those, so that the suite can be split over calls that fit the device's
  10 minutes.
- --workers runs N pytest-xdist processes sharing the GPU, where xdist is installed (1117 tests
  in 196 s with 8 on the H100 machine; not for test_optimize.py, whose module fixture then built
  every export in parallel processes in each worker at once, which ran past 510 s, and under
  -n 12 past 420 s on two H200s in session 44; since then each worker takes its share of the
  cores and starts at its own place in the list, not yet timed on a GPU).
- --split-gpus, where more than one GPU is visible and pytest-xdist is installed (else it is
  ignored), runs the selected tests as one pytest process of --workers' N workers per GPU
  (N times the GPUs processes share the cores), each worker pinned to one GPU
  (tests/conftest.py's pin_worker_gpu), so that xdist hands tests to whichever worker is free
  on any GPU; test_parallel.py runs apart, without xdist, in a process that sees every GPU
  (beside the others on the same GPUs), with its own log and summary line.
- --test-timeout bounds pytest's seconds (540); a run it cuts short lists the tests still
  running in the summary (pytest -v names each as it finishes; a test past 300 s, or 80% of a
  shorter limit, dumps its threads' stacks into the log's stderr part).
- --no-cold skips the cold builds, for a second call on a machine that already ran them.
- --lazy-builds builds only the shipped problems' kernels (and the plain GEMM's) before the
  tests, which then build what they launch as they run, each structure once across the xdist
  workers (the build's file lock): on one GPU of 16 cores, building all of them first would
  take most of a 10-minute call (an estimate from 67 structures in 184 s on 64 cores, session
  48), while pytest -n 10 with lazy builds ran every GPU test file but test_parallel.py and
  test_optimize.py on one H200 in two calls of 293 and 406 s (session 49, run by hand); through
  this script with --workers 12 (session 50), all but those two and two others took one call
  and met its 520 s pytest limit with 30 of 1932 cases left, so split the files over calls
  with --files and --skip-files. With --no-tests the benchmark builds
  its random chains itself, within its time limit.
Where the tree travels without its own .git (the device tool's copy carries a stale one), set
GEMMFUSE_COMMIT to the commit that runs: the benchmark records it (gemmfuse.bench.git_commit).
Every log is written as its command runs, so a call killed from outside (the device tool's
limit) keeps what ran.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "gpu-check-out")
# GEMMFUSE_TEST_GPUS pins xdist workers to GPUs (tests/conftest.py): split_runs sets it, and only
# for the process it spreads, never inherited from the caller's shell.
ENV = {k: v for k, v in os.environ.items() if k != "GEMMFUSE_TEST_GPUS"}
ENV.update(PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
LOAD_SNIPPET = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "from gemmfuse.jit import CHAIN_PARTS, extension_for; "
    "from gemmfuse.kernelbench.registry import PROBLEMS; "
    "extension_for(PROBLEMS[62].structures[0], parts=CHAIN_PARTS[1:]); t2 = time.perf_counter(); "
    "print(f'{t2 - t1:.2f} s after import torch ({t1 - t0:.2f} s)')"
)
# A fresh process's first call of a shipped problem's ModelNew at KernelBench's size, autograd
# on as KernelBench times it (the build included); it prints the wall clock at which the call
# began (scripts/cold_build_profile.py's origin), then the call's seconds.
FIRST_CALL_SNIPPET = (
    "import sys, time, torch; from gemmfuse.kernelbench.registry import get_problem; "
    "p = get_problem(sys.argv[1]); m = p.load(); torch.manual_seed(0); "
    "model = p.model_new(*m.get_init_inputs()).cuda(); "
    "x = [t.cuda() for t in m.get_inputs()]; torch.cuda.synchronize(); "
    "print(f'begin {time.time():.3f}'); t = time.perf_counter(); "
    "model(*x); torch.cuda.synchronize(); print(f'first call {time.perf_counter() - t:.1f} s')"
)


def run(cmd: list[str], log: str, timeout: float = 420, env: dict | None = None) -> tuple[int, str]:
    """Runs cmd, its output written under OUT as it comes (stdout to ``log``, stderr beside it
    until the end), so that a call killed from outside keeps it; a hang is killed with every
    process it started (xdist's workers, a distributed test's ranks: its own session) and
    reported (rc 124). Returns the exit status and the log's final text."""
    print("$", " ".join(cmd), flush=True)
    path, err_path = OUT / log, OUT / f"{log}.stderr"
    with path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=out, stderr=err, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    stdout, stderr = path.read_text(errors="replace"), err_path.read_text(errors="replace")
    err_path.unlink()
    if rc is None:
        rc = 124
        # stderr apart: pytest's faulthandler dumps a stuck test's stacks there (kept apart, as
        # merged they could split a test's -v line from its result)
        text = f"TIMEOUT after {timeout} s\n{stdout}\n---- stderr ----\n{stderr}"
    else:
        text = stdout + stderr
    path.write_text(text)
    print(text[-6000:], flush=True)
    return rc, text


def sass_report(libraries: list[str]) -> str:
    """Counts the matrix and local-memory instructions of each kernel in built libraries."""
    runs = [subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True)
            for lib in libraries]  # fmt: skip
    proc = subprocess.CompletedProcess([], max(r.returncode for r in runs),
                                       "".join(r.stdout for r in runs),
                                       "".join(r.stderr for r in runs))  # fmt: skip
    (OUT / "sass.txt").write_text(proc.stdout)
    report, name = [], None
    counts: dict[str, dict[str, int]] = {}
    for line in proc.stdout.splitlines():
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            counts[name] = {"HGMMA": 0, "HMMA": 0, "LDL": 0, "STL": 0}
        elif name:
            for op in counts[name]:
                counts[name][op] += f" {op}" in line
    for name, c in counts.items():
        variant = re.search(r"GeneratedEpilogueLb(\d)ELb(\d)E", name)
        if "sm90" in name and variant:
            split, bf16 = variant.groups()
            short = "sm90[" + ("split" if split == "1" else "bf16" if bf16 == "1" else "tf32") + "]"
        elif "gemm_gn" in name:
            short = "sm90" if "sm90" in name else "sm80"
        else:
            short = re.sub(r"^_ZN8gemmfuse\d+", "", name)[:24]
        report.append(f"{short}: " + " ".join(f"{k}={v}" for k, v in c.items()))
    return (
        "SASS: " + "; ".join(report) if report else f"SASS: cuobjdump failed ({proc.stderr[:200]})"
    )


def every_structure() -> list[str]:
    """The reprs of every kernel structure the GPU tests and the benchmark launch."""
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from model_files import FIT, build

    from gemmfuse import Epilogue, optimize
    from gemmfuse.chains import (
        chain_pool,
        layer_norm_chain,
        softmax_chains,
        value_chain_pool,
        value_chains,
    )
    from gemmfuse.kernelbench.registry import PROBLEMS
    from gemmfuse.warmup import model_structures

    structures = [Epilogue()]  # the plain GEMM: the backward's products
    structures += [s.structure for p in PROBLEMS.values() for s in p.structures]
    structures += [c.structure for c in chain_pool() + value_chain_pool()]
    structures += [c.structure for c in value_chains() + softmax_chains()]
    structures += [
        layer_norm_chain(affine, rms).structure for affine in (True, False) for rms in (False, True)
    ]
    from gpu.test_plan import CHAINS as PLAN_CHAINS

    structures += [c.structure for c in PLAN_CHAINS.values()]
    for name in FIT:
        _, model, inputs = build(name)
        structures += model_structures(optimize(model, inputs)[0])
    return list(dict.fromkeys(repr(s) for s in structures))


def cold_builds() -> str:
    """First calls in fresh processes over an empty cache: #62 (host extension and chain built
    at once), then #75 (its chain alone); each with its build lines."""
    lines = []
    with tempfile.TemporaryDirectory() as empty:
        env = {**ENV, "GEMMFUSE_CACHE_DIR": empty}
        for number in ("62", "75"):
            proc = subprocess.run([sys.executable, "-c", FIRST_CALL_SNIPPET, number], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
            done = [ln for ln in proc.stderr.splitlines() if ln.startswith("gemmfuse: built")]
            built = [ln.removeprefix("gemmfuse: built ").split(",")[0] for ln in done]
            calls = [ln for ln in proc.stdout.splitlines() if ln.startswith("first call")]
            result = calls[-1] if calls else f"FAILED (rc {proc.returncode}): {proc.stderr[-400:]}"
            lines.append(f"#{number} {result} (built: {', '.join(built) or 'nothing'})")
    return "cold (fresh process, empty cache): " + "; ".join(lines)


def option(name: str) -> str | None:
    """The value after ``name`` on the command line, or None; exits with a message where the
    flag is given without one."""
    if name not in sys.argv:
        return None
    at = sys.argv.index(name) + 1
    if at >= len(sys.argv):
        sys.exit(f"gpu_check: {name} needs a value")
    return sys.argv[at]


def named_files(flag: str = "--files") -> list[str]:
    """A comma-separated option's names, empty ones dropped: --files' (files of tests/gpu, or
    pytest node ids in them), or --skip-files' (files of tests/gpu)."""
    return [name for name in (option(flag) or "").split(",") if name]


def test_selection() -> tuple[list[str], list[str]]:
    """(the paths pytest collects, its other arguments) for --files, --skip-files, --workers."""
    paths = [f"tests/gpu/{name}" for name in named_files()] or ["tests"]
    args = [f"--ignore=tests/gpu/{name}" for name in named_files("--skip-files")]
    workers = option("--workers")
    if workers:
        if xdist_installed():
            args += ["-n", workers]
        else:
            print("gpu_check: pytest-xdist is not installed; --workers ignored", flush=True)
    return paths, args


def xdist_installed() -> bool:
    """Whether pytest-xdist is here (on the GPU machine; not a dependency of the package)."""
    return importlib.util.find_spec("xdist") is not None


# pytest -v's lines for a test (its id may hold spaces: a parameter's words): with
# pytest-xdist its start alone, then "[gwN] [ x%] RESULT id"; without, "id RESULT [ x%]" on the
# line its start began ("SKIPPED (reason)" since pytest 9).
_RESULTS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_XDIST_RESULT = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] (?:{_RESULTS}) (tests/\S*?\.py::.*?) ?$")
_PLAIN_RESULT = re.compile(
    rf"^(tests/\S*?\.py::.*?) (?:{_RESULTS})(?: \(.*\))?(?: +\[\s*\d+%\])?\s*$"
)
_START = re.compile(r"^(tests/\S*?\.py::.*?) ?$")


def unfinished_tests(log: str) -> list[str]:
    """The tests a pytest -v log shows started and never finished, in the order they started:
    where a run killed at its time limit stood (a hang, or only a slow machine)."""
    started, finished = {}, set()
    for line in log.splitlines():
        result = _XDIST_RESULT.match(line) or _PLAIN_RESULT.match(line)
        if result:
            finished.add(result.group(1))
        elif start := _START.match(line):
            started.setdefault(start.group(1))
    return [name for name in started if name not in finished]


def pytest_command(paths: list[str], selection: list[str], timeout: float) -> list[str]:
    """pytest over `paths` with gpu_check's options: -v names each test as it finishes, so a
    run cut short by its time limit still says which ones were running; a test (setup included)
    running past faulthandler's timeout, set within the run's limit, dumps every thread's stack
    to stderr."""
    command = [sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-v", "-rs", "-p",
               "no:cacheprovider", "-o", f"faulthandler_timeout={min(300, 0.8 * timeout):.0f}",
               *selection]  # fmt: skip
    expression = option("-k")
    return command + ["-k", expression] if expression else command


def split_runs(gpus: int, timeout: float) -> list[tuple[str, list[str], dict]]:
    """(log, command, environment) of each pytest process of --split-gpus: the selected tests
    (--files, else every tests/gpu/test_*.py; less --skip-files) but test_parallel.py in one
    process of --workers' N workers per visible GPU, GEMMFUSE_TEST_GPUS naming the GPUs its
    workers are pinned to in turn, and test_parallel.py, where selected, in a process of its own
    that sees them all (its cases need two). A process per GPU over files dealt by size had left
    one GPU's files running past the limit (the loader tests' exports) while the other two had
    finished at 274 and 169 s (session 48)."""
    names = named_files() or sorted(f.name for f in (ROOT / "tests/gpu").glob("test_*.py"))
    skipped = set(named_files("--skip-files"))
    names = [n for n in names if n.split("::")[0] not in skipped]
    apart = [f"tests/gpu/{n}" for n in names if n.split("::")[0] == "test_parallel.py"]
    spread = [f"tests/gpu/{n}" for n in names if n.split("::")[0] != "test_parallel.py"]
    visible = [d.strip() for d in ENV.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = visible[:gpus] if visible else [str(i) for i in range(gpus)]  # those CUDA sees
    workers = int(option("--workers") or 1) * len(ids)
    runs = []
    if spread:
        env = {**ENV, "GEMMFUSE_TEST_GPUS": ",".join(ids)}
        runs.append(("pytest_gpus.log", pytest_command(spread, ["-n", str(workers)], timeout), env))
    if apart:
        runs.append(("pytest_parallel.log", pytest_command(apart, [], timeout), ENV))
    return runs


def check_test_files() -> None:
    """Exits with a message, before any build, where --files names a file tests/gpu lacks, or
    --split-gpus is given --workers other than a count (it runs that many on each GPU)."""
    workers = option("--workers")
    if "--split-gpus" in sys.argv and workers and not (workers.isdigit() and int(workers) > 0):
        sys.exit(f"gpu_check: --split-gpus takes --workers as a count a GPU, not {workers!r}")
    for name in named_files():
        if not (ROOT / "tests/gpu" / name.split("::")[0]).is_file():
            sys.exit(f"gpu_check: --files: tests/gpu has no {name.split('::')[0]}")


def combined_status(codes: list[int]) -> int:
    """One exit status for pytest runs: the first that is neither a pass nor pytest's "no tests
    collected" (5: a -k that selects nothing in one process's files), else 0 if any passed."""
    failing = [rc for rc in codes if rc not in (0, 5)]
    return failing[0] if failing else (0 if 0 in codes else 5)


def run_tests(summary: list[str], timeout: float) -> int:
    """Runs the GPU tests (one pytest, or --split-gpus' several at once) and notes each one's
    counts and the tests its time limit left running as it ends; returns combined_status."""
    gpus = torch.cuda.device_count()
    if "--split-gpus" in sys.argv and gpus > 1 and xdist_installed():
        runs = split_runs(gpus, timeout)
    else:
        if "--split-gpus" in sys.argv:
            print(f"gpu_check: --split-gpus ignored ({gpus} GPU(s), pytest-xdist "
                  f"{'installed' if xdist_installed() else 'missing'})", flush=True)  # fmt: skip
        paths, selection = test_selection()
        runs = [("pytest.log", pytest_command(paths, selection, timeout), ENV)]
    if not runs:
        note(summary, "GPU tests: no test files selected")
        return 5
    codes = []
    with ThreadPoolExecutor(len(runs)) as pool:
        started = {pool.submit(run, cmd, log, timeout, env): log for log, cmd, env in runs}
        for done in as_completed(started):
            log, (rc, text) = started[done], done.result()
            codes.append(rc)
            counts = re.findall(
                r"^=*\s*(\d+ (?:passed|failed|error|skipped).*?) in [\d.]+s", text, re.M
            )
            label = "" if log == "pytest.log" else f" ({log})"
            found = counts[-1] if counts else "no summary line"
            note(summary, f"GPU tests{label}: {found} (rc {rc})")
            running = unfinished_tests(text)
            if running:
                note(summary, f"unfinished ({len(running)}): {', '.join(running[:10])}")
    return combined_status(codes)


def note(summary: list[str], line: str) -> None:
    """Adds a summary line and prints it at once: a run cut short keeps what it measured."""
    summary.append(line)
    print(f"summary: {line}", flush=True)


def structures_to_build() -> list[str]:
    """What main builds before the tests: every structure, or with --lazy-builds the plain
    GEMM's and the shipped problems' (the SASS report and the second-process load read #62's);
    the tests build the rest as they run."""
    if "--lazy-builds" not in sys.argv:
        return every_structure()
    sys.path[:0] = [str(ROOT / "src")]
    from gemmfuse import Epilogue
    from gemmfuse.kernelbench.registry import PROBLEMS

    shipped = [Epilogue()] + [s.structure for p in PROBLEMS.values() for s in p.structures]
    return list(dict.fromkeys(repr(s) for s in shipped))


def main() -> int:
    check_test_files()
    quick = "--quick" in sys.argv
    OUT.mkdir(parents=True, exist_ok=True)
    structures = structures_to_build()
    from gemmfuse.build import cache_dir
    from gemmfuse.jit import CHAIN_PARTS, part_library
    from gemmfuse.kernelbench.registry import PROBLEMS
    from gemmfuse.warmup import build_in_processes

    summary = []
    note(summary, f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    if "--no-cold" not in sys.argv:
        note(summary, cold_builds())
    t = time.perf_counter()
    errors = build_in_processes(structures, env=ENV)
    print("\n".join(errors), flush=True)
    lazy = " (--lazy-builds: the tests build the rest)" if "--lazy-builds" in sys.argv else ""
    note(
        summary,
        f"build: {len(structures)} chains ({len(errors)} failed) in "
        f"{time.perf_counter() - t:.1f} s, {os.cpu_count()} at a time, into {cache_dir()}{lazy}",
    )
    chain62 = PROBLEMS[62].structures[0]
    note(summary, sass_report([str(part_library(chain62, part)) for part in CHAIN_PARTS[1:]]))
    _, load = run([sys.executable, "-c", LOAD_SNIPPET], "load.log")
    note(summary, f"second-process load from cache: {load.strip().splitlines()[-1]}")

    timeout = float(option("--test-timeout") or 540)
    rc_tests = 0 if "--no-tests" in sys.argv else run_tests(summary, timeout)
    if "--no-bench" in sys.argv:
        print("\n==== gpu-check summary ====\n" + "\n".join(summary))
        return rc_tests
    bench = [sys.executable, "-m", "gemmfuse", "bench", "--json", str(OUT / "bench.json")]
    bench += ["--chains"]
    if quick:
        bench += ["--seeds", "3", "--no-compile"]
    if "--sweep" in sys.argv:
        bench += ["--sweep"]
    rc_bench, text = run(bench, "bench.log", timeout=450)
    table = [ln for ln in text.splitlines() if ln.startswith("|") or ln.startswith("gpu:")]
    summary += [f"benchmark (rc {rc_bench}):", *table]
    print("\n==== gpu-check summary ====\n" + "\n".join(summary))
    return rc_tests or rc_bench


if __name__ == "__main__":
    sys.exit(main())
