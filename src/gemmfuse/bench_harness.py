"""The benchmark in KernelBench's method, and a training step.

Per shipped problem, every time through ``kernelbench.harness.time_cuda_events`` (KernelBench's
``time_execution_with_cuda_event``: 3 warm-ups, the L2 cleared before each call, CUDA events,
the first trial discarded; mean and median of ``trials``):

- forward: the models as constructed (parameters requiring grad, no ``no_grad``: autograd
  records, as in KernelBench's timing loop) for eager fp32, torch.compile and gemmfuse, and
  gemmfuse under ``no_grad`` (what recording the backward costs);
- training step: zero the gradients, forward, ``backward`` of a fixed random output gradient
  (gradients of every parameter and of x) for eager fp32, torch.compile and gemmfuse; gemmfuse
  again with every parameter marked changed before each step (its version counter stepped, as
  an optimizer step's in-place update steps it: the weight splits are made again);
- KernelBench's bf16 and fp16 modes: both models converted with ``.to(dtype)`` (fresh copies
  for each dtype), the forward timed as constructed (autograd on) and a training step, eager
  against gemmfuse in that dtype.

Every row is timed in ``rounds`` rounds, each timing every row once in the order above. A row's
"mean" and "median" are its first round's (KernelBench times a model once); "round_means" holds
every round's mean. Why rounds: one mean of 100 moves with what the GPU ran just before it (on an
H200 the second of two back-to-back timings of one ModelNew was the higher in 31 of 32 pairs, by
up to 12.8%; cause not established: docs/DESIGN.md, section 9), so the spread of the per-round
ratios to eager says how far one figure can be trusted.
"""

import torch

from gemmfuse.bench import _markdown, cuda_pair, set_seed, weights_changed
from gemmfuse.kernelbench.harness import time_cuda_events


def _training_step(model, x, grad):
    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).backward(grad)

    return step


def _no_grad(model):
    def call(x):
        with torch.no_grad():
            return model(x)

    return call


def run_problem(number: int, trials: int, compile_: bool, rounds: int = 3) -> list[dict]:
    """One row per (what is timed, implementation): {"problem", "what", "impl", "path", "mean",
    "median", "min", "max"} of the first round, and "round_means"."""
    entries, x, grad = _fp32_entries(number, compile_)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        entries += _16bit_entries(number, dtype, name, x, grad)
    rows = [{"problem": number, "what": what, "impl": impl, "path": "-", "round_means": []}
            for what, impl, *_ in entries]  # fmt: skip
    for _ in range(rounds):
        for row, (_, _, fn, args, model) in zip(rows, entries, strict=True):
            stats = time_cuda_events(fn, args, trials=trials)
            if not row["round_means"]:
                row.update(stats)
                row["path"] = "-" if model is None else model.last_path
            row["round_means"].append(stats["mean"])
    return rows


def _fp32_entries(number: int, compile_: bool) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The float32 rows as (what, impl, fn, args, the model whose last_path the row shows or
    None), with x and the training steps' output gradient."""
    _, module, ref, new = cuda_pair(number)
    set_seed(0)
    x = module.get_inputs()[0].to(torch.device("cuda"))
    compiled = torch.compile(ref) if compile_ else None
    with torch.no_grad():
        grad = torch.randn_like(ref(x))
    xg = x.detach().requires_grad_()
    change, step = weights_changed(new), _training_step(new, xg, grad)

    def changed():
        change()
        step()

    entries = [("forward", "eager", ref, (x,), None)]
    if compiled is not None:
        entries.append(("forward", "torch.compile", compiled, (x,), None))
    entries += [("forward", "gemmfuse", new, (x,), new),
                ("forward", "gemmfuse, no_grad", _no_grad(new), (x,), None),
                ("training step", "eager", _training_step(ref, xg, grad), (), None)]  # fmt: skip
    if compiled is not None:
        entries.append(("training step", "torch.compile", _training_step(compiled, xg, grad), (),
                        None))  # fmt: skip
    entries += [("training step", "gemmfuse", _training_step(new, xg, grad), (), new),
                ("training step", "gemmfuse, weights changed", changed, (), None)]  # fmt: skip
    return entries, x, grad


def _16bit_entries(number: int, dtype: torch.dtype, name: str, x, grad) -> list:
    """KernelBench's 16-bit mode for one dtype: a fresh pair in ``dtype`` (a module's ``to``
    converts it in place, so the fp32 pair is not reused), its forward as constructed and a
    training step, as _fp32_entries' tuples."""
    _, _, ref, new = cuda_pair(number, dtype)
    x16, grad16 = x.to(dtype), grad.to(dtype)
    x16g = x16.detach().requires_grad_()
    return [
        (f"{name} forward", f"eager {name}", ref, (x16,), None),
        (f"{name} forward", f"gemmfuse {name}", new, (x16,), new),
        (f"{name} training step", f"eager {name}", _training_step(ref, x16g, grad16), (), None),
        (f"{name} training step", f"gemmfuse {name}", _training_step(new, x16g, grad16), (), new),
    ]


def format_rows(rows: list[dict]) -> str:
    """A markdown table; "vs eager" against the eager row of the same problem and kind, and the
    range of that ratio over the rounds (each round's mean against eager's of the same round)."""
    eager = {(r["problem"], r["what"]): r for r in rows if r["impl"].startswith("eager")}
    body = []
    for r in rows:
        base = eager[(r["problem"], r["what"])]
        rounds = zip(base.get("round_means", []), r.get("round_means", []), strict=True)
        ratios = [b / m for b, m in rounds]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else "-"
        body.append(
            [
                f"#{r['problem']}", r["what"], r["impl"], r["path"], f"{r['mean']:.3f}",
                f"{r['median']:.3f}", f"{base['mean'] / r['mean']:.2f}x",
                f"{base['median'] / r['median']:.2f}x", spread,
            ]
        )  # fmt: skip
    header = ["problem", "timed", "implementation", "path", "mean ms", "median ms",
              "vs eager (mean)", "vs eager (median)", "vs eager by round (means)"]  # fmt: skip
    return _markdown(header, body)
