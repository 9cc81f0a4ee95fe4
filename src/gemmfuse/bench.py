"""The benchmark: correctness and speed of each shipped problem's ModelNew against PyTorch.

Per problem: Model and ModelNew built from one seed (their parameters must be identical);
correctness on several seeds (fresh inputs, the allocator poisoned with NaN first, exact shape,
allclose 1e-4 against eager fp32, max abs error of eager and of gemmfuse against a float64
reference); then times of eager fp32, torch.compile (default) and gemmfuse, each the median of
``--iters`` calls timed with CUDA events, the L2 cache flushed before every call.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, field

import torch

from gemmfuse.kernelbench.registry import Problem, get_problem

ATOL = RTOL = 1e-4
L2_FLUSH_BYTES = 256 << 20  # well past the H100's 50 MB L2


@dataclass
class Result:
    problem: int
    shape: str
    seeds: int
    correct: bool
    paths: list[str]
    max_err_eager: float  # against float64, worst seed
    max_err_gemmfuse: float
    ms: dict[str, float] = field(default_factory=dict)


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_pair(problem: Problem, init: list, seed: int = 42):
    """(Model, ModelNew) constructed as KernelBench does; raises if their parameters differ."""
    module = problem.load()
    set_seed(seed)
    ref = module.Model(*init)
    set_seed(seed)
    new = problem.model_new(*init)
    ref_state, new_state = ref.state_dict(), new.state_dict()
    if list(ref_state) != list(new_state) or any(
        not torch.equal(ref_state[k], new_state[k]) for k in ref_state
    ):
        raise AssertionError(f"#{problem.number}: ModelNew's seeded parameters differ from Model's")
    return ref, new


def poison_allocator(nbytes: int, device) -> None:
    """Leaves NaN-filled blocks in the caching allocator, so an unwritten output reads NaN."""
    blocks = [torch.full((max(nbytes // 4, 1),), float("nan"), device=device) for _ in range(4)]
    del blocks


def max_abs_err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    return (out.double() - ref64).abs().max().item()


def check(problem: Problem, ref, new, inputs_fn, seeds: int, device) -> Result:
    ref64 = copy.deepcopy(ref).double()
    errs_eager, errs_new, paths, correct, shape = [], [], set(), True, ""
    for seed in range(seeds):
        set_seed(1000 + seed)
        x = [t.to(device) for t in inputs_fn()]
        with torch.no_grad():
            expect = ref(*x)
            exact = ref64(*[t.double() for t in x])
            poison_allocator(expect.numel() * 4, device)
            got = new(*x)
        paths.add(new.last_path)
        shape = "x".join(map(str, got.shape))
        same_shape = got.shape == expect.shape
        errs_eager.append(max_abs_err(expect, exact))
        errs_new.append(max_abs_err(got, exact) if same_shape else float("inf"))
        # The bar: allclose to eager fp32, and no further from float64 than eager on this data.
        correct &= (
            same_shape
            and bool(torch.allclose(got, expect, atol=ATOL, rtol=RTOL))
            and errs_new[-1] <= errs_eager[-1]
        )
    return Result(
        problem.number, shape, seeds, correct, sorted(paths), max(errs_eager), max(errs_new)
    )


def time_ms(fn, x, iters: int, warmup: int = 5) -> float:
    """Median ms of ``iters`` calls, each timed alone with CUDA events after an L2 flush."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=x[0].device)
    with torch.no_grad():
        for _ in range(warmup):
            fn(*x)
        times = []
        for _ in range(iters):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def git_commit() -> str:
    """$GEMMFUSE_COMMIT (set where the tree travels without .git), else git's HEAD."""
    if os.environ.get("GEMMFUSE_COMMIT"):
        return os.environ["GEMMFUSE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_problem(number: int, seeds: int, iters: int, compile_: bool) -> Result:
    problem = get_problem(number)
    module = problem.load()
    device = torch.device("cuda")
    ref, new = build_pair(problem, module.get_init_inputs())
    ref, new = ref.to(device), new.to(device)
    result = check(problem, ref, new, module.get_inputs, seeds, device)
    set_seed(0)
    x = [t.to(device) for t in module.get_inputs()]
    result.ms["eager"] = time_ms(ref, x, iters)
    if compile_:
        result.ms["compile"] = time_ms(torch.compile(ref), x, iters)
    result.ms["gemmfuse"] = time_ms(new, x, iters)
    if torch.cuda.get_device_capability() == (9, 0):  # the portable kernel, for comparison
        new.kernel = "portable"
        result.ms["portable"] = time_ms(new, x, iters)
        new.kernel = "auto"
    return result


def check_reference_path(numbers: list[int]) -> bool:
    """Without a GPU: ModelNew's PyTorch path against Model on small CPU shapes."""
    ok = True
    for number in numbers:
        problem = get_problem(number)
        ref, new = build_pair(problem, list(problem.small_init))
        k = problem.small_init[0]
        result = check(problem, ref, new, lambda k=k: [torch.rand(33, k)], 3, "cpu")
        print(f"#{number}: reference path {'ok' if result.correct else 'WRONG'} on CPU")
        ok &= result.correct
    return ok


def format_table(results: list[Result]) -> str:
    head = (
        "| problem | output | correct | path | max err eager | max err gemmfuse | eager ms "
        "| compile ms | gemmfuse ms | vs eager | vs compile | portable kernel ms |"
    )
    rows = [head, "|" + "---|" * 12]
    for r in results:
        eager, comp, ours = r.ms.get("eager"), r.ms.get("compile"), r.ms.get("gemmfuse")

        def fmt(v, spec=".3f"):
            return "-" if v is None else format(v, spec)

        rows.append(
            f"| #{r.problem} | {r.shape} | {'yes' if r.correct else 'NO'} | {'/'.join(r.paths)} "
            f"| {r.max_err_eager:.2e} | {r.max_err_gemmfuse:.2e} | {fmt(eager)} | {fmt(comp)} "
            f"| {fmt(ours)} | {fmt(eager / ours if ours else None, '.2f')}x "
            f"| {fmt(comp / ours if comp and ours else None, '.2f')}x "
            f"| {fmt(r.ms.get('portable'))} |"
        )
    return "\n".join(rows)


def main(numbers: list[int], json_path: str | None, seeds: int, iters: int, compile_: bool) -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU: checking the reference path on small shapes only; no timing")
        return 0 if check_reference_path(numbers) else 1
    results = [run_problem(n, seeds, iters, compile_) for n in numbers]
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "method": f"median of {iters} calls, CUDA events, L2 flushed before each call",
    }
    print(" | ".join(f"{k}: {v}" for k, v in meta.items()))
    print(format_table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**meta, "results": [asdict(r) for r in results]}, f, indent=2)
    return 0 if all(r.correct for r in results) else 1
