"""gemmfuse.optimize on the GPU: every hand-written KernelBench-format model, optimized, and its
standalone export, against eager PyTorch.

Bar: allclose(eager fp32, atol=rtol=1e-4) with no NaN where eager has a number (these models are
small, K <= 128: the float64 comparison is asserted at the benchmark's shapes, in
test_chains.py, see helpers.float64_bar); every FusedLinear on the fused path (the kernel is
forced, so the small-problem rule does not apply) except where a chain's operands keep it on
PyTorch.
"""

from __future__ import annotations

import os

import pytest
import torch
from model_files import FIT, build, load, path_of

from gemmfuse import FallbackWarning, FusedLinear, optimize
from gemmfuse.kernelbench.export import standalone_source_for_file
from gemmfuse.warmup import build_in_processes, model_structures
from helpers import run_both

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


@pytest.fixture(scope="module", autouse=True)
def built_extensions():
    """Every kernel structure the model files need, built into the disk cache by parallel
    processes first, as the package builds them and as their exported files do; a failed build
    fails its tests when they build it again."""
    structures = set()
    for name in FIT:
        _, model, inputs = build(name)
        structures |= {repr(s) for s in model_structures(optimize(model, inputs)[0])}
    order, jobs = _worker_share(sorted(structures))
    build_in_processes(order, jobs)
    build_in_processes(order, jobs, standalone=True)


def _worker_share(structures: list[str]) -> tuple[list[str], int]:
    """Under pytest-xdist every worker runs this module's fixture: each takes its share of the
    cores and starts at its own place in the list (a structure another worker is building is
    waited for on its lock, then found cached), so the workers build apart, not all at once."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    start = worker * len(structures) // max(workers, 1)
    jobs = max(1, (os.cpu_count() or 4) // workers)
    return structures[start:] + structures[:start], jobs


def check(name, ref, new, x, fused_modules):
    expect, _, got = run_both(ref, new, x)
    assert got.shape == expect.shape
    assert not (got.isnan() & ~expect.isnan()).any()
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
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
    """A 3-D input before a reduction (which would take dim 1, not the features)."""
    _, ref, inputs = build("max_values_tail", device=CUDA)
    new, _ = optimize(ref, inputs, kernel="portable")
    x = inputs[0].reshape(4, -1, inputs[0].shape[1])
    with pytest.warns(FallbackWarning, match="is not 2-D and the chain is not row-wise"):
        with torch.no_grad():
            got = new(x)
    assert new.fc.last_path == "fallback"
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x), rtol=0, atol=0)


def test_a_3d_input_to_a_pointwise_chain_is_fused_with_its_rows_flattened():
    _, ref, inputs = build("activations_no_norm", device=CUDA)
    new, _ = optimize(ref, inputs)
    x = inputs[0].reshape(4, -1, inputs[0].shape[1])
    with torch.no_grad():
        got = new(x)
        torch.testing.assert_close(got, ref(x), rtol=1e-4, atol=1e-4)
    assert new.fc.last_path in ("fused", "epilogue") and got.shape == ref(x).shape


def test_to_cuda_after_optimize_moves_everything():
    _, ref, inputs = build("per_channel_operands")
    new, _ = optimize(ref, inputs, kernel="portable")
    new.to(CUDA)
    x = inputs[0].to(CUDA)
    check("per_channel_operands", ref, new, x, [("fc", new.fc)])
