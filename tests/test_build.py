from pathlib import Path

from gemmfuse.build import cache_dir


def test_cache_dir_prefers_gemmfuse_then_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernelbench"))
    assert cache_dir() == tmp_path / "ours"
    monkeypatch.delenv("GEMMFUSE_CACHE_DIR")
    assert cache_dir() == tmp_path / "kernelbench"  # KernelBench's build directory
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cache_dir() == Path.home() / ".cache" / "gemmfuse"
