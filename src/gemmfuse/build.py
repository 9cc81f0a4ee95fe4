"""Compiling CUDA sources into a Python extension: arch flags, on-disk cache, readable errors.

``load_extension`` compiles with ``torch.utils.cpp_extension.load_inline`` for the current GPU's
own architecture (sm_90a on an H100) into ``cache_dir()``. The extension's name carries a hash of
its sources, flags and the torch/CUDA versions, so a library found on disk under that name is
always current and is imported directly: a second process is ready without running the compiler
or ninja.

Builds are serialised by an exclusive ``fcntl.flock`` on ``<name>.lock`` next to the build
directory, held while looking for the library and while building it: processes (DDP ranks,
KernelBench eval workers) and threads build each kernel once, and none imports a library that
another is still writing. ``load_inline`` runs in a child Python process, so a failed build is an
exit status read here, and :class:`BuildError` carries the compiler's error lines.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

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

EXTENSION_FUNCTIONS = [
    "split_rows",
    "split_cols",
    "gemm_split",
    "fused_forward",
    "fused_forward_bf16",
    "epilogue_forward",
    "gemv_forward",
    "chain_backward",
    "chain_backward_plan",
]
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
    """Where compiled extensions are kept, one directory each.

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


def _compiler_errors(log: str, limit: int = 40) -> str:
    lines = [ln for ln in log.splitlines() if re.search(r"error|Error|ERROR", ln)]
    return "\n".join((lines or log.splitlines())[-limit:])


def load_extension(
    prefix: str,
    cpp_source: str,
    cuda_source: str,
    device: torch.device | int | None = None,
    label: object = None,
) -> ModuleType:
    """Builds (or finds in the cache) the extension for these sources and imports it.

    Called on every forward: a loaded extension is found by a dict lookup (the source strings
    keep their hashes), so the sources are hashed with sha256 only once per process. ``label``
    (the chain structure, say) names what is built in the build's progress lines.
    """
    # -fno-gnu-unique: each chain's library keeps its templates' statics to itself (they share
    # names across libraries; as GNU unique symbols the process would hold one copy of each)
    cuda_flags = ("-O3", "-std=c++17", "-lineinfo", "-Xcompiler=-fno-gnu-unique",
                  *arch_flags(device))  # fmt: skip
    key = (prefix, cpp_source, cuda_source, cuda_flags)
    module = _LOADED.get(key)
    if module is None:
        digest = hashlib.sha256(
            "\0".join(
                [cpp_source, cuda_source, *cuda_flags, torch.__version__, str(torch.version.cuda)]
            ).encode()
        ).hexdigest()[:16]
        module = _find_or_build(key, f"{prefix}_{digest}", label)
    return module


def _find_or_build(key: tuple, name: str, label: object) -> ModuleType:
    """Under the build lock: the module this process loaded meanwhile, else the cached library
    (built first if absent) imported."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "a") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        if key not in _LOADED:
            library = root / name / f"{name}.so"
            if not library.exists():
                _, cpp_source, cuda_source, cuda_flags = key
                _build(name, root / name, cpp_source, cuda_source, cuda_flags, label)
            spec = importlib.util.spec_from_file_location(name, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _LOADED[key] = module
        return _LOADED[key]


def _build(name, build_dir, cpp_source, cuda_source, cuda_flags, label) -> None:
    """Runs load_inline in a child process; raises BuildError with the compiler's errors."""
    what = name if label is None else f"{name} for {label}"
    print(f"gemmfuse: building CUDA extension {what}: not in cache {build_dir}", file=sys.stderr)
    start = time.perf_counter()
    build_dir.mkdir(parents=True, exist_ok=True)
    arguments = {
        "name": name,
        "cpp_sources": [cpp_source],
        "cuda_sources": [cuda_source],
        "functions": EXTENSION_FUNCTIONS,
        "extra_cflags": ["-O3", "-std=c++17", "-fno-gnu-unique"],
        "extra_cuda_cflags": list(cuda_flags),
        "build_directory": str(build_dir),
    }
    child = subprocess.run(
        [sys.executable, "-c", _BUILD_PROGRAM],
        input=json.dumps(arguments),
        capture_output=True,
        text=True,
        errors="replace",
        check=False,
    )
    if child.returncode != 0:
        raise BuildError(
            f"gemmfuse: compiling CUDA extension {what} in {build_dir} failed "
            f"(exit status {child.returncode}):\n{_compiler_errors(child.stdout + child.stderr)}"
        )
    seconds = time.perf_counter() - start
    print(f"gemmfuse: built {name} in {seconds:.1f} s, cached in {build_dir}", file=sys.stderr)
