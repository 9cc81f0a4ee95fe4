"""The hand-written KernelBench-format models in tests/kernelbench_models/.

``unfit_*`` files hold nothing gemmfuse can swap (export refuses them); every other file has at
least one Linear chain that optimize fuses.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from types import ModuleType

import torch

MODEL_DIR = Path(__file__).with_name("kernelbench_models")
FIT = sorted(p.stem for p in MODEL_DIR.glob("*.py") if not p.stem.startswith("unfit_"))
UNFIT = sorted(p.stem for p in MODEL_DIR.glob("unfit_*.py"))


def path_of(name: str) -> Path:
    return MODEL_DIR / f"{name}.py"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kernelbench_model_{name}", path_of(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name: str, seed: int = 0, device="cpu"):
    """(problem module, Model built from ``seed``, inputs from ``seed + 1``) on device."""
    module = load(name)
    torch.manual_seed(seed)
    model = module.Model(*module.get_init_inputs()).to(device)
    torch.manual_seed(seed + 1)
    inputs = [t.to(device) for t in module.get_inputs()]
    return module, model, inputs


# Model files whose optimized model computes the model's value in another order of operations,
# so not bit for bit as eager does on the CPU: name -> how. Their bar instead: at most twice
# eager's own max error against float64 (tests/gpu/test_accuracy.py's bar), and allclose(1e-5).
REORDERED = {
    "avg_pool_over_channels": "each average pooling is folded into its Linear's weights (the "
    "mean of 4, or 3, weight rows, then one product)",
    "batchnorm_eval": "eval-mode BatchNorm1d as (x - mean) * (weight / sqrt(var + eps)) + bias, "
    "where eager on the CPU computes x * alpha + (bias - mean * alpha)",
}


def assert_computes_the_model(name: str, model, got: torch.Tensor, inputs) -> None:
    """``got`` (the optimized model's value on ``inputs``) is ``model``'s, bit for bit; for a
    :data:`REORDERED` file, as close to float64 as described there."""
    expect = model(*inputs)
    if name not in REORDERED:
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
        return
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    exact = copy.deepcopy(model).double()(*(t.double() for t in inputs))
    assert_as_accurate(got, expect, exact, name)


def assert_as_accurate(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what) -> None:
    """got's max abs error against ``exact`` (float64) at most twice eager's, plus one float32
    ulp of exact's largest magnitude (where eager happens to be exact)."""
    err, err_eager = ((t.double() - exact).abs().max() for t in (got, eager))
    ulp = torch.finfo(torch.float32).eps * exact.abs().max()
    assert err <= 2 * err_eager + ulp, (what, float(err), float(err_eager))
