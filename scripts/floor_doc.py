"""docs/PERFORMANCE.md's "Against the floor": each problem's time beside the floor its work sets
(scripts/problem_floors.py), as a table and as a roofline plot (matplotlib, imported only to
draw it)."""

from __future__ import annotations

from pathlib import Path

from problem_floors import (
    FP32_SIMT_DATASHEET,
    HBM_MEASURED,
    SPLIT_PASSES,
    TENSOR_16BIT_DATASHEET,
    TENSOR_16BIT_MEASURED,
    floors,
)

from gemmfuse.bench import _markdown

# The main benchmark's problems and their files in the package (problem_floors.py's rows)
MAIN_FILES = {62: "p62_matmul_groupnorm_leakyrelu_sum.py", 75: "p75_gemm_groupnorm_min_biasadd.py"}


def floor_rows(work: dict, harness: list[dict], bench_commit: str, kb: dict | None,
               kb_commit: str) -> list[dict]:  # fmt: skip
    """A row per timed problem: the main benchmark's #62 and #75 in KernelBench's method
    (forward, autograd on), then each row of the KernelBench files' run ``kb``."""
    by_file = {r["file"]: r for r in work["rows"]}
    rows = []
    for number, file in MAIN_FILES.items():
        timed = {r["impl"]: r["mean"] for r in harness
                 if r["problem"] == number and r["what"] == "forward"}  # fmt: skip
        if "gemmfuse" in timed and file in by_file:
            rows.append(_row(f"#{number}", bench_commit, by_file[file], timed["eager"],
                             timed["gemmfuse"]))  # fmt: skip
    for r in (kb or {}).get("rows", []):
        if r["file"] in by_file:
            rows.append(_row(r["file"].removesuffix(".py"), kb_commit, by_file[r["file"]],
                             r["eager_ms"], r["gemmfuse_ms"]))  # fmt: skip
    return rows


def _row(name: str, commit: str, work: dict, eager_ms: float, gemmfuse_ms: float) -> dict:
    bound = floors(work["flop"], work["bytes"])
    return {"problem": name, "commit": commit, "products": work["products"],
            "flop": work["flop"], "bytes": work["bytes"], "eager_ms": eager_ms,
            "gemmfuse_ms": gemmfuse_ms, **{k: v * 1e3 for k, v in bound.items()}}  # fmt: skip


def format_floor_rows(rows: list[dict]) -> str:
    """The rows as a markdown table: the floor (and which bound sets it), the fraction of it
    reached (floor / time), and the same for eager fp32 against its SIMT floor."""
    header = ["problem", "commit", "products (M x K x N)", "GFLOP", "MB moved",
              "floor ms (bound)", "gemmfuse ms", "of floor", "eager ms",
              "eager of its SIMT floor"]  # fmt: skip
    body = []
    for r in rows:
        bound = "compute" if r["split_measured"] >= r["memory"] else "memory"
        simt = max(r["fp32_simt"], r["memory"])
        body.append([
            r["problem"], r["commit"], ", ".join("x".join(map(str, p)) for p in r["products"]),
            f"{r['flop'] / 1e9:.1f}", f"{r['bytes'] / 1e6:.0f}", f"{r['floor']:.3f} ({bound})",
            f"{r['gemmfuse_ms']:.3f}", f"{r['floor'] / r['gemmfuse_ms']:.0%}",
            f"{r['eager_ms']:.3f}", f"{simt / r['eager_ms']:.0%}",
        ])  # fmt: skip
    return _markdown(header, body)


def plot_roofline(rows: list[dict], path: Path, title: str) -> None:
    """Achieved TFLOP/s (the products' FLOP counted once) against FLOP per byte moved, for
    gemmfuse and eager, under the ceilings: the split scheme's (three 16-bit passes) at the
    measured and the datasheet rate, fp32 SIMT, and the memory's slope."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    intensity = [r["flop"] / r["bytes"] for r in rows]
    lo, hi = min(intensity) / 2, max(intensity) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ceilings = [
        (TENSOR_16BIT_DATASHEET / SPLIT_PASSES, "fp32-accurate split, datasheet 989 / 3", ":"),
        (TENSOR_16BIT_MEASURED / SPLIT_PASSES, "fp32-accurate split, cuBLAS-measured 800 / 3", "-"),
        (FP32_SIMT_DATASHEET, "fp32 SIMT (eager), datasheet 67", "--"),
    ]
    for peak, label, style in ceilings:
        ax.plot(xs, [min(peak, HBM_MEASURED * x) / 1e12 for x in xs], style, color="gray",
                linewidth=1)  # fmt: skip
        ax.text(hi, peak / 1e12, label, ha="right", va="bottom", fontsize=7, color="dimgray")
    for key, label, marker in (("gemmfuse_ms", "gemmfuse", "o"), ("eager_ms", "eager fp32", "x")):
        tflops = [r["flop"] / (r[key] * 1e-3) / 1e12 for r in rows]
        ax.scatter(intensity, tflops, marker=marker, label=label, s=22)
        for r, x, y in zip(rows, intensity, tflops, strict=True):
            if r["problem"].startswith("#"):  # the main benchmark's #62 and #75
                ax.annotate(r["problem"], (x, y), textcoords="offset points", xytext=(6, -3),
                            fontsize=7)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte moved (products' FLOP once; inputs, parameters, output once)")
    ax.set_ylabel("achieved TFLOP/s (products' FLOP once)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
