"""Writes docs/PERFORMANCE.md from a benchmark JSON (python -m gemmfuse bench --json PATH).

Usage: python scripts/performance_doc.py BENCH_JSON [--date YYYY-MM-DD] [--stale TEXT]
[--kernelbench KB_JSON --kernelbench-commit C ...] [--mlp-block JSON --mlp-block-commit C]
[--floors JSON [--roofline PNG]] [--sweep-json JSON] [--chains-json JSON] [--other-date YYYY-MM-DD]
[--parallel JSON --parallel-commit C --parallel-gpu TEXT --parallel-date YYYY-MM-DD]
(--stale: what has changed since the measured commit that these figures do not show;
--sweep-json / --chains-json: the shape sweep's or the random chains' table from another run (a
later one of its own, .devwork-style scripts calling bench.run_sweep / bench.run_chains and
writing the bench JSON's meta with "sweep" or "chains"; or an earlier benchmark JSON that holds
the table BENCH_JSON's run left out), shown under that run's GPU, commit and --other-date in
place of BENCH_JSON's;
--kernelbench, repeatable: scripts/kernelbench_files.py's --json, a table of exported problem
files judged in KernelBench's method, each with the commit it measured; --mlp-block:
scripts/mlp_block.py's --json; --floors: scripts/problem_floors.py's --json, for the section
"Against the floor", drawn as a roofline plot into --roofline, which needs matplotlib;
--parallel: scripts/bench_parallel.py's --json, one GPU against two, with the commit, machine and
date it measured). The measured JSON files are kept in docs/measurements/.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from bench_parallel import table as format_parallel_rows
from floor_doc import floor_rows, format_floor_rows, plot_roofline
from kernelbench_files import format_problem_rows
from mlp_block import format_rows as format_mlp_rows

from gemmfuse.bench import (
    CHAIN_GROUPS,
    ModeResult,
    Result,
    format_chains,
    format_modes,
    format_sweep,
    format_table,
)
from gemmfuse.bench_harness import format_rows

DOC = Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md"
FLOP = 2 * 1024 * 8192 * 8192  # both problems: M=1024, K=N=8192


def _problem_table(kb: dict, commit: str) -> str:
    """One kernelbench_files.py run's rows as a table under its GPU, commit and method (and
    where the rows came from, when the run's own JSON was not kept: ``kb["source"]``)."""
    source = f" {kb['source']}" if kb.get("source") else ""
    return (f"GPU: {kb['gpu']}; torch {kb['torch']}; commit {commit}; method: {kb['method']}."
            f"{source}\n\n{format_problem_rows(kb['rows'])}")  # fmt: skip


def _table(path: str | None, date: str | None, data: dict, key: str) -> tuple[list, str]:
    """A table's rows, from another run at ``path`` (with a line naming that run: a later one, or
    an earlier one where the main benchmark left the table out) or from the main benchmark's
    JSON (no line: the page's header names its run)."""
    if not path:
        return data.get(key, []), ""
    other = json.loads(Path(path).read_text())
    line = (f"Measured in another run than the tables above: GPU {other['gpu']}; torch "
            f"{other['torch']} (CUDA {other['cuda']}); commit {other['commit']}; {date}; "
            f"method: {other['method']}.\n\n")  # fmt: skip
    return other[key], line


def _floor_section(args, data: dict) -> str:
    """The section "Against the floor": the main benchmark's #62 and #75 in KernelBench's
    method, and the largest KernelBench files' run measured on an H100 (the floors are an
    H100's), each beside the floor of its work; the roofline plot drawn where --roofline
    asks."""
    if not args.floors:
        return "(not run)"
    work = json.loads(Path(args.floors).read_text())
    runs = [(json.loads(Path(p).read_text()), c)
            for p, c in zip(args.kernelbench, args.kernelbench_commit, strict=True)]  # fmt: skip
    h100 = [(kb, c) for kb, c in runs if "H100" in kb["gpu"]]
    # the last given of those with the most rows
    kb, kb_commit = max(reversed(h100), key=lambda run: len(run[0]["rows"])) if h100 else (None, "")
    rows = floor_rows(work, data.get("harness", []), data["commit"], kb, kb_commit)
    plot = ""
    if args.roofline:
        machines = data["gpu"]
        if kb is not None and kb["gpu"] != data["gpu"]:  # the files ran on another machine
            machines = f"#62, #75 on {data['gpu']}, the files on {kb['gpu']}"
        plot_roofline(rows, args.roofline, f"{machines}: KernelBench's method (autograd on, "
                      "L2 cleared, mean of 100)")  # fmt: skip
        plot = f"\n\n![roofline]({args.roofline.name})"
    return f"""The floor of a problem is the larger of two times (scripts/problem_floors.py, figures
from anchors.md): its matrix products' FLOP (counted once) as the fp32-accurate split runs them,
three 16-bit tensor-core passes at cuBLAS's measured 800 TFLOP/s, and the least bytes any
implementation moves (inputs, parameters and output once) at the measured 2.86 TB/s. "of floor"
is floor / time: 100% would be the split at cuBLAS's rate with nothing else costing time. Eager
fp32 is measured against its own floor, the same bytes or its products at the datasheet's 67
TFLOP/s of fp32 SIMT. Times are KernelBench's method (autograd on, L2 cleared, mean of 100):
#62 and #75 from this page's benchmark (on the machine its header names), the files from the
last H100 run of the section above with the most rows. The rates are an H100's; #62 and #75 are
compute-bound, and an H200 is the same chip with more memory bandwidth. A row above 100%
computes less than its model's products: #98's average pooling over the Linear's channels is
folded into the weight (pooling.py), a GEMM of N / 16 columns.

{format_floor_rows(rows)}{plot}"""


def _rounds_note(harness: list[dict]) -> str:
    """How the KernelBench-method table's rounds read, where the run timed more than one."""
    rounds = max((len(r.get("round_means", [])) for r in harness), default=0)
    if rounds < 2:
        return ""
    return (
        f"\nEvery row was timed in {rounds} rounds, each timing every row once in the table's "
        "order;\nthe mean and median columns are the first round's (KernelBench times a model "
        "once), and\n\"vs eager by round\" is the range of the rounds' means against eager's "
        "of the same round: one\nmean of 100 moves with what the GPU ran just before it "
        "(docs/DESIGN.md, section 9).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bench_json")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--stale", default="", help="what the figures predate")
    parser.add_argument(
        "--kernelbench",
        action="append",
        default=[],
        help="scripts/kernelbench_files.py --json output (repeatable)",
    )
    parser.add_argument(
        "--kernelbench-commit",
        action="append",
        default=[],
        help="the commit each --kernelbench measured, in order",
    )
    parser.add_argument("--mlp-block", help="scripts/mlp_block.py --json output")
    parser.add_argument("--mlp-block-commit", default="", help="the commit it measured")
    parser.add_argument("--floors", help="scripts/problem_floors.py --json output")
    parser.add_argument("--roofline", type=Path, help="where to draw the roofline plot (PNG)")
    parser.add_argument("--sweep-json", help="the shape sweep from another run")
    parser.add_argument("--chains-json", help="the random-chain table from another run")
    parser.add_argument("--other-date", help="when the --sweep-json / --chains-json run ran")
    parser.add_argument("--parallel", help="scripts/bench_parallel.py --json output")
    parser.add_argument("--parallel-commit", default="", help="the commit it measured")
    parser.add_argument("--parallel-gpu", default="", help="the machine it ran on")
    parser.add_argument("--parallel-date", default="", help="when it ran")
    args = parser.parse_args()
    if args.parallel and not (args.parallel_commit and args.parallel_gpu and args.parallel_date):
        parser.error("--parallel needs --parallel-commit, --parallel-gpu and --parallel-date")
    if (args.sweep_json or args.chains_json) and not args.other_date:
        parser.error("--sweep-json and --chains-json need --other-date")
    if args.roofline and not args.floors:
        parser.error("--roofline draws the floors: give --floors too")
    if len(args.kernelbench_commit) != len(args.kernelbench):
        parser.error("give one --kernelbench-commit for each --kernelbench")
    problems = (
        "\n\n".join(
            _problem_table(json.loads(Path(path).read_text()), commit)
            for path, commit in zip(args.kernelbench, args.kernelbench_commit, strict=True)
        )
        or "(not run)"
    )
    mlp = "(not run)"
    if args.mlp_block:
        block = json.loads(Path(args.mlp_block).read_text())
        mlp = (f"GPU: {block['gpu']}; commit {args.mlp_block_commit}; method: CUDA events, L2 "
               "cleared before each call, mean of 100, autograd on (parameters require grad)."
               f"\n\n{format_mlp_rows(block['rows'])}")  # fmt: skip
    parallel = "(not run)"
    if args.parallel:
        rows = json.loads(Path(args.parallel).read_text())
        parallel = (f"Machine: {args.parallel_gpu}; commit {args.parallel_commit}; measured "
                    f"{args.parallel_date}.\n\n{format_parallel_rows(rows)}")  # fmt: skip
    stale = f"- **Not yet measured:** {args.stale}\n" if args.stale else ""
    data = json.loads(Path(args.bench_json).read_text())
    results = [Result(**r) for r in data["results"]]
    modes = [ModeResult(**m) for m in data.get("modes", [])]
    sweep, sweep_run = _table(args.sweep_json, args.other_date, data, "sweep")
    chains, chains_run = _table(args.chains_json, args.other_date, data, "chains")
    structures = len({row["chain"] for row in chains})  # the pool's chains
    harness = data.get("harness", [])
    trials = data.get("harness_trials", 0)
    floor = _floor_section(args, data)
    tflops = "\n".join(
        f"| #{r.problem} | {r.ms['gemmfuse']:.3f} | {FLOP / r.ms['gemmfuse'] / 1e9:.0f} "
        f"| {3 * FLOP / r.ms['gemmfuse'] / 1e9:.0f} |"
        for r in results
    )
    DOC.write_text(
        f"""# Performance

Generated by `scripts/performance_doc.py` from `python -m gemmfuse bench --json`; do not edit.

- GPU: {data["gpu"]}; torch {data["torch"]} (CUDA {data["cuda"]}); commit {data["commit"]};
  measured {args.date}.
- Method: {data["method"]}.
- Correctness over the stated seeds: fresh `torch.rand` inputs, NaN-poisoned allocator,
  exact shape, `allclose(atol=rtol=1e-4)` against eager fp32, and max abs error against a
  float64 run of the same Model on the same data (worst seed shown).
- Problems at KernelBench's sizes: M=1024, K=N=8192, 512 groups.
{stale}
{format_table(results)}

## KernelBench's method, and a training step

Timed as KernelBench's `timing.time_execution_with_cuda_event` times (re-implemented in
`gemmfuse.kernelbench.harness`): 3 warm-up calls, then per trial a synchronise, an L2 clear
(a 256 MB fill), CUDA events around one call; the first trial discarded; the mean (KernelBench's
figure) and median of {trials} trials. "forward" calls each model as constructed: its
parameters require grad and no `no_grad` is around the call, so autograd records (the fused
path then also saves the GEMM result for a backward); "gemmfuse, no_grad" is the same call under
`no_grad`. "training step": gradients set to None, forward, `backward` of a fixed random output
gradient, so every parameter's and the input's gradient is computed; "weights changed" marks
every parameter changed before each step (its version counter stepped, as an optimizer step's
in-place update steps it), so the weight splits are made again inside the step. "bf16" and
"fp16": fresh models converted with `.to(torch.bfloat16)` or `.to(torch.float16)`, as
KernelBench's 16-bit modes convert them. The "path" column is the path the gemmfuse model took.
{_rounds_note(harness)}
{format_rows(harness) if harness else "(not run)"}

## KernelBench problem files

Each file exported (`python -m gemmfuse export`), loaded as KernelBench's eval loads a solution
(a build directory's lines prepended, then `exec`), Model and ModelNew built after the same
seed, checked on 5 fresh inputs under `no_grad` (allclose 1e-4, and the largest error against the
float64 Model beside eager fp32's), then both timed in KernelBench's method
(`scripts/kernelbench_files.py`). The chain is the export report's; a BatchNorm1d in training
mode runs as the fused GEMM up to it, its batch statistics in PyTorch, then the rest of the
chain on the chain kernel. Each run below ran on the machine its device call got: rows whose
kernels did not change between two runs differ by up to some 20% between them, in either
direction, so compare the rows of one table.

{problems}

## A transformer MLP block

`LayerNorm -> Linear -> GELU -> Linear -> + residual` on (batch, sequence, d_model) float32
tokens, as a user's model writes it (`scripts/mlp_block.py`): `optimize` fuses fc1 with its GELU
and fc2 with the residual add (the (M, N) residual read per element by fc2's epilogue, the rows
of batch and sequence flattened); the LayerNorm before fc1 is PyTorch's. Errors against the
float64 block: the output's largest, and the worst gradient's (x's and every parameter's,
relative to its own largest element), each beside eager fp32's. "training step": forward and
backward of the output's sum.

{mlp}

## Achieved throughput

2·M·N·K = {FLOP / 1e9:.1f} GFLOP counted once; the split scheme issues three fp16 products
per multiply-add, so the tensor cores execute three times that.

| problem | gemmfuse ms | TFLOP/s (2·M·N·K once) | fp16 tensor-core TFLOP/s executed |
|---|---|---|---|
{tflops}

Floors for comparison (anchors.md): three 16-bit passes 0.42 ms at the datasheet's 989 TFLOP/s,
0.52 ms at the measured 800; fp32 SIMT 2.05 ms.

"weights changed" times every call after the weight changed (the cached fp16 split is rebuilt
inside the timed call); "portable kernel" forces the sm_80 mma.sync kernel on the same GPU.
"gemmfuse compiled": the gemmfuse model under `torch.compile(fullgraph=True)`, timed interleaved
with the uncompiled model (each iteration one call of each, each after its own L2 flush); the
percentage, where shown, is its median against that uncompiled median (issue 12 asks for 5%).

## Against the floor

{floor}

## Opt-in speed modes

`precision="tf32"`: one tensor-core pass on 11-bit operands. "3xTF32 peer" is not a gemmfuse
mode but the scheme the issue names as the fallback, measured for comparison: the eager Model
with its Linear computed as hi·hi + (hi·lo + lo·hi) in three cuBLAS TF32 GEMMs (W's split made
once, x's in the timed call), eager's epilogue after it (`bench.ThreeTF32Linear`).
"bf16 model" and "fp16 model": the models converted
with `.to(torch.bfloat16)` or `.to(torch.float16)` as KernelBench's 16-bit modes do (tolerance
1e-2 there); errors are against the float64 reference of the fp32 model, allclose against eager
in the same mode.

{format_modes(modes) if modes else "(not run)"}

## Shape sweep

#62's chain (GroupNorm, LeakyReLU, x + x) at M x N=K with the given group size, inputs `torch.rand`.
"gemmfuse" is `kernel="auto"`, the shipped dispatch: the fused kernel where `dispatch.fused_pays`
holds (M*N*K >= 1e8, M >= 16, K >= 1024), the epilogue path (PyTorch's fp32 GEMM, then the whole
chain in one tile kernel; at M = 1, one kernel for the compensated matrix-vector product and the
chain, csrc/gemm/gemv_epilogue.cuh) elsewhere; from M*N = 2^23 with K >= 4096 (since fee5588,
`dispatch.chain_apart`) the fused path runs the split GEMM, then the chain kernel on its result;
with fewer 128 x 128 output tiles than SMs (since 63b2ad0, `dispatch.fused_k_splits`: the rows of
16 and 128 rows at N = K = 4096 and 8192) the fused kernel cuts K into slices, a block each. The
last two columns force the fused kernel (`kernel="hopper"`: the chain in its epilogue) and the
epilogue path on the same row, which is how the thresholds were chosen. The calls run under
`no_grad` (with autograd recording, a call of one or two rows saves the GEMM result for the
backward and takes the chain kernel after PyTorch's GEMM, not the few-rows kernel). Every
timed window opens before the Python dispatch, so host cost counts. A row's four calls are
timed interleaved (each iteration times each call once, each after its own L2 flush), so a
slow stretch of the machine weighs on all four alike. Runs up to 89fea0e timed eager first and
`kernel="auto"` right after
it, at whatever clock and host state eager's SIMT GEMM left (a probe on one machine measured
20-30 us for that place at the smallest sizes; 89fea0e's sweep shows it on one row: DESIGN
section 9); later runs cycle through orders in which each call follows each other equally
often (`bench.time_interleaved`). The main table times each model's calls in a block, as KernelBench
does (interleaved there, #62 measured 0.786 ms against 0.651 ms, commit f761df4). Group
size 512 spans several 128-channel tiles: those rows take the cross-tile statistics, a second pass
after the fused kernel, one launch on the epilogue path and after the split GEMM of a chain run
apart (since 8263735 `wide_rows_kernel`: a float32 row of up to 8192 channels held in registers by
one block; at M = 1 and N = K = 1024 since b520922 the few-rows kernel's last block, the row in
its registers, where before a window epilogue, a second arrival and a pass through global memory
took 13 us of kernel time and the row ran at 0.93x eager: DESIGN section 1).

{sweep_run}{format_sweep(sweep) if sweep else "(not run)"}

## Random chains from the epilogue grammar

Each chain of `gemmfuse.chains.chain_pool()` ({structures} structures covering every pointwise op
and reduction), with argument values drawn once, at M=1024, K=N=8192, input `torch.randn`, with
{", ".join(str(g) for g in CHAIN_GROUPS)} GroupNorm groups (group sizes 8192 and 512 span several
128-channel tiles and take the cross-tile statistics, since 8263735 on `wide_rows_kernel` after the
split GEMM; 16 fits a tile). Eager's (and the references') `minimum` and `maximum` of a float take
it as a 0-dim tensor made by a fill kernel since 8263735 (before, a copy from host memory that
waited for the stream to drain). "fp32 ops alone" is the
error of eager's fp32 ops run on the float64 GEMM result rounded to fp32: the part of any fp32
evaluation's error that does not come from the GEMM.

{chains_run}{format_chains(chains) if chains else "(not run)"}

## Two GPUs

`gemmfuse.parallelize` splits an optimized model's fused Linear by output channels over the
ranks (README, "Across GPUs"): #62's chain is all-gathered to the full (M, N) output, #75's min
over the channels combines the ranks' M partial results. `scripts/bench_parallel.py`: M = 8192
rows, K = 8192, N = 8192 and 16384, the optimized model (`kernel="auto"`) on one GPU, then split
over two (NCCL, one process a GPU, NVLink multicast off); the forward under `no_grad` and a
training step (forward, then `backward` of the output's sum), each the median of 30 calls after 3
warm-ups, CUDA events on rank 0 between barriers, L2 not flushed (the operands are hundreds of
MB). Speed-ups are against the same optimized model on one GPU, not against eager; "efficiency"
is the forward's speed-up over the number of GPUs; "sent" is what a rank sends per forward (the
all-gather of its output slice, or its M reduced values).

{parallel}
"""
    )
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
