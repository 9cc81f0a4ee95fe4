"""scripts/gpu_check.py on the CPU: which tests a pytest -v log cut short had left running, and
what a run killed at its time limit keeps."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check import unfinished_tests  # noqa: E402

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
