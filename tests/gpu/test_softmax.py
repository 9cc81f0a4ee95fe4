"""A softmax or log_softmax over the channels in the norm slot, on every CUDA path: the fused
kernels (in-tile rows, and rows wider than a tile: per-tile maxima and sums merged by the second
pass), the few-rows kernel, the epilogue path, bfloat16 models, gradients (PyTorch's backward of
the chain from the saved GEMM result), and KernelBench #99 / #84 through optimize.

Bar, as for the other chains (test_chains.py): allclose(eager fp32, 1e-4) on every path, no NaN
where eager has a number; within helpers.float64_bar wherever gemmfuse's own dispatch runs the
case (kernel="auto") and at the benchmark's width.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from gemmfuse import FallbackWarning, fused_linear, optimize
from gemmfuse.chains import chain_references, linear_data, softmax_chains
from gemmfuse.dispatch import GEMV_MAX_ROWS, fused_pays
from gemmfuse.ops import fused_linear_with_path
from helpers import float64_bar, fused_kernels, max_abs_err, poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
CHAINS = softmax_chains()
# (m, k, n): a row within one tile (n = 64 divides it), one row over two tiles, few rows, rows
# over many tiles (the merges), and the benchmark's width.
SHAPES = [(130, 300, 64), (300, 1024, 200), (GEMV_MAX_ROWS, 2048, 1000), (257, 2048, 3000),
          (64, 8192, 8192)]  # fmt: skip


def _case(index, m, k, n, seed, spread=1.0, dtype=torch.float32):
    """(epilogue, x, w, b, params) on the GPU; ``spread`` scales the weights (the logits)."""
    gen = torch.Generator().manual_seed(seed)
    epilogue = CHAINS[index]
    x, w, b, _, _ = linear_data(gen, m, k, n)
    params = [(0.5 + torch.rand(n, generator=gen)) for _ in epilogue.channel_params]
    tensors = [t.to(CUDA, dtype) for t in (x, w * spread, b * spread, *params)]
    return epilogue, *tensors[:3], tensors[3:]


@pytest.mark.parametrize("index", range(len(CHAINS)))
@pytest.mark.parametrize("kernel", [*fused_kernels(), "auto"])
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("spread", [1.0, 40.0])
def test_softmax_chain_matches_pytorch(index, kernel, m, k, n, spread):
    """``spread`` 40: logits of tens (rows whose tiles' maxima differ by far more than exp's
    range), where a merge that rescales the sums wrongly shows at once."""
    epilogue, x, w, b, params = _case(index, m, k, n, 100 * index + m, spread)
    with torch.no_grad():
        eager, exact, ops_alone = chain_references(x, w, b, epilogue, None, None, params)
        poison_allocator(4 * max(eager.numel(), m * n), CUDA)
        got, path = fused_linear_with_path(x, w, b, epilogue, params=params, kernel=kernel)
    auto = "fused" if fused_pays(m, n, k) else "epilogue"
    assert path == (auto if kernel == "auto" else "fused")
    assert got.shape == eager.shape and not (got.isnan() & ~eager.isnan()).any()
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    if kernel == "auto" or k == 8192:
        bar = float64_bar(max_abs_err(eager, exact), max_abs_err(ops_alone, exact), exact)
        assert max_abs_err(got, exact) <= bar


@pytest.mark.parametrize("m, k, n", [(1024, 8192, 8192), (257, 1000, 592)])
def test_bf16_softmax(m, k, n):
    """A bfloat16 model's GELU -> softmax on the Hopper kernel (forced where the problem is
    below auto's thresholds): rounded where eager bf16 rounds, so within twice eager bf16's
    distance from float64 (the bf16 model's own values); allclose(1e-2) to it."""
    epilogue, x, w, b, _ = _case(0, m, k, n, m, dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    with torch.no_grad():
        eager, exact, _ = chain_references(x, w, b, epilogue, None, None, [])
        got, path = fused_linear_with_path(x, w, b, epilogue, kernel="hopper" if hopper else "auto")
    assert got.dtype == torch.bfloat16 and got.shape == eager.shape
    if hopper:
        assert path == "fused"
    assert max_abs_err(got, exact) <= 2 * max_abs_err(eager, exact)
    torch.testing.assert_close(got.float(), eager.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("index", range(len(CHAINS)))
@pytest.mark.parametrize("m, k, n", [(300, 1024, 200), (256, 2048, 4096)])
def test_softmax_gradients(index, m, k, n):
    """Under autograd: the forward on the fused kernel, gradients of x, the weight, the bias
    and the chain's tensor from the saved GEMM result, each within twice eager fp32's distance
    from float64 (plus one fp32 ulp of the largest)."""
    epilogue, x, w, b, params = _case(index, m, k, n, 7 + index)
    grad = torch.randn(*(m, 1) if epilogue.reduce else (m, n), device=CUDA)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w, b, *params)]
        out = fn(*leaves[:3], epilogue, params=leaves[3:])
        return (out, *torch.autograd.grad(out, leaves, grad.to(dtype)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = run(fused_linear, torch.float32)

    def reference(x, w, b, epilogue, params):
        return chain_references(x, w, b, epilogue, None, None, params)[0]

    eager, exact = run(reference, torch.float32), run(reference, torch.float64)
    for i, (got, theirs, want) in enumerate(zip(ours, eager, exact, strict=True)):
        ulp = torch.finfo(torch.float32).eps * want.abs().max().item()
        assert max_abs_err(got, want) <= 2 * max_abs_err(theirs, want) + ulp, i


class _Gemm99(nn.Module):
    """KernelBench #99: Linear -> GELU -> softmax(dim=1)."""

    def __init__(self, k, n):
        super().__init__()
        self.linear = nn.Linear(k, n)

    def forward(self, x):
        return torch.nn.functional.softmax(torch.nn.functional.gelu(self.linear(x)), dim=1)


class _Gemm84(nn.Module):
    """KernelBench #84: Linear -> BatchNorm1d (training) -> * scale -> nn.Softmax(dim=1)."""

    def __init__(self, k, n):
        super().__init__()
        self.gemm = nn.Linear(k, n)
        self.bn = nn.BatchNorm1d(n)
        self.scale = nn.Parameter(torch.ones(1))
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        return self.softmax(self.scale * self.bn(self.gemm(x)))


MODELS = [(_Gemm99, "gelu -> softmax(dim=1)"), (_Gemm84, "x * scale -> softmax")]


@pytest.mark.parametrize("model_class, fused", MODELS)
def test_kernelbench_softmax_models(model_class, fused):
    """#99 and #84 at KernelBench's width (M = 256 here), optimized: the whole chain fused
    (report), three calls in training mode (autograd on, as KernelBench times them): outputs
    within float64_bar, running statistics within twice eager's distance, no fallback."""
    torch.manual_seed(0)
    model = model_class(8192, 8192).to(CUDA)
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    new, report = optimize(model, (torch.rand(256, 8192, device=CUDA),))
    assert fused in str(report) and "ends at the model's output" in str(report)
    for step in range(3):
        x = torch.rand(256, 8192, device=CUDA)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            got = new(x)
        first = getattr(new, "linear", None) or new.gemm
        assert first.last_path == "fused", step
        expect, want = eager(x), exact(x.double())
        ulp = torch.finfo(torch.float32).eps * want.abs().max().item()
        assert max_abs_err(got, want) <= 2 * max_abs_err(expect, want) + ulp, step
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    for ours, theirs, want in zip(model.buffers(), eager.buffers(), exact.buffers(), strict=True):
        ulp = torch.finfo(torch.float32).eps * want.double().abs().max().item()
        assert max_abs_err(ours, want) <= 2 * max_abs_err(theirs, want) + ulp
