"""Error against float64 of random chains at small shapes: gemmfuse's over the float64 bar (GPU).

The bar (tests/helpers.float64_bar) is eager fp32's error plus the chain's own fp32 op rounding
plus one ulp of the result. Where eager's own error is a few ulps (small K, M = 1), the split
GEMM's is not always below it; this prints, per kernel, the distribution of the ratio over
random chains of the pool, shapes and data. Usage: python scripts/small_shape_accuracy.py
[--cases N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

from test_chains import POOL, kernels, run_chain  # noqa: E402

from helpers import float64_bar, max_abs_err  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    for kernel in kernels():
        ratios = []
        for _ in range(args.cases):
            m, k = rng.choice([1, 5, 130]), rng.choice([64, 300, 1024])
            gs, groups = rng.choice([16, 48, 128, 200]), rng.randint(1, 3)
            _, eager, exact, got, _, floor = run_chain(
                rng.choice(POOL), m, k, gs, groups, 1e-5, rng.randrange(2**31), kernel
            )
            bar = float64_bar(max_abs_err(eager, exact), floor, exact)
            ratios.append(max_abs_err(got, exact) / bar)
        ratios.sort()
        print(
            f"{kernel}: error / float64 bar over {len(ratios)} cases: median "
            f"{statistics.median(ratios):.2f}, 90% {ratios[int(0.9 * len(ratios))]:.2f}, "
            f"max {ratios[-1]:.2f}, above 1: {sum(r > 1 for r in ratios)}"
        )


if __name__ == "__main__":
    main()
