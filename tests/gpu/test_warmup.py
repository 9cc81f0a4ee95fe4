"""``python -m gemmfuse warmup`` on the GPU: every kernel #62 needs is ready in the cache after
it, and a fresh process then loads them all without building."""

import subprocess
import sys

import pytest

from gemmfuse.warmup import structures_for

pytestmark = pytest.mark.gpu

# every part of each structure (a call loads only the parts it runs)
LOAD_ALL = (
    "from gemmfuse.jit import CHAIN_PARTS, extension_for\n"
    "from gemmfuse.warmup import structures_for\n"
    "for s in structures_for('62'):\n    extension_for(s, parts=CHAIN_PARTS[1:])\n"
)


def test_warmup_readies_every_structure_of_a_problem():
    n = len(structures_for("62"))
    proc = subprocess.run([sys.executable, "-m", "gemmfuse", "warmup", "62", "--jobs", "4"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{n} of {n} ready" in proc.stderr, proc.stderr
    assert (
        proc.stderr.count("gemmfuse warmup: built") + proc.stderr.count("gemmfuse warmup: cached")
        == n
    ), proc.stderr
    load = subprocess.run([sys.executable, "-c", LOAD_ALL], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert load.returncode == 0, load.stderr
    assert "gemmfuse: building" not in load.stderr, load.stderr
