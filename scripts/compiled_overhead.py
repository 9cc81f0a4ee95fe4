"""What torch.compile adds to a gemmfuse call without autograd (issue 12: within 5%, and
reduce-overhead faster at small M).

Usage: python scripts/compiled_overhead.py [--calls N] [--runs R]

For #62 and #75 (ModelNew at KernelBench's size, ``torch.compile(fullgraph=True)``, default
mode) and, as the control, torch's own ``nn.Linear`` in bf16 at 4096 x 8192 x 8192 (a like GPU
time): the compiled and the uncompiled call timed interleaved (``gemmfuse.bench.
time_interleaved``: median of N calls each, L2 flushed before each, ``no_grad``), R times; and
each call's host microseconds (host_overhead.host_us: the mean of 50 calls queued behind a long
GPU sleep). For #62 also the layers of the compiled call: the op a compiled graph calls
(``gemmfuse::fused_linear_inference``), the op with an autograd formula that it replaced
(``gemmfuse::fused_linear``), and the weight cache's plan called alone (``plan.planned_call``).
Then torch's own floor on the host: a compiled ``nn.Linear`` of 16 x 64 x 64 (float32) against
the same module eager, host microseconds alone (its GPU time is nothing). Last, small M: #62's
chain (ModelNew62, groups of 16) at N = K = 1024 and M = 1, 16 and 128, the uncompiled call, the
default compile and ``mode="reduce-overhead"`` timed interleaved (median of N calls each, L2
flushed before each, ``no_grad``), with their host microseconds and the path the uncompiled
call took.
"""

import argparse
import warnings

import torch
from host_overhead import host_us

from gemmfuse.bench import cuda_pair, time_interleaved
from gemmfuse.epilogue import epilogue_from_spec
from gemmfuse.kernelbench.models import ModelNew62, epilogue_62
from gemmfuse.ops import chain_call_specs
from gemmfuse.plan import planned_call


def paired(label: str, eager, compiled, x, calls: int, runs: int) -> None:
    with torch.no_grad():
        compiled(*x)
        for run in range(runs):
            a, b = time_interleaved([(eager, None), (compiled, None)], x, calls)
            hosts = [host_us(lambda f=f: f(*x)) for f in (eager, compiled)]
            print(
                f"{label} run {run}: uncompiled {a:.4f} ms, compiled {b:.4f} ms ({b / a - 1:+.1%});"
                f" host us {hosts[0]:.0f} and {hosts[1]:.0f}",
                flush=True,
            )


def layers_62(model, x) -> None:
    gn = model.gn
    spec = chain_call_specs(epilogue_62(gn.num_groups, gn.eps, gn.affine, 0.01))[0]
    tensors = (x, model.fc.weight, model.fc.bias, gn.weight, gn.bias, [])
    args = (*tensors, spec, model.kernel, model.precision, model.weight_split.token)
    plan_args = (model.weight_split, epilogue_from_spec(spec), model.kernel, model.precision)
    ops = torch.ops.gemmfuse
    with torch.no_grad():
        rows = {
            "gemmfuse::fused_linear_inference": lambda: ops.fused_linear_inference(*args),
            "gemmfuse::fused_linear": lambda: ops.fused_linear(*args),
            "plan.planned_call": lambda: planned_call(*plan_args, *tensors),
        }
        print("#62, host us a call: " + ", ".join(f"{k} {host_us(f):.1f}" for k, f in rows.items()))


def torch_floor() -> None:
    """Host µs of a compiled module whose GPU work is nothing: what torch.compile's layers
    (Dynamo's guards and frame, AOTAutograd's wrapper, inductor's call) cost a call here."""
    linear = torch.nn.Linear(64, 64, device="cuda")
    x = torch.rand(16, 64, device="cuda")
    compiled = torch.compile(linear, fullgraph=True)
    with torch.no_grad():
        compiled(x)
        eager_us, compiled_us = (host_us(lambda f=f: f(x)) for f in (linear, compiled))
    print(f"nn.Linear 16 x 64 x 64, host us a call: eager {eager_us:.1f}, compiled "
          f"{compiled_us:.1f}", flush=True)  # fmt: skip


def small_rows(calls: int) -> None:
    """#62's chain at N = K = 1024 and small M: uncompiled, compiled and reduce-overhead."""
    n = 1024
    for m in (1, 16, 128):
        torch._dynamo.reset()  # a fresh model each size: no recompile limit across sizes
        torch.manual_seed(0)
        model = ModelNew62(n, n, n // 16).cuda()
        x = [torch.rand(m, n, device="cuda")]
        with torch.no_grad():
            model(*x)
            forms = [model, torch.compile(model, fullgraph=True),
                     torch.compile(model, fullgraph=True, mode="reduce-overhead")]  # fmt: skip
            for form in forms[1:]:
                for _ in range(4):  # reduce-overhead records its graphs after warm-up calls
                    form(*x)
            ms = time_interleaved([(f, None) for f in forms], x, calls)
            hosts = [host_us(lambda f=f, x=x: f(*x)) for f in forms]
        print(f"#62's chain, M = {m}, N = K = {n} ({model.last_path} path): uncompiled "
              f"{ms[0] * 1e3:.1f} us, compiled {ms[1] * 1e3:.1f}, reduce-overhead "
              f"{ms[2] * 1e3:.1f}; host us {hosts[0]:.0f}, {hosts[1]:.0f}, {hosts[2]:.0f}",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"gpu: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    for number in (62, 75):
        _, module, _, model = cuda_pair(number)
        torch.manual_seed(0)
        x = [t.cuda() for t in module.get_inputs()]
        compiled = torch.compile(model, fullgraph=True)
        paired(f"#{number}", model, compiled, x, args.calls, args.runs)
        if number == 62:
            layers_62(model, x[0])
    linear = torch.nn.Linear(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = [torch.rand(4096, 8192, device="cuda", dtype=torch.bfloat16)]
    compiled = torch.compile(linear, fullgraph=True)
    paired("nn.Linear bf16", linear, compiled, x, args.calls, args.runs)
    torch_floor()
    small_rows(args.calls)


if __name__ == "__main__":
    main()
