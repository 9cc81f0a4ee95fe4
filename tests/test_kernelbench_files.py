"""scripts/kernelbench_files.py on the CPU: the files' standalone libraries built ahead, in
parallel, where the exports will look for them (the judging itself needs a GPU)."""

import sys
from pathlib import Path

import pytest
from model_files import path_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import kernelbench_files  # noqa: E402

from gemmfuse.warmup import structures_for  # noqa: E402

FILES = [path_of("mixed_blocks"), path_of("gemm_groupnorm_min_bias"), path_of("mixed_blocks")]


def test_the_files_structures_each_once_in_file_order():
    want = []
    for path in FILES:
        want += [repr(s) for s in structures_for(str(path)) if repr(s) not in want]
    got = kernelbench_files.file_structures(FILES)
    assert got == want and len(got) > 2


def test_builds_ahead_as_a_standalone_export_into_the_build_directory(monkeypatch, tmp_path):
    seen = {}

    def fake_build(names, jobs=None, env=None, on_done=None, standalone=False):
        seen.update(names=list(names), jobs=jobs, env=env, standalone=standalone)
        return []

    monkeypatch.setattr(kernelbench_files, "build_in_processes", fake_build)
    kernelbench_files.build_ahead(FILES, 3, str(tmp_path))
    assert seen["names"] == kernelbench_files.file_structures(FILES)
    assert seen["jobs"] == 3 and seen["standalone"] is True
    assert seen["env"]["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def test_a_failed_build_raises_with_its_message(monkeypatch, tmp_path):
    monkeypatch.setattr(kernelbench_files, "build_in_processes",
                        lambda *a, **k: ["BUILD FAILED Epilogue()\nnvcc: error"])  # fmt: skip
    with pytest.raises(RuntimeError, match="nvcc: error"):
        kernelbench_files.build_ahead(FILES[:1], 2, str(tmp_path))


@pytest.mark.parametrize("jobs", [0, 5])
def test_main_builds_ahead_into_the_directory_it_judges_in(monkeypatch, tmp_path, jobs):
    """--jobs 0 builds nothing ahead; else the build directory the files are judged in."""
    built, judged = [], []
    monkeypatch.setattr(kernelbench_files, "build_ahead", lambda p, j, d: built.append((p, j, d)))
    monkeypatch.setattr(kernelbench_files, "judge",
                        lambda path, trials, d: judged.append(d) or {"correct": True})  # fmt: skip
    monkeypatch.setattr(kernelbench_files, "format_problem_rows", lambda rows: "")
    monkeypatch.setattr(kernelbench_files.torch.cuda, "get_device_name", lambda: "stand-in")
    files = [str(path_of("mixed_blocks"))]
    monkeypatch.setattr(sys, "argv", ["kernelbench_files.py", *files, "--jobs", str(jobs)])
    assert kernelbench_files.main() == 0
    assert len(judged) == 1
    if jobs:
        assert built == [([Path(files[0])], jobs, judged[0])]
    else:
        assert built == []


def test_build_ahead_keeps_the_rest_of_the_environment(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setenv("GEMMFUSE_TEST_MARKER", "kept")
    monkeypatch.setattr(kernelbench_files, "build_in_processes",
                        lambda names, jobs=None, env=None, standalone=False: seen.update(env=env)
                        or [])  # fmt: skip
    kernelbench_files.build_ahead(FILES[:1], 1, str(tmp_path))
    assert seen["env"]["GEMMFUSE_TEST_MARKER"] == "kept"
