"""The CUDA sources of a fused kernel: csrc/ files with the generated epilogue spliced in.

``flatten`` turns a translation unit and the files it includes (local ``#include "..."`` lines
inlined, each header once) into one string, the form ``load_inline`` takes. It reads the files
from a mapping, name -> text: the package's csrc/ directory here (``read_csrc``), the texts a
standalone export embeds there, so an export builds a kernel for any epilogue structure exactly
as the package does. ``extension_for`` builds and caches the extension of a chain.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import re
from collections.abc import Mapping
from functools import cache
from types import ModuleType

from gemmfuse.build import load_extension
from gemmfuse.epilogue import Epilogue, cuda_epilogue
from gemmfuse.kernel_files import read_csrc

GENERATED_HEADER = "epilogue_generated.cuh"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


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


def flatten(files: Mapping[str, str], name: str, generated: str) -> str:
    """``files[name]`` with its local includes inlined; ``GENERATED_HEADER`` is ``generated``."""
    return "\n".join(_flatten(files, name, generated, set())) + "\n"


@cache
def extension_sources(structure: Epilogue) -> tuple[str, str]:
    """(C++ binding, CUDA translation unit) for an epilogue structure."""
    files = read_csrc()
    generated = cuda_epilogue(structure)
    return flatten(files, "binding.cpp", generated), flatten(files, "fused_linear.cu", generated)


def extension_for(epilogue: Epilogue) -> ModuleType:
    """The compiled extension for this chain's structure (built once, then cached)."""
    structure = epilogue.structure
    return load_extension("gemmfuse_fused", *extension_sources(structure), label=structure)
