"""Where a training step's time goes: torch.profiler's CUDA kernel table for one problem.

Usage: python scripts/profile_step.py [62|75] [--bf16] [--forward] [--host]. Times 20 steps after 5
warm-ups (L2 not flushed: this is for reading the breakdown, not for reporting speed) and
prints the CUDA kernels by total time, per step; then the host's time per step (the Python and
launch cost, measured with the GPU kept busy so that it never waits) against the step's wall
time with the GPU free. --host: instead, the Python profile (cProfile) of 20 steps' host time.
"""

import cProfile
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gemmfuse.bench import build_pair
from gemmfuse.kernelbench.registry import get_problem


def main() -> None:
    number = int(next((a for a in sys.argv[1:] if a.isdigit()), 62))
    dtype = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
    problem = get_problem(number)
    module = problem.load()
    _, new = build_pair(problem, module.get_init_inputs())
    new = new.to("cuda", dtype)
    torch.manual_seed(0)
    x = module.get_inputs()[0].to("cuda", dtype).requires_grad_()
    grad = torch.randn_like(new(x))

    def step():
        for p in new.parameters():
            p.grad = None
        x.grad = None
        out = new(x)
        if "--forward" not in sys.argv:
            out.backward(grad)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    if "--host" in sys.argv:
        host_profile(step)
        return
    steps = 20
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"#{number} {dtype} path {new.last_path}: per step over {steps} steps")
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
    )
    print(table)
    print(host_and_wall(step))


def host_profile(step, steps: int = 20) -> None:
    """cProfile of the host's work for `steps` steps, the GPU kept busy (no launch waits)."""
    torch.cuda._sleep(2_000_000_000)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    stats.print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def host_and_wall(step, steps: int = 20) -> str:
    """Host time per step (the GPU queue held by a long sleep, so no launch waits on it) and
    wall time per step (steps back to back, synchronised once)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spin: the steps below only queue
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    return f"host {host * 1e3:.3f} ms per step (GPU busy), wall {wall * 1e3:.3f} ms per step"


if __name__ == "__main__":
    main()
