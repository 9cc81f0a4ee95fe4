import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_every_cuda_source_compiles_for_sm90a_and_sm80():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout
