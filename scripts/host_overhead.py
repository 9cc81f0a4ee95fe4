"""Host (CPU) time of a call, layer by layer: where a step that the GPU finishes early waits.

Usage: python scripts/host_overhead.py [62|75] [--bf16]

1. Host microseconds per call of the eager model and of gemmfuse's (forward with and without
   autograd recording, training step): the mean of 50 calls after 5 warm-ups, with the GPU
   queue held by a long ``torch.cuda._sleep`` so that no launch waits on the GPU.
2. Inside one gemmfuse training step: the host microseconds between the entries and exits of
   the functions the call goes through (median over 30 steps, the GPU held the same way), in
   the order they happen: ``planned_call`` (the C++ plan: checks, splits, launches and the
   autograd node) where a plan serves the step, the Python rules' functions where none does.
   The first kernel launch comes at the end of the forward's preamble: in KernelBench's
   timing, which starts each call on an idle GPU, that preamble is GPU idle time.
"""

import statistics
import sys
import time

import torch

from gemmfuse import autograd, ops
from gemmfuse.bench import build_pair
from gemmfuse.kernelbench.registry import get_problem

CALLS = 50
# A planned call (gemmfuse/plan.py) runs in ops.planned_call, its backward in C++; a call the
# Python rules decide goes through the others.
TRACED = {
    ops: ("planned_call", "validate", "take_path", "backward_plan", "launch_path"),
    autograd: ("_kernel_chain_backward", "grad_input", "grad_weight"),
}


def host_us(fn, calls: int = CALLS) -> float:
    """Mean host microseconds of ``fn()``, the GPU kept busy so that nothing waits on it."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(3_000_000_000)  # ~1.5 s of GPU spin: the calls below only queue
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def step_of(model, x, grad, marks=None):
    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        if marks is not None:
            marks.append(("step", time.perf_counter()))
        model(x).backward(grad)
        if marks is not None:
            marks.append(("end", time.perf_counter()))

    return step


def _traced(fn, name: str, marks: list):
    def wrapped(*args, **kwargs):
        marks.append((f"> {name}", time.perf_counter()))
        out = fn(*args, **kwargs)
        marks.append((f"< {name}", time.perf_counter()))
        return out

    return wrapped


def segments(model, x, grad, steps: int = 30) -> list[tuple[str, float]]:
    """(from -> to, median host microseconds) between consecutive marks of a training step."""
    marks: list = []
    originals = [(m, name, getattr(m, name)) for m, names in TRACED.items() for name in names]
    for module, name, fn in originals:
        setattr(module, name, _traced(fn, name, marks))
    backward = autograd.FusedLinearFunction.backward
    autograd.FusedLinearFunction.backward = staticmethod(_traced(backward, "backward", marks))
    step = step_of(model, x, grad, marks)
    try:
        host_us(step, steps)
        marks.clear()
        host_us(step, steps)  # its own warm-ups add 5 steps
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
        autograd.FusedLinearFunction.backward = staticmethod(backward)
    per_step = len(marks) // (steps + 5)
    runs = [marks[i : i + per_step] for i in range(0, len(marks), per_step)]
    names = [name for name, _ in runs[0]]
    return [
        (f"{a} -> {b}", statistics.median((r[i + 1][1] - r[i][1]) * 1e6 for r in runs))
        for i, (a, b) in enumerate(zip(names, names[1:], strict=False))
    ]


def main() -> None:
    number = int(next((a for a in sys.argv[1:] if a.isdigit()), 62))
    dtype = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
    problem = get_problem(number)
    module = problem.load()
    ref, new = build_pair(problem, module.get_init_inputs())
    ref, new = ref.to("cuda", dtype), new.to("cuda", dtype)
    torch.manual_seed(0)
    x = module.get_inputs()[0].to("cuda", dtype).requires_grad_()
    with torch.no_grad():
        grad = torch.randn_like(ref(x))
    rows = [
        ("eager forward (autograd on)", lambda: ref(x)),
        ("eager training step", step_of(ref, x, grad)),
        ("gemmfuse forward, no_grad", torch.no_grad()(lambda: new(x))),
        ("gemmfuse forward (autograd on)", lambda: new(x)),
        ("gemmfuse training step", step_of(new, x, grad)),
    ]
    print(f"#{number} {dtype}, path {new.last_path}: host microseconds per call")
    print(f"(mean of {CALLS} calls, GPU busy)")
    for name, fn in rows:
        print(f"  {name:46s} {host_us(fn):9.1f}")
    print("inside one gemmfuse training step (median of 30 steps, GPU busy)")
    for name, us in segments(new, x, grad):
        print(f"  {name:46s} {us:9.1f}")


if __name__ == "__main__":
    main()
