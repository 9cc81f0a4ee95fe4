"""KernelBench-method training steps alone: eager against gemmfuse, a quick check of the numbers
the benchmark's training-step rows report (``python -m gemmfuse bench`` times far more).

Usage: python scripts/training_steps.py [TRACE.json]. For #75 (fp32 once, bf16 twice) and #62
(bf16 twice), each implementation's step (gradients set to None, forward, backward of a fixed
random output gradient) is timed as KernelBench's timing loop times a call
(``kernelbench.harness.time_cuda_events``: L2 cleared before each, autograd on; mean, median and
min of $TRIALS, default 100). The bf16 pairs run twice, eager first, so that a slow stretch of
the machine shows as a spread between the two. TRACE.json: a torch.profiler trace of 5 bf16 #75
steps (host ops and kernels), for chrome://tracing or a script.
"""

import os
import sys

import torch

from gemmfuse.bench import cuda_pair, set_seed
from gemmfuse.bench_harness import _training_step
from gemmfuse.kernelbench.harness import time_cuda_events


def trace(step, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def report(number: int, name: str, model, x, grad, trials: int) -> None:
    s = time_cuda_events(_training_step(model, x, grad), (), trials=trials)
    print(f"#{number} {name:18s} mean {s['mean']:.3f} median {s['median']:.3f} "
          f"min {s['min']:.3f} ms")  # fmt: skip


def main() -> None:
    trials = int(os.environ.get("TRIALS", "100"))
    for number in (75, 62):
        _, module, ref, new = cuda_pair(number)
        set_seed(0)
        x = module.get_inputs()[0].cuda()
        with torch.no_grad():
            grad = torch.randn_like(ref(x))
        xg = x.detach().requires_grad_()
        if number == 75:
            report(number, "eager fp32", ref, xg, grad, trials)
            report(number, "gemmfuse fp32", new, xg, grad, trials)
        # .to() converts the models in place: the float32 steps are timed before it
        ref16, new16 = ref.to(dtype=torch.bfloat16), new.to(dtype=torch.bfloat16)
        x16, grad16 = x.to(torch.bfloat16).requires_grad_(), grad.to(torch.bfloat16)
        for run in range(2):
            report(number, f"eager bf16 #{run}", ref16, x16, grad16, trials)
            report(number, f"gemmfuse bf16 #{run}", new16, x16, grad16, trials)
        if number == 75 and len(sys.argv) > 1:
            trace(_training_step(new16, x16, grad16), sys.argv[1])


if __name__ == "__main__":
    main()
