import pytest

from gemmfuse.epilogue import (
    POINTWISE,
    Epilogue,
    GroupNormSpec,
    Pointwise,
    Reduction,
    cuda_epilogue,
)


def chain(slope=0.01, eps=1e-5, groups=8):
    return Epilogue(
        norm=GroupNormSpec(groups, eps),
        post=(Pointwise("leaky_relu", (slope,)), Pointwise("add_self")),
    )


def test_structure_ignores_run_time_values():
    assert chain(0.01, 1e-5, 8).structure == chain(0.2, 1e-3, 64).structure
    assert chain().structure != Epilogue(norm=GroupNormSpec(8)).structure


def test_scalars_in_generated_order():
    epi = Epilogue(
        pre=(Pointwise("mul", (3.0,)),),
        norm=GroupNormSpec(2),
        post=(Pointwise("leaky_relu", (0.1,)), Pointwise("add", (-1.0,))),
    )
    assert epi.scalars == (3.0, 0.1, -1.0)
    code = cuda_epilogue(epi)
    assert code.index("p.scalar[0]") < code.index("p.scalar[1]") < code.index("p.scalar[2]")


def test_generated_struct_flags():
    code = cuda_epilogue(chain())
    assert "kNorm = true" in code and "kReduce = 0" in code
    assert "(v > 0.f ? v : v * p.scalar[0])" in code and "(v + v)" in code
    code = cuda_epilogue(Epilogue(norm=GroupNormSpec(4), reduce=Reduction("min", True)))
    assert "kReduce = 1" in code
    assert "kNorm = false" in cuda_epilogue(Epilogue())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Pointwise("nope"), "unknown pointwise op"),
        (lambda: Pointwise("leaky_relu"), "takes 1 argument"),
        (lambda: Pointwise("relu", (1.0,)), "takes 0 argument"),
        (lambda: GroupNormSpec(0), "num_groups"),
        (lambda: GroupNormSpec(2, eps=-1.0), "eps"),
        (lambda: Reduction("median"), "unknown reduction"),
        (lambda: Epilogue(post=(Pointwise("relu"),)), "post ops need a GroupNorm"),
        (lambda: Epilogue(pre=(Pointwise("add", (1.0,)),) * 9), "at most 8 float"),
    ],
)
def test_bad_descriptions_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_every_op_has_both_meanings():
    for name, op in POINTWISE.items():
        assert "{v}" in op.cuda, name
        assert all(f"{{a{i}}}" in op.cuda for i in range(op.n_args)), name
