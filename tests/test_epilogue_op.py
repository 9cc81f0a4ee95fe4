"""fused_epilogue on the CPU (the PyTorch path; tests/gpu/test_epilogue_op.py runs the kernel)
and split_epilogue, the chain split that a BatchNorm1d's batch statistics need."""

import pytest
import torch

from gemmfuse import (
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    Value,
    fused_epilogue,
    fused_epilogue_with_path,
)
from gemmfuse.chains import chain_pool, value_chains
from gemmfuse.epilogue import split_epilogue
from gemmfuse.reference import apply_epilogue

GN = GroupNormSpec(2, 1e-5, True)
CHAIN = Epilogue(
    pre=(Pointwise("mul", (Param(0),)), Pointwise("gelu")),
    norm=GN,
    post=(Pointwise("add", (Value(0),)), Pointwise("tanh")),
    reduce=Reduction("logsumexp", keepdim=True),
    tail=(Pointwise("mul", (2.0,)),),
)


def _tensors(gen, m=6, n=8):
    z = torch.randn(m, n, generator=gen)
    gn = torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen)
    return z, gn, [torch.randn(n, generator=gen)]


def test_cpu_path_is_the_reference_with_its_gradients():
    gen = torch.Generator().manual_seed(0)
    z, gn, params = _tensors(gen)
    leaves = [t.clone().requires_grad_() for t in (z, *gn, *params)]
    out, path = fused_epilogue_with_path(leaves[0], CHAIN, *leaves[1:3], params=leaves[3:])
    assert path == "torch"
    want = apply_epilogue(z, CHAIN, *gn, params)
    assert torch.equal(out, want) and out.shape == (6, 1)
    grads = torch.autograd.grad(out.sum(), leaves)
    twins = [t.clone().requires_grad_() for t in (z, *gn, *params)]
    expect = torch.autograd.grad(apply_epilogue(twins[0], CHAIN, *twins[1:3], twins[3:]).sum(),
                                 twins)  # fmt: skip
    for g, e in zip(grads, expect, strict=True):
        assert torch.equal(g, e)


def test_an_empty_chain_gives_a_new_tensor():
    """z is read, never written, and never returned: writing into the result leaves z as it was."""
    z = torch.randn(4, 8)
    out = fused_epilogue(z, Epilogue())
    assert torch.equal(out, z) and out.data_ptr() != z.data_ptr()
    grad_z = z.clone().requires_grad_()
    out = fused_epilogue(grad_z, Epilogue())
    out.sum().backward()
    assert out is not grad_z and torch.equal(grad_z.grad, torch.ones(4, 8))


@pytest.mark.parametrize(
    "args, error, match",
    [
        (("z", CHAIN), TypeError, "z must be a torch.Tensor"),
        ((torch.randn(8), CHAIN), ValueError, "z must be 2-D"),
        ((torch.ones(2, 8, dtype=torch.int32), CHAIN), ValueError, "floating-point"),
        ((torch.randn(2, 8), "chain"), TypeError, "epilogue must be a gemmfuse.Epilogue"),
        ((torch.randn(2, 8), CHAIN, torch.ones(8), torch.ones(8)), ValueError,
         r"reads params\[0\] but 0 tensor"),
        ((torch.randn(2, 8), Epilogue(), torch.ones(8), torch.ones(8)), ValueError,
         "no GroupNorm"),
        ((torch.randn(2, 6), Epilogue(norm=GN), torch.ones(6), torch.ones(5)), ValueError,
         r"gn_bias must have shape \(6,\)"),
        ((torch.randn(2, 6), Epilogue(norm=GN), torch.ones(6), torch.ones(6).double()),
         ValueError, "gn_bias must be torch.float32 on cpu like z"),
        ((torch.randn(2, 7), Epilogue(norm=GN), torch.ones(7), torch.ones(7)), ValueError,
         "num_groups=2 must divide"),
    ],
)  # fmt: skip
def test_bad_arguments_raise_naming_them(args, error, match):
    with pytest.raises(error, match=match):
        fused_epilogue(*args)


def test_params_that_change_the_shape_raise():
    chain = Epilogue(pre=(Pointwise("add", (Param(0),)),))
    with pytest.raises(ValueError, match=r"params\[0\] of shape \(3, 8\) does not broadcast"):
        fused_epilogue(torch.randn(2, 8), chain, params=[torch.randn(3, 8)])


def _every_split(epilogue: Epilogue):
    for at in range(len(epilogue.pre) + len(epilogue.post) + 1):
        try:
            yield at, split_epilogue(epilogue, at)
        except ValueError as e:  # a value read again from before the split
            assert "from before it" in str(e)


@pytest.mark.parametrize("epilogue", [CHAIN, *value_chains(2)])
def test_the_rest_on_the_head_is_the_chain(epilogue):
    gen = torch.Generator().manual_seed(1)
    z, gn, params = _tensors(gen)
    want = apply_epilogue(z.double(), epilogue, *(t.double() for t in gn), [params[0].double()])
    splits = 0
    for at, (head, rest) in _every_split(epilogue):
        gn_head, gn_rest = (gn, (None, None)) if head.norm else ((None, None), gn)
        u = apply_epilogue(z.double(), head, *(t if t is None else t.double() for t in gn_head),
                           [params[0].double()])  # fmt: skip
        assert u.shape == z.shape, at
        got = apply_epilogue(u, rest, *(t if t is None else t.double() for t in gn_rest),
                             [params[0].double()])  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=str(at))
        splits += 1
    assert splits >= 2


def test_pool_chains_split_anywhere():
    gen = torch.Generator().manual_seed(2)
    for spec in chain_pool():
        epilogue, params = spec.instantiate(gen, 16, 2, 1e-5)
        z = torch.randn(5, 16, generator=gen, dtype=torch.float64)
        gn = (torch.rand(16, generator=gen).double() + 0.5, torch.randn(16, generator=gen).double())
        gn = gn if spec.norm and spec.affine else (None, None)
        params = [p.double() for p in params]
        want = apply_epilogue(z, epilogue, *gn, params)
        for at, (head, rest) in _every_split(epilogue):
            gn_head, gn_rest = (gn, (None, None)) if head.norm else ((None, None), gn)
            got = apply_epilogue(apply_epilogue(z, head, *gn_head, params), rest, *gn_rest, params)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{spec} at {at}")


def test_a_split_out_of_range_raises():
    with pytest.raises(ValueError, match=r"at must be in \[0, 4\]"):
        split_epilogue(CHAIN, 5)
