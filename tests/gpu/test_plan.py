"""Planned calls (gemmfuse/plan.py, csrc/host/host_plan.h) on the GPU: a call of a kind seen before
runs in C++, with a C++ autograd node, and gives the Python path's results bit for bit.

Each case runs one chain three ways on fresh random data: the Python path (no weight cache, so
no plan: every call decided and split afresh), and a cached call twice (the first decided in
Python, which keeps a plan; the second run by the plan). Outputs and every gradient of the
planned call must equal the Python path's exactly (the same kernels on the same arguments),
its output must be written in full (the allocator poisoned with NaN first), and it must be as
close to a float64 evaluation as the Python path is (the same numbers). The planned call is
identified by its grad_fn (the C++ node) or, without autograd, by the Python rules not running
(``validate`` counted). Then what a plan must refuse or notice: another kind of tensor, a weight
changed in place, an input changed in place before the backward, a second backward, a second
derivative, a CUDA graph being captured.
"""

import functools

import pytest
import torch

import gemmfuse
import gemmfuse.library
import gemmfuse.ops
from gemmfuse import Epilogue, FusedLinear, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.dispatch import chain_apart
from gemmfuse.epilogue import epilogue_spec
from gemmfuse.jit import extension_for
from gemmfuse.kernelbench.models import ModelNew62, ModelNew75
from gemmfuse.reference import linear_epilogue
from gemmfuse.weight_cache import SplitWeightCache
from helpers import CHAIN_KERNELS, GEMV_KERNELS, hopper, kernel_names, poison_allocator

pytestmark = pytest.mark.gpu

NODE = "GemmfuseFusedLinearBackward"


# name -> (epilogue, params as (shape, requires_grad), groups' affine): the shipped chains, a
# per-channel and a scalar operand read twice, reductions, a wide GroupNorm (groups straddling
# 128-channel tiles), a per-element operand (a residual: no gradient wanted).
CHAINS = {
    "62": (Epilogue(norm=GroupNormSpec(32), post=(Pointwise("leaky_relu", (0.01,)),
                                                  Pointwise("add_self")))),
    "75": Epilogue(norm=GroupNormSpec(32), reduce=Reduction("min", keepdim=True),
                   tail=(Pointwise("add", (Param(0),)),)),
    "operands": Epilogue(pre=(Pointwise("mul", (Param(0),)), Pointwise("gelu"),
                              Pointwise("add", (Param(1),)), Pointwise("mul", (Param(0),)))),
    "logsumexp": Epilogue(pre=(Pointwise("tanh"),), reduce=Reduction("logsumexp")),
    "wide": Epilogue(norm=GroupNormSpec(2), post=(Pointwise("silu"),),
                     reduce=Reduction("sum", keepdim=True)),
    "residual": Epilogue(pre=(Pointwise("relu"), Pointwise("add", (Param(0),)))),
}  # fmt: skip


def params_for(name: str, m: int, n: int, device, dtype=torch.float32):
    if name == "75":
        return [torch.randn(1, n, 1, 1, device=device, dtype=dtype, requires_grad=True)]
    if name == "operands":
        return [torch.randn((), device=device, dtype=dtype, requires_grad=True),
                torch.randn(n, device=device, dtype=dtype, requires_grad=True)]  # fmt: skip
    if name == "residual":
        return [torch.randn(m, n, device=device, dtype=dtype)]
    return []


class Case:
    """A chain's tensors (fresh random data) and its three runs."""

    def __init__(self, name, m=256, k=1024, n=512, dtype=torch.float32, seed=0):
        torch.manual_seed(seed)
        dev = torch.device("cuda")
        self.name, self.epilogue = name, CHAINS[name]
        self.x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
        self.weight = (torch.randn(n, k, device=dev) / k**0.5).to(dtype).requires_grad_()
        self.bias = torch.randn(n, device=dev, dtype=dtype, requires_grad=True)
        norm = self.epilogue.norm
        gn = norm is not None and norm.affine
        self.gn = [
            (1 + 0.1 * torch.randn(n, device=dev)).to(dtype).requires_grad_() if gn else None,
            (0.1 * torch.randn(n, device=dev)).to(dtype).requires_grad_() if gn else None,
        ]
        self.params = params_for(name, m, n, dev, dtype)
        self.cache = SplitWeightCache()

    def leaves(self):
        return [t for t in (self.x, self.weight, self.bias, *self.gn, *self.params)
                if t is not None and t.requires_grad]  # fmt: skip

    def call(self, cache, kernel="hopper", precision="fp32"):
        return gemmfuse.fused_linear(
            self.x, self.weight, self.bias, self.epilogue, *self.gn, params=self.params,
            weight_cache=cache, kernel=kernel, precision=precision,
        )  # fmt: skip

    def op(self, library_op, precision, token):
        """``library_op`` (a ``gemmfuse::`` op) on the case's tensors and chain, the Hopper kernel
        forced, with the weight cache of ``token`` (-1: none)."""
        chain = epilogue_spec(self.epilogue, tail=False)
        return library_op(
            self.x, self.weight, self.bias, *self.gn, list(self.params), chain, "hopper",
            precision, token,
        )  # fmt: skip

    def grads(self, out, grad):
        return torch.autograd.grad(out, self.leaves(), grad)

    def float64(self):
        t = [None if v is None else v.detach().double() for v in (self.x, self.weight, self.bias)]
        gn = [None if v is None else v.detach().double() for v in self.gn]
        params = [p.detach().double() for p in self.params]
        return linear_epilogue(*t, self.epilogue, *gn, params=params)


def assert_same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item()}"


def counting(monkeypatch, module, name: str) -> list:
    """A list that grows by one on every call of ``module.name`` (wrapped for the test)."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def counting_validate(monkeypatch) -> list:
    """A list that grows by one on every call the Python rules decide."""
    return counting(monkeypatch, gemmfuse.ops, "validate")


KINDS = [("62", "fp32", torch.float32), ("75", "fp32", torch.float32),
         ("operands", "fp32", torch.float32), ("logsumexp", "fp32", torch.float32),
         ("wide", "fp32", torch.float32), ("residual", "fp32", torch.float32),
         ("62", "tf32", torch.float32), ("62", "fp32", torch.bfloat16),
         ("operands", "fp32", torch.bfloat16), ("75", "fp32", torch.bfloat16),
         ("62", "fp32", torch.float16), ("75", "fp32", torch.float16),
         ("operands", "fp32", torch.float16)]  # fmt: skip


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("name,precision,dtype", KINDS)
def test_planned_call_is_the_python_path_bit_for_bit(name, precision, dtype, monkeypatch):
    case = Case(name, dtype=dtype, seed=hash((name, precision, str(dtype))) % 1000)
    check_planned_call(case, precision, "hopper", counting_validate(monkeypatch))


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("name", ["62", "75", "wide", "residual"])
def test_planned_chain_apart_is_the_python_path_bit_for_bit(name, monkeypatch):
    """kernel="auto" at sizes where the chain runs apart (dispatch.chain_apart: the plain GEMM's
    table, then the chain kernel), planned and in Python."""
    case = Case(name, m=1024, k=4096, n=8192, seed=hash(("apart", name)) % 1000)
    assert not case.cache.plans
    assert chain_apart("fused", case.epilogue, case.x, 8192, "auto", "fp32")
    check_planned_call(case, "fp32", "auto", counting_validate(monkeypatch))
    assert all(plan.path == "fused" for plan in case.cache.plans)
    decided = counting_validate(monkeypatch)
    with torch.no_grad():
        names = kernel_names(functools.partial(case.call, case.cache, kernel="auto"))
    assert not decided, "the plan did not run the call"
    assert any(k in n for k in CHAIN_KERNELS for n in names), names


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("m,kernel", [(1, "epilogue"), (2, "auto"), (16, "auto"),
                                      (300, "epilogue")])  # fmt: skip
def test_planned_float32_epilogue_path_is_the_python_path_bit_for_bit(name, m, kernel,
                                                                       monkeypatch):  # fmt: skip
    """The float32 epilogue path (PyTorch's GEMM, then the chain kernel; at one or two rows
    without autograd the few-rows kernel) planned and in Python: kernel="auto" below the fused
    kernel's sizes, and the path forced."""
    case = Case(name, m=m, seed=hash(("epilogue", name, m)) % 1000)
    check_planned_call(case, "fp32", kernel, counting_validate(monkeypatch))
    assert all(plan.path == "epilogue" for plan in case.cache.plans)
    decided = counting_validate(monkeypatch)
    with torch.no_grad():
        names = kernel_names(functools.partial(case.call, case.cache, kernel=kernel))
    assert not decided, "the plan did not run the call"
    few_rows = any(k in n for k in GEMV_KERNELS for n in names)
    assert few_rows == (m <= 2), names


def check_planned_call(case, precision, kernel, decided):
    """The planned call's output (no_grad, and with autograd) and every gradient equal the
    Python path's; ``decided`` counts the calls the Python rules decide."""
    call = functools.partial(case.call, precision=precision, kernel=kernel)
    with torch.no_grad():
        python = call(None)
        call(case.cache)  # decided in Python: keeps a plan
        assert case.cache.plans, "no plan kept"
        before = len(decided)
        poison_allocator(python.numel() * python.element_size(), python.device)
        planned = call(case.cache)
        assert len(decided) == before, "the plan did not run the call"
    assert_same(planned, python, "no_grad output")
    assert not planned.isnan().any()
    # the Python path's accuracy is held to its bars elsewhere (test_kernels, test_accuracy):
    # here a coarse check that the numbers are the chain's, by the precision's own error (a
    # 16-bit result's own rounding alone is up to 2^-8 of each value in bf16, 2^-11 in fp16)
    exact = case.float64()
    rel = ((planned.double() - exact).norm() / exact.norm()).item()
    float32 = case.x.dtype == torch.float32
    assert rel < ({"fp32": 1e-5, "tf32": 2e-3}[precision] if float32 else 1e-2)

    # Under autograd: the forward with its node, and every gradient
    out_py = call(None)
    call(case.cache)  # a plan for calls that record
    out = call(case.cache)
    # the tail op's node sits on top; the planned call's is below it
    node = out.grad_fn.next_functions[0][0] if case.epilogue.tail else out.grad_fn
    assert node.name() == NODE
    assert_same(out, out_py, "output with autograd")
    grad = torch.randn_like(out)
    for i, (a, b) in enumerate(zip(case.grads(out, grad), case.grads(out_py, grad), strict=True)):
        assert_same(a, b, f"gradient {i}")
        assert not a.isnan().any(), f"gradient {i}"


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("name,precision,dtype", KINDS)
def test_the_saving_z_op_runs_a_plan_bit_for_bit(name, precision, dtype, monkeypatch):
    """``gemmfuse::fused_linear_saving_z``, the op a compiled graph calls where autograd records
    (library.py): with a cache, its first call is decided in Python and keeps a plan, the next
    is the plan's (the Python rules, ``take_path``, not run); both results, the output and the
    GEMM result z the backward reads, equal the Python path's (no cache) bit for bit."""
    case = Case(name, dtype=dtype, seed=hash(("z", name, precision, str(dtype))) % 1000)
    decided = counting(monkeypatch, gemmfuse.library, "take_path")
    op = functools.partial(case.op, torch.ops.gemmfuse.fused_linear_saving_z, precision)

    with torch.no_grad():
        python = op(-1)
        op(case.cache.token)  # decided in Python: keeps a plan
        assert case.cache.plans, "no plan kept"
        before = len(decided)
        poison_allocator(sum(t.numel() * t.element_size() for t in python), python[0].device)
        planned = op(case.cache.token)
        assert len(decided) == before, "the plan did not run the call"
    for a, b, what in zip(planned, python, ("output", "z"), strict=True):
        assert_same(a, b, what)
        assert not a.isnan().any(), what
    # the weight changed in place (an optimizer's step): the plan splits it again
    with torch.no_grad():
        case.weight.mul_(-0.5)
        python_after = op(-1)
        before = len(decided)
        planned_after = op(case.cache.token)
        assert len(decided) == before, "the plan did not run the call after the weight changed"
    for a, b, what in zip(planned_after, python_after, ("output", "z"), strict=True):
        assert_same(a, b, f"{what} after the weight changed")
    planned = planned_after
    # z is the GEMM's result, by the precision's own error (as the test above checks the output)
    exact = torch.nn.functional.linear(case.x.double(), case.weight.double(), case.bias.double())
    rel = ((planned[1].double() - exact).norm() / exact.norm()).item()
    assert rel < (1e-2 if dtype != torch.float32 else {"fp32": 1e-5, "tf32": 2e-3}[precision])


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("name,precision,dtype", KINDS)
def test_the_inference_op_runs_a_plan_bit_for_bit(name, precision, dtype, monkeypatch):
    """``gemmfuse::fused_linear_inference``, the op a compiled graph calls where autograd does
    not record (library.py): its first call with a cache is decided in Python and keeps a plan,
    the next runs the plan with no Python rule (``validate`` not called), and both equal the
    Python path's output (no cache) bit for bit, before and after the weight changes in
    place, without fused_linear's Python around the plan; the output is written in full."""
    case = Case(name, dtype=dtype, seed=hash(("inference", name, precision, str(dtype))) % 1000)
    decided = counting_validate(monkeypatch)
    # fused_linear's implementation: the Python path around the plans
    forwarded = counting(monkeypatch, gemmfuse.library, "_forward")
    op = functools.partial(case.op, torch.ops.gemmfuse.fused_linear_inference, precision)

    with torch.no_grad():
        for step in ("first", "after the weight changed"):
            python = op(-1)
            op(case.cache.token)  # decided in Python where no plan serves: keeps one
            assert case.cache.plans, "no plan kept"
            before, through_python = len(decided), len(forwarded)
            poison_allocator(python.numel() * python.element_size(), python.device)
            planned = op(case.cache.token)
            assert len(decided) == before, f"the plan did not run the call ({step})"
            assert len(forwarded) == through_python, f"the call went through _forward ({step})"
            assert_same(planned, python, f"output ({step})")
            assert not planned.isnan().any(), step
            case.weight.mul_(-0.5)  # an optimizer's step: the plan splits the weight again


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_an_operand_wanting_its_per_element_gradient_takes_the_python_path():
    case = Case("residual")
    case.params[0].requires_grad_()
    for _ in range(3):
        out = case.call(case.cache)
        assert out.grad_fn.name() != NODE
    python = case.call(None)
    grad = torch.randn_like(out)
    for a, b in zip(case.grads(out, grad), case.grads(python, grad), strict=True):
        assert_same(a, b, "gradient")


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_another_kind_of_call_is_decided_again_and_planned_too(monkeypatch):
    case = Case("62")
    decided = counting_validate(monkeypatch)
    x_other = torch.randn(96, case.x.shape[1], device="cuda")
    x_strided = torch.randn(case.x.shape[1], 256, device="cuda").t()
    with torch.no_grad():
        for x in (case.x, x_other, x_strided):
            case.x = x
            first = case.call(case.cache)
            n = len(decided)
            again = case.call(case.cache)
            assert len(decided) == n, f"x {tuple(x.shape)} {x.stride()} was not planned"
            assert_same(again, first, "planned against decided")
            assert_same(again, case.call(None), "planned against the Python path")
        assert len(case.cache.plans) == 3
        case.x = x_other  # the earlier kinds are still served
        n = len(decided)
        case.call(case.cache)
        assert len(decided) == n
        case.call(case.cache, kernel="portable")  # another kernel: decided in Python
        assert len(decided) == n + 1


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_a_weight_changed_in_place_is_split_again():
    case = Case("62")
    opt = torch.optim.SGD(case.leaves(), lr=0.5)
    for _ in range(3):
        out = case.call(case.cache)
        assert_same(out, case.call(None), "after an optimizer step")
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert out.grad_fn.name() == NODE


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_the_node_refuses_what_save_for_backward_refuses():
    case = Case("62")
    case.call(case.cache)
    out = case.call(case.cache)
    assert out.grad_fn.name() == NODE
    with torch.no_grad():
        case.x.detach().mul_(2)  # x's version steps
    with pytest.raises(RuntimeError, match="in-place"):
        out.sum().backward()

    out = case.call(case.cache)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()

    out = case.call(case.cache)
    (gx,) = torch.autograd.grad(out.square().sum(), case.x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="not differentiable"):
        gx.sum().backward()


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_plans_step_aside_during_cuda_graph_capture():
    """Captured with the cache's split, a replay would read it after the weight changed; the
    plan declines and the Python path splits inside the graph (weight_cache.cache_for_call)."""
    case = Case("62")
    with torch.no_grad():
        case.call(case.cache)
        case.call(case.cache)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            case.call(case.cache)
            with torch.cuda.graph(graph):
                out = case.call(case.cache)
        torch.cuda.current_stream().wait_stream(stream)
        case.weight.mul_(1.5)
        graph.replay()
        assert_same(out, case.call(None), "replay after the weight changed")


@pytest.mark.parametrize("model_cls,number", [(ModelNew62, 62), (ModelNew75, 75)])
def test_kernelbench_timing_calls_take_the_planned_path(model_cls, number):
    """KernelBench times the model as constructed, autograd recording: from the second call on,
    the fused call is the plan's (its C++ node on the output)."""
    init = {62: (512, 1024, 32), 75: (512, 1024, 32, (1, 1024, 1, 1))}[number]
    torch.manual_seed(0)
    model = model_cls(*init).cuda()
    model.kernel = "hopper" if hopper() else "auto"
    x = torch.randn(128, 512, device="cuda")
    first, second = model(x), model(x)
    assert model.last_path == "fused"
    node = second.grad_fn if number == 62 else second.grad_fn.next_functions[0][0]
    assert node.name() == NODE
    assert_same(second, first, "second call")
    with torch.no_grad():  # the original Model's chain, eager
        if number == 62:
            eager = model.leaky_relu(model.gn(model.fc(x)))
            eager = eager + eager
        else:
            eager = torch.min(model.group_norm(model.gemm(x)), dim=1, keepdim=True)[0] + model.bias
    assert torch.allclose(second, eager, atol=1e-4, rtol=1e-4)


def test_the_split_cache_tracks_the_weight():
    """The weight's split (the host extension's SplitCache, shared by both paths and the plans)
    is made once per version of the weight: again after an in-place write, for another tensor
    of the same values, and after clear(). (A CPU test held the same rules while the split
    cache was Python's, to commit 90b655b.)"""
    ext = extension_for(CHAINS["62"])
    cache = SplitWeightCache()
    w = torch.randn(256, 1024, device="cuda")

    def rows(weight, k_padded):  # the forward's split, as the executor takes it
        return cache.native(ext).rows(weight, k_padded)

    first = rows(w, 1024)
    assert all(a is b for a, b in zip(rows(w, 1024), first, strict=True))
    assert torch.equal(first[0], ext.split_rows(w, 1024)[0])
    with torch.no_grad():
        w.mul_(2)  # in place: its version steps
    second = rows(w, 1024)
    assert second[0] is not first[0] and torch.equal(second[0], ext.split_rows(w, 1024)[0])
    third = rows(w.clone(), 1024)  # same values, another storage
    assert third[0] is not second[0] and torch.equal(third[0], second[0])
    padded = rows(w, 1088)  # another padding: a slot of its own, beside the first
    assert padded[0].shape == (256, 1088) and rows(w, 1024)[0] is not padded[0]
    cols = cache.transposed(ext, w, 256)
    assert cols[0].shape == (1024, 256) and cache.transposed(ext, w, 256)[0] is cols[0]
    cache.clear()
    assert rows(w, 1024)[0] is not second[0]


def test_a_cache_that_keeps_nothing_makes_afresh():
    """The graph-safe op's SplitCache (keeps=False, weight_cache.SplitWeightCache.graph_safe):
    a new split at every call, equal to the kept cache's."""
    ext = extension_for(CHAINS["62"])
    w = torch.randn(256, 1024, device="cuda")
    twin = SplitWeightCache().graph_safe().native(ext)
    first, second = twin.rows(w, 1024), twin.rows(w, 1024)
    assert all(a is not b for a, b in zip(first, second, strict=True))
    kept = SplitWeightCache().native(ext).rows(w, 1024)
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=True))


def test_inference_tensors_and_inference_mode_in_the_split_cache():
    """An inference tensor's split is made at each call and empties the slot (what an earlier
    weight left there goes); a split kept during inference_mode for an ordinary weight is an
    ordinary tensor, which a later training call may save for backward."""
    ext = extension_for(CHAINS["62"])
    cache = SplitWeightCache()
    w = torch.randn(256, 1024, device="cuda")
    with torch.inference_mode():
        kept = cache.native(ext).rows(w, 1024)
        frozen = torch.randn(256, 1024, device="cuda")
    assert not any(t.is_inference() for t in kept)
    assert cache.native(ext).rows(w, 1024)[0] is kept[0]  # kept: the same tensor again
    assert cache.native(ext).rows(frozen, 1024)[0] is not cache.native(ext).rows(frozen, 1024)[0]
    again = cache.native(ext).rows(w, 1024)  # the slot was emptied: made anew
    assert again[0] is not kept[0] and torch.equal(again[0], kept[0])


class GroupNormChain(torch.nn.Module):
    def __init__(self, k=1024, n=256):
        super().__init__()
        self.fc = torch.nn.Linear(k, n)
        self.gn = torch.nn.GroupNorm(8, n)
        self.act = torch.nn.LeakyReLU(0.05)

    def forward(self, x):
        x = self.act(self.gn(self.fc(x)))
        return x + x


class TokenChain(torch.nn.Module):
    """3-D tokens: Linear -> GELU -> LayerNorm -> + the input (a residual read per element)."""

    def __init__(self, k=1024, n=1024):
        super().__init__()
        self.fc = torch.nn.Linear(k, n)
        self.ln = torch.nn.LayerNorm(n)

    def forward(self, x):
        return self.ln(torch.nn.functional.gelu(self.fc(x))) + x


def fused_of(model) -> FusedLinear:
    (fused,) = [m for m in model.modules() if isinstance(m, FusedLinear)]
    return fused


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
@pytest.mark.parametrize("model_cls,shape", [(GroupNormChain, (256, 1024)),
                                             (TokenChain, (2, 128, 1024))])  # fmt: skip
def test_optimized_models_run_their_plans(model_cls, shape):
    """A FusedLinear offers its call to its plans before its own rules: from the second call
    on the fused call is the plan's, bit for bit the Python path's (the first call's), and
    its gradients too."""
    torch.manual_seed(0)
    model = model_cls().cuda()
    # The residual's own (M, N) gradient is PyTorch's backward of the chain: not planned
    x = torch.randn(*shape, device="cuda", requires_grad=model_cls is GroupNormChain)
    new, _ = gemmfuse.optimize(model, (x,), kernel="hopper")
    fused = fused_of(new)
    fused.weight_split.clear()
    first = new(x)  # decided in Python; keeps a plan
    second = new(x)
    assert fused.last_path == "fused"
    node = second.grad_fn  # on 3-D tokens, the rows' output reshaped: its view node first
    assert (node.name() if x.dim() == 2 else node.next_functions[0][0].name()) == NODE
    assert_same(second, first, "planned against decided")
    grad = torch.randn_like(first)
    leaves = [t for t in (x, *model.parameters()) if t.requires_grad]
    for a, b in zip(torch.autograd.grad(second, leaves, grad),
                    torch.autograd.grad(first, leaves, grad), strict=True):  # fmt: skip
        assert_same(a, b, "gradient")
    with torch.no_grad():
        assert torch.allclose(second, model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_a_higher_input_is_not_planned_for_a_chain_of_dim_1():
    """A GroupNorm acts on dimension 1: on a 3-D input that is not the features, so the
    module falls back, though the flattened rows are of the kind a 2-D call planned."""
    torch.manual_seed(0)
    model = GroupNormChain().cuda()
    x2 = torch.randn(512, 1024, device="cuda")
    new, _ = gemmfuse.optimize(model, (x2,), kernel="hopper")
    with torch.no_grad():
        new(x2)
        new(x2)
        assert fused_of(new).weight_split.plans
        x3 = torch.randn(2, 256, 1024, device="cuda")  # rows: 512 x 1024, as x2's
        with pytest.warns(gemmfuse.FallbackWarning):
            out = new(x3)
        assert fused_of(new).last_path == "fallback"
        assert torch.equal(out, model(x3))


@pytest.mark.skipif(not hopper(), reason="the Hopper kernel (sm_90)")
def test_saved_tensor_hooks_take_the_python_path():
    """Activation checkpointing and offloading work through saved-tensor hooks, which
    save_for_backward honours and a plan's node does not: with hooks set, the plan declines."""
    case = Case("62")
    case.call(case.cache)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = case.call(case.cache)
    assert out.grad_fn.name() != NODE and packed
    planned = case.call(case.cache)
    assert planned.grad_fn.name() == NODE
    grad = torch.randn_like(out)
    for a, b in zip(case.grads(planned, grad), case.grads(out, grad), strict=True):
        assert_same(a, b, "gradient")
