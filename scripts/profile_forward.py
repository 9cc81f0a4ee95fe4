"""Where a ModelNew forward's time goes: host CPU time per call on a tiny problem (GPU work
negligible) against eager's, a cProfile of gemmfuse's Python part, and the GPU time of each
kernel of a full-size #62 forward (torch.profiler).

Usage: python scripts/profile_forward.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from gemmfuse.bench import build_pair
from gemmfuse.kernelbench.registry import get_problem


def per_call_us(fn, x, n=300):
    with torch.no_grad():
        for _ in range(20):
            fn(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn(x)
        cpu = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
    return cpu


def main():
    for number, init in ((62, [1024, 1024, 64]), (75, [1024, 1024, 64, (1, 1024, 1, 1)])):
        ref, new = build_pair(get_problem(number), init)
        ref, new = ref.cuda(), new.cuda()
        new.kernel = "hopper" if torch.cuda.get_device_capability() == (9, 0) else "portable"
        x = torch.rand(1, 1024, device="cuda")
        print(
            f"#{number} host us per call: eager {per_call_us(ref, x):.1f}, "
            f"gemmfuse {per_call_us(new, x):.1f}"
        )
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(200):
            new(x)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    problem = get_problem(62)
    module = problem.load()
    ref, new = build_pair(problem, module.get_init_inputs())
    new = new.cuda()
    x = module.get_inputs()[0].cuda()
    for precision in ("fp32", "tf32"):
        new.precision = precision
        with torch.no_grad():
            for _ in range(3):
                new(x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                for _ in range(10):
                    new(x)
                torch.cuda.synchronize()
        print(f"#62 full size, precision={precision}, 10 calls:")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=6))


if __name__ == "__main__":
    main()
