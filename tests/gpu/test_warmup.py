"""``python -m gemmfuse warmup`` on the GPU: every kernel #62 needs is ready in the cache after
it, and a fresh process then loads them all, and runs a forward and backward, without
building."""

import os
import subprocess
import sys

import pytest

from gemmfuse.warmup import structures_for

pytestmark = pytest.mark.gpu

# every float32 part of each structure (a call loads only the parts it runs), then a call
LOAD_ALL = (
    "import torch\n"
    "from gemmfuse.jit import CHAIN_PARTS, extension_for\n"
    "from gemmfuse.warmup import parts_for_models, structures_for\n"
    "for s in structures_for('62'):\n"
    "    extension_for(s, parts=parts_for_models(CHAIN_PARTS[1:], [torch.float32]))\n"
    "from gemmfuse.bench import cuda_pair\n"
    "_, module, _, new = cuda_pair(62)\n"
    "x = module.get_inputs()[0].cuda().requires_grad_()\n"
    "new(x).sum().backward()\n"
    "torch.cuda.synchronize()\n"
    "assert x.grad is not None and torch.isfinite(x.grad).all()\n"
)


def test_warmup_readies_every_structure_of_a_problem(tmp_path):
    """Over a cache of its own: what the fresh process finds there is warmup's alone, not what
    the suite's other tests built."""
    env = {**os.environ, "GEMMFUSE_CACHE_DIR": str(tmp_path)}
    n = len(structures_for("62"))
    proc = subprocess.run([sys.executable, "-m", "gemmfuse", "warmup", "62", "--jobs", "4"],
                          capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{n} of {n} ready" in proc.stderr, proc.stderr
    assert (
        proc.stderr.count("gemmfuse warmup: built") + proc.stderr.count("gemmfuse warmup: cached")
        == n
    ), proc.stderr
    load = subprocess.run([sys.executable, "-c", LOAD_ALL], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert load.returncode == 0, load.stderr
    assert "gemmfuse: building" not in load.stderr, load.stderr
