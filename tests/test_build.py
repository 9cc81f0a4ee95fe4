import threading
from pathlib import Path

import pytest

from gemmfuse.build import cache_dir


def test_cache_dir_prefers_gemmfuse_then_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernelbench"))
    assert cache_dir() == tmp_path / "ours"
    monkeypatch.delenv("GEMMFUSE_CACHE_DIR")
    assert cache_dir() == tmp_path / "kernelbench"  # KernelBench's build directory
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cache_dir() == Path.home() / ".cache" / "gemmfuse"


def test_cached_library_builds_once_and_says_so(monkeypatch, tmp_path, capsys):
    from gemmfuse.build import cached_library

    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path))
    builds = []

    def build(build_dir, library):
        builds.append(build_dir)
        library.write_text("built")

    first = cached_library("lib_a", "a.so", "the test library", build)
    assert first == tmp_path / "lib_a" / "a.so" and first.read_text() == "built"
    err = capsys.readouterr().err
    assert "gemmfuse: building the test library: not in cache" in err
    assert "gemmfuse: built a.so in" in err
    assert cached_library("lib_a", "a.so", "the test library", build) == first
    assert len(builds) == 1 and capsys.readouterr().err == ""


def test_a_library_that_ninja_did_not_finish_linking_is_built_again(monkeypatch, tmp_path, capsys):
    """ninja links the host extension and the exports straight to their names and logs a link
    once the linker has exited: a library file its log does not name (a build killed mid-link)
    is never loaded, but built again; one the log names is whole."""
    from gemmfuse.build import cached_library

    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path))
    build_dir = tmp_path / "lib_n"
    build_dir.mkdir()
    (build_dir / "n.so").write_text("half a library")
    log = "# ninja log v5\n0\t90\t17\tmain.o\te5a8\n"  # the compile finished, the link did not
    (build_dir / ".ninja_log").write_text(log)
    builds = []

    def build(build_dir, library):
        builds.append(library)
        library.write_text("whole")
        with open(build_dir / ".ninja_log", "a") as f:
            f.write(f"90\t99\t18\t{library.name}\t3c41\n")

    library = cached_library("lib_n", "n.so", "a ninja library", build)
    assert builds == [library] and library.read_text() == "whole"
    assert "was not linked whole (a build stopped mid-link)" in capsys.readouterr().err
    assert cached_library("lib_n", "n.so", "a ninja library", build) == library
    assert len(builds) == 1


def test_a_build_killed_mid_link_is_built_again_by_ninja(monkeypatch, tmp_path, capsys):
    """The check above against the log that torch's cpp_extension (ninja) writes, through the
    standalone export's own build (load_inline in a child process): a build killed mid-link
    leaves the library unlogged and cpp_extension's lock file behind (on which a rebuild would
    wait for ever); the next call builds it again and loads a whole library."""
    from gemmfuse.build import _load_inline_in_child, cached_library, import_extension

    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path))
    name = "gemmfuse_link_check"
    arguments = {"name": name, "cpp_sources": ["int f() { return 3; }"], "functions": ["f"],
                 "build_directory": str(tmp_path / name)}  # fmt: skip

    def build(build_dir, library):
        _load_inline_in_child(arguments, name)

    library = cached_library(name, f"{name}.so", name, build)
    log = tmp_path / name / ".ninja_log"
    lines = log.read_text().splitlines(keepends=True)
    assert any(f"{name}.so" in line.split("\t") for line in lines)
    log.write_text("".join(line for line in lines if f"{name}.so" not in line.split("\t")))
    (tmp_path / name / "lock").touch()
    capsys.readouterr()
    rebuilt = []
    worker = threading.Thread(target=lambda: rebuilt.append(
        cached_library(name, f"{name}.so", name, build)), daemon=True)  # fmt: skip
    worker.start()
    worker.join(timeout=120)
    assert rebuilt == [library], "the rebuild did not finish (waiting on the lock file?)"
    assert "was not linked whole (a build stopped mid-link)" in capsys.readouterr().err
    assert import_extension(name, library).f() == 3


def test_cached_library_leaves_nothing_when_its_build_fails(monkeypatch, tmp_path):
    from gemmfuse.build import BuildError, cached_library

    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path))

    def failing(build_dir, library):
        raise BuildError("no")

    with pytest.raises(BuildError, match="no"):
        cached_library("lib_b", "b.so", "a failing library", failing)
    assert not (tmp_path / "lib_b" / "b.so").exists()
