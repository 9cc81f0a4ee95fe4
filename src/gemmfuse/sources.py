"""The CUDA sources of a chain: csrc/ files with the generated epilogue spliced in, and the
object through which the package calls a chain's kernels.

``flatten`` turns a translation unit and the files it includes (local ``#include "..."`` lines
inlined, each header once) into one string. It reads the files from a mapping, name -> text:
the package's csrc/ directory here (``read_csrc``), the texts a standalone export embeds there,
so an export builds a kernel for any epilogue structure exactly as the package does.

:class:`ChainKernels` is what ``extension_for`` returns, in the package and in an export alike:
the host extension's entry points with the chain library's table bound. The package's
``extension_for`` is gemmfuse/jit.py's (a host extension built once, a chain's parts each a
library of its own, built when first needed); a standalone export bundles this module's instead,
which builds the binding and every part as one ``load_inline`` library (a KernelBench rule), and
ops.py and autograd.py call whichever the file they run in defines.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import functools
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType

from gemmfuse.build import load_extension
from gemmfuse.dispatch import (
    GEMV_MAX_ROWS,
    HOPPER_KERNEL,
    K_ALIGN,
    MAX_K_SPLITS,
    OUTER_OPS,
    PORTABLE_KERNEL,
    SPLIT_COLS_MAX,
    TILE,
)
from gemmfuse.epilogue import MAX_TENSORS, Epilogue, cuda_epilogue
from gemmfuse.kernel_files import read_csrc

GENERATED_HEADER = "epilogue_generated.cuh"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
# The host extension's entry points (csrc/host/host_module.cpp's PYBIND11_MODULE, which
# csrc/export/binding.cpp includes for an export): those that launch a chain's kernels take its
# table first; the splits serve every chain.
CHAIN_FUNCTIONS = ("gemm_split", "epilogue_forward", "chain_backward", "chain_backward_plan")
SHARED_FUNCTIONS = ("split_rows", "split_cols", "sparse_products", "tail_outer")


def _flatten(files: Mapping[str, str], name: str, generated: str, seen: set[str]) -> list[str]:
    if name in seen:
        return []
    seen.add(name)
    if name == GENERATED_HEADER:
        text = generated
    elif name in files:
        text = files[name]
    else:
        raise FileNotFoundError(f"gemmfuse: kernel source {name!r} is not among {sorted(files)}")
    out = [f"// ---- {name}"]
    for line in text.splitlines():
        include = _INCLUDE.match(line)
        if include:
            out.extend(_flatten(files, include.group(1), generated, seen))
        elif line.strip() != "#pragma once":
            out.append(line)
    return out


def flatten(files: Mapping[str, str], name: str, generated: str = "") -> str:
    """``files[name]`` with its local includes inlined; ``GENERATED_HEADER`` is ``generated``."""
    return "\n".join(_flatten(files, name, generated, set())) + "\n"


def check_constants(host: ModuleType) -> None:
    """Raises RuntimeError if the constants Python keeps differ from the compiled extension's."""
    ours = {
        "tile": TILE,
        "gemv_max_rows": GEMV_MAX_ROWS,
        "max_params": MAX_TENSORS,
        "split_cols_max": SPLIT_COLS_MAX,
        "k_align": K_ALIGN,
        "outer_ops": len(OUTER_OPS),
        "portable_kernel": PORTABLE_KERNEL,
        "hopper_kernel": HOPPER_KERNEL,
        "max_k_splits": MAX_K_SPLITS,
    }
    theirs = dict(host.constants())
    if theirs != ours:
        raise RuntimeError(f"gemmfuse: csrc/ constants {theirs} differ from Python's {ours}")


class ChainKernels:
    """A chain's entry points: the host extension's functions, the chain's table bound first.

    ``library`` is the file holding the chain's table (an export's: every kernel too; the
    package's parts are libraries of their own: gemmfuse.jit.part_library); ``host`` the host
    extension's module and ``table`` the chain's table (plans take both); ``parts`` the
    package's gemmfuse.jit.ChainParts (None in an export), which also keeps the libraries loaded.
    """

    def __init__(self, host: ModuleType, table: int, library: Path, parts=None):
        host.check_table(table)
        self.host = host
        self.table = table
        for name in CHAIN_FUNCTIONS:
            setattr(self, name, functools.partial(getattr(host, name), table))
        for name in SHARED_FUNCTIONS:
            setattr(self, name, getattr(host, name))
        self.library = library
        self.parts = parts


@cache
def extension_sources(structure: Epilogue) -> tuple[str, str]:
    """(C++ binding, CUDA translation unit) of a standalone export's one library."""
    files = read_csrc()
    generated = cuda_epilogue(structure)
    return flatten(files, "binding.cpp"), flatten(files, "fused_linear.cu", generated)


@cache
def _kernels_of(module: ModuleType) -> ChainKernels:
    check_constants(module)
    return ChainKernels(module, module.linked_chain_table(), Path(module.__spec__.origin))


def extension_for(epilogue: Epilogue, parts=()) -> ChainKernels:
    """A standalone export's kernels of this chain: binding and kernels in one load_inline
    library (built once, then cached), every part in it (``parts`` is the package's
    gemmfuse.jit.extension_for's, which builds parts apart)."""
    structure = epilogue.structure
    module = load_extension("gemmfuse_fused", *extension_sources(structure), label=structure)
    return _kernels_of(module)


def extensions_for(*epilogues: Epilogue, parts: tuple = ()) -> list[ChainKernels]:
    """extension_for of each, in turn (gemmfuse.jit.extensions_for builds a package's
    libraries at once; an export's load_inline builds stay one at a time)."""
    return [extension_for(e) for e in epilogues]
