"""The package's kernels, built in pieces, each when first needed, and loaded.

- **The host extension** (csrc/host/host_*.cpp, bind_*.cpp, split.cu, sparse_products.cu,
  column_sums.cu and outer_binary.cu): argument checks, allocation and launches for every chain,
  the operand splits, the sparse backward products, the chain backward's column sums and the
  tail ops' outer broadcast.
  Chain-independent, so it is built once per torch version, CUDA version and GPU
  architecture, its translation units in parallel (``torch.utils.cpp_extension.load`` in this
  process: ninja).
- **A chain's parts** (csrc/chain/chain_*.cu, with the chain's generated epilogue; no torch
  headers): each a shared library of its own, compiled by nvcc and loaded with ctypes.
  ``chain_table.cu``'s library exports the table (csrc/abi/chain_table.h) that the host extension
  launches through; each other part holds one kernel family and publishes its entry points to
  the table's library (csrc/abi/part_entries.h). A call names the parts it is about to run
  (dispatch.forward_parts), which are built at once with the table and the host extension; a
  part called that was not built yet is built then, from the table's library calling back into
  :class:`ChainParts` (so a chain's first call compiles the two or three parts it runs, not all
  ten; ``python -m gemmfuse warmup`` builds every part a model of its dtypes and
  precisions can run).

Each build says so on stderr when it starts and ends (build.py). ``extension_for`` is called on
every forward: after the first call it is a dict lookup and a check that the parts named are
loaded (``_ready``). Standalone exports
build differently (one load_inline library holding every part: sources.extension_for).
"""

import atexit
import ctypes
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from types import ModuleType

from gemmfuse.build import (
    CUDA_FLAGS,
    CXX_FLAGS,
    BuildError,
    arch_flags,
    cache_dir,
    cached_library,
    compiler_errors,
    digest,
    import_extension,
)
from gemmfuse.epilogue import Epilogue, cuda_epilogue
from gemmfuse.kernel_files import read_csrc
from gemmfuse.sources import ChainKernels, check_constants, flatten

# The parts of a chain, each a translation unit of csrc/ (fused_linear.cu, an export's one
# translation unit, includes them all); the table's first.
TABLE_PART = "chain_table.cu"
CHAIN_PARTS = (TABLE_PART, "chain_sm90_split.cu", "chain_sm90_one_pass.cu",
               "chain_sm90_fp16.cu", "chain_sm90_bf16.cu", "chain_sm80.cu", "chain_epilogue.cu",
               "chain_epilogue_16bit.cu", "chain_gemv.cu", "chain_backward.cu")  # fmt: skip
HOST_SOURCES = ("host_split.cpp", "host_sparse.cpp", "host_forward.cpp", "host_backward.cpp",
                "host_plan.cpp", "host_autograd.cpp", "bind_splits.cpp",
                "bind_epilogue.cpp", "bind_backward.cpp", "bind_split_cache.cpp", "bind_plan.cpp",
                "bind_launch.cpp", "bind_plan_call.cpp", "bind_plan_run.cpp",
                "host_module.cpp",
                "host_tail.cpp", "split.cu", "sparse_products.cu", "column_sums.cu",
                "outer_binary.cu")  # fmt: skip
# The host's C++ units include each ATen operator's own header (ATen/ops/<op>.h), not all of them:
# torch's autograd headers otherwise reach ATen/Functions.h (every operator) through
# ATen/ExpandUtils.h, seconds of parsing in each unit that includes them (host_autograd.cpp:
# 7.8 -> 6.4 s of CPU on the 2-core development machine). The export's torch/extension.h
# includes every operator either way: its load_inline build keeps CXX_FLAGS.
HOST_CXX_FLAGS = (*CXX_FLAGS, "-DAT_PER_OPERATOR_HEADERS")
# Each part is a shared library of its own, reaching the others through the table's
# (part_entries.h); it exports its C entry points alone (chain_table.h's GEMMFUSE_EXPORT).
_PART_FLAGS = ("-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden", "-DGEMMFUSE_PARTS_APART")
# The table library's callback type: int load_part(const char* part).
_LOADER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)
_KERNELS: dict[tuple, ChainKernels] = {}


@atexit.register
def _detach_builders() -> None:
    for kernels in list(_KERNELS.values()):
        kernels.parts.detach()


def extension_for(epilogue: Epilogue, parts: Iterable[str] = ()) -> ChainKernels:
    """The kernels of this chain's structure on the current GPU (built once, then cached), with
    ``parts`` (files of CHAIN_PARTS: those the caller is about to run) built and loaded; any
    other part is built when first called."""
    arch, parts = arch_flags(), tuple(parts)
    ready = _ready(epilogue.structure, arch, parts)  # every call after the first
    return ready if ready is not None else _kernels(epilogue.structure, parts, arch)


def extensions_for(*epilogues: Epilogue, parts: tuple = ()) -> list[ChainKernels]:
    """extension_for of each (``parts[i]`` the parts of ``epilogues[i]``; none where ``parts``
    is shorter), all that is missing built at once (a thread each; each build's compilers run in
    processes of their own): a call that needs two chains' parts (a chain run apart needs the
    plain GEMM's too) waits for the slowest build, not for each in turn. The host extension is
    built once whichever thread asks first."""
    arch = arch_flags()
    wanted = [tuple(parts[i]) if i < len(parts) else () for i in range(len(epilogues))]
    ready = [_ready(e.structure, arch, w) for e, w in zip(epilogues, wanted, strict=True)]
    if all(k is not None for k in ready):
        return ready
    work = [(e.structure, w) for e, w, k in zip(epilogues, wanted, ready, strict=True) if k is None]
    if len(work) > 1:
        with ThreadPoolExecutor(len(work)) as pool:
            list(pool.map(lambda item: _kernels(*item, arch), work))
    return [_kernels(e.structure, w, arch) for e, w in zip(epilogues, wanted, strict=True)]


def _ready(structure: Epilogue, arch: tuple, parts: tuple) -> ChainKernels | None:
    """The chain's kernels if they and ``parts`` are loaded already (every forward's case)."""
    kernels = _KERNELS.get((structure, arch))
    if kernels is None or not kernels.parts.loaded(parts):
        return None
    return kernels


_LOAD_LOCKS: dict[tuple, threading.Lock] = {}
_LOAD_LOCKS_LOCK = threading.Lock()


def _kernels(structure: Epilogue, parts: tuple, arch: tuple) -> ChainKernels:
    """The chain's kernels with ``parts`` loaded; one thread loads a chain, once (its table
    library keeps the part builder it was given)."""
    key = (structure, arch)
    with _LOAD_LOCKS_LOCK:
        lock = _LOAD_LOCKS.setdefault(key, threading.Lock())
    with lock:
        kernels = _KERNELS.get(key)
        if kernels is None:
            kernels = _KERNELS[key] = _load(structure, parts, arch)
    kernels.parts.ensure(parts)
    return kernels


def _load(structure: Epilogue, parts: tuple, arch: tuple) -> ChainKernels:
    """The host extension, the chain's table and ``parts``, building what the cache lacks at
    once."""
    chain = ChainParts(structure, arch)
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(host_extension, arch)
        chain.build_all((TABLE_PART, *parts))
        host = host.result()
    return ChainKernels(host, chain.open_table(), chain.library(TABLE_PART), parts=chain)


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
    name = f"gemmfuse_host_{digest(*sources.values(), *cuda_flags, *HOST_CXX_FLAGS)}"

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
            extra_cflags=list(HOST_CXX_FLAGS),
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


class ChainParts:
    """A chain's parts on one architecture, each a library of its own in the chain's cache
    directory, built (under build.py's lock) and loaded once, when first needed."""

    def __init__(self, structure: Epilogue, arch: tuple[str, ...]):
        files = read_csrc()
        generated = cuda_epilogue(structure)
        self.sources = {name: flatten(files, name, generated) for name in CHAIN_PARTS}
        self.flags = (*CUDA_FLAGS, *_PART_FLAGS, *arch)
        self.name = f"gemmfuse_chain_{digest(*self.sources.values(), *self.flags)}"
        self.structure = structure
        self._handles: dict[str, ctypes.CDLL] = {}  # part -> its loaded library
        self._failed: set[str] = set()  # parts that could not be built or loaded
        self._built: set[Path] = set()  # libraries this process found or built in the cache
        self._locks = {part: threading.Lock() for part in CHAIN_PARTS[1:]}
        self._loader = _LOADER(self._load_called)  # kept alive while the table may call it

    def library(self, part: str) -> Path:
        """Where the library of ``part`` is (or will be) kept."""
        return cache_dir() / self.name / f"lib{self.name}_{Path(part).stem}.so"

    def build(self, part: str) -> Path:
        """The library of ``part``, built if the cache lacks it. A first call reaches this from
        build_all, ensure and load: once a build has found or left the library, the later ones
        see the file and skip the cache's cross-process lock (a library gone from the disk, or
        a cache directory changed, is asked for again)."""
        library = self.library(part)
        if library in self._built and library.exists():
            return library
        what = f"{part} of {self.structure} ({self.name})"

        def compile_part(build_dir: Path, target: Path) -> None:
            _compile_part(part, self.sources[part], self.flags, build_dir, target)

        cached_library(self.name, library.name, what, compile_part)
        self._built.add(library)
        return library

    def build_all(self, parts: Iterable[str]) -> None:
        """build() of each part at once (a thread each; nvcc runs in a process of its own)."""
        parts = list(dict.fromkeys(parts))
        if len(parts) > 1:
            with ThreadPoolExecutor(len(parts)) as pool:
                list(pool.map(self.build, parts))
        elif parts:
            self.build(parts[0])

    def open_table(self) -> int:
        """Loads the table's library (built already), hands it this chain's part builder and
        returns the address of its table."""
        handle = ctypes.CDLL(str(self.library(TABLE_PART)), mode=os.RTLD_LOCAL)
        handle.gemmfuse_chain_set_loader(self._loader)
        self._handles[TABLE_PART] = handle
        handle.gemmfuse_chain_table.restype = ctypes.c_void_p
        return handle.gemmfuse_chain_table()

    def loaded(self, parts: tuple) -> bool:
        return all(part in self._handles for part in parts)

    def ensure(self, parts: Iterable[str]) -> None:
        """Builds the parts not loaded yet at once, then loads them; raises BuildError. A part
        whose build failed when the table called for it is tried again here (the failure may
        have passed: a compiler killed for memory), and its error raised if it fails again."""
        missing = [p for p in dict.fromkeys(parts) if p not in self._handles]
        for part in missing:
            self._failed.discard(part)
        self.build_all(missing)
        for part in missing:
            self.load(part)

    def load(self, part: str) -> None:
        """Builds (where the cache lacks it) and loads ``part``, which then publishes its entry
        points to the table's library; raises BuildError."""
        if part not in CHAIN_PARTS or part == TABLE_PART:
            raise ValueError(f"gemmfuse: {part!r} is not a part of a chain ({CHAIN_PARTS[1:]})")
        with self._locks[part]:
            if part in self._handles:
                return
            self.build(part)
            handle = ctypes.CDLL(str(self.library(part)), mode=os.RTLD_LOCAL)
            entries = self._handles[TABLE_PART].gemmfuse_chain_entries
            entries.restype = ctypes.c_void_p
            handle.gemmfuse_part_entries(ctypes.c_void_p(entries()))
            self._handles[part] = handle  # loaded() only once its entries are published

    def detach(self) -> None:
        """Takes this chain's part builder back from its table's library (at exit: a call
        through an entry still empty then fails with kPartMissing rather than calling into
        a finalising interpreter)."""
        table = self._handles.get(TABLE_PART)
        if table is not None:
            table.gemmfuse_chain_set_loader(None)

    def _load_called(self, part: bytes) -> int:
        """The table library's callback for a part called before it was loaded: 1 once it is,
        0 (and why, on stderr, once; ``ensure`` tries it again) where it cannot be. Never raises
        (ctypes would only print)."""
        name = part.decode(errors="replace")
        if name in self._failed:
            return 0
        try:
            self.load(name)
            return 1
        except BaseException as error:  # noqa: BLE001  (a callback from C: reported, not raised)
            self._failed.add(name)
            print(f"gemmfuse: {name} of {self.structure} could not be built or loaded, so the "
                  f"calls that need it fail:\n{error}", file=sys.stderr)  # fmt: skip
            return 0


def part_library(epilogue: Epilogue, part: str) -> Path:
    """The library file of one part of this chain (built first if it is not): for inspection
    (cuobjdump, ncu)."""
    return extension_for(epilogue, parts=(part,)).parts.library(part)


def _compile_part(part: str, text: str, flags: tuple, build_dir: Path, library: Path) -> None:
    """nvcc of one part into a shared library; the library appears only when complete."""
    (build_dir / part).write_text(text)
    partial = build_dir / f"{library.name}.partial"
    command = [nvcc(), *flags, "-shared", "-cudart", "shared", "-o", partial.name, part]
    built = subprocess.run(command, cwd=build_dir, capture_output=True, text=True, check=False)
    if built.returncode:
        raise BuildError(
            f"gemmfuse: compiling {part} in {build_dir} failed:\n"
            f"{compiler_errors(built.stdout + built.stderr)}"
        )
    os.replace(partial, library)
