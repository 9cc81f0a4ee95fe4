"""Planned calls (gemmfuse/plan.py) on the CPU: which calls leave a plan and what it holds, that
fused_linear offers a call to its cache's plans before deciding it, and the cache's part. The
plans' C++ side runs on the GPU (tests/gpu/test_plan.py); here a stand-in records what Python
gives it."""

import copy
import re

import pytest
import torch

import gemmfuse.dispatch
import gemmfuse.ops
import gemmfuse.plan
from gemmfuse import Epilogue, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.jit import CHAIN_PARTS
from gemmfuse.kernel_files import read_csrc
from gemmfuse.ops import fused_linear_with_path
from gemmfuse.plan import MAX_PLANS, keep_plan, plannable
from gemmfuse.weight_cache import SplitWeightCache


class FakePlan:
    def __init__(self, cache, epilogue, kernel, precision, tensors, spec):
        self.cache, self.epilogue, self.tensors, self.spec = cache, epilogue, tensors, spec
        self.kernel, self.precision = kernel, precision


class FakeHost:
    Plan = FakePlan
    PlanSpec = dict

    class SplitCache:
        def __init__(self, keeps=True):
            self.keeps = keeps


class FakeExt:
    host = FakeHost
    table = 1234


@pytest.fixture
def fake_ext(monkeypatch):
    """The libraries replaced by FakeExt; returns the parts each request named, in order."""
    asked = []

    def extension_for(epilogue, parts=()):
        asked.append(tuple(parts))
        return FakeExt

    def extensions_for(*chains, parts=()):
        asked.extend(tuple(p) for p in parts)
        return [FakeExt] * len(chains)

    monkeypatch.setattr(gemmfuse.plan, "extension_for", extension_for)
    monkeypatch.setattr(gemmfuse.plan, "extensions_for", extensions_for)
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (9, 0))
    return asked


def tensors(m=64, k=2048, n=256, params=()):
    x = torch.randn(m, k)
    w, b = torch.randn(n, k), torch.randn(n)
    return x, w, b, torch.ones(n), torch.zeros(n), list(params)


def test_a_plan_holds_the_calls_decisions(fake_ext):
    epilogue = Epilogue(
        pre=(Pointwise("mul", (Param(0),)),),
        norm=GroupNormSpec(2, eps=1e-3),
        post=(Pointwise("leaky_relu", (0.2,)), Pointwise("add", (Param(1),))),
        reduce=Reduction("max", keepdim=True),
    )
    cache = SplitWeightCache()
    args = tensors(m=1024, k=2048, n=1024, params=(torch.randn(()), torch.randn(1024)))
    keep_plan(cache, epilogue, "auto", "tf32", args, grad=False)
    (plan,) = cache.plans
    assert plan.epilogue is epilogue and (plan.kernel, plan.precision) == ("auto", "tf32")
    assert plan.tensors == [*args[:5], *args[5]]
    assert plan.cache is cache.native(FakeExt)
    assert plan.spec == dict(
        table=1234, plain_table=0, model16=False, kernel_code=0, split=False,  # CPU: no kernel
        scalars=[0.2], group_size=512, eps=1e-3, norm_wide=True, keepdim=True,
        channel_params=[0, 1], first_slot=3, backward=False, split_dx=True, split_dw=True,
        sparse=False, epilogue_path=False, group_stats=0, gemv=False, chain_apart=False,
        k_splits=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "m, k, precision, kernel, apart",
    [(1024, 4096, "fp32", "auto", True), (2048, 4096, "fp32", "auto", True),
     (1024, 4096, "tf32", "auto", False), (1024, 4096, "fp32", "hopper", False),
     (512, 4096, "fp32", "auto", False), (4096, 2048, "fp32", "auto", False)],
)  # fmt: skip
def test_a_plan_runs_the_chain_apart_where_dispatch_says(fake_ext, m, k, precision, kernel, apart):
    """dispatch.chain_apart's sizes (M * N from 2^23, K from 4096, fp32 under kernel="auto")
    reach the plan, which then holds the plain GEMM's table for the forward's GEMM."""
    cache = SplitWeightCache()
    keep_plan(cache, Epilogue(pre=(Pointwise("relu"),)), kernel, precision,
              tensors(m=m, k=k, n=8192), grad=False)  # fmt: skip
    (plan,) = cache.plans
    assert plan.spec["chain_apart"] is apart
    assert plan.spec["plain_table"] == (FakeExt.table if apart else 0)


_BACKWARD_FIELDS = ("first_slot", "backward", "split_dx", "split_dw", "sparse")


@pytest.mark.parametrize("path, m", [("fused", 1024), ("epilogue", 16), ("epilogue", 1)])
def test_a_plan_runs_the_forward_spec_of_a_call_decided_afresh(fake_ext, path, m):
    """One place decides a forward (plan.forward_spec): a plan's spec is its fields plus the
    backward's, so a planned call and one decided afresh launch alike."""
    epilogue = Epilogue(pre=(Pointwise("mul", (Param(0),)),), norm=GroupNormSpec(16),
                        reduce=Reduction("min", keepdim=True))  # fmt: skip
    args = tensors(m=m, k=4096, n=8192, params=(torch.randn(8192),))
    cache = SplitWeightCache()
    keep_plan(cache, epilogue, "auto", "fp32", args, grad=False, path=path)
    (plan,) = cache.plans
    forward = gemmfuse.plan.forward_spec(path, epilogue, args[0], args[1], "auto", "fp32")
    assert {k: v for k, v in plan.spec.items() if k not in _BACKWARD_FIELDS} == forward
    assert forward["epilogue_path"] is (path == "epilogue") and forward["keepdim"]
    assert forward["gemv"] is (m == 1) and forward["chain_apart"] is (path == "fused")


def test_the_bound_plan_spec_takes_every_field_plan_py_gives(fake_ext):
    """PlanSpec's keywords (bind_plan.cpp) are forward_spec's fields and the backward's, which
    keep_plan adds: a field renamed on one side fails here, not on a GPU."""
    binding = read_csrc()["bind_plan.cpp"]
    bound = re.search(r'py::class_<PlanSpec>\(m, "PlanSpec".*?\);\n', binding, re.S)
    assert bound is not None
    keywords = set(re.findall(r'py::arg\("(\w+)"\)', bound.group()))
    x, w, *_ = tensors(m=1024, k=4096, n=8192)
    fields = gemmfuse.plan.forward_spec("fused", Epilogue(), x, w, "auto", "fp32")
    assert keywords == set(fields) | set(_BACKWARD_FIELDS)
    cache = SplitWeightCache()
    keep_plan(cache, Epilogue(pre=(Pointwise("relu"),)), "auto", "fp32", tensors(), grad=False)
    assert set(cache.plans[0].spec) == keywords


def test_launch_path_runs_the_host_executor_on_the_forward_spec(fake_ext, monkeypatch):
    """ops.launch_path decides nothing itself: forward_spec's fields, the cache's SplitCache and
    the call's tensors go to the host extension's launch (the executor a plan runs)."""
    launched = []

    def launch(spec, native, tensors, save_z):
        launched.append((spec, native, tensors, save_z))
        return "out", "z"

    monkeypatch.setattr(FakeHost, "launch", staticmethod(launch), raising=False)
    monkeypatch.setattr(gemmfuse.ops, "extension_for", lambda epilogue, parts=(): FakeExt)
    epilogue = Epilogue(pre=(Pointwise("mul", (Param(1),)),), norm=GroupNormSpec(16),
                        reduce=Reduction("min"), tail=(Pointwise("add", (Param(0),)),))  # fmt: skip
    x, w, b, gw, gb, params = tensors(m=1024, k=4096, n=8192,
                                      params=(torch.randn(1024), torch.randn(8192)))  # fmt: skip
    cache = SplitWeightCache()
    out = gemmfuse.ops.launch_path("fused", epilogue, cache, "hopper", "tf32", x, w, b, gw, gb,
                                   params, True)  # fmt: skip
    assert out == ("out", "z")
    ((spec, native, passed, save_z),) = launched
    assert spec == gemmfuse.plan.forward_spec("fused", epilogue, x, w, "hopper", "tf32")
    assert spec["kernel_code"] == 2 and not spec["split"] and not spec["chain_apart"]
    assert native is cache.native(FakeExt) and save_z is True
    # every params tensor, a tail op's too, in order (the spec's channel_params index them)
    assert [id(t) for t in passed] == [id(t) for t in (x, w, b, gw, gb, *params)]
    assert spec["channel_params"] == [1]


BACKWARD = "chain_backward.cu"


@pytest.mark.parametrize(
    "path, m, precision, kernel, dtype, parts",
    [
        # a chain apart: the chain kernel here, the split GEMM in the plain GEMM's library
        ("fused", 1024, "fp32", "auto", torch.float32,
         [("chain_epilogue.cu", BACKWARD), ("chain_sm90_split.cu",)]),
        ("fused", 64, "fp32", "hopper", torch.float32, [("chain_sm90_split.cu", BACKWARD)]),
        ("fused", 64, "tf32", "hopper", torch.float32, [("chain_sm90_one_pass.cu", BACKWARD)]),
        ("fused", 64, "fp32", "portable", torch.float32, [("chain_sm80.cu", BACKWARD)]),
        ("fused", 64, "fp32", "hopper", torch.bfloat16, [("chain_sm90_bf16.cu", BACKWARD)]),
        ("fused", 64, "fp32", "hopper", torch.float16, [("chain_sm90_fp16.cu", BACKWARD)]),
        ("epilogue", 64, "fp32", "auto", torch.float32, [("chain_epilogue.cu", BACKWARD)]),
        ("epilogue", 64, "fp32", "auto", torch.float16, [("chain_epilogue_16bit.cu", BACKWARD)]),
        ("epilogue", 2, "fp32", "auto", torch.float32,
         [("chain_gemv.cu", "chain_epilogue.cu", BACKWARD)]),
    ],
)  # fmt: skip
def test_forward_spec_builds_the_parts_the_call_runs(fake_ext, path, m, precision, kernel,
                                                     dtype, parts):  # fmt: skip
    """A chain's first call builds only the parts of its library that its forward runs (and the
    backward's, whose plan keep_plan asks): dispatch.forward_parts, passed with the request."""
    x, w = torch.randn(m, 8192).to(dtype), torch.randn(8192, 8192).to(dtype)
    chain = Epilogue(pre=(Pointwise("relu"),), norm=GroupNormSpec(512))
    gemmfuse.plan.forward_spec(path, chain, x, w, kernel, precision)
    assert fake_ext == parts
    assert all(p in CHAIN_PARTS for request in parts for p in request)


@pytest.mark.parametrize(
    ("dtype", "finalize"),
    [(torch.float32, "chain_epilogue.cu"), (torch.float16, "chain_epilogue_16bit.cu")],
)
def test_a_wide_groupnorm_builds_its_finalize_part(fake_ext, dtype, finalize):
    """Groups wider than a tile: the fused kernel, then the finalize pass of the chain kernel's
    part for the model's dtype (chain_table.cu's launch_fused)."""
    x, w = torch.randn(64, 8192).to(dtype), torch.randn(8192, 8192).to(dtype)
    chain = Epilogue(pre=(Pointwise("relu"),), norm=GroupNormSpec(8))
    spec = gemmfuse.plan.forward_spec("fused", chain, x, w, "hopper", "tf32")
    assert spec["norm_wide"]
    gemm = "chain_sm90_fp16.cu" if dtype == torch.float16 else "chain_sm90_one_pass.cu"
    assert fake_ext == [(gemm, finalize, BACKWARD)]


def test_chain_apart_needs_sm90_float32_and_a_chain(monkeypatch):
    x, chain = torch.randn(1024, 8192), Epilogue(pre=(Pointwise("relu"),))
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (9, 0))
    apart = gemmfuse.dispatch.chain_apart
    assert apart("fused", chain, x, 8192, "auto", "fp32")
    assert not apart("epilogue", chain, x, 8192, "auto", "fp32")
    assert not apart("fused", chain, x.double(), 8192, "auto", "fp32")
    # a plain GEMM (a BatchNorm1d's head in training, say): its z is its output already
    assert not apart("fused", Epilogue(), x, 8192, "auto", "fp32")
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (8, 0))
    assert not apart("fused", chain, x, 8192, "auto", "fp32")


def test_plans_are_kept_most_recent_first_and_bounded(fake_ext):
    cache = SplitWeightCache()
    epilogue = Epilogue(pre=(Pointwise("relu"),))
    kept = []
    for m in range(16, 16 + MAX_PLANS + 2):
        keep_plan(cache, epilogue, "auto", "fp32", tensors(m=m), grad=False)
        kept.insert(0, m)
    assert [p.tensors[0].shape[0] for p in cache.plans] == kept[:MAX_PLANS]


def test_a_kind_already_planned_is_not_planned_again(fake_ext):
    """A call that a kept plan of its kind refused (saved-tensor hooks, a forward-mode tangent:
    what the key does not see) leaves no second plan, which would evict the other kinds'."""
    cache = SplitWeightCache()
    epilogue = Epilogue(pre=(Pointwise("relu"),))
    args = tensors()
    keep_plan(cache, epilogue, "auto", "fp32", tensors(m=32), grad=False)
    for _ in range(MAX_PLANS + 1):
        keep_plan(cache, epilogue, "auto", "fp32", args, grad=False)
    assert [p.tensors[0].shape[0] for p in cache.plans] == [64, 32]
    keep_plan(cache, epilogue, "auto", "tf32", args, grad=False)  # another kind: planned
    assert len(cache.plans) == 3 and len(cache.plan_kinds) == 3
    cache.clear()
    assert cache.plans == [] and cache.plan_kinds == []


def test_calls_a_plan_could_not_serve_leave_none(fake_ext):
    cache = SplitWeightCache()
    epilogue = Epilogue(pre=(Pointwise("relu"),))
    # a backward on the CPU: the chain backward kernel does not serve it
    keep_plan(cache, epilogue, "auto", "fp32", tensors(), grad=True)
    # a tensor subclass (its own torch function): the plans take plain tensors and Parameters
    x, *rest = tensors()
    sub = torch.Tensor._make_subclass(type("Sub", (torch.Tensor,), {}), x)
    keep_plan(cache, epilogue, "auto", "fp32", (sub, *rest), grad=False)
    assert cache.plans == []
    weight = torch.nn.Parameter(rest[0])
    keep_plan(cache, epilogue, "auto", "fp32", (x, weight, *rest[1:]), grad=False)
    assert len(cache.plans) == 1


def test_fused_linear_offers_a_call_to_the_plans_first(monkeypatch):
    """The first plan to return a tensor runs the call (the tail ops then follow in PyTorch);
    where every plan returns None, the Python rules decide it (here: the CPU's PyTorch path)."""
    epilogue = Epilogue(
        norm=GroupNormSpec(4),
        reduce=Reduction("min", keepdim=True),
        tail=(Pointwise("add", (Param(0),)),),
    )
    x, w, b, gw, gb, _ = tensors(m=8, k=16, n=32)
    bias = torch.randn(1, 32, 1, 1)
    seen = []

    def declines(*args):
        seen.append("declines")

    def serves(epi, kernel, precision, *args):
        seen.append((epi is epilogue, kernel, precision, args[-1]))
        return torch.full((8, 1), 2.0)

    serves.path = "epilogue"  # the path the plan runs, reported as the call's
    cache = SplitWeightCache()
    cache.plans = [declines, serves]
    out, path = fused_linear_with_path(
        x, w, b, epilogue, gw, gb, params=(bias,), weight_cache=cache, precision="tf32"
    )
    assert path == "epilogue" and torch.equal(out, torch.full((8, 1), 2.0) + bias)
    assert seen == ["declines", (True, "auto", "tf32", (bias,))]
    cache.plans = [declines]
    out, path = fused_linear_with_path(
        x, w, b, epilogue, gw, gb, params=(bias,), weight_cache=cache
    )
    assert path == "torch" and out.shape == (1, 32, 8, 1)
    monkeypatch.setattr(gemmfuse.ops, "fsdp_in_use", lambda: True)
    seen.clear()
    fused_linear_with_path(x, w, b, epilogue, gw, gb, params=(bias,), weight_cache=cache)
    assert seen == [], "plans run while FSDP2 manages modules"


def test_a_bf16_reduction_on_the_epilogue_path_is_planned_with_eager_statistics(
    fake_ext, monkeypatch
):
    """A bf16 model's chain with a reduction takes the epilogue path (PyTorch's GEMM, then the
    chain with eager bf16's GroupNorm statistics): its plan says so, with the statistics' mode."""
    monkeypatch.setattr(gemmfuse.dispatch, "eager_bf16_group_stats", lambda index: 2)
    epilogue = Epilogue(norm=GroupNormSpec(16), reduce=Reduction("min"))
    cache = SplitWeightCache()
    args = [t.bfloat16() if isinstance(t, torch.Tensor) else t for t in tensors(n=256)]
    assert plannable("epilogue") and plannable("fused") and not plannable("torch")
    keep_plan(cache, epilogue, "auto", "fp32", args, grad=False, path="epilogue")
    (plan,) = cache.plans
    assert plan.spec["epilogue_path"] and plan.spec["group_stats"] == 2 and plan.spec["model16"]
    # a min after groups of 16 of 256 channels: dz is sparse, the sparse products take it
    assert plan.spec["sparse"] and not plan.spec["split_dx"] and not plan.spec["split_dw"]
    # kernel="epilogue" (which these chains take whatever kernel says) has no fused-kernel code
    keep_plan(cache, epilogue, "epilogue", "fp32", args, grad=False, path="epilogue")
    assert cache.plans[0].spec["kernel_code"] == 0 and cache.plans[0].kernel == "epilogue"


@pytest.mark.parametrize(
    "m, aligned, gemv",
    [(1, True, True), (2, True, True), (3, True, False), (1, False, False), (16, True, False)],
)
def test_a_float32_epilogue_path_plan_says_where_the_few_rows_kernel_runs(fake_ext, m, aligned,
                                                                          gemv):  # fmt: skip
    """A float32 call below the fused kernel's sizes takes the epilogue path, and is planned:
    at one or two 16-byte-aligned rows its plan runs the few-rows kernel (dispatch.gemv_fits;
    host_plan.cpp takes it where no z is saved), else PyTorch's GEMM and the chain kernel."""
    epilogue = Epilogue(norm=GroupNormSpec(16), post=(Pointwise("relu"),))
    x, w, b, gw, gb, params = tensors(m=m, k=1028, n=256)
    if not aligned:  # the same sizes and strides, 4 bytes off 16-byte alignment
        x = torch.randn(m * 1028 + 1)[1:].view(m, 1028)
        assert x.stride() == (1028, 1) and x.data_ptr() % 16 == 4
    cache = SplitWeightCache()
    keep_plan(cache, epilogue, "auto", "fp32", (x, w, b, gw, gb, params), grad=False,
              path="epilogue")  # fmt: skip
    (plan,) = cache.plans
    assert plan.spec["epilogue_path"] and not plan.spec["model16"]
    assert plan.spec["gemv"] is gemv and plan.spec["group_stats"] == 0
    # the fused path, and a 16-bit model's epilogue path, never take the few-rows kernel
    assert not gemmfuse.dispatch.gemv_fits("fused", x, w)
    assert not gemmfuse.dispatch.gemv_fits("epilogue", x.bfloat16(), w.bfloat16())
    assert not plan.spec["chain_apart"] and plan.spec["plain_table"] == 0
    assert not plan.spec["split_dx"] and not plan.spec["split_dw"]


def test_a_float32_call_below_the_fused_sizes_leaves_an_epilogue_path_plan(monkeypatch):
    """fused_linear keeps a plan for the float32 epilogue path (host time is most of such a
    call's time): the path's launch and keep_plan stand in here, and the call hands its path to
    keep_plan."""
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gemmfuse.ops, "take_path", lambda *args: "epilogue")
    launched = []

    def launch(path, epilogue, cache, kernel, precision, x, *rest):
        launched.append(path)
        return torch.zeros(x.shape[0], 256), None

    monkeypatch.setattr(gemmfuse.ops, "launch_path", launch)
    kept = []
    monkeypatch.setattr(gemmfuse.ops, "keep_plan", lambda *args, **kw: kept.append(args[-1]))
    x, w, b, gw, gb, params = tensors(m=16, k=1024, n=256)
    epilogue = Epilogue(norm=GroupNormSpec(16))
    with torch.no_grad():
        _, path = fused_linear_with_path(x, w, b, epilogue, gw, gb, weight_cache=SplitWeightCache())
    assert path == "epilogue" and launched == ["epilogue"] and kept == ["epilogue"]


def test_a_cleared_or_copied_cache_has_no_plans(fake_ext):
    cache = SplitWeightCache()
    keep_plan(cache, Epilogue(), "auto", "fp32", tensors(), grad=False)
    copied = copy.deepcopy(cache)
    assert copied.plans == [] and copied.token != cache.token
    native = cache.native(FakeExt)
    cache.clear()
    assert cache.plans == [] and cache.native(FakeExt) is not native


def test_an_inference_tensor_is_derived_at_every_call():
    """An inference tensor has no version counter (reading it raises): what the cache derives
    from one is made at each call, never kept under a key it cannot check."""
    cache, made = SplitWeightCache(), []
    with torch.inference_mode():
        t = torch.randn(8)
        for _ in range(2):
            assert torch.equal(cache.derived(t, "slot", lambda: made.append(1) or t * 2), t * 2)
    assert len(made) == 2
    plain = torch.randn(8)
    for _ in range(2):
        cache.derived(plain, "slot", lambda: made.append(1) or plain * 2)
    assert len(made) == 3  # a plain tensor's: made once


def test_the_graph_safe_twin_keeps_no_tensor(fake_ext):
    """The graph-safe op's cache (library.py): one twin per cache, whose SplitCache keeps
    nothing and whose derived tensors are made at every call, none kept; it keeps plans (host
    memory only), apart from its cache's."""
    cache = SplitWeightCache()
    twin = cache.graph_safe()
    assert twin is cache.graph_safe() and twin is not cache
    assert cache.native(FakeExt).keeps and not twin.native(FakeExt).keeps
    t, made = torch.randn(8), []
    for _ in range(2):
        twin.derived(t, "slot", lambda: made.append(1) or t * 2)
    assert len(made) == 2 and not twin._entries
    keep_plan(twin, Epilogue(), "auto", "fp32", tensors(), grad=False)
    assert len(twin.plans) == 1 and cache.plans == []
