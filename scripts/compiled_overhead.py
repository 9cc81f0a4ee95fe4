"""What torch.compile adds to a gemmfuse call without autograd (issue 12: within 5%, and
reduce-overhead faster at small M).

Usage: python scripts/compiled_overhead.py [--calls N] [--runs R] [--small-rows]

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
flushed before each, ``no_grad``) and back to back (the median of 5 rounds of N calls with no
flush or sync between: the rate a host sustains, what CUDA graphs cut), with their host
microseconds and the path the uncompiled call took, and KernelBench's own Model in the same
forms (the control); then a stack of eight such layers, ``optimize``d, against PyTorch's,
where one graph replay stands for many launches. ``--small-rows``: those rows alone.
"""

import argparse
import statistics
import warnings

import torch
from host_overhead import host_us

from gemmfuse import optimize
from gemmfuse.bench import cuda_pair, time_interleaved
from gemmfuse.epilogue import epilogue_from_spec
from gemmfuse.kernelbench.models import ModelNew62, epilogue_62
from gemmfuse.kernelbench.registry import get_problem
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


def back_to_back_us(fn, x, calls: int, rounds: int = 5) -> float:
    """µs a call over ``calls`` calls issued back to back (no flush, no sync between them), the
    median of ``rounds``: where the host's work a call outlasts the GPU's, the host's rate,
    which CUDA graphs cut."""
    fn(*x)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(*x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


class Block62(torch.nn.Module):
    """#62's chain as a layer: Linear, GroupNorm (groups of 16), LeakyReLU, x + x."""

    def __init__(self, n: int):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
        self.gn = torch.nn.GroupNorm(n // 16, n)
        self.act = torch.nn.LeakyReLU(0.01)

    def forward(self, x):
        x = self.act(self.gn(self.fc(x)))
        return x + x


def deep_rows(calls: int, layers: int = 8) -> None:
    """A stack of ``layers`` Block62 at N = K = 1024, M = 1 and 16, ``optimize``d against
    PyTorch's layers, in the three forms: where CUDA graphs pay, one replay for a model's many
    launches."""
    n = 1024
    for m in (1, 16):
        torch.manual_seed(0)
        theirs = torch.nn.Sequential(*[Block62(n) for _ in range(layers)]).cuda()
        x = [torch.rand(m, n, device="cuda")]
        ours = optimize(theirs, tuple(x))[0]
        for label, model in (("gemmfuse", ours), ("PyTorch", theirs)):
            torch._dynamo.reset()
            ms, rates, hosts = three_forms(model, x, calls)
            print(f"{layers} x #62's chain, M = {m}, N = K = {n}, {label}: uncompiled "
                  f"{ms[0] * 1e3:.1f} us, compiled {ms[1] * 1e3:.1f}, reduce-overhead "
                  f"{ms[2] * 1e3:.1f}; back to back {rates[0]:.1f}, {rates[1]:.1f}, "
                  f"{rates[2]:.1f} us a call; host us {hosts[0]:.0f}, {hosts[1]:.0f}, "
                  f"{hosts[2]:.0f}", flush=True)  # fmt: skip


def small_rows(calls: int) -> None:
    """#62's chain at N = K = 1024 and small M: uncompiled, compiled and reduce-overhead, each
    timed alone (L2 flushed) and back to back; then KernelBench's own Model (PyTorch's layers)
    in the same three forms, the control: what torch.compile costs this host on the same
    work."""
    n = 1024
    for m in (1, 16, 128):
        torch.manual_seed(0)
        ours = ModelNew62(n, n, n // 16).cuda()
        torch.manual_seed(0)
        theirs = get_problem(62).load().Model(n, n, n // 16).cuda()
        x = [torch.rand(m, n, device="cuda")]
        for label, model in (("gemmfuse", ours), ("PyTorch", theirs)):
            torch._dynamo.reset()  # a fresh compile each row: no recompile limit across sizes
            ms, rates, hosts = three_forms(model, x, calls)
            path = f" ({model.last_path} path)" if model is ours else ""
            print(f"#62's chain, M = {m}, N = K = {n}, {label}{path}: uncompiled "
                  f"{ms[0] * 1e3:.1f} us, compiled {ms[1] * 1e3:.1f}, reduce-overhead "
                  f"{ms[2] * 1e3:.1f}; back to back {rates[0]:.1f}, {rates[1]:.1f}, "
                  f"{rates[2]:.1f} us a call; host us {hosts[0]:.0f}, {hosts[1]:.0f}, "
                  f"{hosts[2]:.0f}", flush=True)  # fmt: skip


def three_forms(model, x, calls: int) -> tuple[list, list, list]:
    """(ms timed alone, µs a call back to back, host µs) of ``model`` uncompiled, compiled and
    under reduce-overhead, without autograd."""
    with torch.no_grad():
        model(*x)
        forms = [model, torch.compile(model, fullgraph=True),
                 torch.compile(model, fullgraph=True, mode="reduce-overhead")]  # fmt: skip
        for form in forms[1:]:
            for _ in range(4):  # reduce-overhead records its graphs after warm-up calls
                form(*x)
        ms = time_interleaved([(f, None) for f in forms], x, calls)
        rates = [back_to_back_us(f, x, calls) for f in forms]
        hosts = [host_us(lambda f=f, x=x: f(*x)) for f in forms]
    return ms, rates, hosts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--small-rows", action="store_true", help="only the small-M rows")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"gpu: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    if args.small_rows:
        small_rows(args.calls)
        deep_rows(args.calls)
        return
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
    deep_rows(args.calls)


if __name__ == "__main__":
    main()
