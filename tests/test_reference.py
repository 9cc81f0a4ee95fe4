import pytest
import torch
import torch.nn as nn

from gemmfuse.epilogue import Epilogue, GroupNormSpec, Pointwise, Reduction
from gemmfuse.reference import linear_epilogue


@pytest.mark.parametrize("m,k,n,groups", [(1, 5, 6, 3), (7, 33, 64, 8), (64, 128, 96, 1)])
def test_matches_torch_modules(m, k, n, groups):
    torch.manual_seed(m + k + n)
    fc, gn = nn.Linear(k, n), nn.GroupNorm(groups, n, eps=1e-3)
    nn.init.normal_(gn.weight, 1.0, 0.1)
    nn.init.normal_(gn.bias, 0.0, 0.1)
    x = torch.randn(max(m, 2), k)
    epi = Epilogue(
        pre=(Pointwise("mul", (0.5,)),),
        norm=GroupNormSpec(groups, 1e-3),
        post=(Pointwise("leaky_relu", (0.2,)), Pointwise("add_self")),
    )
    y = nn.functional.leaky_relu(gn(fc(x) * 0.5), 0.2)
    torch.testing.assert_close(
        linear_epilogue(x, fc.weight, fc.bias, epi, gn.weight, gn.bias), y + y, rtol=0, atol=0
    )


@pytest.mark.parametrize("op", ["min", "max", "sum"])
@pytest.mark.parametrize("keepdim", [True, False])
def test_reductions(op, keepdim):
    torch.manual_seed(0)
    fc, gn = nn.Linear(16, 32), nn.GroupNorm(4, 32, affine=False)
    x = torch.randn(9, 16)
    expect = getattr(torch, {"min": "amin", "max": "amax", "sum": "sum"}[op])(
        gn(fc(x)), dim=1, keepdim=keepdim
    )
    epi = Epilogue(norm=GroupNormSpec(4, affine=False), reduce=Reduction(op, keepdim))
    got = linear_epilogue(x, fc.weight, fc.bias, epi)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
