"""The gemmfuse:: torch.library ops on the CPU: their schema, fake and autograd registrations
(torch.library.opcheck), their gradients (gradcheck in float64), and fused_linear under
torch.compile(fullgraph=True) and torch.export, where the ops stand for the call. The CPU
implementation is the PyTorch path; tests/gpu/test_library.py runs the same on the kernels."""

import dataclasses
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import gemmfuse
from gemmfuse import Epilogue, GroupNormSpec, Param, Pointwise, Reduction, Value, optimize
from gemmfuse.epilogue import epilogue_spec
from gemmfuse.kernelbench.export import standalone_source
from gemmfuse.kernelbench.registry import get_problem
from gemmfuse.reference import linear_epilogue
from gemmfuse.weight_cache import SplitWeightCache, cache_for_call

M, K, N = 6, 5, 8

CHAINS = {
    "plain": Epilogue(),
    "pointwise": Epilogue(pre=(Pointwise("mul", (Param(0),)), Pointwise("gelu"))),
    "groupnorm": Epilogue(
        pre=(Pointwise("add", (Param(0),)),),
        norm=GroupNormSpec(2, eps=1e-3),
        post=(Pointwise("leaky_relu", (0.1,)), Pointwise("div", (Param(1),))),
    ),
    "min_keepdim_tail": Epilogue(
        norm=GroupNormSpec(4, affine=False),
        reduce=Reduction("min", keepdim=True),
        tail=(Pointwise("add", (Param(0),)),),
    ),
    "logsumexp": Epilogue(
        pre=(Pointwise("tanh"),), norm=GroupNormSpec(1), reduce=Reduction("logsumexp")
    ),
    "values_read_again": Epilogue(  # chains.value_chains' third, its reads all attached
        pre=(Pointwise("sigmoid"), Pointwise("add", (Value(0),))),
        norm=GroupNormSpec(2),
        post=(
            Pointwise("tanh"),
            Pointwise("mul", (Param(0),)),
            Pointwise("add", (Value(0),)),
            Pointwise("mul", (Value(1),)),
        ),
        reduce=Reduction("logsumexp", keepdim=True),
    ),  # fmt: skip
}
PARAM_SHAPES = {"min_keepdim_tail": [(2, 1, 1)]}  # a tail operand broadcasts as PyTorch does
# what dynamic=True and data-decided row counts need of Dynamo (guard_scalar, guard_or_false)
TORCH_2_8 = torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)


def inputs(name: str, dtype=torch.float32, seed: int = 0, bias: bool = True):
    """(x, weight, bias, gn_weight, gn_bias, params) for CHAINS[name], all requiring grad."""
    epilogue = CHAINS[name]
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=dtype) * scale + shift).requires_grad_()

    affine = epilogue.norm is not None and epilogue.norm.affine
    n_params = len(set(epilogue.channel_params + epilogue.tail_params))
    shapes = PARAM_SHAPES.get(name, [(N,)] * n_params)
    params = [draw(*shape, scale=0.2, shift=1.5) for shape in shapes]
    gn = (draw(N, scale=0.1, shift=1.0), draw(N, scale=0.1)) if affine else (None, None)
    return draw(M, K), draw(N, K, scale=0.5), draw(N) if bias else None, *gn, params


def op_args(name: str, tensors, cache: int = -1):
    chain = epilogue_spec(dataclasses.replace(CHAINS[name], tail=()))
    return (*tensors, chain, "auto", "fp32", cache)


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("op", ["fused_linear", "fused_linear_saving_z"])
def test_opcheck(name, op):
    """Schema, fake tensor, autograd registration and (AOT) dispatch checks, with and without
    a bias."""
    for bias in (True, False):
        args = op_args(name, inputs(name, bias=bias))
        torch.library.opcheck(getattr(torch.ops.gemmfuse, op).default, args)


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("op", ["fused_linear_inference", "fused_linear_graph_safe"])
def test_opcheck_inference(name, op):
    """The ops without a gradient: schema, fake and dispatch checks on tensors autograd does not
    record, and their output fused_linear's."""
    for bias in (True, False):
        tensors = _detached(inputs(name, bias=bias))
        args = op_args(name, tensors)
        torch.library.opcheck(getattr(torch.ops.gemmfuse, op).default, args)
        torch.testing.assert_close(
            getattr(torch.ops.gemmfuse, op)(*args),
            torch.ops.gemmfuse.fused_linear(*args),
            rtol=0, atol=0,
        )  # fmt: skip


def _detached(tensors):
    *head, params = tensors
    return (*(None if t is None else t.detach() for t in head), [p.detach() for p in params])


@pytest.mark.parametrize("op", ["fused_linear_inference", "fused_linear_graph_safe"])
def test_inference_op_refuses_a_recorded_call(op):
    """Where autograd would record it, an op without a gradient says so (its output would
    otherwise carry no gradient); under no_grad the same tensors are served."""
    call = getattr(torch.ops.gemmfuse, op)
    args = op_args("groupnorm", inputs("groupnorm"))
    with pytest.raises(RuntimeError, match=f"{op} has no gradient"):
        call(*args)
    with torch.no_grad():
        out = call(*args)
    torch.testing.assert_close(out, torch.ops.gemmfuse.fused_linear(*args).detach())
    # only a tail op's tensor requires grad: the chain reads none, and it still refuses
    *head, params = _detached(inputs("min_keepdim_tail"))
    params[0].requires_grad_()
    with pytest.raises(RuntimeError, match=f"{op} has no gradient"):
        call(*op_args("min_keepdim_tail", (*head, params)))


def test_compiled_call_with_grad_mode_on_keeps_the_formula():
    """Grad mode on, nothing the chain reads requiring grad, a tail op's tensor requiring it
    (#75's bias, the rest frozen): the graph holds the op with a formula, so no autograd
    warning; the bias's gradient is the model's."""
    model, optimized, x = small_problem(75, seed=6)
    for m in (model, optimized):
        for name, p in m.named_parameters():
            p.requires_grad_(name == "bias")
    recorder = GraphRecorder()
    compiled = torch.compile(optimized, fullgraph=True, backend=recorder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "an autograd kernel was not registered ..."
        out = compiled(x)
        (got,) = torch.autograd.grad(out.sum(), [optimized.bias])
    assert recorder.gemmfuse_ops() == ["gemmfuse.fused_linear"]
    (want,) = torch.autograd.grad(model(x).sum(), [model.bias])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("op", ["fused_linear", "fused_linear_saving_z"])
def test_gradcheck(name, op):
    """The ops' autograd formulas (fused_linear_backward) against finite differences, in
    float64: saving_z's from its saved z, fused_linear's from a recomputed one."""
    x, w, b, gw, gb, params = inputs(name, torch.float64, seed=1)
    spec_args = op_args(name, (None,) * 6)[6:]
    call = getattr(torch.ops.gemmfuse, op)

    def f(x, w, b, gw, gb, *params):
        out = call(x, w, b, gw, gb, list(params), *spec_args)
        return out[0] if isinstance(out, (tuple, list)) else out

    tensors = [t for t in (x, w, b, gw, gb) if t is not None] + params
    assert torch.autograd.gradcheck(
        lambda *ts: f(*_place(ts, (x, w, b, gw, gb), len(params))), tensors, eps=1e-6, atol=1e-7
    )


def _place(ts, slots, n_params):
    """gradcheck's flat tensors back in (x, w, b, gw, gb, *params) order, None where None."""
    it = iter(ts)
    head = [None if s is None else next(it) for s in slots]
    return (*head, *[next(it) for _ in range(n_params)])


def test_double_backward_is_refused():
    x, w, b, gw, gb, params = inputs("groupnorm", torch.float64)
    out = torch.ops.gemmfuse.fused_linear_saving_z(*op_args("groupnorm", (x, w, b, gw, gb, params)))
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(out[0].sum(), [x], create_graph=True)


def test_cache_tokens():
    cache = SplitWeightCache()
    assert SplitWeightCache.for_token(cache.token) is cache
    assert SplitWeightCache.for_token(-1) is not SplitWeightCache.for_token(-1)
    SplitWeightCache._adopted.clear()  # process-wide: start the count from none
    unknown = 10**9 + cache.token  # a token of another process: adopted, then kept
    assert SplitWeightCache.for_token(unknown) is SplitWeightCache.for_token(unknown)
    first = SplitWeightCache.for_token(unknown)
    for i in range(1, SplitWeightCache._MAX_ADOPTED):  # up to the bound: all kept
        SplitWeightCache.for_token(unknown + i)
    assert SplitWeightCache.for_token(unknown) is first
    SplitWeightCache.for_token(unknown + SplitWeightCache._MAX_ADOPTED)  # the oldest goes
    assert len(SplitWeightCache._adopted) <= SplitWeightCache._MAX_ADOPTED
    assert SplitWeightCache.for_token(unknown) is not first


def test_cache_for_call():
    cache = SplitWeightCache()
    assert cache_for_call(cache) is cache  # not capturing a CUDA graph
    assert isinstance(cache_for_call(None), SplitWeightCache)


@pytest.mark.parametrize(
    "name",
    ["fused_linear", "fused_linear_inference", "fused_linear_saving_z", "fused_linear_backward"],
)
@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="a torch without the tag")
def test_ops_stay_out_of_cuda_graphs(name):
    """Inductor's CUDA graphs would warm the weight cache up in their private pool and refuse
    it; the tag makes them run the op outside the recorded graph (GPU: test_library.py)."""
    assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.gemmfuse, name).default.tags


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="a torch without the tag")
def test_the_graph_safe_op_goes_into_cuda_graphs():
    """It keeps no tensor past a call (SplitWeightCache.graph_safe), so nothing marks it unsafe
    for CUDA graphs (GPU: test_library.py records it in one)."""
    assert torch.Tag.cudagraph_unsafe not in torch.ops.gemmfuse.fused_linear_graph_safe.default.tags


@pytest.mark.parametrize(
    "m, k, dtype, kernel, graph_safe",
    [
        (16, 1024, torch.float32, "auto", True),  # below the fused kernel's thresholds
        (2000, 1024, torch.float32, "auto", False),  # the fused kernel: the weight's split
        (2000, 512, torch.float32, "auto", True),  # K below MIN_FUSED_K
        (2000, 1024, torch.float32, "epilogue", True),
        (16, 1024, torch.float32, "hopper", False),  # forced fused kernels split the weight
        (16, 1024, torch.float32, "portable", False),
        (2000, 1024, torch.bfloat16, "auto", True),  # a 16-bit model's kernels read W as it is
        (2000, 1024, torch.float16, "hopper", True),
    ],
)
def test_the_traced_op_by_weight_split(m, k, dtype, kernel, graph_safe):
    """A traced call without autograd takes the graph-safe op exactly where no path splits the
    weight (dispatch.splits_no_weight, from sizes alone: meta tensors)."""
    x = torch.empty(m, k, dtype=dtype, device="meta")
    weight = torch.empty(64, k, dtype=dtype, device="meta")
    want = "fused_linear_graph_safe" if graph_safe else "fused_linear_inference"
    assert gemmfuse.ops._inference_op(x, weight, kernel) is getattr(torch.ops.gemmfuse, want)


class GraphRecorder:
    """A torch.compile backend that keeps each graph dynamo hands it and runs it as it is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def gemmfuse_ops(self) -> list[str]:
        return [
            str(node.target)
            for gm in self.graphs
            for node in gm.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("gemmfuse.")
        ]


def small_problem(number: int, seed: int = 0):
    """(the KernelBench model, its optimized twin, an input) at CPU size."""
    problem = get_problem(number)
    torch.manual_seed(seed)
    model = problem.load().Model(*problem.small_init)
    x = torch.randn(16, problem.small_init[0])
    return model, optimize(model, (x,))[0], x


def grads(model, x) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("number", [62, 75])
def test_compile_fullgraph_holds_the_op(number):
    """One graph, no break, the whole chain in one gemmfuse op: the saving op with autograd
    recording, the one without a gradient under no_grad. Outputs equal the model's; gradients
    too."""
    model, optimized, x = small_problem(number)
    recorder = GraphRecorder()
    compiled = torch.compile(optimized, fullgraph=True, backend=recorder)
    expected = model(x)
    torch.testing.assert_close(compiled(x), expected)
    assert recorder.gemmfuse_ops() == ["gemmfuse.fused_linear_saving_z"]
    assert optimized.get_submodule(_fused_path(optimized)).last_path == "compiled"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected)
    # M = 16, K = 96: below the fused kernel's thresholds, no weight split on any path
    assert recorder.gemmfuse_ops()[-1] == "gemmfuse.fused_linear_graph_safe"
    for got, want in zip(grads(compiled, x), grads(model, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _ops_that_ran(monkeypatch) -> list[str]:
    """The names of the inference ops whose implementation runs from now on, in order."""
    ran, run = [], gemmfuse.library._inference_in

    def spy(name, *args):
        ran.append(name)
        return run(name, *args)

    monkeypatch.setattr(gemmfuse.library, "_inference_in", spy)
    return ran


def test_compiled_sizes_past_the_fused_thresholds_keep_the_cached_op(monkeypatch):
    """Sizes the fused kernel takes (its weight split kept in the cache): the op CUDA graphs
    leave out; a call below the thresholds compiles again with the graph-safe op, and each
    size then runs its own graph's op."""
    torch.manual_seed(0)
    model = get_problem(62).load().Model(1024, 64, 4)
    optimized = optimize(model, (torch.randn(16, 1024),))[0]
    compiled = torch.compile(optimized, fullgraph=True, backend="eager")
    ran = _ops_that_ran(monkeypatch)
    with torch.no_grad():
        for m in (2000, 16, 3000, 24):
            x = torch.randn(m, 1024)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert ran == ["fused_linear_inference", "fused_linear_graph_safe"] * 2


@pytest.mark.skipif(not TORCH_2_8, reason="guard_or_false is torch 2.8's")
def test_a_row_count_that_data_decides_keeps_the_cached_op(monkeypatch):
    """After boolean indexing the row count is unknown until the call runs: the choice cannot
    guard on it, so the call keeps the op CUDA graphs leave out, and fullgraph compiles (where
    the rows may reach the fused kernel's thresholds; it raised at bb8d404)."""
    epilogue = Epilogue(pre=(Pointwise("gelu"),))
    w, b, cache = torch.randn(64, 1024), torch.randn(64), SplitWeightCache()

    def f(x, mask):
        return gemmfuse.fused_linear(x[mask], w, b, epilogue, weight_cache=cache)

    ran = _ops_that_ran(monkeypatch)
    x, mask = torch.randn(3000, 1024), torch.rand(3000) > 0.5
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad():
        got = torch.compile(f, fullgraph=True, backend="eager")(x, mask)
    torch.testing.assert_close(got, F.gelu(x[mask] @ w.T + b), rtol=1e-4, atol=1e-4)
    assert ran == ["fused_linear_inference"]


@pytest.mark.skipif(not TORCH_2_8, reason="Dynamo traces guard_scalar from torch 2.8 on")
@pytest.mark.parametrize("form", ["ModelNew", "optimized"])
@pytest.mark.parametrize("number", [62, 75])
def test_compile_with_dynamic_sizes(number, form):
    """torch.compile(dynamic=True) traces module attributes as symbolic numbers (a GroupNorm's
    eps and num_groups, a LeakyReLU's slope); the chain's spec takes them as the constants they
    are, the graph guarding on them (fullgraph had raised on the spec's text). Outputs are the
    model's at two row counts, and after eps changes."""
    problem = get_problem(number)
    torch.manual_seed(0)
    model = problem.load().Model(*problem.small_init)
    torch.manual_seed(0)  # the same parameters, drawn in the same order
    fused = problem.model_new(*problem.small_init)
    if form == "optimized":
        fused = optimize(model, (torch.randn(16, problem.small_init[0]),))[0]
    compiled = torch.compile(fused, fullgraph=True, dynamic=True, backend="eager")
    norms = [m for m in {*model.modules(), *fused.modules()} if isinstance(m, torch.nn.GroupNorm)]
    with torch.no_grad():
        for rows, eps in ((16, None), (24, None), (20, 0.5)):
            if eps is not None:
                for norm in norms:
                    norm.eps = eps
            x = torch.randn(rows, problem.small_init[0])
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def _fused_path(model) -> str:
    return next(n for n, m in model.named_modules() if isinstance(m, gemmfuse.FusedLinear))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_matches_eager(backend):
    """AOTAutograd traces the backward through fused_linear_backward's fake; the compiled
    step's gradients are the eager op's."""
    model, optimized, x = small_problem(62, seed=3)
    compiled = torch.compile(optimized, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), model(x))
    for got, want in zip(grads(compiled, x), grads(model, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_compiled_functional_call_with_tail_ops():
    """fused_linear itself under fullgraph: tail ops (a broadcasting operand included) run in
    the graph after the op; gradients reach every tensor."""
    x, w, b, gw, gb, params = inputs("min_keepdim_tail", seed=2)
    epilogue = CHAINS["min_keepdim_tail"]

    def f(x, w, b, p):
        return gemmfuse.fused_linear(x, w, b, epilogue, params=(p,))

    recorder = GraphRecorder()
    out = torch.compile(f, fullgraph=True, backend=recorder)(x, w, b, params[0])
    expected = linear_epilogue(x, w, b, epilogue, params=params)
    torch.testing.assert_close(out, expected)
    assert out.shape == (2, M, 1)
    got = torch.autograd.grad(out.sum(), [x, w, b, params[0]])
    want = torch.autograd.grad(expected.sum(), [x, w, b, params[0]])
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("number", [62, 75])
def test_export_runs_and_round_trips(number):
    """torch.export of an optimized model: the op in the program, the program's output the
    model's, and the same after torch.export.save / load (the chain is a string argument)."""
    model, optimized, x = small_problem(number, seed=5)
    expected = model(x)
    # parameters requiring grad: the op that also saves z (export keeps what autograd needs)
    for no_grad, op in ((False, "fused_linear_saving_z"), (True, "fused_linear")):
        with torch.set_grad_enabled(not no_grad):
            program = torch.export.export(optimized, (x,))
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert f"gemmfuse.{op}.default" in targets
        torch.testing.assert_close(program.module()(x), expected)
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        buffer.seek(0)
        torch.testing.assert_close(torch.export.load(buffer).module()(x), expected)


def test_eager_calls_do_not_go_through_the_ops():
    """Eager fused_linear keeps its direct path (no dispatcher overhead): the op is for traced
    code only."""
    x, w, b, *_ = inputs("plain")
    out, path = gemmfuse.fused_linear_with_path(x, w, b, Epilogue())
    assert path == "torch"
    torch.testing.assert_close(out, F.linear(x, w, b))


@pytest.mark.parametrize("number", [62, 75])
def test_compiled_model_new_builds_its_chain_in_the_graph(number):
    """ModelNew62/75 build their Epilogue inside forward: the traced op carries that chain
    (once, a constant made at trace time carried the empty chain: outputs off by 4)."""
    problem = get_problem(number)
    torch.manual_seed(0)
    model = problem.model_new(*problem.small_init)
    x = torch.randn(16, problem.small_init[0])
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    (node,) = [n for gm in recorder.graphs for n in gm.graph.nodes
               if str(n.target).startswith("gemmfuse.")]  # fmt: skip
    expected = problem.epilogue_fn(*_settings(model, number))
    assert node.args[6] == epilogue_spec(expected, tail=False)


@pytest.mark.parametrize("number", [62, 75])
def test_compiled_model_new_checks_its_arguments(number):
    """ModelNew's compiled forward holds its chain as constants and leaves the checks to the
    op's fake implementation: a bad input or setting still names itself when traced."""
    problem = get_problem(number)
    model = problem.model_new(*problem.small_init)

    def trace_only(gm, example_inputs):  # the checks must fire while tracing, not at run time
        return lambda *args: pytest.fail("the traced graph ran: no check fired at trace time")

    compiled = torch.compile(model, fullgraph=True, backend=trace_only)
    k = problem.small_init[0]
    with pytest.raises(Exception, match=rf"x must have shape \(batch, {k}\)"):
        compiled(torch.randn(4, k - 1))
    model.kernel = "fastest"
    with pytest.raises(Exception, match="kernel must be one of"):
        compiled(torch.randn(4, k))


@pytest.mark.parametrize("number", [62, 75])
def test_compiled_standalone_export(number):
    """The exported file's ModelNew (its traced_specs function copied with it) compiles to one
    graph holding the op, with the eager call's outputs."""
    namespace = {}
    exec(compile(standalone_source(number), "<string>", "exec"), namespace)
    problem = get_problem(number)
    torch.manual_seed(0)
    model = namespace["ModelNew"](*problem.small_init)
    x = torch.randn(16, problem.small_init[0])
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert recorder.gemmfuse_ops() == ["gemmfuse.fused_linear_saving_z"]


def _settings(model, number):
    gn = model.gn if number == 62 else model.group_norm
    common = (gn.num_groups, gn.eps, gn.affine)
    return (*common, float(model.leaky_relu.negative_slope)) if number == 62 else common


def test_fake_promotes_a_chain_tensor_of_another_dtype():
    """float32 x times a float64 per-channel tensor is float64 in PyTorch: the fake says so."""
    x, w, b, *_ = inputs("plain")
    p = torch.rand(N, dtype=torch.float64, requires_grad=True)
    epilogue = Epilogue(pre=(Pointwise("mul", (Param(0),)),))
    args = (x, w, b, None, None, [p], epilogue_spec(epilogue), "auto", "fp32", -1)
    for op in ("fused_linear", "fused_linear_saving_z"):
        torch.library.opcheck(getattr(torch.ops.gemmfuse, op).default, args)


def test_backward_returns_no_alias_of_its_inputs():
    """An (M, N) add operand's gradient is the incoming gradient itself in autograd; the op
    returns a copy (a custom op's outputs must not alias its inputs)."""
    x, w, b, *_ = inputs("plain")
    full = torch.randn(M, N, requires_grad=True)
    epilogue = Epilogue(pre=(Pointwise("add", (Param(0),)),))
    spec = epilogue_spec(epilogue)
    z = F.linear(x, w, b).detach()
    grad = torch.randn(M, N)
    needs = [False, False, False, False, False, True]
    out = torch.ops.gemmfuse.fused_linear_backward(
        grad, x, w, z, None, None, [full], spec, "auto", "fp32", -1, needs
    )
    torch.testing.assert_close(out[5], grad)
    assert out[5].data_ptr() != grad.data_ptr()


def test_forward_output_unviews_without_copying_and_copies_an_input_alias():
    """A forward op's (M, 1) view of its own (M,) result is returned as the same memory, not a
    view (no copy kernel); a result sharing an input's storage is copied."""
    from gemmfuse.library import _forward_output

    made = torch.randn(6)
    out = _forward_output(made.view(6, 1), torch.randn(3))
    assert out._base is None and out.shape == (6, 1)
    assert out.untyped_storage().data_ptr() == made.untyped_storage().data_ptr()
    torch.testing.assert_close(out.view(6), made, rtol=0, atol=0)
    x = torch.randn(6)
    copied = _forward_output(x.view(6, 1), x, None)
    assert copied.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(copied.view(6), x, rtol=0, atol=0)


def test_compiling_an_optimized_model_warns_nothing_of_ours():
    """The traced call reads no lru_cache-wrapped function of the package (Dynamo warns at each
    such call that it ignores the cache)."""
    _, optimized, x = small_problem(75)
    compiled = torch.compile(optimized, fullgraph=True, backend=GraphRecorder())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
