"""The chain backward kernel (csrc/backward/chain_backward.cuh) against PyTorch's autograd, given z.

Its inputs are the saved GEMM result z and the output's gradient; its outputs dz and the
gradients of the GroupNorm affine and the chain's tensor arguments. The oracle is float64
autograd through the reference chain (gemmfuse.reference) from the same z; the bar is PyTorch's
own float32 backward of that chain (``autograd.chain_backward``, what ran before the kernel), on
the GPU and on the CPU (two summation orders, two draws of fp32's error): each gradient's
relative L2 error at most twice the larger of theirs plus 4 fp32 ulps, and no more elements
outside allclose(1e-4) of float64 than the GPU's. A gradient that is zero but for float64's
rounding (a scalar multiplier after a GroupNorm whose groups a mean sums) has noise only: max
abs error within 1e-4 or twice PyTorch's, as tests/gpu/test_autograd.py holds such gradients.
bfloat16 and float16 models: at most 1.5x eager's error in that dtype.

Why twice: both sum the same fp32 terms in different orders, so on a sum that cancels their
errors are two draws of one distribution. Measured at da6a7ca (the bar was 1x then): a scalar
tensor argument's gradient at M = 7, N = 48 (336 terms cancelling to 1e-2 of their scale) came
out at 1.02e-2 relative error against PyTorch's 7.8e-3; every other gradient was within 1x.
Why the CPU too (from commit 921756e; the GPU's alone before): pool chain 5's add[t] gradient
(M = 130, N = 600) came out at 5.41e-6 against the GPU PyTorch's 2.42e-6 (bar 5.3e-6) once the
kernel's scalar sums were compensated; the zero clause came with a mul[t] after a GroupNorm and a
mean at N = 2560 (kernel 3.8e8, GPU PyTorch 1.6e8 relative to float64's rounding of zero).
"""

import pytest
import torch

from gemmfuse.autograd import (
    _kernel_backward_fits,
    _kernel_chain_backward,
    chain_backward,
    kernel_plan,
)
from gemmfuse.chains import chain_pool, layer_norm_chain, value_chain_pool, value_chains
from gemmfuse.epilogue import Epilogue
from gemmfuse.kernelbench.models import epilogue_62, epilogue_75
from gemmfuse.reference import apply_epilogue
from helpers import max_abs_err, off_allclose, rel_err

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
POOL = chain_pool()
VALUE_POOL = value_chain_pool()
EPS = torch.finfo(torch.float32).eps


def exact_grads(chain, z, grad, tensors):
    """float64 autograd from z: dz, then the gradient of each tensor (None where absent)."""
    leaves = [None if t is None else t.double().requires_grad_() for t in tensors]
    zz = z.double().requires_grad_()
    gn_w, gn_b, *params = leaves
    out = apply_epilogue(zz, chain, gn_w, gn_b, params)
    wanted = [zz] + [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(out, wanted, grad.double(), allow_unused=True))
    dz = next(got)
    return dz, [None if t is None else next(got) for t in leaves]


def draw(spec, m, n, groups, seed):
    """(chain without tail, z, grad, tensors) on the GPU, fresh random data."""
    gen = torch.Generator().manual_seed(seed)
    epilogue, params = spec.instantiate(gen, n, groups, 1e-5)
    chain = Epilogue(epilogue.pre, epilogue.norm, epilogue.post, epilogue.reduce)
    z = (torch.randn(m, n, generator=gen) * 0.5 + 0.1 * torch.randn(n, generator=gen)).to(CUDA)
    affine = epilogue.norm is not None and epilogue.norm.affine
    gn = [(1 + 0.1 * torch.randn(n, generator=gen)).to(CUDA) if affine else None,
          (0.1 * torch.randn(n, generator=gen)).to(CUDA) if affine else None]  # fmt: skip
    params = [p.to(CUDA) for p in params]
    out_shape = (m, n) if chain.reduce is None else (m, 1) if chain.reduce.keepdim else (m,)
    grad = torch.randn(out_shape, generator=gen).to(CUDA)
    return chain, z, grad, [*gn, *params]


def check(chain, z, grad, tensors, label):
    needs = [t is not None for t in tensors]
    assert _kernel_backward_fits(chain, z, grad), label
    dz, grads, db = _kernel_chain_backward(chain, z, grad, tensors, needs)
    dz32, grads32 = chain_backward(chain, z, grad, tensors, needs)
    cpu = [None if t is None else t.cpu() for t in tensors]
    dz_cpu, grads_cpu = chain_backward(chain, z.cpu(), grad.cpu(), cpu, needs)
    exact_dz, exact = exact_grads(chain, z, grad, tensors)
    pairs = [("dz", dz, (dz32, dz_cpu), exact_dz),
             ("db", db, (dz32.sum(0), dz_cpu.sum(0)), exact_dz.sum(0))]  # fmt: skip
    for i, (g, g32, gc, e) in enumerate(zip(grads, grads32, grads_cpu, exact, strict=True)):
        if e is not None:
            pairs.append((f"tensor {i}", g, (g32, gc), e))
    for name, got, refs32, e in pairs:
        assert got.shape == e.shape and got.dtype == z.dtype, f"{label}: {name} {got.shape}"
        if e.norm() <= 1e-12 * grad.norm():  # zero but for float64's rounding: noise only
            noise = max(max_abs_err(r, e.to(r.device)) for r in refs32)
            line = f"{label}: {name}: zero, kernel {max_abs_err(got, e):.3e}, PyTorch {noise:.3e}"
            assert max_abs_err(got, e) <= max(2 * noise, 1e-4), line
            continue
        err = rel_err(got, e)
        err32 = max(rel_err(r, e.to(r.device)) for r in refs32)
        line = f"{label}: {name}: kernel {err:.3e}, PyTorch fp32 {err32:.3e}"
        assert err <= 2 * err32 + 4 * EPS, line
        assert off_allclose(got, e) <= off_allclose(refs32[0], e), line


def declined(chain, z, grad, group_size, label) -> bool:
    """Whether the chain has a max pooling before its reduction, which the kernel does not
    differentiate: then its rules and its plan (row_blocks 0) must both decline the chain, whose
    backward is PyTorch's (test_autograd.py's random-chain gradients check it end to end)."""
    if chain.reduce is None or chain.reduce.pool == 1:
        return False
    assert not _kernel_backward_fits(chain, z, grad), label
    assert kernel_plan(chain.structure, *z.shape, group_size, CUDA)[1] == 0, label
    return True


@pytest.mark.parametrize("index", range(len(POOL)))
def test_every_pool_chain(index):
    """Every pointwise op and every reduction of the grammar (the pool covers them; its
    kernels are the ones the other GPU tests build)."""
    spec = POOL[index]
    for m, n, groups, seed in ((7, 48, 3, index), (130, 600, 6, 100 + index)):
        groups = groups if spec.norm else 1
        chain, z, grad, tensors = draw(spec, m, n, groups, seed)
        label = f"{spec.describe()} m={m} n={n}"
        if not declined(chain, z, grad, n // groups if spec.norm else 1, label):
            check(chain, z, grad, tensors, label)


# (N, groups with a GroupNorm, the plan without logsumexp: slabs, in registers)
LAYOUTS = {"registers": (4096, 64, [4, 1]), "shared memory": (2560, 10, [2, 0])}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(len(POOL)))
def test_every_pool_chain_in_column_slabs(index, layout):
    """Rows cut into group-aligned column slabs, by both kernels: the register kernel (groups of
    64 here) and the shared-memory one (groups of 256), logsumexp in one slab in shared memory;
    min/max merge their slabs' extremes from a first phase."""
    spec = POOL[index]
    n, groups, plan = LAYOUTS[layout]
    m, groups = 37, (groups if spec.norm else 1)
    chain, z, grad, tensors = draw(spec, m, n, groups, 200 + index)
    if chain.reduce is not None and chain.reduce.op == "logsumexp":
        plan = [1, 0]
    group_size = n // groups if spec.norm else 1
    label = f"{spec.describe()} m={m} n={n} ({layout})"
    if declined(chain, z, grad, group_size, label):
        return
    assert kernel_plan(chain.structure, m, n, group_size, CUDA)[::2] == plan
    check(chain, z, grad, tensors, label)


def chain_62(groups):
    """#62's chain (GroupNorm, LeakyReLU, x + x) and its affine vectors for N channels."""
    return epilogue_62(groups, 1e-5, True, 0.2)


def affine(n, g):
    return [(1 + 0.1 * torch.randn(n, generator=g)).to(CUDA),
            (0.1 * torch.randn(n, generator=g)).to(CUDA)]  # fmt: skip


@pytest.mark.parametrize("group_size", [1, 3, 16, 100, 128, 1000, 4096])
def test_group_sizes(group_size):
    """Groups narrower and wider than a thread's run of columns (backward_segment)."""
    n = group_size * (4 if group_size <= 1000 else 2)
    g = torch.Generator().manual_seed(group_size)
    z = (torch.randn(33, n, generator=g) * 3 + 5).to(CUDA)  # an offset against the spread
    grad = torch.randn(33, n, generator=g).to(CUDA)
    check(chain_62(n // group_size), z, grad, affine(n, g), f"group_size={group_size}")


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine_norm", [True, False])
@pytest.mark.parametrize("m, n", [(7, 48), (130, 600), (16, 2048), (37, 4096)])
def test_row_norms(m, n, affine_norm, rms):
    """A LayerNorm or RMSNorm over all the channels (chains.layer_norm_chain), z offset from
    zero against its spread (an RMSNorm's mean square holds the mean). Both structures in one
    process at the same shared-memory size: each kernel gets its own limit raised (found with
    4096 channels: the second chain's launch failed). At 8192 channels an affine row norm's
    working set exceeds a block's shared memory and PyTorch's backward runs
    (tests/gpu/test_autograd.py's test_row_norm_gradients takes that size)."""
    g = torch.Generator().manual_seed(m + n + 2 * rms + affine_norm)
    chain = layer_norm_chain(affine_norm, rms=rms)
    z = (torch.randn(m, n, generator=g) * 2 + 3).to(CUDA)
    grad = torch.randn(m, n, generator=g).to(CUDA)
    gn = affine(n, g) if affine_norm else [None, None]
    scale = (0.5 + torch.rand(n, generator=g)).to(CUDA)
    check(chain, z, grad, [*gn, scale], f"rms={rms} affine={affine_norm} m={m} n={n}")


def test_ties_split_the_gradient_as_amin_does():
    """Equal values at a row's min share its gradient evenly (torch.amin): #75's chain with ten
    channels whose GroupNorm output is exactly their bias, the row's lowest value."""
    full = epilogue_75(8, 1e-5, True)
    chain = Epilogue(norm=full.norm, reduce=full.reduce)  # the tail runs outside the kernel
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 256, generator=g).to(CUDA)
    grad = torch.randn(64, 1, generator=g).to(CUDA)
    gn_w, gn_b = affine(256, g)
    gn_w[10:20], gn_b[10:20] = 0.0, -50.0
    dz, grads, _ = _kernel_chain_backward(chain, z, grad, [gn_w, gn_b], [True, True])
    exact_dz, exact = exact_grads(chain, z, grad, [gn_w, gn_b])
    torch.testing.assert_close(dz.double(), exact_dz, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[1].double(), exact[1], rtol=1e-6, atol=1e-7)
    assert (grads[1][10:20] != 0).all()  # each of the ten got a share


@pytest.mark.parametrize("groups, in_registers", [(64, 1), (16, 0)])
def test_ties_across_slabs(groups, in_registers):
    """Ties in different column slabs share the gradient: #75's chain on 4096 channels (four
    slabs), the row's lowest value in channels 10..14 and 4000..4004, by both kernels."""
    full = epilogue_75(groups, 1e-5, True)
    chain = Epilogue(norm=full.norm, reduce=full.reduce)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(16, 4096, generator=g).to(CUDA)
    grad = torch.randn(16, 1, generator=g).to(CUDA)  # keepdim
    gn_w, gn_b = affine(4096, g)
    for lo in (10, 4000):
        gn_w[lo : lo + 5], gn_b[lo : lo + 5] = 0.0, -50.0
    assert kernel_plan(chain.structure, 16, 4096, 4096 // groups, CUDA)[::2] == [4, in_registers]
    dz, grads, _ = _kernel_chain_backward(chain, z, grad, [gn_w, gn_b], [True, True])
    exact_dz, exact = exact_grads(chain, z, grad, [gn_w, gn_b])
    torch.testing.assert_close(dz.double(), exact_dz, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[1].double(), exact[1], rtol=1e-6, atol=1e-7)
    assert (grads[1][10:15] != 0).all() and (grads[1][4000:4005] != 0).all()


def test_unaligned_z():
    """A view of z that starts 4 bytes into its storage (the register kernel reads 16 bytes at
    once: the binding copies it)."""
    g = torch.Generator().manual_seed(5)
    storage = torch.randn(8 * 1024 + 1, generator=g).to(CUDA)
    z = storage[1:].view(8, 1024)
    grad = torch.randn(8, 1024, generator=g).to(CUDA)
    assert kernel_plan(chain_62(64).structure, 8, 1024, 16, CUDA)[2] == 1
    check(chain_62(64), z, grad, affine(1024, g), "unaligned z")


def test_strided_gradient():
    """The gradient of out.sum() is an expanded tensor (strides 0): read through its strides."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(50, 64, generator=g).to(CUDA)
    grad = torch.ones((), device=CUDA).expand(50, 64)
    check(chain_62(4), z, grad, affine(64, g), "expanded grad")
    wide = torch.randn(64, 50, generator=g).to(CUDA)
    check(chain_62(4), z, wide.t(), affine(64, g), "transposed grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_register_kernel_gradient_layouts(dtype):
    """The register kernel reads a row's four gradient values as one vector where the layout
    allows (unit column stride, rows and base aligned to four values) and one by one elsewhere:
    a gradient view starting one value in, rows 1026 values apart, and a transposed one give
    the contiguous gradient's result exactly."""
    g = torch.Generator().manual_seed(11)
    chain, m, n = chain_62(64), 8, 1024
    assert kernel_plan(chain.structure, m, n, 16, CUDA, dtype)[2] == 1
    z = torch.randn(m, n, generator=g).to(CUDA, dtype)
    grad = torch.randn(m, n, generator=g).to(CUDA, dtype)
    tensors = [t.to(dtype) for t in affine(n, g)]
    shifted = torch.empty(m * n + 1, device=CUDA, dtype=dtype)[1:].view(m, n)
    padded = torch.empty(m, n + 2, device=CUDA, dtype=dtype)[:, :n]
    transposed = torch.empty(n, m, device=CUDA, dtype=dtype).t()
    expect = _kernel_chain_backward(chain, z, grad, tensors, [True, True])
    for label, layout in (("shifted", shifted), ("padded", padded), ("transposed", transposed)):
        layout.copy_(grad)
        dz, grads, db = _kernel_chain_backward(chain, z, layout, tensors, [True, True])
        assert torch.equal(dz, expect[0]), label
        assert torch.equal(db, expect[2]), label
        for got, want in zip(grads, expect[1], strict=True):
            assert torch.equal(got, want), label
    if dtype == torch.float32:
        check(chain, z, padded, tensors, "padded gradient rows")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "groups", "in_registers"), [(512, 16, 0), (2048, 128, 1)])
def test_16bit_at_most_eager_error(n, groups, in_registers, dtype):
    """A bfloat16 or float16 model's chain: z, grad and dz in its dtype, the arithmetic in fp32
    (the register kernel's with plain sums, as eager's; the shared-memory kernel's compensated):
    no further from float64 than 1.5x eager's error in that dtype."""
    chain = chain_62(groups)
    assert kernel_plan(chain.structure, 256, n, n // groups, CUDA, dtype)[2] == in_registers
    g = torch.Generator().manual_seed(7)
    z16 = torch.randn(256, n, generator=g).to(CUDA, dtype)
    grad16 = torch.randn(256, n, generator=g).to(CUDA, dtype)
    t16 = [t.to(dtype) for t in affine(n, g)]
    dz, grads, _ = _kernel_chain_backward(chain, z16, grad16, t16, [True, True])
    eager_dz, eager = chain_backward(chain, z16, grad16, t16, [True, True])
    exact_dz, exact = exact_grads(chain, z16.float(), grad16.float(), [t.float() for t in t16])
    assert dz.dtype == dtype
    assert rel_err(dz, exact_dz) <= 1.5 * rel_err(eager_dz, exact_dz)
    for got, ge, e in zip(grads, eager, exact, strict=True):
        assert rel_err(got, e) <= 1.5 * rel_err(ge, e)


def test_slabs_too_wide_fall_back_to_pytorch():
    """A slab (here one group of 65536 channels) whose working set exceeds a block's shared
    memory is not sent to the kernel; 16 groups of that row fit, in slabs of one group."""
    z = torch.randn(2, 1 << 16, device=CUDA)
    assert not _kernel_backward_fits(chain_62(1), z, z)
    assert _kernel_backward_fits(chain_62(16), z, z)
    assert kernel_plan(chain_62(16).structure, 2, 1 << 16, 1 << 12, CUDA)[::2] == [16, 0]


@pytest.mark.parametrize("index", range(len(value_chains())))
def test_values_read_again(index):
    """Chains that read values again (chains.value_chains): the backward kernel gathers a
    value's later reads in a register and adds them where the walk back reaches it; a
    detached read sends nothing back."""
    for m, n, groups, seed in ((7, 48, 3, index), (130, 600, 6, 100 + index)):
        chain = value_chains(groups)[index]
        gen = torch.Generator().manual_seed(seed)
        z = (torch.randn(m, n, generator=gen) * 0.5).to(CUDA)
        affine = chain.norm is not None and chain.norm.affine
        gn = [(1 + 0.1 * torch.randn(n, generator=gen)).to(CUDA) if affine else None,
              (0.1 * torch.randn(n, generator=gen)).to(CUDA) if affine else None]  # fmt: skip
        params = [(0.5 + torch.rand(n, generator=gen)).to(CUDA) for _ in chain.channel_params]
        out_shape = (m, n) if chain.reduce is None else (m, 1)
        grad = torch.randn(out_shape, generator=gen).to(CUDA)
        check(chain, z, grad, [*gn, *params], f"value chain {index} m={m} n={n}")


@pytest.mark.parametrize("index", range(len(VALUE_POOL)))
def test_every_value_pool_chain(index):
    """Drawn graphs (chains.value_chain_pool), as test_every_pool_chain."""
    spec = VALUE_POOL[index]
    for m, n, groups, seed in ((7, 48, 3, index), (130, 600, 6, 100 + index)):
        groups = groups if spec.norm else 1
        chain, z, grad, tensors = draw(spec, m, n, groups, seed)
        check(chain, z, grad, tensors, f"{spec.describe()} m={m} n={n}")
