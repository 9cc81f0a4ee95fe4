"""gemmfuse.jit's loading order, on the CPU with the builds replaced: extensions_for builds the
libraries a call needs at once, and the host extension once whichever thread asks."""

import functools
import threading
import time

import gemmfuse.jit as jit
from gemmfuse import Epilogue, GroupNormSpec, Pointwise

ARCH = ("-gencode=arch=compute_90a,code=sm_90a",)


def fake_builds(monkeypatch, seconds=0.3):
    """Replaces the host extension's and the chain libraries' builds with sleeps that record
    when each ran; returns that record."""
    record, lock = [], threading.Lock()

    def host_build(arch):
        with lock:
            record.append(("host", time.perf_counter()))
        time.sleep(seconds)
        return "host"

    def chain_build(structure, arch):
        start = time.perf_counter()
        time.sleep(seconds)
        with lock:
            record.append((structure, start))
        return f"lib-{structure}"

    class Kernels:
        def __init__(self, host, table, path, keep):
            self.host, self.path = host, path

    monkeypatch.setattr(jit, "_KERNELS", {})
    monkeypatch.setattr(jit, "arch_flags", lambda: ARCH)
    monkeypatch.setattr(jit, "_host_extension", functools.cache(host_build))  # as the real one
    monkeypatch.setattr(jit, "chain_library", chain_build)
    monkeypatch.setattr(jit.ctypes, "CDLL", lambda path, mode: _FakeLibrary())
    monkeypatch.setattr(jit, "ChainKernels", Kernels)
    return record


class _FakeTableFunction:
    """The library's ctypes function: its restype is set, then it is called."""

    restype = None

    def __call__(self):
        return 1


class _FakeLibrary:
    def __init__(self):
        self.gemmfuse_chain_table = _FakeTableFunction()


def test_extensions_for_builds_a_calls_libraries_at_once(monkeypatch):
    record = fake_builds(monkeypatch)
    chain = Epilogue(pre=(Pointwise("relu"),), norm=GroupNormSpec(16))
    start = time.perf_counter()
    ext, plain = jit.extensions_for(chain, Epilogue())
    took = time.perf_counter() - start
    assert (ext.path, plain.path) == (f"lib-{chain.structure}", f"lib-{Epilogue().structure}")
    assert ext.host == plain.host == "host"
    # one host build; both chain builds started before either could have finished
    assert [name for name, _ in record].count("host") == 1
    starts = sorted(t for name, t in record if name != "host")
    assert len(starts) == 2 and starts[1] - starts[0] < 0.2
    # the host's build and both chains' in parallel: 0.3 s; the chains in turn took 0.6 s
    assert took < 0.55
    # loaded once: later calls are lookups
    assert jit.extensions_for(chain, Epilogue()) == [ext, plain]
    assert jit.extension_for(chain) is ext and len(record) == 3


def test_extensions_for_one_missing_library_builds_it_alone(monkeypatch):
    record = fake_builds(monkeypatch, seconds=0.05)
    chain = Epilogue(pre=(Pointwise("relu"),))
    first = jit.extension_for(chain)
    (again, plain) = jit.extensions_for(chain, Epilogue())
    assert again is first and plain is not first
    assert [name for name, _ in record].count("host") == 1 and len(record) == 3
