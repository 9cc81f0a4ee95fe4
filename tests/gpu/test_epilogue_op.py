"""fused_epilogue on the GPU (the chain kernel on a given tensor, and its backward), and a
BatchNorm1d in training mode through optimize: the fused GEMM up to it, its batch statistics,
then the rest of the chain on the kernel."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_epilogue_op import CHAIN

from gemmfuse import FallbackWarning, fused_epilogue_with_path, optimize
from gemmfuse.chains import layer_norm_chain, value_chains
from gemmfuse.kernelbench.models import epilogue_62, epilogue_75
from gemmfuse.reference import apply_epilogue
from helpers import CHAIN_KERNELS, kernel_names, max_abs_err, off_allclose, poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
CHAINS = [CHAIN, epilogue_62(8, 1e-5, True, 0.01), epilogue_75(8, 1e-5, True), *value_chains(8),
          layer_norm_chain(True, rms=True), layer_norm_chain(False)]  # fmt: skip


def _tensors(epilogue, seed, m=300, n=512):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(m, n, generator=g) * 3
    gn = (torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g))
    gn = gn if epilogue.norm is not None and epilogue.norm.affine else (None, None)
    count = 1 + max(epilogue.channel_params + epilogue.tail_params, default=-1)
    params = [torch.randn(n, generator=g) for _ in range(count)]
    return [None if t is None else t.to(CUDA) for t in (z, *gn, *params)]


def _run(tensors, epilogue, dtype=None):
    leaves = [None if t is None else t.to(dtype or t.dtype).requires_grad_() for t in tensors]
    z, gn_w, gn_b, *params = leaves
    if dtype is not None:  # the PyTorch reference in that dtype
        out, path = apply_epilogue(z, epilogue, gn_w, gn_b, params), "reference"
    else:
        poison_allocator(4 * z.numel(), CUDA)
        out, path = fused_epilogue_with_path(z, epilogue, gn_w, gn_b, params=params)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(CUDA)
    wanted = [t for t in leaves if t is not None]
    return out, torch.autograd.grad(out, wanted, grad.to(out.dtype)), path


@pytest.mark.parametrize("index", range(len(CHAINS)))
def test_kernel_matches_float64_as_eager_does(index):
    """Output and every gradient: no more elements outside allclose(1e-4) of float64 than
    eager fp32 has, and max abs error at most twice eager's (plus one fp32 ulp of the value)."""
    epilogue = CHAINS[index]
    tensors = _tensors(epilogue, index)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours, ours_grads, path = _run(tensors, epilogue)
    assert path == "epilogue"
    eager, eager_grads, _ = _run(tensors, epilogue, torch.float32)
    exact, exact_grads, _ = _run(tensors, epilogue, torch.float64)
    assert not ours.isnan().any()
    pairs = [(ours, eager, exact), *zip(ours_grads, eager_grads, exact_grads, strict=True)]
    for i, (got, theirs, want) in enumerate(pairs):
        ulp = torch.finfo(torch.float32).eps * want.abs().max().item()
        assert off_allclose(got, want) <= off_allclose(theirs, want), (epilogue, i)
        assert max_abs_err(got, want) <= 2 * max_abs_err(theirs, want) + ulp, (epilogue, i)


# (chain, M, N, z's offset in its storage): pointwise chains in fours, and one value at a time
# (a width not a multiple of 4; rows off a 16-byte boundary); a GroupNorm within tiles, with
# and without a reduction; groups wider than a tile in rows up to 2048 (one block a row) and
# longer (tiles, then the finalize kernel); groups of whole tiles in rows held in registers
# (wide_rows_kernel: #62's chain, an RMSNorm and a LayerNorm over rows, CHAIN's logsumexp, a
# chain reading values again), and off alignment (tiles and the finalize kernel again).
LAYOUTS = [(4, 64, 512, 0), (3, 37, 301, 0), (4, 64, 512, 1), (1, 33, 1024, 0), (2, 64, 512, 1),
           (0, 37, 302, 0), (0, 5, 4100, 2), (2, 200, 4104, 1), (1, 300, 8192, 0),
           (6, 300, 8192, 0), (7, 130, 2048, 0), (0, 128, 4096, 0), (5, 200, 4096, 0),
           (1, 64, 4096, 1)]  # fmt: skip


@pytest.mark.parametrize("index, m, n, offset", LAYOUTS)
def test_kernel_leaves_its_input_as_it_was(index, m, n, offset):
    """The kernel reads z and writes a new tensor: z keeps its values, and the output is the
    float64 chain's within eager fp32's own error (twice, plus one ulp)."""
    epilogue = CHAINS[index]
    z, *rest = _tensors(epilogue, m + n, m, n)
    storage = torch.full((offset + m * n,), float("nan"), device=CUDA)
    z_view = storage[offset:].view(m, n)
    z_view.copy_(z)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        got, path = fused_epilogue_with_path(z_view, epilogue, *rest[:2], params=rest[2:])
    assert path == "epilogue"
    assert torch.equal(z_view, z), "the input was written"
    _assert_within_twice_eager(got, z, epilogue, rest)


def _assert_within_twice_eager(got, z, epilogue, rest):
    """No NaN, and max abs error against the float64 chain at most twice eager fp32's (plus one
    fp32 ulp of the largest value)."""
    eager = apply_epilogue(z, epilogue, *rest[:2], rest[2:])
    doubles = [None if t is None else t.double() for t in rest]
    exact = apply_epilogue(z.double(), epilogue, *doubles[:2], doubles[2:])
    ulp = torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert not got.isnan().any()
    assert max_abs_err(got, exact) <= 2 * max_abs_err(eager, exact) + ulp


# (chain, M, N, z's offset, the kernels the call launches): groups of whole tiles in aligned rows
# of up to 8192 held in registers (#62's and #75's chains in 8 groups, an RMSNorm, a LayerNorm
# without affine, CHAIN's logsumexp in 2 groups, a chain reading values again); groups that
# straddle tiles in short rows one block a row; else tiles, then the finalize kernel.
WIDE_KERNELS = [(1, 5, 2048, 0, ["wide_rows_kernel"]), (1, 300, 8192, 0, ["wide_rows_kernel"]),
                (2, 64, 4096, 0, ["wide_rows_kernel"]), (6, 64, 4096, 0, ["wide_rows_kernel"]),
                (7, 64, 4096, 0, ["wide_rows_kernel"]), (0, 64, 4096, 0, ["wide_rows_kernel"]),
                (5, 64, 4096, 0, ["wide_rows_kernel"]), (1, 5, 2040, 0, ["row_epilogue_kernel"]),
                (1, 64, 4104, 0, ["tile_epilogue_kernel", "norm_finalize_kernel"]),
                (1, 64, 4096, 1, ["tile_epilogue_kernel", "norm_finalize_kernel"])]  # fmt: skip


@pytest.mark.parametrize("index, m, n, offset, expected", WIDE_KERNELS)
def test_wide_groups_kernels(index, m, n, offset, expected):
    epilogue = CHAINS[index]
    z, *rest = _tensors(epilogue, m, m, n)
    storage = torch.empty(offset + m * n, device=CUDA)
    z_view = storage[offset:].view(m, n)
    z_view.copy_(z)

    def call():
        return fused_epilogue_with_path(z_view, epilogue, *rest[:2], params=rest[2:])

    names = kernel_names(call)
    kinds = (*CHAIN_KERNELS, "norm_finalize_kernel")
    assert [k for name in names for k in kinds if k in name] == expected, names


@pytest.mark.parametrize("index", [1, 6])
def test_wide_groups_of_values_far_from_zero(index):
    """Rows of 1000 + noise in groups of whole tiles (wide_rows_kernel): the moments' shift and
    compensated sums keep the float64 bar where a plain E[x^2] - E[x]^2 would not."""
    epilogue = CHAINS[index]
    z, *rest = _tensors(epilogue, 7, 64, 4096)
    z = z + 1000.0
    got, path = fused_epilogue_with_path(z, epilogue, *rest[:2], params=rest[2:])
    assert path == "epilogue"
    _assert_within_twice_eager(got, z, epilogue, rest)


class _Gemm41(nn.Module):
    """KernelBench #41's chain (Linear -> BatchNorm1d -> GELU -> ReLU) at a size the fused
    kernel takes."""

    def __init__(self, k=1024, n=512, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(k, n)
        self.bn = nn.BatchNorm1d(n, momentum=momentum)

    def forward(self, x):
        return torch.relu(F.gelu(self.bn(self.gemm(x))))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_in_training_mode_is_fused(momentum):
    """Three training steps: the GEMM on the fused kernel, the rest on the chain kernel, no
    fallback; outputs, gradients and running statistics against the float64 model, each no
    further than twice eager fp32's distance (plus one fp32 ulp)."""
    torch.manual_seed(0)
    model = _Gemm41(momentum=momentum).to(CUDA)
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(256, 1024, device=CUDA)
    new, report = optimize(model, (x,))
    assert "bn (batch statistics: (x - mean) * scale + bias) -> gelu -> relu" in str(report)
    for step in range(3):
        x = torch.randn(256, 1024, device=CUDA)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            out = new(x.clone().requires_grad_())
        assert new.gemm.last_path == "fused"
        outs = [out, eager(x.clone().requires_grad_()), exact(x.double().requires_grad_())]
        ulp = torch.finfo(torch.float32).eps * outs[2].abs().max().item()
        assert max_abs_err(outs[0], outs[2]) <= 2 * max_abs_err(outs[1], outs[2]) + ulp, step
        grad = torch.randn(out.shape, device=CUDA)
        for o in outs:
            o.backward(grad.to(o.dtype))
    named = zip(model.named_parameters(), eager.parameters(), exact.parameters(), strict=True)
    for (key, ours), theirs, want in named:
        ulp = torch.finfo(torch.float32).eps * want.grad.abs().max().item()
        assert max_abs_err(ours.grad, want.grad) <= 2 * max_abs_err(theirs.grad, want.grad) + ulp, (
            key
        )
    named = zip(model.named_buffers(), eager.buffers(), exact.buffers(), strict=True)
    for (key, ours), theirs, want in named:
        ulp = torch.finfo(torch.float32).eps * want.double().abs().max().item()
        assert max_abs_err(ours, want) <= 2 * max_abs_err(theirs, want) + ulp, key
