"""tail.py without a GPU: which broadcasts are outer products (dispatch.outer_layout), and that
a tail off CUDA is PyTorch's. tests/gpu/test_tail.py runs the kernel and its backward."""

import pytest
import torch

from gemmfuse.dispatch import OUTER_OPS, outer_layout
from gemmfuse.epilogue import Epilogue, Param, Pointwise, Reduction
from gemmfuse.pointwise import POINTWISE
from gemmfuse.reference import apply_pointwise
from gemmfuse.tail import apply_tail


@pytest.mark.parametrize(
    ("value", "operand", "layout"),
    [
        ((6, 1), (1, 5, 1, 1), True),  # #75: (1, C, M, 1), the value along M, inner
        ((6, 1), (1, 5), False),  # (M, C): the operand inner
        ((6,), (5, 1), True),
        ((1, 6, 1), (5, 1, 1), True),
        ((6, 1), (6, 5), None),  # the operand spans the value's rows: not an outer product
        ((6, 1), (5,), False),
        ((6, 1), (1,), None),  # one operand value: elementwise
        ((1, 1), (1, 5, 1, 1), None),  # one reduced value
        ((6, 1), (1, 5, 1, 2), None),  # the operand's dims on both sides of the value's
        ((0, 1), (1, 5, 1, 1), None),  # empty
    ],
)
def test_outer_layout(value, operand, layout):
    got = outer_layout(torch.empty(value), torch.empty(operand))
    if layout is None:
        assert got is None
    else:
        assert got == (layout, torch.broadcast_shapes(value, operand))


def test_outer_ops_are_pointwise_tensor_ops():
    """The kernel's op codes name binary ops of the grammar that take a tensor operand."""
    assert all(POINTWISE[name].tensor_arg for name in OUTER_OPS)


@pytest.mark.parametrize("name", OUTER_OPS)
def test_cpu_tail_is_pytorchs(name):
    g = torch.Generator().manual_seed(0)
    v, a = torch.randn(7, 1, generator=g), torch.rand(1, 9, 1, 1, generator=g) + 0.5
    epilogue = Epilogue(reduce=Reduction("min", keepdim=True), tail=(Pointwise(name, (Param(0),)),))
    assert torch.equal(apply_tail(v, epilogue, [a]), apply_pointwise(v, epilogue.tail, [a]))
