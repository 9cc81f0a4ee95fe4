"""The benchmark: correctness and speed of each shipped problem's ModelNew against PyTorch.

Per problem: Model and ModelNew built from one seed (their parameters must be identical);
correctness on several seeds (fresh inputs, the allocator poisoned with NaN first, exact shape,
allclose 1e-4 against eager fp32, max abs error of eager and of gemmfuse against a float64
reference); then times of eager fp32, torch.compile (default) and gemmfuse, each the median of
``--iters`` calls timed with CUDA events, the L2 cache flushed before every call.
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import subprocess
from dataclasses import dataclass, field

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


def weights_changed(model):
    """A function that marks every parameter of ``model`` changed in place, as an optimizer
    step's update does (their version counters step): the next call makes its weight splits
    again, as it would after the step."""
    params = list(model.parameters())
    return lambda: torch.autograd.graph.increment_version(params)


def time_ms(fn, x, iters: int, warmup: int = 5, before=None) -> float:
    """Median ms of ``iters`` calls, each timed alone with CUDA events after an L2 flush.

    ``before``, if given, runs ahead of each call, outside the timed region.
    """
    return time_interleaved([(fn, before)], x, iters, warmup)[0]


def time_interleaved(calls, x, iters: int, warmup: int = 5, orders=None) -> list[float]:
    """:func:`time_ms` of each ``(fn, before)`` in ``calls``, interleaved: every iteration times
    each call once, so a slow stretch of the machine (host or GPU) weighs on all alike, in the
    orders of :func:`balanced_orders`, so that no call always follows the same one: in a probe of
    the shape sweep's smallest sizes (scripts/small_rows_probe.py, H100, 2026-11-28) a call
    timed right after eager's took 20-30 us more than the same call timed after another gemmfuse
    call (M = 1, N = K = 1024: 0.063 against 0.033 ms). ``orders``: the orders to cycle through
    instead (lists of indices into ``calls``; that probe's fixed orders)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=x[0].device)
    with torch.no_grad():
        for fn, before in calls:
            for _ in range(warmup):
                if before is not None:
                    before()
                fn(*x)
        times = [[] for _ in calls]
        orders = orders or balanced_orders(len(calls))
        for i in range(iters):
            for k in orders[i % len(orders)]:
                fn, before = calls[k]
                if before is not None:
                    before()
                flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*x)
                end.record()
                end.synchronize()
                times[k].append(start.elapsed_time(end))
    return [statistics.median(record) for record in times]


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n calls in which each call comes right after each other call equally often (a
    Williams design: n orders for an even n, 2n for an odd one), and first equally often."""
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        if low != high:
            first.append(high)
        low, high = low + 1, high - 1
    orders = [[(k + shift) % n for k in first] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


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


def cuda_pair(number: int, dtype: torch.dtype = torch.float32):
    """(problem, its module, eager Model, gemmfuse ModelNew): seeded alike, on the GPU, both
    converted to ``dtype`` as KernelBench's 16-bit modes convert them (``.to(dtype)``)."""
    problem = get_problem(number)
    module = problem.load()
    ref, new = build_pair(problem, module.get_init_inputs())
    return problem, module, ref.to("cuda", dtype), new.to("cuda", dtype)


def run_problem(number: int, seeds: int, iters: int, compile_: bool) -> Result:
    problem, module, ref, new = cuda_pair(number)
    device = torch.device("cuda")
    result = check(problem, ref, new, module.get_inputs, seeds, device)
    set_seed(0)
    x = [t.to(device) for t in module.get_inputs()]
    result.ms["eager"] = time_ms(ref, x, iters)
    if compile_:
        result.ms["compile"] = time_ms(torch.compile(ref), x, iters)
    result.ms["gemmfuse"] = time_ms(new, x, iters)
    if compile_:  # the registered op inside a compiled graph (issue 12: within 5% of eager's)
        # timed interleaved with the uncompiled call, so both meet the same stretch of the
        # host (the compiled call is bound by it, and a block of calls right after compiling
        # can meet the compiler's worker processes still busy)
        compiled = torch.compile(new, fullgraph=True)
        paired = time_interleaved([(new, None), (compiled, None)], x, iters)
        result.ms["gemmfuse_paired"], result.ms["gemmfuse_compiled"] = paired
    # The weight split is cached; this is the time when the weights change before every call.
    result.ms["weights_changed"] = time_ms(new, x, iters, before=weights_changed(new))
    if torch.cuda.get_device_capability() == (9, 0):  # the portable kernel, for comparison
        new.kernel = "portable"
        result.ms["portable"] = time_ms(new, x, iters)
        new.kernel = "auto"
    return result


@dataclass
class ModeResult:
    problem: int
    mode: str
    max_err: float  # against float64 (the fp32 model's, in every mode)
    max_err_eager: float
    allclose_1e4: bool
    path: str
    ms_eager: float
    ms_gemmfuse: float


class ThreeTF32Linear(torch.nn.Module):
    """The 3xTF32 peer the issue names as the fallback scheme, unfused: x @ W^T as
    hi*hi + (hi*lo + lo*hi) in three cuBLAS TF32 GEMMs, hi being the operand truncated to TF32's
    10 mantissa bits and lo the exact rest. W's split is made once, as gemmfuse caches its own."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.w_hi, self.w_lo = self.split(linear.weight.detach())
        self.bias = linear.bias

    @staticmethod
    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hi = (t.contiguous().view(torch.int32) & -8192).view(torch.float32)
        return hi, t - hi

    def forward(self, x):
        x_hi, x_lo = self.split(x)
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            small = torch.mm(x_hi, self.w_lo.t()) + torch.mm(x_lo, self.w_hi.t())
            y = torch.addmm(small, x_hi, self.w_hi.t())
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
        return y if self.bias is None else y + self.bias


def with_three_tf32(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with each Linear replaced by :class:`ThreeTF32Linear`."""
    peer = copy.deepcopy(model)
    for child in list(peer.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, torch.nn.Linear):
                setattr(child, attr, ThreeTF32Linear(sub))
    return peer


def run_speed_modes(number: int, iters: int) -> list[ModeResult]:
    """The opt-in modes, precision="tf32" and the model in bfloat16 or float16 (KernelBench's
    16-bit modes), and the unfused 3xTF32 peer (same fp32 data, eager's epilogue)."""
    problem, module, ref, new = cuda_pair(number)
    device = torch.device("cuda")
    set_seed(7)
    x = [t.to(device) for t in module.get_inputs()]
    out = []
    with torch.no_grad():
        expect = ref(*x)
        exact = copy.deepcopy(ref).double()(*[t.double() for t in x])
        new.precision = "tf32"
        got = new(*x)
    out.append(
        ModeResult(
            number, 'precision="tf32"', max_abs_err(got, exact), max_abs_err(expect, exact),
            bool(torch.allclose(got, expect, atol=ATOL, rtol=RTOL)), new.last_path,
            time_ms(ref, x, iters), time_ms(new, x, iters),
        )
    )  # fmt: skip
    new.precision = "fp32"
    peer = with_three_tf32(ref)
    with torch.no_grad():
        got = peer(*x)
    out.append(
        ModeResult(
            number, "3xTF32 peer", max_abs_err(got, exact), max_abs_err(expect, exact),
            bool(torch.allclose(got, expect, atol=ATOL, rtol=RTOL)), "torch (3 TF32 GEMMs)",
            time_ms(ref, x, iters), time_ms(peer, x, iters),
        )
    )  # fmt: skip
    del peer, ref, new
    for dtype, name in ((torch.bfloat16, "bf16 model"), (torch.float16, "fp16 model")):
        out.append(_16bit_mode(number, dtype, name, x, exact, iters))
    return out


def _16bit_mode(number: int, dtype: torch.dtype, name: str, x, exact, iters: int) -> ModeResult:
    """KernelBench's 16-bit mode: a fresh pair in ``dtype`` (a module's ``to`` converts it in
    place, so the fp32 pair is not reused), tolerance 1e-2."""
    _, _, ref16, new16 = cuda_pair(number, dtype)
    x16 = [t.to(dtype) for t in x]
    with torch.no_grad():
        expect16, got16 = ref16(*x16), new16(*x16)
    return ModeResult(
        number, name, max_abs_err(got16, exact), max_abs_err(expect16, exact),
        bool(torch.allclose(got16.float(), expect16.float(), atol=1e-2, rtol=1e-2)),
        new16.last_path, time_ms(ref16, x16, iters), time_ms(new16, x16, iters),
    )  # fmt: skip


SWEEP_M = (1, 16, 128, 1024, 8192)
SWEEP_NK = (1024, 4096, 8192)
SWEEP_GROUP = (16, 64, 512)


def run_sweep(iters: int) -> list[dict]:
    """#62's chain over shapes: gemmfuse must never be slower than eager fp32.

    Each row times kernel="auto" (the shipped dispatch) and, to show what it chose between,
    the fused kernel and the epilogue path forced; each is checked allclose to eager. The four
    calls of a row are timed interleaved (time_interleaved): at these sizes a few tens of us
    of machine noise would otherwise decide a row.
    """
    problem = get_problem(62)
    device = torch.device("cuda")
    fused = "hopper" if torch.cuda.get_device_capability() == (9, 0) else "portable"
    kernels = (("auto", "gemmfuse_ms"), (fused, "fused_ms"), ("epilogue", "epilogue_ms"))
    rows = []
    for nk in SWEEP_NK:
        for group in SWEEP_GROUP:
            ref, new = build_pair(problem, [nk, nk, nk // group])
            ref, new = ref.to(device), new.to(device)
            for m in SWEEP_M:
                set_seed(m)
                x = [torch.rand(m, nk, device=device)]
                row = {"m": m, "nk": nk, "group": group, "correct": True}
                with torch.no_grad():
                    expect = ref(*x)
                for kernel, _ in kernels:
                    new.kernel = kernel
                    with torch.no_grad():
                        got = new(*x)
                    row["correct"] &= bool(torch.allclose(got, expect, atol=ATOL, rtol=RTOL))
                    if kernel == "auto":
                        row["path"] = new.last_path
                calls = [(ref, None)]
                calls += [(new, functools.partial(setattr, new, "kernel", k)) for k, _ in kernels]
                times = time_interleaved(calls, x, iters)
                row["eager_ms"] = times[0]
                row.update({key: t for (_, key), t in zip(kernels, times[1:], strict=True)})
                new.kernel = "auto"
                rows.append(row)
    return rows


CHAIN_SHAPE = (1024, 8192, 8192)  # M, K, N: the bar for arbitrary chains
CHAIN_GROUPS = (1, 16, 512)  # one group and 16 (both wider than a tile), 512 (16 channels)


def run_chains(iters: int) -> list[dict]:
    """Every chain of ``gemmfuse.chains.chain_pool`` at M=1024, K=N=8192 against eager fp32."""
    from gemmfuse.chains import chain_pool, chain_references, linear_data
    from gemmfuse.ops import fused_linear_with_path
    from gemmfuse.reference import linear_epilogue
    from gemmfuse.weight_cache import SplitWeightCache

    device = torch.device("cuda")
    m, k, n = CHAIN_SHAPE
    gen = torch.Generator().manual_seed(5)
    x, w, b, gn_w, gn_b = (t.to(device) for t in linear_data(gen, m, k, n))
    rows = []
    for spec in chain_pool():
        for groups in CHAIN_GROUPS if spec.norm else (None,):
            epilogue, params = spec.instantiate(gen, n, groups or 1)
            params = [p.to(device) for p in params]
            gn = (gn_w, gn_b) if spec.norm and spec.affine else (None, None)
            cache = SplitWeightCache()

            def eager(x, epilogue=epilogue, gn=gn, params=params):
                return linear_epilogue(x, w, b, epilogue, *gn, params)

            def fused(x, epilogue=epilogue, gn=gn, params=params, cache=cache):
                return fused_linear_with_path(
                    x, w, b, epilogue, *gn, params=params, weight_cache=cache
                )[0]

            with torch.no_grad():
                expect, exact, ops_alone = chain_references(x, w, b, epilogue, *gn, params)
                got, path = fused_linear_with_path(
                    x, w, b, epilogue, *gn, params=params, weight_cache=cache
                )
            rows.append(
                {"chain": spec.describe(), "groups": groups, "path": path,
                 "correct": bool(torch.allclose(got, expect, atol=ATOL, rtol=RTOL)),
                 "max_err_eager": max_abs_err(expect, exact),
                 "max_err_gemmfuse": max_abs_err(got, exact),
                 "max_err_ops_alone": max_abs_err(ops_alone, exact),
                 "eager_ms": time_ms(eager, [x], iters), "gemmfuse_ms": time_ms(fused, [x], iters)}
            )  # fmt: skip
    return rows


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


def _fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _compiled_cell(ms: dict) -> str:
    """The compiled call's ms, and where it was timed interleaved with the uncompiled call
    (``gemmfuse_paired``), how much slower than that call it was."""
    compiled, paired = ms.get("gemmfuse_compiled"), ms.get("gemmfuse_paired")
    if compiled is None or not paired:
        return _fmt(compiled)
    return f"{compiled:.3f} ({compiled / paired - 1:+.1%} paired)"


def format_table(results: list[Result]) -> str:
    header = [
        "problem", "output", "correct", "path", "max err eager", "max err gemmfuse", "eager ms",
        "compile ms", "gemmfuse ms", "vs eager", "vs compile", "gemmfuse compiled ms",
        "weights changed ms", "portable kernel ms",
    ]  # fmt: skip
    rows = []
    for r in results:
        eager, comp, ours = r.ms.get("eager"), r.ms.get("compile"), r.ms.get("gemmfuse")
        rows.append(
            [
                f"#{r.problem}", r.shape, "yes" if r.correct else "NO", "/".join(r.paths),
                f"{r.max_err_eager:.2e}", f"{r.max_err_gemmfuse:.2e}", _fmt(eager), _fmt(comp),
                _fmt(ours), f"{_fmt(eager / ours if ours else None, '.2f')}x",
                f"{_fmt(comp / ours if comp and ours else None, '.2f')}x",
                _compiled_cell(r.ms), _fmt(r.ms.get("weights_changed")),
                _fmt(r.ms.get("portable")),
            ]
        )  # fmt: skip
    return _markdown(header, rows)


def format_modes(modes: list[ModeResult]) -> str:
    header = [
        "problem", "mode", "path", "max err", "eager's max err", "allclose", "eager ms",
        "gemmfuse ms", "vs eager",
    ]  # fmt: skip
    rows = [
        [
            f"#{r.problem}", r.mode, r.path, f"{r.max_err:.2e}", f"{r.max_err_eager:.2e}",
            "yes" if r.allclose_1e4 else "no", f"{r.ms_eager:.3f}", f"{r.ms_gemmfuse:.3f}",
            f"{r.ms_eager / r.ms_gemmfuse:.2f}x",
        ]
        for r in modes
    ]  # fmt: skip
    return _markdown(header, rows)


def format_sweep(rows: list[dict]) -> str:
    header = ["M", "N = K", "group", "path", "correct", "eager ms", "gemmfuse ms", "vs eager",
              "fused kernel ms", "epilogue path ms"]  # fmt: skip
    return _markdown(
        header,
        [
            [
                str(r["m"]), str(r["nk"]), str(r["group"]), r["path"],
                "yes" if r["correct"] else "NO", f"{r['eager_ms']:.3f}",
                f"{r['gemmfuse_ms']:.3f}", f"{r['eager_ms'] / r['gemmfuse_ms']:.2f}x",
                _fmt(r.get("fused_ms")), _fmt(r.get("epilogue_ms")),
            ]
            for r in rows
        ],
    )  # fmt: skip


def format_chains(rows: list[dict]) -> str:
    header = ["chain", "groups", "path", "allclose", "max err eager", "max err gemmfuse",
              "max err fp32 ops alone", "eager ms", "gemmfuse ms", "vs eager"]  # fmt: skip
    return _markdown(
        header,
        [
            [
                r["chain"], "-" if r["groups"] is None else str(r["groups"]), r["path"],
                "yes" if r["correct"] else "NO", f"{r['max_err_eager']:.2e}",
                f"{r['max_err_gemmfuse']:.2e}", f"{r['max_err_ops_alone']:.2e}",
                f"{r['eager_ms']:.3f}", f"{r['gemmfuse_ms']:.3f}",
                f"{r['eager_ms'] / r['gemmfuse_ms']:.2f}x",
            ]
            for r in rows
        ],
    )  # fmt: skip
