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


def test_cached_library_leaves_nothing_when_its_build_fails(monkeypatch, tmp_path):
    from gemmfuse.build import BuildError, cached_library

    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path))

    def failing(build_dir, library):
        raise BuildError("no")

    with pytest.raises(BuildError, match="no"):
        cached_library("lib_b", "b.so", "a failing library", failing)
    assert not (tmp_path / "lib_b" / "b.so").exists()
