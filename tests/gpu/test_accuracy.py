"""Hard data for the split-fp16 GEMM: huge dynamic range, extreme rows, zero-variance groups.

Bar (issue 3): on each data set, max abs error against float64 within 2x eager fp32's own, and
never NaN where eager gives a number.
"""

from __future__ import annotations

import pytest
import torch

from helpers import max_abs_err, run_both, small_pair

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
M, K, N, GROUPS = 256, 1024, 1024, 64  # group size 16 (a tile's groups); kernels forced


def ten_decades(g):
    return torch.randn(M, K, generator=g) * 10 ** (torch.rand(M, K, generator=g) * 10 - 5)


def extreme_rows(g):
    x = torch.rand(M, K, generator=g)
    x[0] = 0.0  # a row of zeros
    x[1] *= 6.0e4  # near fp16's largest finite value
    x[2] *= 1.0e-7  # near fp16's smallest subnormal
    x[3, ::2] = 6.0e4  # both ends inside one row
    x[3, 1::2] = 1.0e-7
    return x


DATA = {"ten_decades": ten_decades, "extreme_rows": extreme_rows}


def shape_weight(model):
    """Weight rows scaled by 1e-6 and 1e4, a zero row, and one group of identical rows (and
    identical biases), so that group's outputs are equal: variance 0, only eps remains."""
    w, b = model.fc.weight, model.fc.bias
    with torch.no_grad():
        w[:16] *= 1e-6
        w[16:32] *= 1e4
        w[32] = 0.0
        w[48:64] = w[48]
        b[48:64] = b[48]


@pytest.mark.parametrize("kernel", ["hopper", "portable", "epilogue"])
@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("seed", [0, 1])
def test_hard_data(kernel, data, seed):
    if kernel == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    ref, new = small_pair(62, seed=seed, init=(K, N, GROUPS))
    for model in (ref, new):
        shape_weight(model)
    torch.testing.assert_close(new.fc.weight, ref.fc.weight, rtol=0, atol=0)
    ref, new = ref.to(CUDA), new.to(CUDA)
    new.kernel = kernel
    g = torch.Generator().manual_seed(seed)
    x = DATA[data](g).to(CUDA)
    expect, exact, got = run_both(ref, new, x)
    assert new.last_path == ("epilogue" if kernel == "epilogue" else "fused")
    assert not (got.isnan() & ~expect.isnan()).any(), "NaN where eager gives a number"
    err, err_eager = max_abs_err(got, exact), max_abs_err(expect, exact)
    at = divmod(int((got.double() - exact).abs().argmax()), N)
    assert err <= 2 * err_eager, (
        f"gemmfuse {err:.3e} vs eager {err_eager:.3e}; worst at {at}: gemmfuse "
        f"{got[at].item():.6e}, eager {expect[at].item():.6e}, float64 {exact[at].item():.6e}"
    )
    # the zero-variance group: its GroupNorm output is the affine bias alone, in both
    torch.testing.assert_close(got[:, 48:64], expect[:, 48:64], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["hopper", "portable"])
def test_identical_weight_rows_give_identical_columns(kernel):
    """GroupNorm of a group whose channels are equal is exactly its bias; that holds only if
    the GEMM computes identical weight rows to bitwise identical output columns."""
    if kernel == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    from gemmfuse import Epilogue, fused_linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g)
    w[64:128] = w[64]
    x = (torch.rand(200, 1024, generator=g) * 6e4).to(CUDA)
    y = fused_linear(x, w.to(CUDA), None, Epilogue(), kernel=kernel)
    spread = (y[:, 64:128] - y[:, 64:65]).abs().max().item()
    assert spread == 0.0, f"identical rows differ by up to {spread:.3e}"
