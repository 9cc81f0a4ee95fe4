"""gemmfuse.optimize on the GPU: every hand-written KernelBench-format model, optimized, and its
standalone export, against eager PyTorch.

Bar: allclose(eager fp32, atol=rtol=1e-4), and max abs error against a float64 copy of the model
within helpers.float64_bar: eager fp32's plus the model's own fp32 rounding (as in
test_chains.py: the error of the model with each Linear computed exactly and rounded to fp32),
with its measured small-problem allowance (these models have K <= 128); every FusedLinear on the
fused path (the kernel is forced, so the small-problem rule does not apply) except where a
chain's operands keep it on PyTorch.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from model_files import FIT, build, load, path_of

from gemmfuse import FallbackWarning, FusedLinear, optimize
from gemmfuse.kernelbench.export import standalone_source_for_file
from helpers import float64_bar, max_abs_err, run_both

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# (model file, Linear path) -> why that FusedLinear takes the PyTorch path on the GPU.
TORCH_PATH = {
    ("scalar_tensor_attributes", "fc"): "a plain tensor attribute stays on the CPU under .to()",
}


@pytest.fixture(params=["hopper", "portable"])
def kernel(request):
    if request.param == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    return request.param


BUILD = "from gemmfuse.epilogue import *\nfrom gemmfuse.sources import extension_for\n"


@pytest.fixture(scope="module", autouse=True)
def built_extensions():
    """Every kernel structure the model files need, built into the disk cache by parallel
    processes first (one process builds one at a time); a failed build fails its tests."""
    structures = set()
    for name in FIT:
        _, model, inputs = build(name)
        new, _ = optimize(model, inputs)
        structures |= {repr(m.epilogue.structure) for m in new.modules()
                       if isinstance(m, FusedLinear)}  # fmt: skip
    pending = sorted(structures)
    while pending:
        batch, pending = pending[:8], pending[8:]
        procs = [subprocess.Popen([sys.executable, "-c", f"{BUILD}extension_for({s})"])
                 for s in batch]  # fmt: skip
        for proc in procs:
            proc.wait()


class ExactLinear(nn.Module):
    """A Linear computed in float64 and rounded to the model's dtype once."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        w, b = self.linear.weight, self.linear.bias
        y = F.linear(x.double(), w.double(), None if b is None else b.double())
        return y.to(x.dtype)


def op_floor(ref: nn.Module, x, exact) -> float:
    """Max error of the model's fp32 ops alone, on exactly rounded Linear results."""
    floor = copy.deepcopy(ref)
    for name, m in list(floor.named_modules()):
        if type(m) is nn.Linear:
            floor.set_submodule(name, ExactLinear(m))
    with torch.no_grad():
        return max_abs_err(floor(x), exact)


def check(name, ref, new, x, fused_modules):
    expect, exact, got = run_both(ref, new, x)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    err, err_eager = max_abs_err(got, exact), max_abs_err(expect, exact)
    bar = float64_bar(err_eager, op_floor(ref, x, exact), exact, strict=False)
    assert err <= bar, (err, err_eager, bar)
    for path, m in fused_modules:
        expected = "torch" if (name, path) in TORCH_PATH else "fused"
        assert m.last_path == expected, (path, m.last_path)


@pytest.mark.parametrize("name", FIT)
def test_optimized_model(name, kernel):
    _, ref, inputs = build(name, device=CUDA)
    new, report = optimize(ref, inputs, kernel=kernel)
    assert report.fused and all(r.verified for r in report.fused)
    fused = [(p, m) for p, m in new.named_modules() if isinstance(m, FusedLinear)]
    check(name, ref, new, inputs[0], fused)


@pytest.mark.parametrize("name", FIT)
def test_exported_file(name, kernel):
    namespace: dict = {}
    exec(standalone_source_for_file(path_of(name))[0], namespace)
    module = load(name)
    init = module.get_init_inputs()
    torch.manual_seed(3)
    ref = module.Model(*init).to(CUDA)
    torch.manual_seed(3)
    new = namespace["ModelNew"](*init).to(CUDA)
    new.kernel = kernel
    torch.manual_seed(4)
    x = module.get_inputs()[0].to(CUDA)
    with torch.no_grad():
        new(x)  # the first call optimizes (checking each chain on these inputs)
    optimized = new.__dict__["_gemmfuse"][0]
    fused = [(p, m) for p, m in optimized.named_modules() if type(m).__name__ == "FusedLinear"]
    check(name, ref, new, x, fused)


def test_fallback_on_cuda_warns():
    _, ref, inputs = build("activations_no_norm", device=CUDA)
    new, _ = optimize(ref, inputs, kernel="portable")
    x = inputs[0].reshape(4, -1, inputs[0].shape[1])
    with pytest.warns(FallbackWarning, match="not a 2-D tensor"):
        with torch.no_grad():
            got = new(x)
    assert new.fc.last_path == "fallback"
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x), rtol=0, atol=0)


def test_to_cuda_after_optimize_moves_everything():
    _, ref, inputs = build("per_channel_operands")
    new, _ = optimize(ref, inputs, kernel="portable")
    new.to(CUDA)
    x = inputs[0].to(CUDA)
    check("per_channel_operands", ref, new, x, [("fc", new.fc)])
