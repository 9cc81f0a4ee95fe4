"""gemmfuse.jit's loading order, on the CPU with the builds replaced: extensions_for builds what a
call needs at once (the host extension, each chain's table and the parts the call names), the
host extension once whichever thread asks, and a part only when it is first needed; a part that
cannot be built makes the table's callback answer 0 and say why, once."""

import functools
import threading
import time

import pytest

import gemmfuse.jit as jit
from gemmfuse import Epilogue, GroupNormSpec, Pointwise
from gemmfuse.build import BuildError

ARCH = ("-gencode=arch=compute_90a,code=sm_90a",)


def fake_builds(monkeypatch, seconds=0.3):
    """Replaces the host extension's build and the chains' part builds with sleeps that record
    what ran and when it started; returns that record."""
    record, lock = [], threading.Lock()

    def host_build(arch):
        with lock:
            record.append(("host", "", time.perf_counter()))
        time.sleep(seconds)
        return "host"

    class Parts:
        def __init__(self, structure, arch):
            self.structure, self.built = structure, set()

        def library(self, part):
            return f"lib-{self.structure}-{part}"

        def build(self, part):
            if part not in self.built:
                start = time.perf_counter()
                time.sleep(seconds)
                with lock:
                    record.append((self.structure, part, start))
                self.built.add(part)

        def build_all(self, parts):  # at once, as the real one
            threads = [threading.Thread(target=self.build, args=(p,)) for p in parts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        def open_table(self):
            assert jit.TABLE_PART in self.built
            return 1

        def loaded(self, parts):
            return set(parts) <= self.built

        def ensure(self, parts):
            for part in parts:
                self.build(part)

    class Kernels:
        def __init__(self, host, table, library, parts):
            self.host, self.library, self.parts = host, library, parts

    monkeypatch.setattr(jit, "_KERNELS", {})
    monkeypatch.setattr(jit, "arch_flags", lambda: ARCH)
    monkeypatch.setattr(jit, "_host_extension", functools.cache(host_build))  # as the real one
    monkeypatch.setattr(jit, "ChainParts", Parts)
    monkeypatch.setattr(jit, "ChainKernels", Kernels)
    return record


CHAIN = Epilogue(pre=(Pointwise("relu"),), norm=GroupNormSpec(16))


def test_extensions_for_builds_a_calls_pieces_at_once(monkeypatch):
    record = fake_builds(monkeypatch)
    start = time.perf_counter()
    parts = (("chain_epilogue.cu", "chain_backward.cu"), ("chain_sm90_split.cu",))
    ext, plain = jit.extensions_for(CHAIN, Epilogue(), parts=parts)
    took = time.perf_counter() - start
    assert ext.library == f"lib-{CHAIN.structure}-{jit.TABLE_PART}"
    assert ext.host == plain.host == "host"
    built = sorted((str(s), p) for s, p, _ in record if s != "host")
    assert built == sorted([(str(CHAIN.structure), jit.TABLE_PART),
                            (str(CHAIN.structure), "chain_epilogue.cu"),
                            (str(CHAIN.structure), "chain_backward.cu"),
                            (str(Epilogue().structure), jit.TABLE_PART),
                            (str(Epilogue().structure), "chain_sm90_split.cu")])  # fmt: skip
    # one host build; every piece started before any could have finished
    assert [s for s, _, _ in record].count("host") == 1
    starts = sorted(t for _, _, t in record)
    assert starts[-1] - starts[0] < 0.2
    # the six builds in parallel: 0.3 s; two in turn would take 0.6 s
    assert took < 0.55
    # loaded once: later calls naming loaded parts are lookups
    assert jit.extensions_for(CHAIN, Epilogue(), parts=parts) == [ext, plain]
    assert jit.extension_for(CHAIN) is ext and len(record) == 6


def test_a_part_not_loaded_yet_is_built_alone(monkeypatch):
    record = fake_builds(monkeypatch, seconds=0.05)
    first = jit.extension_for(CHAIN, parts=("chain_epilogue.cu",))
    again = jit.extension_for(CHAIN, parts=("chain_epilogue.cu", "chain_gemv.cu"))
    assert again is first
    built = [p for _, p, _ in record if p]
    # the table and the first call's part at once (either may finish first), then gemv alone
    assert sorted(built[:2]) == sorted([jit.TABLE_PART, "chain_epilogue.cu"])
    assert built[2:] == ["chain_gemv.cu"]


def test_extensions_for_one_missing_chain_builds_it_alone(monkeypatch):
    record = fake_builds(monkeypatch, seconds=0.05)
    first = jit.extension_for(CHAIN)
    (again, plain) = jit.extensions_for(CHAIN, Epilogue())
    assert again is first and plain is not first
    assert [s for s, _, _ in record].count("host") == 1 and len(record) == 3


def test_a_part_that_cannot_be_built_answers_0_and_says_why_once(monkeypatch, capsys):
    parts = jit.ChainParts(CHAIN.structure, ARCH)
    calls = []

    def failing_build(part):
        calls.append(part)
        raise BuildError(f"gemmfuse: compiling {part} failed:\nerror: no")

    monkeypatch.setattr(parts, "build", failing_build)
    assert parts._load_called(b"chain_gemv.cu") == 0
    assert parts._load_called(b"chain_gemv.cu") == 0
    assert calls == ["chain_gemv.cu"]  # not built again
    err = capsys.readouterr().err
    assert err.count("chain_gemv.cu of") == 1 and "error: no" in err
    assert parts._load_called(b"chain_nothing.cu") == 0  # not a part: refused, not built
    assert calls == ["chain_gemv.cu"]
    with pytest.raises(ValueError, match="not a part"):
        parts.load(jit.TABLE_PART)


def test_parts_are_libraries_of_one_directory_named_by_every_source():
    parts = jit.ChainParts(CHAIN.structure, ARCH)
    other = jit.ChainParts(Epilogue().structure, ARCH)
    assert parts.name != other.name and parts.name.startswith("gemmfuse_chain_")
    libraries = {parts.library(p) for p in jit.CHAIN_PARTS}
    assert len(libraries) == len(jit.CHAIN_PARTS)
    assert {lib.parent.name for lib in libraries} == {parts.name}
    assert "-DGEMMFUSE_PARTS_APART" in parts.flags


def test_a_part_asks_the_cache_once_per_process(monkeypatch, tmp_path):
    """A first call's build_all, ensure and load each want a part's library: the cache and its
    cross-process lock are asked once, or again after a build that failed or where the library
    has left the disk."""
    monkeypatch.setenv("GEMMFUSE_CACHE_DIR", str(tmp_path))
    parts = jit.ChainParts(CHAIN.structure, ARCH)
    asked, failing = [], {"chain_sm80.cu"}

    def cached_library(name, file_name, what, build):
        asked.append(file_name)
        if any(part[:-3] in file_name for part in failing):
            raise BuildError("gemmfuse: compiling failed")
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / file_name).touch()

    monkeypatch.setattr(jit, "cached_library", cached_library)
    gemv = parts.library("chain_gemv.cu")
    assert parts.build("chain_gemv.cu") == parts.build("chain_gemv.cu") == gemv
    parts.build_all(["chain_gemv.cu", "chain_epilogue.cu"])
    assert asked == [gemv.name, parts.library("chain_epilogue.cu").name]
    for _ in range(2):
        with pytest.raises(BuildError):
            parts.build("chain_sm80.cu")
    assert asked[2:] == [parts.library("chain_sm80.cu").name] * 2
    gemv.unlink()
    assert parts.build("chain_gemv.cu") == gemv and asked[4:] == [gemv.name]
