import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_every_cuda_source_compiles_for_sm90a_and_sm80():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_every_host_source_parses(tmp_path):
    """The host extension's C++ sources (jit.HOST_SOURCES) through g++ -fsyntax-only against
    torch's headers: a syntax error there otherwise shows first on the GPU machine's build. A
    CPU build of torch lacks one generated header of c10/cuda; an empty stand-in takes its
    place (it only configures export macros)."""
    import sysconfig

    import torch.utils.cpp_extension as cpp

    from gemmfuse.jit import HOST_CXX_FLAGS, HOST_SOURCES
    from gemmfuse.kernel_files import csrc_paths, include_dirs

    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    includes = [tmp_path, *cpp.include_paths(), sysconfig.get_paths()["include"], *include_dirs()]
    cuda_home = cpp.CUDA_HOME or "/usr/local/cuda"
    includes.append(Path(cuda_home) / "include")
    defines = [f for f in HOST_CXX_FLAGS if f.startswith("-D")]  # the build's: which headers
    flags = ["g++", "-std=c++17", "-fsyntax-only", *defines, *(f"-I{p}" for p in includes)]

    def parse(name: str) -> tuple[str, subprocess.CompletedProcess]:
        cmd = [*flags, str(csrc_paths()[name])]
        return name, subprocess.run(cmd, capture_output=True, text=True)

    names = [s for s in HOST_SOURCES if s.endswith(".cpp")]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one g++ a core
        for name, proc in pool.map(parse, names):
            assert proc.returncode == 0, name + "\n" + proc.stderr[-4000:]
