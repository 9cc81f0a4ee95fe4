"""Compiling CUDA and C++ sources: arch flags, the on-disk cache, its locks, readable errors.

Every library is built for the current GPU's own architecture (sm_90a on an H100) into a
directory of ``cache_dir()`` whose name carries a hash of its sources, flags and the torch/CUDA
versions, so a library found on disk under that name is always current and is imported
directly: a second process is ready without running a compiler.

Builds are serialised by an exclusive ``fcntl.flock`` on ``<name>.lock`` next to the build
directory (``build_lock``), held while looking for the library and while building it: processes
(DDP ranks, KernelBench eval workers) and threads build each library once, and none loads one
that another is still writing. Compilers run in child processes, so a failed build is an exit
status read here, and :class:`BuildError` carries the compiler's error lines. Each build says
on stderr when it starts (what, and why: not in the cache) and when it ends (seconds, where).

``load_extension`` is a standalone export's build (``torch.utils.cpp_extension.load_inline``,
one library for a chain, a KernelBench rule); the package builds through gemmfuse/jit.py.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

# nvcc flags of every CUDA build. -fno-gnu-unique: each library keeps its templates' statics to
# itself (chains' libraries share their names; as GNU unique symbols the process would hold one
# copy of each).
CUDA_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "-Xcompiler=-fno-gnu-unique")
CXX_FLAGS = ("-O3", "-fno-gnu-unique")
_LOADED: dict[tuple, ModuleType] = {}
# The child process's program: a torch.utils.cpp_extension loader ("load" or "load_inline")
# and its keyword arguments arrive as JSON on stdin.
_BUILD_PROGRAM = (
    "import json, sys\n"
    "from torch.utils import cpp_extension\n"
    "call = json.load(sys.stdin)\n"
    "getattr(cpp_extension, call['loader'])(**call['arguments'])\n"
)


class BuildError(RuntimeError):
    """The CUDA sources did not compile; the message holds the compiler's errors."""


def cache_dir() -> Path:
    """Where compiled libraries are kept, one directory each.

    ``$GEMMFUSE_CACHE_DIR`` if set; else ``$TORCH_EXTENSIONS_DIR`` if set (KernelBench's build
    directory: its harness sets it before it runs a submission); else ``~/.cache/gemmfuse``.
    """
    root = os.environ.get("GEMMFUSE_CACHE_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "gemmfuse"


def arch_flags(device: torch.device | int | None = None) -> tuple[str, ...]:
    """nvcc flags for exactly this GPU; Hopper gets sm_90a so wgmma/setmaxnreg are available."""
    index = device.index if isinstance(device, torch.device) else device
    return _arch_flags(torch.cuda.current_device() if index is None else index)


@functools.cache
def _arch_flags(index: int) -> tuple[str, ...]:
    major, minor = torch.cuda.get_device_capability(index)
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return (f"-gencode=arch=compute_{arch},code=sm_{arch}",)


def digest(*parts: str) -> str:
    """A short hash of sources and flags, with the torch and CUDA versions they build against."""
    text = "\0".join([*parts, torch.__version__, str(torch.version.cuda)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compiler_errors(log: str, limit: int = 40) -> str:
    """The lines of a compiler's output that name errors (else its last lines)."""
    lines = [ln for ln in log.splitlines() if re.search(r"error|Error|ERROR", ln)]
    return "\n".join((lines or log.splitlines())[-limit:])


@contextlib.contextmanager
def build_lock(name: str):
    """Holds the cross-process build lock of library ``name`` (in ``cache_dir()``)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "a") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root


def import_extension(name: str, library: Path) -> ModuleType:
    """Imports a compiled Python extension from its file."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def announce_build(what: str, where: Path) -> float:
    """The build's first stderr line; returns its start time for ``announce_built``."""
    print(f"gemmfuse: building {what}: not in cache {where}", file=sys.stderr)
    return time.perf_counter()


def announce_built(name: str, where: Path, start: float) -> None:
    seconds = time.perf_counter() - start
    print(f"gemmfuse: built {name} in {seconds:.1f} s, cached in {where}", file=sys.stderr)


def build_in_child(loader: str, arguments: dict, what: str, build_dir: Path) -> None:
    """Runs ``torch.utils.cpp_extension.<loader>(**arguments)`` in a child process; raises
    BuildError with the compiler's errors."""
    build_dir.mkdir(parents=True, exist_ok=True)
    child = subprocess.run(
        [sys.executable, "-c", _BUILD_PROGRAM],
        input=json.dumps({"loader": loader, "arguments": arguments}),
        capture_output=True,
        text=True,
        errors="replace",
        check=False,
    )
    if child.returncode != 0:
        raise BuildError(
            f"gemmfuse: compiling {what} in {build_dir} failed "
            f"(exit status {child.returncode}):\n{compiler_errors(child.stdout + child.stderr)}"
        )


def load_extension(
    prefix: str,
    cpp_source: str,
    cuda_source: str,
    device: torch.device | int | None = None,
    label: object = None,
) -> ModuleType:
    """Builds (or finds in the cache) one load_inline extension of these sources and imports it;
    ``cpp_source`` defines the Python module (PYBIND11_MODULE).

    Called on every forward: a loaded extension is found by a dict lookup (the source strings
    keep their hashes), so the sources are hashed with sha256 only once per process. ``label``
    (the chain structure, say) names what is built in the build's progress lines.
    """
    cuda_flags = (*CUDA_FLAGS, *arch_flags(device))
    key = (prefix, cpp_source, cuda_source, cuda_flags)
    module = _LOADED.get(key)
    if module is None:
        name = f"{prefix}_{digest(cpp_source, cuda_source, *cuda_flags, *CXX_FLAGS)}"
        with build_lock(name) as root:
            if key not in _LOADED:
                library = root / name / f"{name}.so"
                if not library.exists():
                    _build_inline(name, root / name, key, label)
                _LOADED[key] = import_extension(name, library)
        module = _LOADED[key]
    return module


def _build_inline(name: str, build_dir: Path, key: tuple, label: object) -> None:
    _, cpp_source, cuda_source, cuda_flags = key
    what = f"CUDA extension {name}" + ("" if label is None else f" for {label}")
    start = announce_build(what, build_dir)
    arguments = {
        "name": name,
        "cpp_sources": [cpp_source],
        "cuda_sources": [cuda_source],
        "extra_cflags": list(CXX_FLAGS),
        "extra_cuda_cflags": list(cuda_flags),
        "build_directory": str(build_dir),
    }
    build_in_child("load_inline", arguments, what, build_dir)
    announce_built(name, build_dir, start)
