import subprocess
import sys

import pytest
import torch


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "gemmfuse", *args], capture_output=True, text=True, timeout=300
    )


def test_export_prints_a_model_new():
    proc = cli("export", "75")
    assert proc.returncode == 0, proc.stderr
    assert "class ModelNew(nn.Module)" in proc.stdout


def test_unknown_problem_is_a_usage_error():
    proc = cli("export", "99")
    assert proc.returncode == 2 and "gemmfuse ships problems [62, 75]" in proc.stderr


def test_too_few_iterations_refused():
    proc = cli("bench", "--iters", "5")
    assert proc.returncode == 2 and "--iters must be >= 30" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_bench_without_gpu_checks_reference_and_exits_zero():
    proc = cli("bench", "--problems", "62,75")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("no CUDA GPU")
    assert "#62: reference path ok" in proc.stdout and "#75: reference path ok" in proc.stdout
    assert " ms" not in proc.stdout
