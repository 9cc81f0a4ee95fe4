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


def run_problem(number: int, trials: int, compile_: bool) -> list[dict]:
    """One row per (what is timed, implementation): {"problem", "what", "impl", "mean",
    "median", "path"}."""
    _, module, ref, new = cuda_pair(number)
    device = torch.device("cuda")
    set_seed(0)
    x = module.get_inputs()[0].to(device)
    compiled = torch.compile(ref) if compile_ else None
    rows = []

    def add(what, impl, fn, *args, path="-"):
        stats = time_cuda_events(fn, args, trials=trials)
        rows.append({"problem": number, "what": what, "impl": impl, "path": path, **stats})

    add("forward", "eager", ref, x)
    if compiled is not None:
        add("forward", "torch.compile", compiled, x)
    add("forward", "gemmfuse", new, x)
    rows[-1]["path"] = new.last_path
    add("forward", "gemmfuse, no_grad", _no_grad(new), x)

    with torch.no_grad():
        grad = torch.randn_like(ref(x))
    xg = x.detach().requires_grad_()
    add("training step", "eager", _training_step(ref, xg, grad))
    if compiled is not None:
        add("training step", "torch.compile", _training_step(compiled, xg, grad))
    add("training step", "gemmfuse", _training_step(new, xg, grad))
    rows[-1]["path"] = new.last_path
    change, step = weights_changed(new), _training_step(new, xg, grad)

    def changed():
        change()
        step()

    add("training step", "gemmfuse, weights changed", changed)
    del ref, new, compiled
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        rows += _16bit_rows(number, dtype, name, x, grad, trials)
    return rows


def _16bit_rows(number: int, dtype: torch.dtype, name: str, x, grad, trials: int) -> list[dict]:
    """KernelBench's 16-bit mode for one dtype: a fresh pair in ``dtype`` (a module's ``to``
    converts it in place, so the fp32 pair is not reused), its forward as constructed and a
    training step."""
    _, _, ref, new = cuda_pair(number, dtype)
    x16, grad16 = x.to(dtype), grad.to(dtype)
    x16g = x16.detach().requires_grad_()
    rows = []
    for what, impl, fn, args, model in (
        (f"{name} forward", f"eager {name}", ref, (x16,), None),
        (f"{name} forward", f"gemmfuse {name}", new, (x16,), new),
        (f"{name} training step", f"eager {name}", _training_step(ref, x16g, grad16), (), None),
        (f"{name} training step", f"gemmfuse {name}", _training_step(new, x16g, grad16), (), new),
    ):
        stats = time_cuda_events(fn, args, trials=trials)
        path = "-" if model is None else model.last_path
        rows.append({"problem": number, "what": what, "impl": impl, "path": path, **stats})
    return rows


def format_rows(rows: list[dict]) -> str:
    """A markdown table; "vs eager" against the eager row of the same problem and kind."""
    eager = {(r["problem"], r["what"]): r for r in rows if r["impl"].startswith("eager")}
    body = []
    for r in rows:
        base = eager[(r["problem"], r["what"])]
        body.append(
            [
                f"#{r['problem']}", r["what"], r["impl"], r["path"], f"{r['mean']:.3f}",
                f"{r['median']:.3f}", f"{base['mean'] / r['mean']:.2f}x",
                f"{base['median'] / r['median']:.2f}x",
            ]
        )  # fmt: skip
    header = ["problem", "timed", "implementation", "path", "mean ms", "median ms",
              "vs eager (mean)", "vs eager (median)"]  # fmt: skip
    return _markdown(header, body)
