"""The hand-written KernelBench-format models in tests/kernelbench_models/.

``unfit_*`` files hold nothing gemmfuse can swap (export refuses them); every other file has at
least one Linear chain that optimize fuses.
"""

from __future__ import annotations

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
