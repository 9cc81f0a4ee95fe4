"""Compile every CUDA source with nvcc, no GPU needed (CI runs this).

Each ``.cu`` file in csrc/ is compiled as it stands, with the generated epilogue header of every
kernel structure the shipped problems use, for sm_90a and the portable sm_80 target.
Usage: python scripts/compile_check.py [--jobs N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gemmfuse.epilogue import cuda_epilogue
from gemmfuse.kernelbench.registry import PROBLEMS
from gemmfuse.sources import CSRC, GENERATED_HEADER

ARCHS = ("compute_90a,code=sm_90a", "compute_80,code=sm_80")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    structures = {repr(s.structure): s.structure for p in PROBLEMS.values() for s in p.structures}
    work = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, structure in enumerate(structures.values()):
            include = Path(tmp) / f"epilogue{i}"
            include.mkdir()
            (include / GENERATED_HEADER).write_text(cuda_epilogue(structure))
            for source in sorted(CSRC.glob("*.cu")):
                for arch in ARCHS:
                    cmd = ["nvcc", "-std=c++17", "-O3", f"-gencode=arch={arch}", "-c",
                           f"-I{include}", f"-I{CSRC}", str(source), "-o", "/dev/null"]  # fmt: skip
                    work.append((f"{source.name} [{arch.split('=')[-1]}] {structure}", cmd))

        def run(item):
            label, cmd = item
            proc = subprocess.run(cmd, capture_output=True, text=True)
            return label, proc.returncode, proc.stdout + proc.stderr

        failed = 0
        with ThreadPoolExecutor(args.jobs) as pool:
            for label, rc, log in pool.map(run, work):
                print(f"{'ok  ' if rc == 0 else 'FAIL'} {label}")
                if rc != 0 or "warning" in log:
                    print(log)
                failed += rc != 0
    print(f"{len(work) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
