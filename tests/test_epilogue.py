import re
from dataclasses import replace

import pytest
import torch

from gemmfuse.chains import chain_pool, softmax_chains, value_chains
from gemmfuse.epilogue import (
    POINTWISE,
    REDUCTIONS,
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    Value,
    cuda_epilogue,
    epilogue_from_spec,
    epilogue_problem,
    epilogue_spec,
)
from gemmfuse.pointwise import ROUND


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
    assert "kRms = false" in cuda_epilogue(chain())
    rms = Epilogue(norm=GroupNormSpec(1, layer=True, rms=True))
    assert "kNorm = true" in cuda_epilogue(rms) and "kRms = true" in cuda_epilogue(rms)
    assert "kSoftmax = false" in cuda_epilogue(rms) and "kSoftmax = false" in cuda_epilogue(
        Epilogue()
    )
    softmax, _, log_softmax = (cuda_epilogue(c) for c in softmax_chains())
    assert "kNorm = true" in softmax and "kSoftmax = true" in softmax and "kRms = false" in softmax
    assert "kLogSoftmax = false" in softmax and "kLogSoftmax = true" in log_softmax


def test_structure_keeps_what_the_kernels_tell_apart():
    """A LayerNorm is a one-group GroupNorm to the kernels (one structure); an RMSNorm is not."""
    group = Epilogue(norm=GroupNormSpec(4, 1e-3))
    layer = Epilogue(norm=GroupNormSpec(1, layer=True))
    rms = Epilogue(norm=GroupNormSpec(1, 1e-6, layer=True, rms=True))
    assert group.structure == layer.structure
    assert rms.structure != layer.structure
    assert rms.structure == Epilogue(norm=GroupNormSpec(1, 0.5, layer=True, rms=True)).structure
    softmax = GroupNormSpec(1, 0.0, False, layer=True, softmax=True)
    structures = {Epilogue(norm=n).structure for n in (softmax, replace(softmax, log=True))}
    assert len(structures | {layer.structure, rms.structure}) == 4


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Pointwise("nope"), "unknown pointwise op"),
        (lambda: Pointwise(["relu"]), "unknown pointwise op"),  # not a TypeError: unhashable
        (lambda: Pointwise("hardtanh", (1.0, -1.0)), "min_val cannot be greater than max_val"),
        (lambda: GroupNormSpec(True), "num_groups must be a positive int"),
        (lambda: Reduction(["min"]), "unknown reduction"),
        (lambda: Param(True), "Param index"),
        (lambda: Pointwise("leaky_relu"), "takes 1 argument"),
        (lambda: Pointwise("relu", (1.0,)), "takes 0 argument"),
        (lambda: GroupNormSpec(0), "num_groups"),
        (lambda: GroupNormSpec(2, eps=-1.0), "eps"),
        (lambda: GroupNormSpec(2, layer=True), "LayerNorm .* is one group"),
        (lambda: GroupNormSpec(1, rms=True), "RMSNorm .* needs layer=True"),
        (lambda: GroupNormSpec(1, affine=False, softmax=True), "softmax .* needs layer=True"),
        (lambda: GroupNormSpec(1, layer=True, softmax=True), "needs .* affine=False"),
        (lambda: GroupNormSpec(1, affine=False, layer=True, log=True), "log=True .* softmax"),
        (lambda: Reduction("median"), "unknown reduction"),
        (lambda: Reduction("sum", pool=0), "pool must be an int >= 1"),
        (lambda: Reduction("sum", pool=2.0), "pool must be an int >= 1"),
        (lambda: Reduction("sum", pool=6), "power of two up to 128"),
        (lambda: Reduction("sum", pool=256), "power of two up to 128"),
        (
            lambda: Epilogue(norm=GroupNormSpec(2), reduce=Reduction("sum", pool=2)),
            "max pooling before the reduction .* without a norm",
        ),
        (lambda: Epilogue(post=(Pointwise("relu"),)), "post ops need a GroupNorm"),
        (lambda: Epilogue(pre=(Pointwise("add", (1.0,)),) * 9), "at most 8 float"),
    ],
)
def test_bad_descriptions_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Pointwise("leaky_relu", 0.01), "args must be a tuple, got float"),
        (lambda: GroupNormSpec(4, eps="1e-5"), "eps must be a real number, got str"),
        (lambda: GroupNormSpec(1, eps=None, layer=True, rms=True), "eps must be a real number"),
        (lambda: GroupNormSpec(4, affine="no"), "GroupNormSpec affine must be a bool"),
        (lambda: GroupNormSpec(1, layer=2), "GroupNormSpec layer must be a bool"),
        (lambda: GroupNormSpec(4, affine=torch.tensor(True)), "GroupNormSpec affine must be"),
        (lambda: Reduction("min", keepdim="yes"), "Reduction keepdim must be a bool"),
        (lambda: Reduction("min", keepdim=None), "Reduction keepdim must be a bool"),
        (lambda: Epilogue(pre=("relu",)), "Epilogue pre holds Pointwise ops, got 'relu'"),
        (lambda: Epilogue(pre=Pointwise("relu")), "Epilogue pre must be a tuple of Pointwise"),
        (lambda: Epilogue(norm=4), "Epilogue norm must be a GroupNormSpec or None"),
        (lambda: Epilogue(reduce="min"), "Epilogue reduce must be a Reduction or None"),
        (lambda: Epilogue(reduce=Reduction("sum"), tail=(None,)), "Epilogue tail holds"),
    ],
)
def test_descriptions_of_the_wrong_kind_raise_type_errors(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_flags_equal_to_a_bool_are_that_bool():
    """1 and 0 (and numpy's bools, which equal them) are the bools they equal, stored as such,
    so the descriptions stay equal and hash alike."""
    assert (
        GroupNormSpec(4, affine=1) == GroupNormSpec(4) and GroupNormSpec(4, affine=1).affine is True
    )
    assert Reduction("min", keepdim=0).keepdim is False
    assert hash(Reduction("min", keepdim=1)) == hash(Reduction("min", keepdim=True))


def test_lists_are_taken_as_tuples():
    """A list where a tuple is expected (ops, an op's arguments) is what one writes: it is kept
    as a tuple, so the description stays hashable and equal to the tuple form."""
    listed = Epilogue(pre=[Pointwise("leaky_relu", [0.01])], norm=GroupNormSpec(4),
                      post=[Pointwise("relu")])  # fmt: skip
    tupled = Epilogue(pre=(Pointwise("leaky_relu", (0.01,)),), norm=GroupNormSpec(4),
                      post=(Pointwise("relu"),))  # fmt: skip
    assert listed == tupled and hash(listed) == hash(tupled)
    assert isinstance(listed.pre, tuple) and isinstance(listed.pre[0].args, tuple)


def test_every_op_has_both_meanings():
    for name, op in POINTWISE.items():
        assert "{v}" in op.cuda, name
        assert all(f"{{a{i}}}" in op.cuda for i in range(op.n_args)), name


def test_tensor_arguments_read_per_channel_in_order():
    epi = Epilogue(
        pre=(Pointwise("mul", (Param(3),)), Pointwise("add", (2.0,))),
        norm=GroupNormSpec(2),
        post=(Pointwise("div", (Param(1),)), Pointwise("div", (4.0,))),
    )
    # a float divisor's slot holds its reciprocal, taken in float64 as PyTorch takes it
    assert epi.channel_params == (3, 1) and epi.scalars == (2.0, 0.25)
    code = cuda_epilogue(epi)
    # each at (row, col): a row stride of 0 reads a channel vector, N an (M, N) operand
    assert "(v * __ldg(p.vec[0] + row * p.vec_row_stride[0] + col))" in code
    assert "(v / __ldg(p.vec[1] + row * p.vec_row_stride[1] + col))" in code
    # and the kernel multiplies by it, forward and backward
    assert "(v * p.scalar[1])" in code
    assert "(d * p.scalar[1])" in code


def test_a_float_over_x_rounds_the_reciprocal_as_its_model():
    """float / x is x.reciprocal() * float in PyTorch: two ops, so a 16-bit model rounds the
    reciprocal before the product (ROUND, the identity in a float32 instance)."""
    code = cuda_epilogue(Epilogue(pre=(Pointwise("rdiv", (2.5,)),)))
    assert f"({ROUND}(1.f / v, p) * p.scalar[0])" in code


def test_a_float_divisors_reciprocal_is_taken_in_float64():
    """1.1's reciprocal in float64, then rounded to float32, is not 1 / float32(1.1) rounded:
    the kernel reads the first, as PyTorch's CUDA ``x / 1.1`` multiplies by it; ±0 gives ±inf."""
    ops = (Pointwise("div", (1.1,)), Pointwise("div", (0.0,)), Pointwise("div", (-0.0,)))
    got = torch.tensor(Epilogue(pre=ops).scalars, dtype=torch.float32)
    one = torch.tensor(1.0)
    assert got[0] == torch.tensor(1 / 1.1, dtype=torch.float32) != one / torch.tensor(1.1)
    assert got[1:].tolist() == [float("inf"), float("-inf")]


def test_structure_leaves_out_values_param_indices_and_tail():
    def chain(scale, index, tail):
        return Epilogue(
            pre=(Pointwise("mul", (Param(index),)),),
            norm=GroupNormSpec(4, 1e-3),
            post=(Pointwise("leaky_relu", (scale,)),),
            reduce=Reduction("sum", keepdim=True),
            tail=tail,
        )

    a = chain(0.1, 0, ())
    b = chain(0.3, 5, (Pointwise("add", (Param(0),)),))
    assert a.structure == b.structure
    assert a.structure != Epilogue(pre=a.pre, norm=GroupNormSpec(4), reduce=Reduction("min"))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Pointwise("relu", (Param(0),)), "takes 0 argument"),
        (lambda: Pointwise("leaky_relu", (Param(0),)), "float arguments only"),
        (lambda: Pointwise("add", ("1",)), "floats, Param or Value"),
        (lambda: Pointwise("add", (True,)), "floats, Param or Value"),
        (lambda: Pointwise("leaky_relu", (Value(0),)), "float arguments only"),
        (lambda: Value(-1), "Value index"),
        (lambda: Value(0, detach=1), "detach must be a bool"),
        (
            lambda: Epilogue(pre=(Pointwise("add", (Value(1),)),)),
            r"pre op 1 \(add\) reads Value\(1\)",
        ),
        (
            lambda: Epilogue(
                norm=GroupNormSpec(2), post=(Pointwise("relu"), Pointwise("mul", (Value(2),)))
            ),
            r"post op 2 \(mul\) reads Value\(2\); an op at position 2 reads values 0 to 1",
        ),
        (lambda: Param(-1), "Param index"),
        (lambda: Epilogue(tail=(Pointwise("relu"),)), "tail ops need a reduction"),
        (lambda: Epilogue(pre=(Pointwise("add", (Param(0),)),) * 9), "at most 8 tensor"),
    ],
)
def test_bad_arguments_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_chain_pool_covers_the_grammar():
    """The GPU property tests draw from this pool: every op must reach a kernel."""
    pool = chain_pool()
    in_kernel = {op.name for spec in pool for op in spec.pre + spec.post}
    assert in_kernel == set(POINTWISE)
    assert {spec.reduce for spec in pool} >= set(REDUCTIONS)


@pytest.mark.parametrize(
    "epilogue",
    [
        Epilogue(),
        chain(slope=0.1, eps=1e-3),
        Epilogue(
            pre=(Pointwise("mul", (Param(2),)), Pointwise("hardtanh", (float("-inf"), 0.5))),
            norm=GroupNormSpec(1, 1e-6, affine=False, layer=True),
            reduce=Reduction("logsumexp", keepdim=True),
            tail=(Pointwise("add", (Param(0),)), Pointwise("clamp", (-1.0, float("inf")))),
        ),
        Epilogue(norm=GroupNormSpec(1, 1.1920928955078125e-07, layer=True, rms=True)),
        *value_chains(),
        *softmax_chains(),
        Epilogue(reduce=Reduction("max"), tail=(Pointwise("mish"), Pointwise("mul", (Value(0),)))),
        Epilogue(pre=(Pointwise("gelu"),), reduce=Reduction("sum", True, 2)),
    ],
)
def test_spec_round_trips(epilogue):
    """What the torch.library ops carry: the same chain back, floats exactly."""
    spec = epilogue_spec(epilogue)
    assert isinstance(spec, str)
    assert epilogue_from_spec(spec) == epilogue
    assert epilogue_spec(Epilogue(norm=GroupNormSpec(3, 0.1 + 0.2))) != epilogue_spec(
        Epilogue(norm=GroupNormSpec(3, 0.3))
    )


def test_values_are_structure():
    """A Value argument is part of what a kernel is compiled for (its index and whether it is
    detached); the floats around it are not."""
    a, b = value_chains()[:2]
    assert a.structure.pre[2].args == (Value(0),)
    assert b.structure.pre[1].args == (Value(0, detach=True),)
    same = Epilogue(
        pre=(Pointwise("sigmoid"), Pointwise("mul", (7.0,)), Pointwise("add", (Value(0),)))
    )
    assert same.structure == a.structure
    other = Epilogue(
        pre=(Pointwise("sigmoid"), Pointwise("mul", (2.0,)), Pointwise("add", (Value(1),)))
    )
    assert other.structure != a.structure
    assert a.scalars == (2.0,) and a.channel_params == ()


def test_epilogue_problem_checks_values_without_raising():
    assert epilogue_problem(pre=(("sigmoid", ()), ("add", (Value(0),)))) == ""
    assert "reads Value(2)" in epilogue_problem(pre=(("sigmoid", ()), ("add", (Value(2),))))


@pytest.mark.parametrize(
    "parts, message",
    [
        ({"pre": (("hardtanh", (1.0, -1.0)),)}, "min_val cannot be greater than max_val"),
        ({"norm": (True, 1e-5)}, "num_groups must be a positive int"),
        ({"norm": (4, None)}, "eps must be a real number"),
        ({"norm": (4, 1e-5, "no")}, "affine must be a bool"),
        ({"pre": (("leaky_relu", [0.1, 0.2]),)}, "takes 1 argument(s), got (0.1, 0.2)"),
    ],
)
def test_epilogue_problem_holds_the_classes_rules(parts, message):
    """What the classes refuse, epilogue_problem names (a FusedLinear whose module settings
    changed falls back on it rather than raising in its forward)."""
    assert message in epilogue_problem(**parts)
    norm = parts.get("norm")
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        Epilogue(
            pre=tuple(Pointwise(*op) for op in parts.get("pre", ())),
            norm=None if norm is None else GroupNormSpec(*norm),
        )
    assert epilogue_problem(pre=(("hardtanh", (-1.0, -1.0)),), norm=(4, 0.0, False)) == ""


def test_generated_struct_rounds_as_its_instance_model():
    """The generated struct is a template over the model dtype, every rounding of its ops (the
    swish's inner sigmoid and its gradient included) takes that dtype, and GeneratedEpilogue is
    the instance that reads it at run time (csrc/abi/fused_args.h)."""
    code = cuda_epilogue(Epilogue(pre=(Pointwise("swish"), Pointwise("mul", (2.0,)))))
    assert "template <int kModel>\nstruct GeneratedEpilogueFor {" in code
    assert "static constexpr int kModelDtype = kModel;" in code
    assert "using GeneratedEpilogue = GeneratedEpilogueFor<gemmfuse::kAnyModel>;" in code
    assert ROUND == "gemmfuse::round_like_model<kModel>"
    assert "round_like_model(" not in code.replace(f"{ROUND}(", "")
    assert f"{ROUND}(gemmfuse::sigmoid_rn(" in code and "swish_grad<kModel>(" in code


def test_generated_code_keeps_values_in_registers():
    """Without Value arguments a stretch is generated as before (one running v); with them each
    value has its register, and the backward gathers a value's later reads in d<index>."""
    plain = cuda_epilogue(Epilogue(pre=(Pointwise("sigmoid"), Pointwise("mul", (2.0,)))))
    assert f"    v = {ROUND}(" in plain and "float d0" not in plain
    code = cuda_epilogue(value_chains()[0].structure)
    assert f"const float v3 = {ROUND}((v2 + v0), p);" in code and "v = v3;" in code
    assert "float d0 = 0.f;" in code and "d0 += d;" in code and "d += d0;" in code
    detached = cuda_epilogue(value_chains()[1].structure)
    assert "float d0" not in detached  # the detached read sends no gradient back


def test_a_pooled_reduction_is_its_own_structure():
    """The max-pooling window is compiled in (kPool): it stays in the structure."""
    pooled = Epilogue(reduce=Reduction("sum", pool=4))
    assert pooled.structure.reduce == Reduction("sum", pool=4)
    assert pooled.structure != Epilogue(reduce=Reduction("sum")).structure
    assert "kPool = 4" in cuda_epilogue(pooled)
    assert "kPool = 1" in cuda_epilogue(Epilogue(reduce=Reduction("sum")))
    assert "kPool = 1" in cuda_epilogue(Epilogue())
    assert epilogue_problem(norm=(2, 1e-5), reduce=Reduction("max", pool=2))
    assert not epilogue_problem(reduce=Reduction("max", pool=2))
