"""A chain's parts, each a library of its own built when first needed (gemmfuse/jit.py,
csrc/abi/part_entries.h): an entry point the host reaches through the table's library before its
part is loaded builds and loads that part first, from a thread that does not hold the GIL too (a
backward on autograd's thread), once however many threads call it at once; the kernels it then
runs match the float64 reference."""

import ctypes
import shutil
import subprocess
import threading

import pytest
import torch

from gemmfuse import Epilogue, GroupNormSpec, Pointwise
from gemmfuse.epilogue_op import fused_epilogue
from gemmfuse.jit import extension_for
from gemmfuse.reference import apply_epilogue

pytestmark = pytest.mark.gpu


class TableHead(ctypes.Structure):
    """The head of csrc/abi/chain_table.h's ChainTable, up to gemv_slice: int gemv_slice(int, int)
    is an entry a plain C call can reach (through the table's library, like the host's calls)."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "version", "table_bytes", "fused_args_bytes", "backward_args_bytes", "gemv_args_bytes",
        "reduce_kind", "is_plain", "column_sums")] + [
        (name, ctypes.c_void_p) for name in (
            "launch_fused", "launch_epilogue_only", "follows_tiles", "launch_gemv")] + [
        ("gemv_slice", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int))]  # fmt: skip


def fresh_chain(tag: int) -> Epilogue:
    """A chain structure no other test uses (this process has loaded none of its parts)."""
    ops = [Pointwise("tanh"), Pointwise("sigmoid"), Pointwise("relu"), Pointwise("gelu")]
    pre, post = (tuple(ops[(tag + i) % 4] for i in range(length)) for length in (5, 3))
    return Epilogue(pre=pre, norm=GroupNormSpec(8), post=post)


def test_an_entry_called_without_the_gil_builds_its_part_once_from_many_threads(capfd, monkeypatch):
    ext = extension_for(fresh_chain(0))
    capfd.readouterr()
    builds, build = [], ext.parts.build
    monkeypatch.setattr(ext.parts, "build", lambda part: (builds.append(part), build(part))[1])
    assert not ext.parts.loaded(("chain_gemv.cu",))
    head = TableHead.from_address(ext.table)
    slices, errors = [], []

    def call():  # ctypes releases the GIL for the call: the builder takes it back
        try:
            slices.append(head.gemv_slice(8192, 1024))
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and len(slices) == 4 and len(set(slices)) == 1 and slices[0] > 0
    assert ext.parts.loaded(("chain_gemv.cu",))
    assert head.gemv_slice(8192, 1024) == slices[0]
    # one thread built (or found in the disk cache) and loaded it; the others waited for it
    assert builds == ["chain_gemv.cu"]
    assert capfd.readouterr().err.count("building chain_gemv.cu") <= 1


def test_a_part_built_on_first_call_runs_the_chain():
    chain = fresh_chain(1)
    torch.manual_seed(0)
    z = torch.randn(256, 512, device="cuda")
    params = dict(gn_weight=torch.rand(512, device="cuda"), gn_bias=torch.randn(512, device="cuda"))
    assert not extension_for(chain).parts.loaded(("chain_epilogue.cu",))
    first = fused_epilogue(z, chain, **params)  # builds chain_epilogue.cu through the table
    assert extension_for(chain).parts.loaded(("chain_epilogue.cu",))
    again = fused_epilogue(z, chain, **params)
    assert torch.equal(first, again) and torch.isfinite(first).all()
    reference = apply_epilogue(z.double(), chain, *(v.double() for v in params.values()), [])
    torch.testing.assert_close(first.double(), reference, atol=1e-4, rtol=1e-4)


def test_a_backward_on_autograds_thread_builds_the_part_it_reaches(monkeypatch):
    """The chain backward's part, left unbuilt by fused_epilogue's forward, is built when the
    backward (on autograd's thread) reaches it through the table."""
    chain = fresh_chain(2)
    ext = extension_for(chain)
    assert not ext.parts.loaded(("chain_backward.cu",))
    loads, load = [], ext.parts.load
    monkeypatch.setattr(ext.parts, "load", lambda part: (
        loads.append((part, threading.current_thread())), load(part))[1])  # fmt: skip
    torch.manual_seed(1)
    z = torch.randn(128, 512, device="cuda", requires_grad=True)
    gn_weight = torch.rand(512, device="cuda", requires_grad=True)
    gn_bias = torch.randn(512, device="cuda", requires_grad=True)
    out = fused_epilogue(z, chain, gn_weight=gn_weight, gn_bias=gn_bias)
    grad = torch.randn_like(out)
    main = threading.main_thread()
    # the forward loaded the chain kernel's part alone, on this thread
    assert [(part, thread is main) for part, thread in loads] == [("chain_epilogue.cu", True)]
    out.backward(grad)
    assert ext.parts.loaded(("chain_backward.cu",))
    assert [(part, thread is main) for part, thread in loads[1:]] == [("chain_backward.cu", False)]
    zd = z.detach().double().requires_grad_()
    wd, bd = (t.detach().double().requires_grad_() for t in (gn_weight, gn_bias))
    apply_epilogue(zd, chain, wd, bd, []).backward(grad.double())
    for ours, theirs in ((z, zd), (gn_weight, wd), (gn_bias, bd)):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=1e-4, rtol=1e-4)


def test_a_parts_library_exports_its_entry_points_alone():
    """Each part's library is built with -fvisibility=hidden (jit._PART_FLAGS): of the package's
    own symbols it exports only its C entry points (chain_table.h's GEMMFUSE_EXPORT), so that what
    every chain's library defines under one name (GeneratedEpilogueFor<...>'s kernels and their
    launches' per-device caches) binds within its own library, however the libraries are
    loaded."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    ext = extension_for(fresh_chain(3))
    exported = {}
    for part in ("chain_table.cu", "chain_epilogue.cu", "chain_sm90_split.cu"):
        library = ext.parts.build(part)
        listing = subprocess.run([nm, "-D", "--defined-only", "-C", str(library)],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
        exported[part] = {line.split(maxsplit=2)[-1] for line in listing.splitlines()
                          if "gemmfuse" in line or "GeneratedEpilogue" in line}  # fmt: skip
    assert exported == {
        "chain_table.cu": {"gemmfuse_chain_table", "gemmfuse_chain_entries",
                           "gemmfuse_chain_set_loader"},
        "chain_epilogue.cu": {"gemmfuse_part_entries"},
        "chain_sm90_split.cu": {"gemmfuse_part_entries"},
    }  # fmt: skip
