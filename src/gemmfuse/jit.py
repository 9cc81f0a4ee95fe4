"""The package's kernels, built in two pieces and loaded.

- **The host extension** (csrc/host/host_*.cpp, bind_*.cpp, split.cu, sparse_products.cu,
  column_sums.cu and outer_binary.cu): argument checks, allocation and launches for every chain,
  the operand splits, the sparse backward products, the chain backward's column sums and the
  tail ops' outer broadcast.
  Chain-independent, so it is built once per torch version, CUDA version and GPU
  architecture, its translation units in parallel (``torch.utils.cpp_extension.load`` in this
  process: ninja).
- **A chain's library** (the csrc/chain/chain_*.cu parts, with the chain's generated epilogue): its
  kernels and their launches, no torch headers. nvcc compiles the parts (one kernel family
  each) in parallel and links them into a shared library, loaded with ctypes; its one exported
  function returns the table (csrc/abi/chain_table.h) that the host extension launches through.

A chain's first call builds what the cache lacks, the two pieces at once (with the plain GEMM's
library beside them where the call needs it: ``extensions_for``), and says so on stderr
(build.py). ``extension_for`` is called on every forward: after the first call it is a dict
lookup. Standalone exports build differently (one load_inline library: sources.extension_for).
"""

import ctypes
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path
from types import ModuleType

from gemmfuse.build import (
    CUDA_FLAGS,
    CXX_FLAGS,
    BuildError,
    arch_flags,
    cached_library,
    compiler_errors,
    digest,
    import_extension,
)
from gemmfuse.epilogue import Epilogue, cuda_epilogue
from gemmfuse.kernel_files import read_csrc
from gemmfuse.sources import ChainKernels, check_constants, flatten

# The parts of a chain's library, each a translation unit of csrc/ (fused_linear.cu, an
# export's one translation unit, includes them all).
CHAIN_PARTS = ("chain_table.cu", "chain_sm90_split.cu", "chain_sm90_one_pass.cu",
               "chain_sm90_fp16.cu", "chain_sm90_bf16.cu", "chain_sm80.cu", "chain_epilogue.cu",
               "chain_epilogue_16bit.cu", "chain_gemv.cu", "chain_backward.cu")  # fmt: skip
HOST_SOURCES = ("host_split.cpp", "host_sparse.cpp", "host_forward.cpp", "host_backward.cpp",
                "host_plan.cpp", "host_autograd.cpp", "bind_splits.cpp",
                "bind_epilogue.cpp", "bind_backward.cpp", "bind_plan.cpp", "bind_plan_call.cpp",
                "host_module.cpp",
                "host_tail.cpp", "split.cu", "sparse_products.cu", "column_sums.cu",
                "outer_binary.cu")  # fmt: skip
# The parts' host code goes into a shared library.
_PART_FLAGS = ("-Xcompiler=-fPIC",)
_KERNELS: dict[tuple, ChainKernels] = {}


def extension_for(epilogue: Epilogue) -> ChainKernels:
    """The kernels of this chain's structure on the current GPU (built once, then cached)."""
    return _kernels(epilogue.structure, arch_flags())


def extensions_for(*epilogues: Epilogue) -> list[ChainKernels]:
    """extension_for of each, the libraries not yet loaded built at once (a thread each; each
    build's compilers run in processes of their own): a call that needs two chains' libraries
    (a chain run apart needs the plain GEMM's too) waits for the slower build, not for both in
    turn. The host extension is built once whichever thread asks first."""
    arch = arch_flags()
    missing = {e.structure for e in epilogues if (e.structure, arch) not in _KERNELS}
    if len(missing) > 1:
        with ThreadPoolExecutor(len(missing)) as pool:
            list(pool.map(lambda structure: _kernels(structure, arch), missing))
    return [_kernels(e.structure, arch) for e in epilogues]


def _kernels(structure: Epilogue, arch: tuple[str, ...]) -> ChainKernels:
    kernels = _KERNELS.get((structure, arch))
    if kernels is None:
        kernels = _KERNELS.setdefault((structure, arch), _load(structure, arch))
    return kernels


def _load(structure: Epilogue, arch: tuple[str, ...]) -> ChainKernels:
    """The host extension and the chain's library, building what the cache lacks at once."""
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(host_extension, arch)
        path = chain_library(structure, arch)
        host = host.result()
    library = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    table_of = library.gemmfuse_chain_table
    table_of.restype = ctypes.c_void_p
    return ChainKernels(host, table_of(), path, keep=library)


_HOST_LOCK = threading.Lock()


def host_extension(arch: tuple[str, ...]) -> ModuleType:
    """The host extension for this architecture, built if the cache lacks it: once, and
    imported once, however many threads ask at the same time (extensions_for)."""
    with _HOST_LOCK:
        return _host_extension(arch)


@cache
def _host_extension(arch: tuple[str, ...]) -> ModuleType:
    files = read_csrc()
    sources = {name: flatten(files, name) for name in HOST_SOURCES}
    cuda_flags = (*CUDA_FLAGS, *arch)
    name = f"gemmfuse_host_{digest(*sources.values(), *cuda_flags, *CXX_FLAGS)}"

    def build(build_dir: Path, _: Path) -> None:
        for file, text in sources.items():
            (build_dir / file).write_text(text)
        _build_host(name, [build_dir / file for file in sources], cuda_flags, build_dir)

    library = cached_library(name, f"{name}.so", f"the host extension {name}", build)
    host = import_extension(name, library)
    check_constants(host)
    return host


def _build_host(name: str, sources: list[Path], cuda_flags: tuple, build_dir: Path) -> None:
    """``cpp_extension.load`` here, not in a child process (a child would first spend seconds
    importing torch). Raises BuildError with the compiler's errors."""
    from torch.utils import cpp_extension  # imports setuptools: only when building

    try:
        cpp_extension.load(
            name,
            [str(s) for s in sources],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=list(cuda_flags),
            build_directory=str(build_dir),
        )
    except (RuntimeError, OSError) as error:
        raise BuildError(
            f"gemmfuse: compiling the host extension in {build_dir} failed:\n"
            f"{compiler_errors(str(error))}"
        ) from None


def nvcc() -> str:
    """The nvcc that torch's extensions build with (CUDA_HOME's), else the one on PATH."""
    from torch.utils import cpp_extension  # imports setuptools: only when building

    home = cpp_extension.CUDA_HOME
    found = Path(home, "bin", "nvcc") if home else None
    if found is not None and found.exists():
        return str(found)
    on_path = shutil.which("nvcc")
    if on_path is None:
        raise BuildError("gemmfuse: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return on_path


def chain_library(structure: Epilogue, arch: tuple[str, ...]) -> Path:
    """The path of this chain's library for this architecture, built if the cache lacks it."""
    files = read_csrc()
    generated = cuda_epilogue(structure)
    parts = {name: flatten(files, name, generated) for name in CHAIN_PARTS}
    flags = (*CUDA_FLAGS, *_PART_FLAGS, *arch)
    name = f"gemmfuse_chain_{digest(*parts.values(), *flags)}"
    what = f"the kernels of {structure} ({name})"
    return cached_library(name, f"lib{name}.so", what, partial(_compile_parts, parts, flags))


def _compile_parts(parts: dict[str, str], flags: tuple, build_dir: Path, library: Path) -> None:
    """nvcc -c of every part at once, then one link; the library appears only when complete."""
    compiler = nvcc()
    jobs = []
    for file, text in parts.items():
        (build_dir / file).write_text(text)
        command = [compiler, *flags, "-c", file, "-o", f"{file}.o"]
        jobs.append((file, subprocess.Popen(command, cwd=build_dir, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))  # fmt: skip
    logs = {file: job.communicate()[0] for file, job in jobs}
    failed = [f"{file}:\n{compiler_errors(logs[file])}" for file, job in jobs if job.returncode]
    if failed:
        errors = "\n".join(failed)
        raise BuildError(f"gemmfuse: compiling the parts in {build_dir} failed:\n{errors}")
    partial = build_dir / f"{library.name}.partial"
    link = [compiler, *flags, "-shared", "-cudart", "shared", "-o", partial.name,
            *(f"{file}.o" for file in parts)]  # fmt: skip
    linked = subprocess.run(link, cwd=build_dir, capture_output=True, text=True, check=False)
    if linked.returncode:
        raise BuildError(
            f"gemmfuse: linking {library} failed:\n{compiler_errors(linked.stdout + linked.stderr)}"
        )
    os.replace(partial, library)
