"""scripts/gpu_check.py on the CPU: which tests a pytest -v log cut short had left running, what a
run killed at its time limit keeps, and how --split-gpus spreads the tests over the GPUs."""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import pin_worker_gpu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check import (  # noqa: E402
    check_test_files,
    combined_status,
    split_runs,
    structures_to_build,
    unfinished_tests,
)

A = "tests/gpu/test_a.py::test_one[62-hopper]"
B = "tests/gpu/test_b.py::test_two"
C = "tests/gpu/test_b.py::test_three[1-2]"


def test_xdist_starts_without_their_results_are_unfinished():
    log = "\n".join([
        "bringing up nodes...", f"{A} ", f"{B} ", f"[gw0] [ 33%] PASSED {A} ", f"{C} ",
        f"[gw1] [ 66%] FAILED {C} ",
    ])  # fmt: skip
    assert unfinished_tests(log) == [B]


def test_a_finished_run_leaves_none_the_summary_lines_aside():
    log = "\n".join([
        f"{A} ", f"[gw0] [ 50%] SKIPPED {A} ", f"{B} ", f"[gw1] [100%] ERROR {B} ",
        "=========================== short test summary info ============================",
        f"SKIPPED [1] {A.split('::')[0]}:12: needs two GPUs", f"ERROR {B} - RuntimeError",
        "====== 1 skipped, 1 error in 3.0s ======",
    ])  # fmt: skip
    assert unfinished_tests(log) == []


def test_ids_with_spaces_are_whole_and_unfinished_ones_keep_their_order():
    first = "tests/gpu/test_c.py::test_bad[<lambda>-2-D CUDA tensors0]"
    second = "tests/gpu/test_c.py::test_bad[<lambda>-2-D CUDA tensors1]"
    log = "\n".join([
        f"{first} ", f"{second} ", f"{A} ", f"[gw2] [ 10%] PASSED {first} ",
        f"{B} ", f"[gw3] [ 20%] PASSED {A} ",
    ])  # fmt: skip
    assert unfinished_tests(log) == [second, B]
    plain = f"{first} SKIPPED (needs two GPUs) [ 50%]\n{second} "
    assert unfinished_tests(plain) == [second]


def test_without_xdist_the_last_test_without_a_result_is_unfinished():
    log = "\n".join([f"{A} PASSED [ 33%]", f"{B} XFAIL [ 66%]", f"{C} "])
    assert unfinished_tests(log) == [C]
    assert unfinished_tests(f"TIMEOUT after 540 s\n{A} PASSED [ 50%]\n{B} ") == [B]


def test_a_run_past_its_limit_keeps_both_streams(monkeypatch, tmp_path):
    """A stuck test's stacks (faulthandler) are on stderr: the log of a killed run keeps them."""
    monkeypatch.setattr(gpu_check, "OUT", tmp_path)
    child = (
        "import sys, time; print('on stdout', flush=True); "
        "print('Timeout (0:05:00)!', file=sys.stderr, flush=True); time.sleep(30)"
    )
    rc, text = gpu_check.run([sys.executable, "-c", child], "stuck.log", timeout=2)
    assert rc == 124 and "TIMEOUT after 2 s" in text
    assert "on stdout" in text and "Timeout (0:05:00)!" in text
    assert (tmp_path / "stuck.log").read_text() == text


def test_a_log_holds_the_output_while_its_command_runs(monkeypatch, tmp_path):
    """A call killed from outside (the device tool's limit) keeps what its commands printed."""
    monkeypatch.setattr(gpu_check, "OUT", tmp_path)
    go = tmp_path / "go"
    child = (
        "import pathlib, time; print('early', flush=True); "
        f"go = pathlib.Path({str(go)!r}); t = time.time()\n"
        "while not go.exists() and time.time() - t < 30: time.sleep(0.05)"
    )
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(gpu_check.run, [sys.executable, "-c", child], "live.log", 60)
        log, deadline = tmp_path / "live.log", time.time() + 10
        while not (log.exists() and "early" in log.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        assert not done.done() and "early" in log.read_text()
        go.touch()
        rc, text = done.result()
    assert rc == 0 and text.startswith("early") and not (tmp_path / "live.log.stderr").exists()


def test_split_runs_spread_the_tests_over_workers_on_every_gpu_and_test_parallel_apart(
    monkeypatch,
):
    monkeypatch.setitem(gpu_check.ENV, "CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(gpu_check, "xdist_installed", lambda: True)
    names = "test_kernels.py,test_parallel.py,test_plan.py::test_x,test_tail.py"
    argv = ["--split-gpus", "--workers", "8", "--files", names, "--skip-files", "test_tail.py"]
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
    runs = split_runs(2, 540)
    assert [log for log, _, _ in runs] == ["pytest_gpus.log", "pytest_parallel.log"]
    (_, spread, env), (_, apart, env_apart) = runs
    assert [a for a in spread if a.startswith("tests/")] == [
        "tests/gpu/test_kernels.py", "tests/gpu/test_plan.py::test_x"]  # fmt: skip
    assert spread[spread.index("-n") + 1] == "16"  # 8 workers on each of the two GPUs
    assert env["GEMMFUSE_TEST_GPUS"] == "2,3" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert [a for a in apart if a.startswith("tests/")] == ["tests/gpu/test_parallel.py"]
    assert "-n" not in apart
    assert env_apart is gpu_check.ENV  # the environment gpu_check itself was given
    assert all("-v" in command and "gpu" in command for _, command, _ in runs)
    monkeypatch.setitem(gpu_check.ENV, "CUDA_VISIBLE_DEVICES", " 2, 3,4,")
    env = split_runs(2, 540)[0][2]  # the ids CUDA sees: the first two, spaces and blanks dropped
    assert env["GEMMFUSE_TEST_GPUS"] == "2,3"


def test_each_xdist_worker_sees_one_of_the_named_gpus_in_turn():
    seen = []
    for worker in ("gw0", "gw1", "gw2", "gw5"):
        environ = {"GEMMFUSE_TEST_GPUS": "2,3", "PYTEST_XDIST_WORKER": worker,
                   "CUDA_VISIBLE_DEVICES": "2,3"}  # fmt: skip
        pin_worker_gpu(environ)
        seen.append(environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["2", "3", "2", "3"]
    for environ in ({"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "2,3"},
                    {"GEMMFUSE_TEST_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "2,3"}):  # fmt: skip
        pin_worker_gpu(environ)  # not a worker, or no GPUs named: nothing changes
        assert environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_timeout_kills_the_processes_its_command_started(monkeypatch, tmp_path):
    """xdist's workers and a distributed test's ranks must not outlive a run cut short."""
    monkeypatch.setattr(gpu_check, "OUT", tmp_path)
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    rc, text = gpu_check.run([sys.executable, "-c", child], "tree.log", timeout=3)
    grandchild = int(text.splitlines()[1])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {grandchild} outlived the run")
    assert rc == 124


def test_the_runs_status_is_the_first_failure_and_no_tests_is_not_one():
    assert combined_status([0, 5]) == 0
    assert combined_status([5, 5]) == 5
    assert combined_status([0, -6, 1]) == -6  # a crashed process (a signal) is a failure
    assert combined_status([124, 0]) == 124


def test_files_that_tests_gpu_lacks_are_refused_before_any_build(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--files", "test_plan.py,test_nope.py"])
    with pytest.raises(SystemExit, match="no test_nope.py"):
        check_test_files()
    node = "test_plan.py::test_x"
    for argv in (["--files", node], ["--split-gpus", "--files", node]):
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
        check_test_files()  # node ids of files it has
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--split-gpus", "--workers", "auto"])
    with pytest.raises(SystemExit, match="a count a GPU, not 'auto'"):
        check_test_files()  # before any build, not in run_tests after them


def test_lazy_builds_build_the_plain_gemm_and_the_shipped_problems_alone(monkeypatch):
    """--lazy-builds: before the tests, the plain GEMM's structure and #62's and #75's; without
    it, every structure the tests and the benchmark launch."""
    from gemmfuse import Epilogue
    from gemmfuse.kernelbench.registry import PROBLEMS

    monkeypatch.setattr(gpu_check, "every_structure", lambda: ["every"])
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--lazy-builds"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the function puts src/ first
    shipped = [repr(Epilogue())] + [repr(s) for p in PROBLEMS.values() for s in p.structures]
    assert len(shipped) == 3 and structures_to_build() == shipped
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    assert structures_to_build() == ["every"]


def test_skip_files_read_one_way_by_either_run(monkeypatch):
    """--skip-files' names, empty ones dropped, leave one pytest process's collection and
    --split-gpus' file list alike (an empty name had ignored the whole of tests/gpu)."""
    monkeypatch.setattr(gpu_check, "xdist_installed", lambda: True)
    monkeypatch.setitem(gpu_check.ENV, "CUDA_VISIBLE_DEVICES", "0,1")
    argv = ["--files", "test_plan.py,test_tail.py", "--skip-files", "test_tail.py,"]
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
    paths, args = gpu_check.test_selection()
    assert paths == ["tests/gpu/test_plan.py", "tests/gpu/test_tail.py"]
    assert args == ["--ignore=tests/gpu/test_tail.py"]
    ((_, spread, _),) = split_runs(2, 540)
    assert [a for a in spread if a.startswith("tests/")] == ["tests/gpu/test_plan.py"]
