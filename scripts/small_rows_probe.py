"""The shape sweep's small rows, path by path: where a call's time goes (needs a GPU).

For #62's ModelNew at each (M, N = K, group size) of ROWS and each of kernel="auto", "hopper"
and "epilogue", and for the eager Model: the path taken, the CUDA kernels' device time
(torch.profiler, mean of 10 calls), the host time to queue one call (median of 30 calls queued
while ``torch.cuda._sleep`` holds the GPU busy, so nothing waits on it), and the four calls
timed as the sweep times them (``bench.time_interleaved``, median of 30, L2 flushed) in two
fixed orders, eager first and eager last, which shows what being timed right after eager's
call costs. no_grad throughout. One JSON line a row on stdout.
Usage: PYTHONPATH=src python scripts/small_rows_probe.py > probe.jsonl
"""

import functools
import json
import statistics
import time

import torch

from gemmfuse.bench import build_pair, set_seed, time_interleaved
from gemmfuse.kernelbench.registry import get_problem

ROWS = [(1, 1024, 16), (16, 1024, 16), (1, 1024, 64), (16, 1024, 64), (1, 1024, 512),
        (16, 1024, 512), (128, 1024, 512), (1, 4096, 512), (16, 4096, 16), (1, 8192, 16),
        (16, 8192, 16), (128, 1024, 16)]  # fmt: skip
KERNELS = ("auto", "hopper", "epilogue")


def kernel_times(fn, x, reps=10) -> tuple[float, dict]:
    """(total device us a call, {kernel name: us a call})."""
    with torch.no_grad():
        fn(*x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn(*x)
            torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:60]] = per_kernel.get(e.name[:60], 0.0) + e.device_time / reps
    return round(sum(per_kernel.values()), 1), {k: round(v, 1) for k, v in per_kernel.items()}


def host_us(fn, x, reps=30) -> float:
    """Median us to queue one call with the GPU busy."""
    with torch.no_grad():
        fn(*x)
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(*x)
            times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


def probe(problem, m: int, nk: int, group: int) -> dict:
    ref, new = build_pair(problem, [nk, nk, nk // group])
    ref, new = ref.cuda(), new.cuda()
    set_seed(m)
    x = [torch.rand(m, nk, device="cuda")]
    row = {"m": m, "nk": nk, "group": group}
    calls = {"eager": (ref, None)}
    for kernel in KERNELS:
        new.kernel = kernel
        with torch.no_grad():
            new(*x)
        row[f"path_{kernel}"] = new.last_path
        row[f"gpu_{kernel}"], row[f"kern_{kernel}"] = kernel_times(new, x)
        row[f"host_{kernel}"] = host_us(new, x)
        calls[kernel] = (new, functools.partial(setattr, new, "kernel", kernel))
    row["gpu_eager"], row["kern_eager"] = kernel_times(ref, x)
    row["host_eager"] = host_us(ref, x)
    names = ["eager", *KERNELS]
    timed = [calls[name] for name in names]
    for label, order in (("ms_fwd_order", [0, 1, 2, 3]), ("ms_rev_order", [3, 2, 1, 0])):
        times = time_interleaved(timed, x, 30, orders=[order])
        row[label] = {name: round(t, 4) for name, t in zip(names, times, strict=True)}
    new.kernel = "auto"
    return row


def main() -> None:
    problem = get_problem(62)
    for m, nk, group in ROWS:
        print(json.dumps(probe(problem, m, nk, group)), flush=True)


if __name__ == "__main__":
    main()
