"""A transformer MLP block, eager against ``gemmfuse.optimize`` (needs a GPU).

``LayerNorm -> Linear -> GELU -> Linear -> + residual`` on (batch, sequence, d_model) float32
tokens: optimize fuses fc1 with its GELU and fc2 with the residual add (the residual read per
element by fc2's epilogue), the LayerNorm before fc1 staying PyTorch's. Correctness first: the
output's largest error against the float64 block and the worst gradient's (relative to its
largest element), each beside eager fp32's; the output allclose(1e-4) to eager's.
Then both timed as KernelBench times (CUDA events, L2 cleared before each call, mean of
--trials), the forward with autograd on (parameters require grad) and a training step (forward
and backward of the output's sum). A markdown table last; --json writes the rows.
Usage: python scripts/mlp_block.py [--trials N] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse import optimize
from gemmfuse.bench import _markdown, max_abs_err
from gemmfuse.kernelbench.harness import time_cuda_events

CUDA = torch.device("cuda")
# (batch, sequence, d_model, hidden): a GPT-2-medium-like width, and a larger one
SHAPES = [(8, 512, 1024, 4096), (4, 1024, 2048, 8192)]


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)))) + x


def _grads(model, x):
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


def _step(model, x):
    model(x).sum().backward()


def measure(shape, trials: int) -> dict:
    batch, seq, d_model, hidden = shape
    torch.manual_seed(0)
    eager = MLPBlock(d_model, hidden).to(CUDA)
    x = torch.randn(batch, seq, d_model, device=CUDA)
    fused, report = optimize(eager, (x,))
    exact_model = copy.deepcopy(eager).double()
    out_ours, g_ours = _grads(fused, x)
    out_eager, g_eager = _grads(eager, x)
    out_exact, g_exact = _grads(exact_model, x.double())

    # each gradient's error relative to its largest element (they differ by orders of
    # magnitude, up to thousands: sums over every token), before the timed steps accumulate
    # into the parameters' .grad again
    def grad_err(grads):
        pairs = zip(grads, g_exact, strict=True)
        return max(max_abs_err(a, b) / b.abs().max().item() for a, b in pairs)

    errors = {
        "err": max_abs_err(out_ours, out_exact),
        "err_eager": max_abs_err(out_eager, out_exact),
        "grad_err": grad_err(g_ours),
        "grad_err_eager": grad_err(g_eager),
    }
    close = torch.allclose(out_ours, out_eager, atol=1e-4, rtol=1e-4)
    times = {}
    for name, model in (("eager", eager), ("gemmfuse", fused)):
        times[name, "forward"] = time_cuda_events(model, (x,), trials)["mean"]
        times[name, "training step"] = time_cuda_events(lambda m=model: _step(m, x), (), trials)[
            "mean"
        ]
    paths = sorted({m.last_path for m in fused.modules() if hasattr(m, "last_path")})
    return {
        "shape": f"{batch}x{seq} x {d_model}, hidden {hidden}",
        "chains": [" -> ".join(r.chain) for r in report.fused],
        "allclose": bool(close),
        **errors,
        "times": {f"{k[0]} {k[1]}": v for k, v in times.items()},
        "paths": paths,
    }


def format_rows(rows: list[dict]) -> str:
    header = ["tokens x d_model", "fused chains", "output allclose 1e-4",
              "output max err vs fp64 (eager's)", "gradients: max err / max, worst (eager's)",
              "timed", "eager ms", "gemmfuse ms", "vs eager"]  # fmt: skip
    body = []
    for r in rows:
        for timed in ("forward", "training step"):
            e, g = r["times"][f"eager {timed}"], r["times"][f"gemmfuse {timed}"]
            body.append([r["shape"], "; ".join(r["chains"]), "yes" if r["allclose"] else "NO",
                         f"{r['err']:.2e} ({r['err_eager']:.2e})",
                         f"{r['grad_err']:.2e} ({r['grad_err_eager']:.2e})", timed, f"{e:.3f}",
                         f"{g:.3f}", f"{e / g:.2f}x"])  # fmt: skip
    return _markdown(header, body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(shape, args.trials) for shape in SHAPES]
    print(f"gpu: {torch.cuda.get_device_name()} | method: mean of {args.trials}, CUDA events, "
          "L2 cleared before each call, autograd on")  # fmt: skip
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))
    return 0 if all(r["allclose"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
