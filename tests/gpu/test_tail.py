"""The tail's outer-broadcast kernel (tail.py, csrc/operands/outer_binary.cu) against PyTorch's
broadcasting op: values and both gradients bit for bit, both layouts, inner lengths with and
without its 16-byte stores; 16-bit and mixed dtypes stay PyTorch's."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from gemmfuse.dispatch import OUTER_OPS
from gemmfuse.epilogue import Epilogue, Param, Pointwise
from gemmfuse.kernelbench.models import epilogue_75
from gemmfuse.pointwise import POINTWISE
from gemmfuse.tail import _outer, apply_tail
from helpers import poison_allocator

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# #75's structure (tail ops are not part of a structure): a chain library the suite builds anyway
CHAIN = epilogue_75(8, 1e-5, True)
LAYOUTS = {
    "75": ((1024, 1), (1, 4096, 1, 1)),  # (1, C, M, 1): the value inner
    "75-odd": ((1001, 1), (1, 300, 1, 1)),  # inner length off the 16-byte stores
    "rows": ((1024, 1), (4096,)),  # (M, C): the operand inner
    "rows-odd": ((999, 1), (257,)),
}


def _tensors(value_shape, operand_shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(value_shape, generator=g) * 3
    sign = torch.where(torch.rand(operand_shape, generator=g) < 0.5, -1.0, 1.0)
    a = (torch.rand(operand_shape, generator=g) + 0.5) * sign  # away from 0: div
    grad_seed = torch.Generator().manual_seed(seed + 1)
    shape = torch.broadcast_shapes(value_shape, operand_shape)
    grad = torch.randn(shape, generator=grad_seed)
    return [t.to(CUDA, dtype) for t in (v, a, grad)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", OUTER_OPS)
def test_kernel_is_pytorch_bit_for_bit(name, layout):
    v, a, grad = _tensors(*LAYOUTS[layout], torch.float32, OUTER_OPS.index(name))
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=(Pointwise(name, (Param(0),)),))
    leaves = [v.clone().requires_grad_(), a.clone().requires_grad_()]
    poison_allocator(4 * grad.numel(), CUDA)
    ours = _outer(epilogue, name, *leaves[:1], leaves[1:])
    assert ours is not None  # the kernel ran
    ours_grads = torch.autograd.grad(ours, leaves, grad)
    eager_leaves = [v.clone().requires_grad_(), a.clone().requires_grad_()]
    eager = POINTWISE[name].torch(*eager_leaves)
    eager_grads = torch.autograd.grad(eager, eager_leaves, grad)
    assert ours.shape == eager.shape and ours.dtype == eager.dtype
    assert torch.equal(ours, eager)
    for got, want in zip(ours_grads, eager_grads, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    with torch.no_grad():
        poison_allocator(4 * grad.numel(), CUDA)
        assert torch.equal(apply_tail(v, epilogue, [a]), eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_and_mixed_dtypes_stay_pytorchs(dtype):
    """A 16-bit model's tail (dispatch.OUTER_DTYPES), and a float32 operand against a 16-bit
    value (PyTorch's type promotion): PyTorch's op, not the kernel."""
    v, a, _ = _tensors(*LAYOUTS["75"], dtype, 0)
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=CHAIN.tail)
    for operand in (a, a.float()):
        assert _outer(epilogue, "add", v, [operand]) is None
        out = apply_tail(v, epilogue, [operand])
        assert out.dtype == (v + operand).dtype and torch.equal(out, v + operand)


@pytest.mark.parametrize("name", ["mul", "div"])
def test_gradient_of_one_input(name):
    """Only the value requires grad (a frozen operand): its gradient is PyTorch's."""
    v, a, grad = _tensors(*LAYOUTS["75"], torch.float32, 3)
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=(Pointwise(name, (Param(0),)),))
    leaf = v.clone().requires_grad_()
    (ours,) = torch.autograd.grad(apply_tail(leaf, epilogue, [a]), [leaf], grad)
    eager_leaf = v.clone().requires_grad_()
    (eager,) = torch.autograd.grad(POINTWISE[name].torch(eager_leaf, a), [eager_leaf], grad)
    assert torch.equal(ours, eager)


def test_second_derivative_is_refused():
    v, a, grad = _tensors(*LAYOUTS["75"], torch.float32, 4)
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=CHAIN.tail)
    leaf = v.clone().requires_grad_()
    grad = grad.requires_grad_()
    (dv,) = torch.autograd.grad(apply_tail(leaf, epilogue, [a]), [leaf], grad, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(dv.sum(), [grad])


def test_forward_ad_is_pytorchs():
    """A dual tensor (forward-mode AD) takes PyTorch's op, so its tangent is PyTorch's."""
    v, a, _ = _tensors(*LAYOUTS["75"], torch.float32, 5)
    tangent = torch.randn_like(v)
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=CHAIN.tail)
    with fwAD.dual_level():
        dual = fwAD.make_dual(v, tangent)
        ours = fwAD.unpack_dual(apply_tail(dual, epilogue, [a])).tangent
        theirs = fwAD.unpack_dual(dual + a).tangent
    assert ours is not None and torch.equal(ours, theirs)


def test_non_contiguous_operand_stays_pytorchs():
    v, a, _ = _tensors(*LAYOUTS["75"], torch.float32, 6)
    operand = torch.empty(1, 4096, 1, 2, device=CUDA)[..., :1]  # a column stride of 2
    operand.copy_(a)
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=CHAIN.tail)
    assert not operand.is_contiguous() and _outer(epilogue, "add", v, [operand]) is None
    assert torch.equal(apply_tail(v, epilogue, [operand]), v + operand)


def test_in_place_change_no_gradient_reads_is_allowed():
    """mul with a frozen operand: the value's gradient reads the operand alone, so changing the
    value in place after the forward is no error (as with PyTorch's mul), and the gradient is
    PyTorch's."""
    v, a, grad = _tensors(*LAYOUTS["75"], torch.float32, 7)
    epilogue = Epilogue(norm=CHAIN.norm, reduce=CHAIN.reduce, tail=(Pointwise("mul", (Param(0),)),))
    grads = []
    for run in (lambda x: apply_tail(x, epilogue, [a]), lambda x: x * a):
        leaf = v.clone().requires_grad_()
        x = leaf * 1.0
        out = run(x)
        x.add_(1.0)
        grads.append(torch.autograd.grad(out, [leaf], grad)[0])
    assert torch.equal(grads[0], grads[1])
