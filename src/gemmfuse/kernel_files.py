"""The CUDA/C++ files of csrc/, read from the installed package.

csrc/ holds a folder per role (README's layout says which), its sources one level down, as
pyproject.toml's package data ships them (``csrc/*/*``); a file's name is unique across them and
the sources include each other by name alone (``#include "fused_args.h"``): builds
flatten a translation unit by name (sources.flatten), so where a file sits changes no build.
Kept apart from sources.py, which standalone exports inline: an export has no package directory,
so it embeds these texts and defines its own ``read_csrc`` returning them.
"""

from __future__ import annotations

import functools
from pathlib import Path

ROOT_PACKAGE = Path(__file__).parent
CSRC = ROOT_PACKAGE / "csrc"
SUFFIXES = (".cu", ".cuh", ".h", ".cpp")  # the package data pyproject.toml ships


@functools.cache
def csrc_paths() -> dict[str, Path]:
    """csrc/'s source files, name -> path; raises if two folders hold the same name."""
    paths: dict[str, Path] = {}
    for path in sorted(CSRC.glob("*/*")):
        if path.suffix not in SUFFIXES:
            continue
        if path.name in paths:
            raise RuntimeError(f"gemmfuse: csrc/ holds {path.name} twice ({paths[path.name]})")
        paths[path.name] = path
    return paths


def include_dirs() -> list[Path]:
    """The folders of csrc/ that hold sources (``-I`` of a build that compiles them in place)."""
    return sorted({path.parent for path in csrc_paths().values()})


@functools.cache
def read_csrc() -> dict[str, str]:
    """csrc/'s source files, name -> text (read once per process)."""
    return {name: path.read_text() for name, path in csrc_paths().items()}
