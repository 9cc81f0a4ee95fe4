"""The epilogue's branch-free pointwise functions (csrc/epilogue/pointwise_math.cuh) against
PyTorch over every float32 bit pattern, the binary ops with a float argument bit for bit (forward
and the chain backward kernel's gradient), and the row reductions' partials (tile_epilogue.cuh's
row_partials: runs of a row in independent chains, merged) on rows of special values.

Both run through ``fused_epilogue``: the chain kernel applies ``pre`` as the fused kernels'
staging does (the same generated ``Epi::pre``) and reduces a tile's rows with the same code.
"""

import pytest
import torch
import torch.nn.functional as F

from gemmfuse import fused_epilogue_with_path
from gemmfuse.autograd import _kernel_chain_backward
from gemmfuse.epilogue import Epilogue, Pointwise, Reduction
from gemmfuse.pointwise import POINTWISE
from helpers import poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
CHUNK = 1 << 28  # float32 values per call: 1 GiB in, 1 GiB out
COLUMNS = 4096

OPS = {
    "sigmoid": (Pointwise("sigmoid"), torch.sigmoid),
    "silu": (Pointwise("silu"), F.silu),
    "swish": (Pointwise("swish"), lambda z: z * torch.sigmoid(z)),
    # log1p_rn in mish and softplus (and its default and another beta and threshold)
    "mish": (Pointwise("mish"), F.mish),
    "softplus": (Pointwise("softplus", (1.0, 20.0)), F.softplus),
    "softplus_beta": (Pointwise("softplus", (0.75, 3.0)), lambda z: F.softplus(z, 0.75, 3.0)),
}


def _bit_patterns(first: int) -> torch.Tensor:
    """CHUNK consecutive int32 bit patterns from ``first``, read as float32, (rows, COLUMNS)."""
    bits = torch.arange(first, first + CHUNK, dtype=torch.int64, device=CUDA)
    return bits.to(torch.int32).view(torch.float32).view(-1, COLUMNS)


def _differing(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where two float32 tensors differ in their bits (any NaN equals any NaN)."""
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    return ~same


@pytest.mark.parametrize("op", sorted(OPS))
def test_pointwise_equals_pytorch_on_every_float(op):
    pointwise, reference = OPS[op]
    epilogue = Epilogue(pre=(pointwise,))
    mismatches, examples = 0, []
    with torch.no_grad():
        for first in range(-(1 << 31), 1 << 31, CHUNK):
            z = _bit_patterns(first)
            poison_allocator(4 * z.numel(), CUDA)
            got, path = fused_epilogue_with_path(z, epilogue)
            assert path == "epilogue"
            want = reference(z)
            bad = _differing(got, want)
            count = int(bad.sum())
            if count:
                mismatches += count
                i = bad.flatten().nonzero()[:3].flatten()
                examples += [
                    (z.flatten()[j].item(), got.flatten()[j].item(), want.flatten()[j].item())
                    for j in i.tolist()
                ]
            del z, got, want, bad
    assert mismatches == 0, f"{op}: {mismatches} of 2^32 differ from PyTorch, e.g. {examples[:6]}"


# Floats whose float32 rounding loses digits (1.1, 1.2528...: x / a then differs by an ulp in
# most values between a reciprocal of float32(a) and PyTorch's, taken in float64), exact ones, a
# negative one and a small one.
FLOAT_ARGUMENTS = (1.1, 1.252802910310969, 0.7, 3.0, -7.123456789, 1e-3)


@pytest.mark.parametrize("op", ["add", "sub", "rsub", "mul", "div", "rdiv", "minimum", "maximum"])
def test_float_argument_equals_pytorch_bit_for_bit(op):
    """``op`` with a Python float argument against PyTorch's CUDA kernel for ``x op a``, which
    takes the float as a scalar of its own: the chain kernel's values and the chain backward
    kernel's gradient, bit for bit, on fresh random values with zeros, infinities and a NaN."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(512, COLUMNS, generator=gen) * 3
    z[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    z, grad = z.to(CUDA), torch.randn(z.shape, generator=gen).to(CUDA)
    for a in FLOAT_ARGUMENTS:
        label = f"{op}({a}) | seed {seed}"
        chain = Epilogue(pre=(Pointwise(op, (a,)),))
        eager_z = z.clone().requires_grad_(True)
        want = POINTWISE[op].torch(eager_z, a)
        want.backward(grad)
        with torch.no_grad():
            poison_allocator(8 * z.numel(), CUDA)
            got, path = fused_epilogue_with_path(z, chain)
            dz = _kernel_chain_backward(chain, z, grad, [None, None], [False, False])[0]
        assert path == "epilogue", label
        bad = _differing(got, want.detach())
        assert not bad.any(), f"{label}: {int(bad.sum())} values differ"
        bad = _differing(dz, eager_z.grad)
        assert not bad.any(), f"{label}: {int(bad.sum())} gradients differ"


def _special_rows(m: int, n: int, seed: int) -> torch.Tensor:
    """Random rows of several scales, then rows of special values: all -inf, one +inf, one NaN,
    values near 1e30 (exponentials that overflow without the shift), one finite value among
    -infs, a large spread (exp underflows for half the row), NaN beside +inf."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(m, n, generator=g) * torch.logspace(-3, 2, m).unsqueeze(1)
    z[0] = float("-inf")
    z[1, n // 3] = float("inf")
    z[2, n - 1] = float("nan")
    z[3] = (1 + torch.randn(n, generator=g) * 1e-3) * 1e30
    z[4] = float("-inf")
    z[4, n // 2] = -5.0
    z[5, : n // 2] = 80.0
    z[5, n // 2 :] = -200.0
    z[6, 0] = float("nan")
    z[6, 1] = float("inf")
    return z.to(CUDA)


REDUCTIONS = {
    "min": torch.amin,
    "max": torch.amax,
    "sum": torch.sum,
    "mean": torch.mean,
    "logsumexp": torch.logsumexp,
}


# 129 and 130 channels leave the last tile one column (no window of 4 at all), 300 a partial
# tile, 4096 thirty-two tiles; 7 rows take a warp a row, 40 and 130 two threads a row.
@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("m,n", [(40, 300), (130, 1024), (7, 4096), (33, 129), (9, 130)])
def test_reductions_of_rows_with_special_values(op, pool, m, n):
    z = _special_rows(m, n, seed=m + n + pool)
    epilogue = Epilogue(reduce=Reduction(op, pool=pool))
    with torch.no_grad():
        poison_allocator(4 * m, CUDA)
        got, path = fused_epilogue_with_path(z, epilogue)
        pooled = F.max_pool1d(z.unsqueeze(1), pool).squeeze(1) if pool > 1 else z
        eager = REDUCTIONS[op](pooled, dim=1)
        exact = REDUCTIONS[op](pooled.double(), dim=1)
    assert path == "epilogue" and got.shape == eager.shape == (m,)
    if op in ("min", "max"):  # no rounding anywhere: eager's values to the bit
        assert torch.equal(got.isnan(), eager.isnan())
        assert torch.equal(got[~got.isnan()], eager[~eager.isnan()])
        return
    assert torch.equal(got.isnan(), eager.isnan())
    assert torch.equal(got.isinf(), eager.isinf())
    assert torch.equal(got[got.isinf()], eager[eager.isinf()])
    finite = got.isfinite()
    err = (got[finite].double() - exact[finite]).abs()
    err_eager = (eager[finite].double() - exact[finite]).abs()
    # row by row: within eager's own error, or 2 float32 ulps of the result (with the ulp of
    # 1e-30 as the least, where a row's result is about 0)
    ulp = torch.finfo(torch.float32).eps * exact[finite].abs().clamp_min(1e-30)
    assert (err <= torch.maximum(2 * ulp, err_eager)).all(), (err - err_eager).max()
