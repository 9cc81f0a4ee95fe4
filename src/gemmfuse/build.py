"""Compiling CUDA sources into a Python extension: arch flags, on-disk cache, readable errors.

``load_extension`` compiles through ``torch.utils.cpp_extension.load_inline`` for the current
GPU's own architecture (sm_90a on an H100) into a cache directory (``$GEMMFUSE_CACHE_DIR``, else
``~/.cache/gemmfuse``). The extension's name carries a hash of its sources, flags and the
torch/CUDA versions, so a library found on disk under that name is always current and is
imported directly: a second process is ready without running the compiler or ninja.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import threading
from pathlib import Path
from types import ModuleType

import torch

EXTENSION_FUNCTIONS = [
    "split_rows",
    "fused_forward",
    "fused_forward_bf16",
    "epilogue_forward",
    "gemv_forward",
]
_LOADED: dict[tuple, ModuleType] = {}
_LOCK = threading.Lock()


class BuildError(RuntimeError):
    """The CUDA sources did not compile; the message holds the compiler's errors."""


def cache_dir() -> Path:
    root = os.environ.get("GEMMFUSE_CACHE_DIR")
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
    prefix: str, cpp_source: str, cuda_source: str, device: torch.device | int | None = None
) -> ModuleType:
    """Builds (or finds in the cache) the extension for these sources and imports it.

    Called on every forward: a loaded extension is found by a dict lookup (the source strings
    keep their hashes), so the sources are hashed with sha256 only once per process.
    """
    cuda_flags = ("-O3", "-std=c++17", "-lineinfo", *arch_flags(device))
    key = (prefix, cpp_source, cuda_source, cuda_flags)
    module = _LOADED.get(key)
    if module is not None:
        return module
    digest = hashlib.sha256(
        "\0".join(
            [cpp_source, cuda_source, *cuda_flags, torch.__version__, str(torch.version.cuda)]
        ).encode()
    ).hexdigest()[:16]
    name = f"{prefix}_{digest}"
    with _LOCK:
        if key not in _LOADED:
            build_dir = cache_dir() / name
            library = build_dir / f"{name}.so"
            if library.exists():
                spec = importlib.util.spec_from_file_location(name, library)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                module = _compile(name, build_dir, cpp_source, cuda_source, list(cuda_flags))
            _LOADED[key] = module
        return _LOADED[key]


def _compile(name, build_dir, cpp_source, cuda_source, cuda_flags) -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load_inline(
            name=name,
            cpp_sources=[cpp_source],
            cuda_sources=[cuda_source],
            functions=EXTENSION_FUNCTIONS,
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=cuda_flags,
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # load_inline raises RuntimeError or CalledProcessError
        log = str(exc)
        if hasattr(exc, "output") and exc.output:
            log += "\n" + exc.output.decode(errors="replace")
        raise BuildError(
            f"gemmfuse: compiling CUDA extension {name} in {build_dir} failed:\n"
            f"{_compiler_errors(log)}"
        ) from exc
