"""The CUDA sources of a fused kernel: csrc/ files with the generated epilogue spliced in.

``extension_sources`` flattens csrc/fused_linear.cu and csrc/binding.cpp into one string each
(local ``#include "..."`` lines inlined, each header once), the form ``load_inline`` and
standalone exports take. ``extension_for`` builds and caches the extension of a chain.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from types import ModuleType

from gemmfuse.build import load_extension
from gemmfuse.epilogue import Epilogue, cuda_epilogue

CSRC = Path(__file__).with_name("csrc")
GENERATED_HEADER = "epilogue_generated.cuh"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _flatten(name: str, generated: str, seen: set[str]) -> list[str]:
    if name in seen:
        return []
    seen.add(name)
    text = generated if name == GENERATED_HEADER else (CSRC / name).read_text()
    out = [f"// ---- {name}"]
    for line in text.splitlines():
        include = _INCLUDE.match(line)
        if include:
            out.extend(_flatten(include.group(1), generated, seen))
        elif line.strip() != "#pragma once":
            out.append(line)
    return out


@cache
def extension_sources(structure: Epilogue) -> tuple[str, str]:
    """(C++ binding, CUDA translation unit) for an epilogue structure."""
    generated = cuda_epilogue(structure)
    cpp = "\n".join(_flatten("binding.cpp", generated, set())) + "\n"
    cuda = "\n".join(_flatten("fused_linear.cu", generated, set())) + "\n"
    return cpp, cuda


def extension_for(epilogue: Epilogue) -> ModuleType:
    """The compiled extension for this chain's structure (built once, then cached)."""
    return load_extension("gemmfuse_fused", *extension_sources(epilogue.structure))
