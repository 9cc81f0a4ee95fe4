"""Compiling CUDA and C++ sources: arch flags, the on-disk cache, its locks, readable errors.

Every library is built for the current GPU's own architecture (sm_90a on an H100) into a
directory of ``cache_dir()`` whose name carries a hash of its sources, flags and the torch/CUDA
versions, so a library found on disk under that name is always current and is imported
directly: a second process is ready without running a compiler.

Builds are serialised by an exclusive ``fcntl.flock`` on ``<library file>.lock`` next to the
build directory (``cached_library``), held while looking for the library and while building it:
processes (DDP ranks, KernelBench eval workers) and threads build each library once, and none
loads one that another is still writing, nor one that a killed build left half-linked
(``_not_cached``). Compilers run as child processes, so a failed build is
an exit status read here, and :class:`BuildError` carries the compiler's error lines. Each
build says on stderr when it starts (what, and why: not in the cache, or not linked whole) and
when it ends (seconds, where).

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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

# nvcc flags of every CUDA build. -fno-gnu-unique: each library keeps its templates' statics to
# itself (chains' libraries share their names; as GNU unique symbols the process would hold one
# copy of each).
CUDA_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "-Xcompiler=-fno-gnu-unique")
CXX_FLAGS = ("-O3", "-fno-gnu-unique")
_LOADED: dict[tuple, ModuleType] = {}
# The child process's program: load_inline's keyword arguments arrive as JSON on stdin.
_BUILD_PROGRAM = (
    "import json, sys\n"
    "from torch.utils.cpp_extension import load_inline\n"
    "load_inline(**json.load(sys.stdin))\n"
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


# library file name -> the descriptor of its build lock while held (_build_lock)
_HELD: dict[str, int] = {}


@contextlib.contextmanager
def _build_lock(file_name: str):
    """Holds the cross-process build lock of library file ``file_name`` (in ``cache_dir()``):
    one per library, so that the libraries of one directory (a chain's parts) build at once."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{file_name}.lock", "a") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        _HELD[file_name] = lock.fileno()
        yield root
        del _HELD[file_name]


def import_extension(name: str, library: Path) -> ModuleType:
    """Imports a compiled Python extension from its file."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cached_library(
    name: str, file_name: str, what: str, build: Callable[[Path, Path], None]
) -> Path:
    """The path of library ``name`` (``<cache_dir>/<name>/<file_name>``), built first under the
    build lock if the cache lacks it: ``build(build_dir, library)`` must leave the library there
    or raise BuildError. Says on stderr when a build starts (``what``, and why) and ends."""
    with _build_lock(file_name) as root:
        build_dir = root / name
        library = build_dir / file_name
        why = _not_cached(build_dir, library)
        if why:
            print(f"gemmfuse: building {what}: {why}", file=sys.stderr)
            start = time.perf_counter()
            build_dir.mkdir(parents=True, exist_ok=True)
            # cpp_extension's own lock file, which a build killed there leaves and the next
            # waits on for ever: no other build uses this directory while ours is held (an
            # export's build child holds ours too; the host extension's ninja, left running
            # by a process killed alone, does not: a rare race left open)
            (build_dir / "lock").unlink(missing_ok=True)
            build(build_dir, library)
            seconds = time.perf_counter() - start
            print(f"gemmfuse: built {file_name} in {seconds:.1f} s, cached in {build_dir}",
                  file=sys.stderr)  # fmt: skip
    return library


def _not_cached(build_dir: Path, library: Path) -> str:
    """Why ``library`` must be built ("" where it is whole in the cache). ninja links the host
    extension and a load_inline export straight to their names, and records a link in its log
    (``.ninja_log``, a line of tab-separated fields per output) only once the linker has exited:
    a library file that a log beside it does not name is what a build stopped mid-link left. A
    chain part appears under its name only when complete (jit._compile_part), with no log."""
    if not library.exists():
        return f"not in cache {build_dir}"
    log = build_dir / ".ninja_log"
    if log.exists():  # a field of a line, whatever the log's version puts beside it
        logged = any(library.name in line.split("\t") for line in log.read_text().splitlines())
        if not logged:
            return f"{library} was not linked whole (a build stopped mid-link)"
    return ""


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
        what = f"CUDA extension {name}" + ("" if label is None else f" for {label}")
        arguments = {
            "name": name,
            "cpp_sources": [cpp_source],
            "cuda_sources": [cuda_source],
            "extra_cflags": list(CXX_FLAGS),
            "extra_cuda_cflags": list(cuda_flags),
        }

        def build(build_dir: Path, _: Path) -> None:
            _load_inline_in_child({**arguments, "build_directory": str(build_dir)}, what)

        library = cached_library(name, f"{name}.so", what, build)
        module = _LOADED.setdefault(key, import_extension(name, library))
    return module


def _load_inline_in_child(arguments: dict, what: str) -> None:
    """Runs ``load_inline(**arguments)`` in a child process; raises BuildError with the
    compiler's errors. The child shares the build lock (its file descriptor): killed alone, this
    process leaves the lock held until the child's build ends, so no other build starts in the
    directory meanwhile (cached_library then removes cpp_extension's lock file, stale only
    once no build holds ours)."""
    held = _HELD.get(f"{arguments['name']}.so")
    child = subprocess.run(
        [sys.executable, "-c", _BUILD_PROGRAM],
        pass_fds=() if held is None else (held,),
        input=json.dumps(arguments),
        capture_output=True,
        text=True,
        errors="replace",
        check=False,
    )
    if child.returncode != 0:
        raise BuildError(
            f"gemmfuse: compiling {what} in {arguments['build_directory']} failed "
            f"(exit status {child.returncode}):\n{compiler_errors(child.stdout + child.stderr)}"
        )
