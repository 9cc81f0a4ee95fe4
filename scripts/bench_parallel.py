"""One GPU against two: #62 and #75 chains split by gemmfuse.parallelize (issue 14's benchmark).

    python scripts/bench_parallel.py [--iters 30] [--json out.json]

For M = 8192 rows, K = 8192 and N = 8192 and 16384: the optimized model on one GPU, then split
over 2 GPUs (NCCL, one process each; NVLink multicast off). Times per call, forward under
no_grad and a training step (forward + backward of every parameter), each the median of
``--iters`` calls after 3 warm-ups, CUDA events on rank 0 between barriers, L2 not flushed (the
operands are hundreds of MB). Prints a markdown table: ms, speed-up, scaling efficiency, and the
bytes each rank sends per call (the all-gather of the output or of the M reduced values).
"""

import argparse
import json
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

M, K = 8192, 8192
WIDTHS = (8192, 16384)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def model_for(number: int, n: int):
    from gemmfuse.kernelbench.registry import get_problem

    init = [K, n, 512] + ([(1, n, 1, 1)] if number == 75 else [])
    torch.manual_seed(0)
    return get_problem(number).load().Model(*init).cuda()


def median_ms(fn, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        if dist.is_initialized():
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(model, x, iters: int) -> dict:
    def forward():
        with torch.no_grad():
            model(x)

    def step():
        model(x).float().sum().backward()
        for p in model.parameters():
            p.grad = None

    return {"forward": median_ms(forward, iters), "train": median_ms(step, iters)}


def comm_bytes(number: int, n: int, world: int) -> int:
    """Bytes one rank sends per forward: its (M, N/W) slice for #62 (gathered), M values for #75."""
    return 4 * M * (n // world if number == 62 else 1) if world > 1 else 0


def worker(rank: int, world: int, port: int, iters: int, out: str) -> None:
    from gemmfuse import optimize, parallelize

    torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
    rows = []
    for number in (62, 75):
        for n in WIDTHS:
            torch.manual_seed(1)
            x = torch.rand(M, K, device="cuda")
            model = optimize(model_for(number, n), (x,))[0]
            if world > 1:
                model = parallelize(model, mesh)
            times = measure(model, x, iters)
            rows.append({"problem": number, "n": n, "world": world,
                         "comm_bytes": comm_bytes(number, n, world), **times})  # fmt: skip
            del model
            torch.cuda.empty_cache()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if world > 1:
        dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    one = {(r["problem"], r["n"]): r for r in rows if r["world"] == 1}
    lines = ["| problem | N | GPUs | forward ms | train ms | forward speed-up | train speed-up "
             "| efficiency (fwd) | sent per rank per call |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        base = one[(r["problem"], r["n"])]
        fwd, train = base["forward"] / r["forward"], base["train"] / r["train"]
        lines.append(
            f"| #{r['problem']} | {r['n']} | {r['world']} | {r['forward']:.3f} | "
            f"{r['train']:.3f} | {fwd:.2f}x | {train:.2f}x | {fwd / r['world']:.0%} | "
            f"{_size(r['comm_bytes'])} |"
        )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    if nbytes == 0:
        return "0"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default="bench_parallel.json")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_parallel needs 2 GPUs")
    rows = []
    for world in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        part = f"{args.json}.{world}"
        mp.spawn(worker, args=(world, port, args.iters, part), nprocs=world)
        with open(part) as f:
            rows += json.load(f)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{torch.cuda.get_device_name()}, M = {M}, K = {K}, median of {args.iters}")
    print(table(rows))


if __name__ == "__main__":
    main()
