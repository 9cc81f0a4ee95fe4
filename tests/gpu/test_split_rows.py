"""The fp32 operand split (csrc/operands/split_rows.cuh): x [rows, k] -> fp16 hi, lo
[rows, k_padded] and a power-of-two inverse scale per row. Two kernels serve it: the row held in
registers (16-byte loads: x 16-byte aligned, k and the row stride multiples of 4, k_padded at
most 8192) and the general one. Each is held to the split's definition, computed here in
float64 and PyTorch's own roundings (the row's largest magnitude scaled into [2^14, 2^15), hi its
fp16 rounding, lo the rest's, padding zero), to the bit, on fresh random data of many
magnitudes with zero, NaN, inf and tiny rows (subnormals, and a row whose inverse scale
underflows to 0), the outputs' memory NaN-poisoned first; and the two kernels agree to the bit.
"""

import pytest
import torch

from gemmfuse.bench import poison_allocator
from gemmfuse.build import arch_flags
from gemmfuse.jit import host_extension

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# (rows, k, k_padded): the register kernel's 1, 2, 4 and 8 words a thread (k_padded 1024, 2048,
# 4096, 8192; 64 and 1088 round up), and past it (8256); k not a multiple of 64 (padding)
SHAPES = [(7, 64, 64), (33, 1000, 1024), (300, 1088, 1088), (129, 2048, 2048),
          (64, 4000, 4096), (1024, 8192, 8192), (16, 8200, 8256)]  # fmt: skip


def reference_split(x: torch.Tensor, k_padded: int):
    """(hi, lo, inv_scale) by the split's definition."""
    rows, k = x.shape
    top = x.abs().amax(dim=1)
    _, exponent = torch.frexp(top)
    e = torch.where((top > 0) & torch.isfinite(top), 15 - exponent, torch.zeros_like(exponent))
    # 2^e and 2^-e exactly, in float64 on the host (|e| stays far below 1023)
    up = torch.tensor([2.0**v for v in e.tolist()], dtype=torch.float64, device=x.device)
    down = torch.tensor([2.0**-v for v in e.tolist()], dtype=torch.float64, device=x.device)
    scaled = (x.double() * up[:, None]).float()  # exact, then rounded once
    hi = scaled.half()
    lo = (scaled - hi.float()).half()
    pad = torch.zeros(rows, k_padded - k, dtype=torch.half, device=x.device)
    inv_scale = down.float()  # 0 where 2^-e is below float's subnormals
    return torch.cat([hi, pad], 1), torch.cat([lo, pad], 1), inv_scale


def fresh_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10 ** (torch.rand(rows, 1, generator=g) * 60 - 30)  # a scale per row
    x = torch.randn(rows, k, generator=g) * magnitude
    x *= 10 ** (torch.rand(rows, k, generator=g) * 6 - 3)  # and spread within it
    # a zero row, a NaN, an inf, a row of subnormals, and one whose largest magnitude is about
    # 1e-42 (e >= 150: its inverse scale underflows to 0)
    for row, value in ((1, 0.0), (2, float("nan")), (3, float("inf"))):
        if row < rows:
            x[row, row % k] = value
            x[row] *= 0.0 if value == 0.0 else 1.0
    if rows > 4:
        x[4] = torch.randn(k, generator=g) * 1e-39
    if rows > 6:
        x[6] = torch.randn(k, generator=g) * 1e-43
    if rows > 5:
        x[5, k // 2] = float("-inf")
    return x.to(CUDA)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.float16 else t.view(torch.int32)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, but a NaN's, which need only be NaN in both (its payload is the
    conversion's: the kernel's cvt and PyTorch's differ)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def misaligned_copy(x: torch.Tensor) -> torch.Tensor:
    """x's values at an address 4 bytes past 16-byte alignment: the general kernel's input."""
    buffer = torch.empty(x.numel() + 1, device=x.device)
    view = buffer[1:].view_as(x)
    view.copy_(x)
    assert view.data_ptr() % 16 == 4
    return view


@pytest.mark.parametrize("shape", SHAPES)
def test_split_rows_is_its_definition(shape):
    rows, k, k_padded = shape
    host = host_extension(arch_flags())
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    x = fresh_rows(rows, k, seed)
    want = reference_split(x, k_padded)
    poison_allocator(4 * rows * k_padded, CUDA)
    aligned = host.split_rows(x, k_padded)
    poison_allocator(4 * rows * k_padded, CUDA)
    misaligned = host.split_rows(misaligned_copy(x), k_padded)
    for part, a, b, c in zip(("hi", "lo", "inv_scale"), aligned, misaligned, want, strict=True):
        assert same_values(a, c), f"{part} differs from the definition (seed {seed})"
        assert torch.equal(bits(a), bits(b)), f"the two kernels' {part} differ (seed {seed})"


def test_split_rows_strided_rows():
    """Rows 4 floats apart beyond k (the register kernel) and an odd row stride (the general)."""
    host = host_extension(arch_flags())
    x = fresh_rows(40, 1500, int(torch.randint(0, 2**31 - 1, ()).item()))
    for extra in (4, 3):
        wide = torch.full((40, 1500 + extra), float("nan"), device=CUDA)
        wide[:, :1500] = x
        poison_allocator(4 * 40 * 1536, CUDA)
        got = host.split_rows(wide[:, :1500], 1536)
        for a, b in zip(got, reference_split(x, 1536), strict=True):
            assert same_values(a, b)
