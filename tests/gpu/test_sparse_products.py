"""The sparse backward products (csrc/operands/sparse_products.cu) against float64 and PyTorch's
dense products, and the training steps that take them.

dx = dz @ W and dW = dz.T @ x where dz is zero but for a few groups of each row (a min or max
after a GroupNorm: dispatch.sparse_gradient). The oracle is float64's product of the same
(float32-, bf16- or fp16-valued) operands; the bar for float32 is the bound of a float sum of
the row's nonzero terms, (terms + 1) * eps / 2 * (|dz| @ |W|) elementwise, and a relative L2
error at most twice PyTorch's float32 product's plus 4 ulps; for a 16-bit dtype that bound plus
the one rounding to it (2^-8 of the value in bf16, 2^-11 in fp16 or 2^-25 among its
subnormals), and at most 1.5x eager's relative error in that dtype. Outputs
land in NaN-poisoned memory, so an element the kernels leave unwritten fails. Rows with no
nonzero entry, ties over several groups, a dense dz, a NaN, sizes that leave vector loads,
chunks and pieces partial, and views that are not contiguous.
"""

import pytest
import torch

from gemmfuse.bench import cuda_pair
from gemmfuse.build import arch_flags
from gemmfuse.jit import host_extension
from helpers import kernel_names, rel_err

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def host():
    return host_extension(arch_flags())


def poison(nbytes):
    """Leaves blocks in the caching allocator that read as NaN in float32, bfloat16 and float16
    alike (0x7FC07FC0: a float32 NaN whose two halves are bf16 and fp16 NaNs), so that an output
    element the kernels leave unwritten fails."""
    blocks = [
        torch.full((max(nbytes // 4, 1),), 0x7FC07FC0, dtype=torch.int32, device=CUDA)
        for _ in range(4)
    ]
    del blocks


def sparse_dz(m, n, group, dtype, seed, ties=0.1, empty=0.05):
    """dz [m, n]: each row nonzero in one random group of `group` columns, a `ties` share of
    rows in two or three groups, an `empty` share in none; values N(0, 1) (a few exact zeros
    inside a group do no harm)."""
    gen = torch.Generator().manual_seed(seed)
    groups = n // group
    mask = torch.zeros(m, groups, dtype=torch.bool)
    mask[torch.arange(m), torch.randint(groups, (m,), generator=gen)] = True
    for extra in range(2):
        tied = torch.rand(m, generator=gen) < ties / (extra + 1)
        mask[tied, torch.randint(groups, (int(tied.sum()),), generator=gen)] = True
    mask[torch.rand(m, generator=gen) < empty] = False
    values = torch.randn(m, n, generator=gen)
    dz = values * mask.repeat_interleave(group, dim=1)
    return dz.to(CUDA, dtype)


def operand(rows, cols, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(CUDA, dtype)


def check_product(got, a, b, dtype):
    """got against float64's a @ b: the float-sum bound elementwise, and PyTorch's own product's
    error in dtype (relative L2) as a second bar."""
    exact = a.double() @ b.double()
    terms = int((a != 0).sum(1).max()) + 1
    bound = (terms + 1) * EPS / 2 * (a.double().abs() @ b.double().abs())
    if dtype != torch.float32:  # the one rounding to the 16-bit dtype (fp16: subnormals below
        # 2^-14 round to a multiple of 2^-24, an absolute error of up to 2^-25)
        rounding = (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11) * exact.abs()
        if dtype == torch.float16:
            rounding = rounding.clamp(min=2.0**-25)
        bound = bound + rounding
    err = (got.double() - exact).abs()
    assert torch.isfinite(got).all(), "an element left unwritten (NaN poison) or overflowed"
    assert (err <= bound + 1e-30).all(), f"max excess {float((err - bound).max()):.3e}"
    # the same terms summed in another order than PyTorch's: two draws of one error, so twice
    # the larger plus 4 ulps (tests/gpu/test_chain_backward.py's bar); 16-bit: 1.5x eager's
    eager = rel_err(a @ b, exact)
    if dtype == torch.float32:
        assert rel_err(got, exact) <= 2 * eager + 4 * EPS
    else:
        assert rel_err(got, exact) <= 1.5 * eager


SHAPES = [
    # m, n, k, group: #75's groups at a small size; pieces of dz rows (n > 2048) and of dz rows'
    # blocks (m > 256); K chunks partial (k not a multiple of 2048 / 512); sizes that leave the
    # vector loads (odd n and k)
    (64, 512, 256, 16),
    (300, 4096 + 64, 2048 + 40, 16),
    (513, 1024, 1030, 8),
    (37, 203, 77, 7),
    (5, 96, 3, 32),
    (8, 64, 8192 + 16, 16),  # few rows and strips: blocks split K between them
    (1024, 8192, 8192, 16),  # #75's shape
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k, group", SHAPES)
def test_products_match_float64_and_pytorch(host, m, n, k, group, dtype):
    dz = sparse_dz(m, n, group, dtype, seed=m + n + k)
    w = operand(n, k, dtype, seed=1)
    x = operand(m, k, dtype, seed=2)
    poison((m + n) * k * 4)
    dx, dw = host.sparse_products(dz, w, x, True, True)
    assert dx.shape == (m, k) and dw.shape == (n, k) and dx.dtype == dw.dtype == dtype
    check_product(dx, dz, w, dtype)
    check_product(dw, dz.t(), x, dtype)
    # rows of dz with no nonzero entry give exact zeros, as a dense product does
    empty = (dz == 0).all(1)
    assert (dx[empty] == 0).all()
    # the same bits on a second run (every sum in a fixed order), and each product alone
    dx_alone, none = host.sparse_products(dz, w, x, True, False)
    assert torch.equal(dx_alone, dx) and none is None
    none, dw_alone = host.sparse_products(dz, w, x, False, True)
    assert torch.equal(dw_alone, dw) and none is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n", [(70, 300), (600, 2100)])
def test_a_dense_dz_is_still_a_correct_product(host, m, n, dtype):
    """Every entry nonzero (ties everywhere): slow for these kernels, but the same product. At
    600 x 2100 a row's entries (2100 > 2048) outgrow dx's list in shared memory, which is then
    made again a piece at a time, and dW stages a strip's 600 rows in three batches."""
    dz, w, x = operand(m, n, dtype, 3), operand(n, 90, dtype, 4), operand(m, 90, dtype, 5)
    poison((m + n) * 90 * 4)
    dx, dw = host.sparse_products(dz, w, x, True, True)
    check_product(dx, dz, w, dtype)
    check_product(dw, dz.t(), x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dx_rows_of_one_strip_or_several_get_the_same_sums(host, dtype):
    """A row of dz with nonzero entries in one 16-column strip is summed by a strip item, a row
    with entries in several by a row item: both add the entries in column order, so a row that
    repeats another's strip and adds an entry whose row of W is zero (adding exactly nothing)
    gets the same bits."""
    m, n, k = 64, 256, 300
    gen = torch.Generator().manual_seed(12)
    dz = torch.zeros(m, n)
    for r in range(0, m, 2):
        strip = int(torch.randint(n // 16 - 1, (), generator=gen))
        dz[r, 16 * strip : 16 * strip + 16] = torch.randn(16, generator=gen)
        dz[r + 1] = dz[r]
        dz[r + 1, n - 1] = 1.0  # in the last strip, which the others never use
    w = torch.randn(n, k, generator=gen)
    w[n - 1] = 0.0
    dz, w = dz.to(CUDA, dtype), w.to(CUDA, dtype)
    dx, _ = host.sparse_products(dz, w, operand(m, k, dtype, 13), True, False)
    assert torch.equal(dx[0::2], dx[1::2])
    check_product(dx, dz, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_strip_holding_many_rows(host, dtype):
    """Most rows' extremes in one strip (#75 holds 212 of its 1024 rows in one): dx's strip
    items take them in batches of 16 rows; dW's items for a strip of more than 32 rows share
    them among their warps, staged in two batches here (300 rows > 256), K's last 64-column
    chunk partial (700 = 10 * 64 + 60); a few rows tie into a second strip (row items), a few
    are empty. The same bits on a second run (the warps' sums are added in a fixed order)."""
    m, n, k = 300, 512, 700
    gen = torch.Generator().manual_seed(14)
    dz = torch.zeros(m, n)
    dz[:, 32:48] = torch.randn(m, 16, generator=gen)  # strip 2
    dz[::7, 200:216] = torch.randn(len(range(0, m, 7)), 16, generator=gen)  # ties in strip 12
    dz[5::50] = 0.0  # empty rows
    dz, w, x = dz.to(CUDA, dtype), operand(n, k, dtype, 15), operand(m, k, dtype, 16)
    poison((m + n) * k * 4)
    dx, dw = host.sparse_products(dz, w, x, True, True)
    check_product(dx, dz, w, dtype)
    check_product(dw, dz.t(), x, dtype)
    assert (dx[5::50] == 0).all() and (dw[:32] == 0).all()
    again = host.sparse_products(dz, w, x, True, True)
    assert torch.equal(again[0], dx) and torch.equal(again[1], dw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_all_zero_dz_gives_zeros(host, dtype):
    """No strip has rows: dW is written by the idle strips' zero items alone (16-byte stores
    where K allows them, element stores where it does not), dx by the empty-row items; the
    outputs land in NaN-poisoned memory."""
    for m, n, k in ((64, 512, 4096), (33, 200, 77)):
        dz = torch.zeros(m, n, device=CUDA, dtype=dtype)
        w, x = operand(n, k, dtype, 19), operand(m, k, dtype, 20)
        poison((m + n) * k * 4)
        dx, dw = host.sparse_products(dz, w, x, True, True)
        assert (dx == 0).all() and (dw == 0).all()


def test_empty_sizes_and_nothing_asked(host):
    w, x = operand(8, 5, torch.float32, 17), operand(4, 5, torch.float32, 18)
    assert host.sparse_products(torch.zeros(4, 8, device=CUDA), w, x, False, False) == [None, None]
    dx, dw = host.sparse_products(torch.zeros(0, 8, device=CUDA), w, x[:0], True, True)
    assert dx.shape == (0, 5) and dw.shape == (8, 5) and (dw == 0).all()
    dx, dw = host.sparse_products(torch.zeros(4, 0, device=CUDA), w[:0], x, True, True)
    assert dx.shape == (4, 5) and (dx == 0).all() and dw.shape == (0, 5)


def test_a_nan_in_dz_reaches_its_row_and_column():
    host = host_extension(arch_flags())
    dz = sparse_dz(40, 256, 16, torch.float32, seed=6)
    dz[3, 17] = float("nan")
    w, x = operand(256, 50, torch.float32, 7), operand(40, 50, torch.float32, 8)
    dx, dw = host.sparse_products(dz, w, x, True, True)
    assert dx[3].isnan().all() and dw[17].isnan().all()
    assert not dx[torch.arange(40) != 3].isnan().any()
    assert not dw[torch.arange(256) != 17].isnan().any()


def test_views_that_are_not_contiguous(host):
    dz = sparse_dz(96, 128, 16, torch.float32, seed=9)
    w_t = operand(64, 128, torch.float32, 10).t()  # [128, 64], transposed
    x_t = operand(64, 96, torch.float32, 11).t()  # [96, 64]
    dx, dw = host.sparse_products(dz.t().contiguous().t(), w_t, x_t, True, True)
    check_product(dx, dz, w_t, torch.float32)
    check_product(dw, dz.t(), x_t, torch.float32)


def zeros(*shape, device=CUDA, dtype=torch.float32):
    return torch.zeros(shape, device=device, dtype=dtype)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (zeros(4, 8), zeros(8, 3, dtype=torch.float64), zeros(4, 3)),
         "float32, bfloat16 or float16 tensors of one dtype"),
        (lambda: (zeros(4, 8), zeros(9, 3), zeros(4, 3)), r"weight must be \[8, K\]"),
        (lambda: (zeros(4, 8), zeros(8, 3), zeros(5, 3)), r"x \[4, K\]"),
        (lambda: (zeros(4, 8, device="cpu"), zeros(8, 3, device="cpu"), zeros(4, 3, device="cpu")),
         "2-D CUDA tensors"),
        (lambda: (zeros(4), zeros(4, 3), zeros(4, 3)), "2-D CUDA tensors"),
    ],
)  # fmt: skip
def test_bad_operands_raise(host, make, message):
    with pytest.raises(RuntimeError, match=message):
        host.sparse_products(*make(), True, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_75_training_step_takes_the_sparse_products(dtype):
    """KernelBench #75 (GroupNorm of 16 channels, then min) as the benchmark trains it: each
    step's backward runs the sparse kernels, the first (decided in Python) and the later ones
    (run by the call's plan where it serves; tests/gpu/test_plan.py holds the two equal).
    Gradient values at this size: tests/gpu/test_autograd.py's full-size cases."""
    _, module, _, new = cuda_pair(75)
    new = new.to(dtype)
    x = module.get_inputs()[0].to(CUDA, dtype).requires_grad_()
    grad = torch.randn_like(new(x))

    def step():
        for p in new.parameters():
            p.grad = None
        new(x).backward(grad)

    # the first call is decided in Python (and keeps a plan); the later ones run the plan
    for _ in range(3):
        names = kernel_names(step)
        assert any("sparse_rows_kernel" in n for n in names), names
        assert any("sparse_products_kernel" in n for n in names), names
        assert all(p.grad is not None and p.grad.isfinite().all() for p in new.parameters())
