"""Compile every CUDA source with nvcc, no GPU needed (CI runs this).

Each part of a chain's library (gemmfuse.jit.CHAIN_PARTS) is compiled as it stands, with the
generated epilogue header of every kernel structure the shipped problems use, of chains holding
every pointwise op (the last with logsumexp, the reduction with the most code), of the chains
that read values again (gemmfuse.chains.value_chains) and of the softmax chains, for sm_90a and
the portable sm_80 target (the Hopper parts for sm_80 with the first structure only: their
kernels are empty there, so the others would repeat the sm_90a compile's host code). The
chain-independent split.cu is compiled once per target, and fused_linear.cu (a standalone
export's one translation unit: the same parts together) once, with the first structure.
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
SM90_ONLY_PARTS = ("chain_sm90_split.cu", "chain_sm90_one_pass.cu", "chain_sm90_bf16.cu")


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
        cmd = ["nvcc", "-std=c++17", "-O3", f"-gencode=arch={arch}", "-c", f"-I{include}",
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
                    # For sm_80 the Hopper parts' kernels are empty (their bodies need sm_90a's
                    # features) and their host code is the sm_90a compile's: one structure
                    # checks what the others would.
                    if i == 0 or arch == ARCHS[0] or source not in SM90_ONLY_PARTS:
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
