"""Tensor arguments read per element: an (M, N) operand computed elsewhere (a residual, a gate)
in the chain before and after the norm, on every CUDA path (the fused kernels, the few-rows
kernel, the epilogue path, a bfloat16 model), with gradients (PyTorch's backward of the chain
where the operand wants one, the chain backward kernel where it does not), and a transformer
MLP block through optimize (a 3-D input, both Linears fused, the residual included).

Bar, as for the other chains (test_chains.py): allclose(eager fp32, 1e-4) on every path, no NaN
where eager has a number; within helpers.float64_bar wherever gemmfuse's own dispatch runs the
case (kernel="auto"); gradients to tests/gpu/test_autograd.py's bars.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gemmfuse.autograd
from gemmfuse import Epilogue, FusedLinear, GroupNormSpec, Param, Pointwise, Reduction, optimize
from gemmfuse.chains import chain_references, linear_data
from gemmfuse.dispatch import GEMV_MAX_ROWS, fused_pays
from gemmfuse.ops import fused_linear_with_path
from gpu.test_autograd import Chain, check_gradients
from helpers import float64_bar, fused_kernels, max_abs_err, ops_alone, poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ELEMENT, CHANNEL = "element", "channel"
# (chain, how each params[i] is read). Groups of 8: in the tile at n = 64, straddling tiles
# (the second pass's normalize) at n = 200, 1000 and 3000.
CHAINS = [
    (Epilogue(pre=(Pointwise("add", (Param(0),)),)), [ELEMENT]),
    (
        Epilogue(
            pre=(Pointwise("mul", (Param(0),)),),
            norm=GroupNormSpec(8),
            post=(Pointwise("add", (Param(1),)), Pointwise("gelu")),
        ),
        [ELEMENT, ELEMENT],
    ),
    (
        Epilogue(
            pre=(Pointwise("add", (Param(0),)),),
            norm=GroupNormSpec(1, layer=True),
            post=(Pointwise("mul", (Param(1),)), Pointwise("sub", (Param(0),))),
        ),
        [ELEMENT, CHANNEL],
    ),
    (
        Epilogue(
            pre=(Pointwise("sub", (Param(1),)), Pointwise("mul", (Param(0),)), Pointwise("tanh")),
            reduce=Reduction("max", keepdim=True),
        ),
        [ELEMENT, CHANNEL],
    ),
]
SHAPES = [(130, 300, 64), (300, 1024, 200), (GEMV_MAX_ROWS, 2048, 1000), (257, 2048, 3000)]


def _case(index, m, k, n, seed, dtype=torch.float32):
    """(epilogue, x, w, b, gn_weight, gn_bias, params) on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    epilogue, kinds = CHAINS[index]
    x, w, b, gn_w, gn_b = linear_data(gen, m, k, n)
    params = [torch.randn(m, n, generator=gen) if kind == ELEMENT
              else 0.5 + torch.rand(n, generator=gen) for kind in kinds]  # fmt: skip
    gn = (gn_w, gn_b) if epilogue.norm is not None and epilogue.norm.affine else (None, None)
    tensors = [None if t is None else t.to(CUDA, dtype) for t in (x, w, b, *gn, *params)]
    return epilogue, *tensors[:5], tensors[5:]


@pytest.mark.parametrize("index", range(len(CHAINS)))
@pytest.mark.parametrize("kernel", [*fused_kernels(), "epilogue", "auto"])
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_per_element_operands_match_pytorch(index, kernel, m, k, n):
    epilogue, x, w, b, gn_w, gn_b, params = _case(index, m, k, n, 10 * index + m)
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, gn_w, gn_b, params)
        poison_allocator(4 * max(eager.numel(), m * n), CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, gn_w, gn_b, params=params,
                                           kernel=kernel)  # fmt: skip
    auto = "fused" if fused_pays(m, n, k) else "epilogue"
    assert path == {"auto": auto, "epilogue": "epilogue"}.get(kernel, "fused")
    assert got.shape == eager.shape and not (got.isnan() & ~eager.isnan()).any()
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    if kernel == "auto":
        bar = float64_bar(max_abs_err(eager, exact), max_abs_err(ops_alone, exact), exact)
        assert max_abs_err(got, exact) <= bar


def test_a_per_element_operand_is_not_read_per_channel():
    """The same chain with the operand's rows made different from each other: a kernel that
    read row 0 (or any one row) for every row would be off by the rows' differences."""
    epilogue, x, w, b, _, _, params = _case(0, 256, 1024, 512, 5)
    rows = torch.arange(256, device=CUDA, dtype=torch.float32).unsqueeze(1) * 10.0
    operand = params[0] + rows
    with torch.no_grad():
        got = fused_linear_with_path(x, w, b, epilogue, params=[operand], kernel="auto")[0]
    torch.testing.assert_close(got, F.linear(x, w, b) + operand, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="bfloat16 models are fused by the Hopper kernel only",
)
def test_bf16_residual():
    """A bfloat16 model's residual add on the Hopper kernel: rounded where eager bf16 rounds,
    within twice eager bf16's distance from float64; allclose(1e-2) to it."""
    epilogue, x, w, b, _, _, params = _case(0, 1024, 2048, 1024, 3, torch.bfloat16)
    with torch.no_grad():
        eager, exact, _ = chain_references(x, w, b, epilogue, None, None, params)
        got, path = fused_linear_with_path(x, w, b, epilogue, params=params, kernel="hopper")
    assert path == "fused" and got.dtype == torch.bfloat16
    assert max_abs_err(got, exact) <= 2 * max_abs_err(eager, exact)
    torch.testing.assert_close(got.float(), eager.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_per_element_operand_gradients(index):
    """Every gradient (x, the weight, the bias, the norm's vectors, each operand: an (M, N)
    one's gradient is per element) to test_autograd.py's bars, at a size the fused kernel
    takes."""
    epilogue, x, w, b, gn_w, gn_b, params = _case(index, 256, 1024, 1024, 40 + index)
    chain = Chain(x, w, b, epilogue, (gn_w, gn_b), params)
    out = chain.run_from_z(F.linear(x, w, b), [gn_w, gn_b], params)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(index)).to(CUDA)
    names = ["x", "weight", "bias", *(["norm.weight", "norm.bias"] if gn_w is not None else [])]
    names += [f"params[{i}]" for i in range(len(params))]
    path, lines = check_gradients(chain, grad, "auto", f"per element chain {index}", names)
    assert path == "fused"
    print("\n".join(lines))


@pytest.mark.parametrize("index", [0, 1, 3])
def test_an_operand_without_a_gradient_takes_the_chain_backward_kernel(index, monkeypatch):
    """With the (M, N) operands detached, the chain backward kernel runs (it reads them per
    element as the forward does); its x, weight and bias gradients agree with PyTorch's
    backward of the chain (the path taken when an operand wants its gradient)."""
    epilogue, x, w, b, gn_w, gn_b, params = _case(index, 256, 1024, 1024, 60 + index)
    kinds = CHAINS[index][1]
    calls = []
    kernel_backward = gemmfuse.autograd._kernel_chain_backward
    monkeypatch.setattr(gemmfuse.autograd, "_kernel_chain_backward",
                        lambda *a, **k: calls.append(1) or kernel_backward(*a, **k))  # fmt: skip
    grad = None
    results = []
    for operand_grad in (False, True):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        ps = [p.detach().requires_grad_(operand_grad and kind == ELEMENT)
              for p, kind in zip(params, kinds, strict=True)]  # fmt: skip
        out, path = fused_linear_with_path(*leaves, epilogue, gn_w, gn_b, params=ps)
        assert path == "fused"
        grad = torch.randn_like(out) if grad is None else grad
        results.append(torch.autograd.grad(out, leaves, grad))
        assert len(calls) == 1, operand_grad  # the kernel for the first call only
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


class _MLP(nn.Module):
    """A transformer MLP block: LayerNorm -> Linear -> GELU -> Linear -> + residual."""

    def __init__(self, d_model, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)))) + x


def test_transformer_mlp_block_trains_with_both_linears_and_the_residual_fused():
    """(batch 8, sequence 128, 1024 features; hidden 4096), 3 training steps' forward and
    backward: both Linears on the fused kernel, fc2's chain ending with the residual; outputs
    and gradients (x's and every parameter's) allclose(1e-4) to eager fp32 and, for the
    output, within float64_bar."""
    torch.manual_seed(0)
    model = _MLP(1024, 4096).to(CUDA)
    x = torch.randn(8, 128, 1024, device=CUDA)
    new, report = optimize(model, (x,))
    chains = {r.name: " -> ".join(r.chain) for r in report.fused}
    assert chains == {"fc1": "fc1 -> gelu", "fc2": "fc2 -> x + input x"}, report
    exact_model = copy.deepcopy(model).double()
    for step in range(3):
        xs = torch.randn(8, 128, 1024, device=CUDA).requires_grad_()
        outs, grads = [], []
        for m in (new, model):
            model.zero_grad(set_to_none=True)
            xs.grad = None
            out = m(xs)
            out.backward(torch.ones_like(out) if step == 0 else torch.cos(out.detach()))
            outs.append(out.detach())
            grads.append([xs.grad, *(p.grad for p in model.parameters())])
        fused = [f for f in new.modules() if isinstance(f, FusedLinear)]
        assert len(fused) == 2 and all(f.last_path == "fused" for f in fused)
        with torch.no_grad():
            exact = exact_model(xs.double())
        floor = max_abs_err(ops_alone(model, xs.detach()), exact)
        bar = float64_bar(max_abs_err(outs[1], exact), floor, exact)
        assert max_abs_err(outs[0], exact) <= bar
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
