"""Compile every CUDA source with nvcc, no GPU needed (CI runs this).

Each part of a chain (gemmfuse.jit.CHAIN_PARTS) is compiled as the package builds it (each a
library of its own: GEMMFUSE_PARTS_APART), with the generated epilogue header of every kernel
structure the shipped problems use, of chains holding every pointwise op (the last with
logsumexp, the reduction with the most code), of the chains that read values again
(gemmfuse.chains.value_chains) and of the softmax chains, for sm_90a and the portable sm_80
target (for sm_80 every part but the portable kernel with the first structure only: the Hopper
parts' kernels are empty there, and the others compile the same source as for sm_90a, where
nothing but gemm_gn_sm90.cuh depends on the architecture). The chain-independent split.cu is
compiled once per target, and fused_linear.cu (a standalone export's one translation unit: the
same parts together) once, with the first structure.
Usage: python scripts/compile_check.py [--jobs N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gemmfuse.chains import softmax_chains, value_chains
from gemmfuse.epilogue import (
    POINTWISE,
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    cuda_epilogue,
)
from gemmfuse.jit import CHAIN_PARTS
from gemmfuse.kernel_files import csrc_paths, include_dirs
from gemmfuse.kernelbench.registry import PROBLEMS
from gemmfuse.sources import GENERATED_HEADER

ARCHS = ("compute_90a,code=sm_90a", "compute_80,code=sm_80")
SM80_PART = "chain_sm80.cu"  # the one part with kernels of its own for sm_80


def every_op_chains() -> list[Epilogue]:
    """Chains that between them generate the CUDA of every pointwise op and argument kind,
    the last one ending in logsumexp (the reduction with the most code)."""
    ops = []
    for name, d in POINTWISE.items():
        ops.append(Pointwise(name, (1.0,) * d.n_args))
        if d.tensor_arg:
            ops.append(Pointwise(name, (Param(0),)))
    groups, current = [], []
    for op in ops:  # at most 8 float arguments per chain
        if sum(len(o.scalars) for o in current + [op]) > 8:
            groups.append(tuple(current))
            current = []
        current.append(op)
    groups.append(tuple(current))
    chains = [Epilogue(pre=g[:3], norm=GroupNormSpec(4), post=g[3:]) for g in groups]
    chains[-1] = Epilogue(chains[-1].pre, chains[-1].norm, chains[-1].post, Reduction("logsumexp"))
    return chains


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    chains = [s for p in PROBLEMS.values() for s in p.structures] + every_op_chains()
    chains += value_chains()  # values read again: registers and gathered gradients
    chains += softmax_chains()  # the softmax statistics and merges
    structures = {repr(s.structure): s.structure for s in chains}
    work = []

    def compile_(source: str, arch: str, include: Path, label: str) -> None:
        # the parts as the package builds them, each a library of its own (part_entries.h)
        apart = ["-DGEMMFUSE_PARTS_APART"] if source in CHAIN_PARTS else []
        cmd = ["nvcc", "-std=c++17", "-O3", *apart, f"-gencode=arch={arch}", "-c", f"-I{include}",
               *(f"-I{d}" for d in include_dirs()), str(csrc_paths()[source]), "-o",
               "/dev/null"]  # fmt: skip
        work.append((f"{source} [{arch.split('=')[-1]}] {label}", cmd))

    with tempfile.TemporaryDirectory() as tmp:
        for i, structure in enumerate(structures.values()):
            include = Path(tmp) / f"epilogue{i}"
            include.mkdir()
            (include / GENERATED_HEADER).write_text(cuda_epilogue(structure))
            for arch in ARCHS:
                for source in CHAIN_PARTS:
                    # For sm_80 only the portable kernel (chain_sm80.cu) is code of its own: the
                    # Hopper parts' kernels are empty there (their bodies need sm_90a's
                    # features), and the other parts compile the very source the sm_90a compile
                    # does (only gemm_gn_sm90.cuh tests the architecture). One structure checks
                    # them for sm_80.
                    if i == 0 or arch == ARCHS[0] or source == SM80_PART:
                        compile_(source, arch, include, str(structure))
                if i == 0:
                    compile_("split.cu", arch, include, "")
            if i == 0:
                compile_("fused_linear.cu", ARCHS[0], include, str(structure))

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
