"""The CUDA/C++ files of csrc/, read from the installed package.

Kept apart from sources.py, which standalone exports inline: an export has no package directory,
so it embeds these texts and defines its own ``read_csrc`` returning them.
"""

from __future__ import annotations

import functools
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SUFFIXES = (".cu", ".cuh", ".h", ".cpp")  # the package data pyproject.toml ships


@functools.cache
def read_csrc() -> dict[str, str]:
    """csrc/'s source files, name -> text (read once per process)."""
    return {p.name: p.read_text() for p in sorted(CSRC.iterdir()) if p.suffix in SUFFIXES}
