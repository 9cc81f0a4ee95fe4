"""The work of KernelBench problem files and the floors it sets (no GPU needed).

For each file, its Model is built and run once on the meta device (shapes only: no memory, no
arithmetic) and every matrix product it runs is recorded: (M, K, N) and 2·M·N·K FLOP, counted
once. Its bytes are the least any implementation moves: the inputs and parameters read once,
the output written once, at their dtypes. ``floors(flop, bytes)`` turns the two into times on the
H100 (docs/PERFORMANCE.md's "Against the floor" reads the JSON this writes).
Usage: python scripts/problem_floors.py FILE.py [FILE.py ...] --json PATH
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmfuse.kernelbench.export import _load

# H100 80GB SXM figures (../shared/notes/anchors.md): cuBLAS's bf16 GEMM measured at #62's size,
# the datasheet's dense fp16/bf16 and fp32 rates, and the measured device-to-device copy rate.
TENSOR_16BIT_MEASURED = 800e12
TENSOR_16BIT_DATASHEET = 989e12
FP32_SIMT_DATASHEET = 67e12
HBM_MEASURED = 2.86e12
SPLIT_PASSES = 3  # the fp32-accurate split: hi*hi + hi*lo + lo*hi, each a 16-bit product

_PRODUCTS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.mv.default,
    torch.ops.aten.addmv.default,
    torch.ops.aten.dot.default,
}


class _Products(TorchDispatchMode):
    """Records (M, K, N) of every matrix product run under it."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            a, b = args[-2], args[-1]  # addmm/baddbmm/addmv: (bias, a, b)
            if a.dim() == 1:  # dot: a row times a column
                a = a.unsqueeze(0)
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k = a.shape[-2:]
            self.shapes.append((batch * m, k, b.shape[-1] if b.dim() > 1 else 1))
        return func(*args, **(kwargs or {}))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def problem_work(path: Path) -> dict:
    """A problem file's matrix products, FLOP and least bytes (its Model on the meta device)."""
    module = _load(path)
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs())
        inputs = module.get_inputs()
        with _Products() as products, torch.no_grad():
            out = model(*inputs)
    outputs = out if isinstance(out, (tuple, list)) else [out]
    state = [*model.parameters(), *model.buffers()]
    return {
        "file": path.name,
        "products": products.shapes,
        "flop": sum(2 * m * k * n for m, k, n in products.shapes),
        "bytes": _bytes(inputs) + _bytes(state) + _bytes(outputs),
    }


def floors(flop: float, nbytes: float) -> dict:
    """Seconds: the split scheme's three 16-bit passes at cuBLAS's measured and the datasheet's
    rate, eager fp32's SIMT rate, the bytes at the measured copy rate, and the floor of the
    fp32-accurate split (the larger of its compute at the measured rate and the bytes)."""
    split = SPLIT_PASSES * flop / TENSOR_16BIT_MEASURED
    memory = nbytes / HBM_MEASURED
    return {
        "split_measured": split,
        "split_datasheet": SPLIT_PASSES * flop / TENSOR_16BIT_DATASHEET,
        "fp32_simt": flop / FP32_SIMT_DATASHEET,
        "memory": memory,
        "floor": max(split, memory),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    rows = [problem_work(path) for path in sorted(args.files)]
    for row in rows:
        print(f"{row['file']}: {row['products']} {row['flop'] / 1e9:.1f} GFLOP, "
              f"{row['bytes'] / 1e6:.1f} MB")  # fmt: skip
    args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
