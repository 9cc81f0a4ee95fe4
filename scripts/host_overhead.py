"""Host-side cost of one ModelNew forward: CPU time per call on a tiny problem (GPU work
negligible), eager for comparison, and a cProfile of gemmfuse's Python part.

Usage: python scripts/host_overhead.py
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


if __name__ == "__main__":
    main()
