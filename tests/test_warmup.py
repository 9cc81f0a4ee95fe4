"""gemmfuse.warmup and ``python -m gemmfuse warmup`` on the CPU: which structures a model needs,
the parallel builds' outcomes (with a stand-in child program), and the CLI's errors."""

import itertools

import pytest
import torch
from model_files import build, path_of

import gemmfuse.dispatch
import gemmfuse.warmup as warmup
from gemmfuse import Epilogue, FusedLinear, GroupNormSpec, optimize
from gemmfuse.cli import main
from gemmfuse.epilogue import split_epilogue
from gemmfuse.jit import CHAIN_PARTS
from gemmfuse.kernelbench.export import ExportError
from gemmfuse.kernelbench.registry import PROBLEMS


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_a_shipped_problem_needs_its_structures_and_the_plain_gemms(number):
    got = warmup.structures_for(str(number))
    assert got[0] == Epilogue()
    assert got[1:] == [s.structure for s in PROBLEMS[number].structures]


def test_a_problem_file_needs_what_optimize_swaps_in():
    _, model, inputs = build("mixed_blocks")
    new, _ = optimize(model, inputs)
    fused = [m.epilogue.structure for m in new.modules() if isinstance(m, FusedLinear)]
    got = warmup.structures_for(str(path_of("mixed_blocks")))
    assert got == list(dict.fromkeys([Epilogue(), *fused])) and len(got) > 1


def test_unknown_targets_raise():
    with pytest.raises(ValueError, match="unknown problem '99'"):
        warmup.structures_for("99")
    with pytest.raises(ExportError, match="no Linear of Model can be swapped"):
        warmup.structures_for(str(path_of("unfit_computed_weight")))


def test_builds_report_each_outcome_and_the_failures(monkeypatch):
    """A stand-in child: "a" compiles (says so on stderr), "b" is found cached, "bad" fails."""
    program = (
        "import sys\ns = sys.argv[1]\n"
        "sys.stderr.write('gemmfuse: building CUDA extension' if s == 'a' else 'oops')\n"
        "sys.exit(1 if s == 'bad' else 0)\n"
    )
    monkeypatch.setattr(warmup, "_BUILD_ONE", program)
    heard = {}
    errors = warmup.build_in_processes(
        ["a", "b", "bad"], jobs=2, on_done=lambda s, outcome, _: heard.update({s: outcome})
    )
    assert heard == {"a": "built", "b": "cached", "bad": "FAILED"}
    assert len(errors) == 1 and errors[0].startswith("BUILD FAILED bad") and "oops" in errors[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_cli_without_a_gpu_says_so(capsys):
    assert main(["warmup", "62"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_cli_errors_name_the_argument(capsys):
    with pytest.raises(SystemExit):
        main(["warmup", "99"])
    assert "unknown problem '99'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["warmup", "62", "--jobs", "0"])
    assert "--jobs must be at least 1" in capsys.readouterr().err
    assert main(["warmup", str(path_of("unfit_computed_weight"))]) == 2
    assert "no Linear of Model can be swapped" in capsys.readouterr().err


def test_cli_builds_several_targets_together_each_structure_once(monkeypatch, capsys):
    """62 and 75 share the plain GEMM's structure: one pool builds it once with both chains."""
    built = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []
    monkeypatch.setattr(
        warmup, "build_in_processes",
        lambda s, jobs, on_done, dtypes, precisions: (
            built.extend(s) or asked.append((dtypes, precisions)) or []
        ),
    )  # fmt: skip
    assert main(["warmup", "62", "75", "--jobs", "3"]) == 0
    want = list(dict.fromkeys(warmup.structures_for("62") + warmup.structures_for("75")))
    assert built == want and len(want) == 3
    assert asked == [([torch.float32], ["fp32"])]  # a KernelBench problem's own, optimize's own
    err = capsys.readouterr().err
    assert f"{len(want)} kernel structure(s) for float32 models (precision fp32), 3 at" in err
    assert main(["warmup", "62", "--dtype", "bfloat16", "--dtype", "float32",
                 "--precision", "tf32"]) == 0  # fmt: skip
    assert asked[-1] == ([torch.bfloat16, torch.float32], ["tf32"])
    with pytest.raises(SystemExit):
        main(["warmup", "62", "--dtype", "float64"])
    assert "invalid choice: 'float64'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["warmup", "62", "--dtype", "bfloat16", "--precision", "tf32"])
    assert "--precision is optimize's precision of float32 models" in capsys.readouterr().err


def test_each_child_builds_the_parts_of_the_dtypes_asked(monkeypatch):
    """The child program hears the parts to build: every part by default, and for float32
    models at precision fp32 none of the 16-bit instances nor the one-pass GEMM."""
    heard = []

    class Ran:
        returncode, stderr = 0, ""

    monkeypatch.setattr(warmup.subprocess, "run", lambda argv, **_: heard.append(argv) or Ran())
    warmup.build_in_processes(["a"], jobs=1)
    warmup.build_in_processes(["a"], jobs=1, dtypes=[torch.float32])
    every, fp32 = heard[0][4:], heard[1][4:]
    assert heard[0][3] == "a" and tuple(every) == warmup.CHAIN_PARTS[1:]
    assert set(every) - set(fp32) == {
        "chain_sm90_bf16.cu", "chain_sm90_fp16.cu", "chain_epilogue_16bit.cu",
        "chain_sm90_one_pass.cu",
    }  # fmt: skip


class _ScaledBatchNorm(torch.nn.Module):
    """KernelBench #33's pattern: Linear -> * s -> BatchNorm1d in training mode."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 96)
        self.scale = torch.nn.Parameter(torch.randn(96))
        self.bn = torch.nn.BatchNorm1d(96)

    def forward(self, x):
        return self.bn(self.fc(x) * self.scale)


def test_a_batch_statistics_chain_needs_its_two_halves():
    """A BatchNorm1d in training mode splits its chain's call in two (the fused call up to it,
    then the rest): warmup builds those halves, not the whole chain no call launches."""
    new, _ = optimize(_ScaledBatchNorm(), [torch.randn(32, 64)])
    fc = next(m for m in new.modules() if isinstance(m, FusedLinear))
    head, rest = split_epilogue(fc.epilogue, 1)
    assert fc.kernel_structures == [head.structure, rest.structure]
    assert head.structure.pre and rest.structure.pre and head.structure != Epilogue()
    got = warmup.model_structures(new)
    assert got == fc.kernel_structures and fc.epilogue.structure not in got


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_models_parts_hold_every_part_its_forwards_run(dtype, precision):
    """warmup's parts for a model's dtype and precision are exactly those dispatch.forward_parts
    picks for them on some path that such a call can take, and a float32 backward's products
    (the plain GEMM's split or one-pass instance, as the host's gemm_split takes the spec's
    split)."""
    kept = warmup.parts_for_models(CHAIN_PARTS[1:], [dtype], [precision])
    split = gemmfuse.dispatch.PRECISIONS[precision]
    assert set(kept) == _parts_run(dtype, split)
    if precision == "fp32" or dtype != torch.float32:
        assert "chain_sm90_one_pass.cu" not in kept
    if dtype != torch.float32:  # the float32 calls' parts: 16-bit models never run them
        assert not {"chain_gemv.cu", "chain_epilogue.cu", "chain_sm90_split.cu"} & set(kept)


def _parts_run(dtype, split: bool) -> set:
    """Every part a forward (any path it can take) or a backward's products of a model in
    ``dtype`` runs: the few-rows kernel only where x is float32, a chain apart only where x is
    float32 and the precision splits (test_the_paths_parts_run_leaves_out_are_refused)."""
    dispatch = gemmfuse.dispatch
    float32 = dtype == torch.float32
    run = {"chain_sm90_split.cu" if split else "chain_sm90_one_pass.cu"} if float32 else set()
    for path, apart, code, wide, gemv in itertools.product(
        ("fused", "epilogue"), (False, True) if float32 and split else (False,),
        (dispatch.HOPPER_KERNEL, dispatch.PORTABLE_KERNEL), (False, True),
        (False, True) if float32 else (False,),
    ):  # fmt: skip
        chain, plain = dispatch.forward_parts(path, apart, code, split, dtype, wide, gemv)
        run |= set(chain) | set(plain)
    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_paths_parts_run_leaves_out_are_refused(dtype):
    """The paths _parts_run leaves out: a 16-bit call never takes the few-rows kernel nor runs
    its chain apart, and a float32 call at a precision that does not split runs no chain apart
    (each refused before the device is asked)."""
    dispatch, chain = gemmfuse.dispatch, Epilogue(norm=GroupNormSpec(16))
    x, w = torch.randn(1, 64), torch.randn(64, 64)
    assert dispatch.gemv_fits("epilogue", x, w)  # the float32 call that fits
    assert not dispatch.gemv_fits("epilogue", x.to(dtype), w.to(dtype))

    def big(of):  # KernelBench's sizes, without their memory
        return torch.empty(1, dtype=of).expand(4096, 8192)

    assert not dispatch.chain_apart("fused", chain, big(dtype), 8192, "auto", "fp32")
    assert not dispatch.chain_apart("fused", chain, big(torch.float32), 8192, "auto", "tf32")


def test_models_of_several_dtypes_and_precisions_keep_each_ones_parts():
    """Several dtypes and precisions: the union of each one's parts; a bare precision string
    is one precision."""
    every, parts_for_models = CHAIN_PARTS[1:], warmup.parts_for_models
    kept = parts_for_models(every, [torch.bfloat16, torch.float32], ["fp32", "tf32"])
    want = set()
    for dtype in (torch.bfloat16, torch.float32):
        for precision in ("fp32", "tf32"):
            want |= set(parts_for_models(every, [dtype], [precision]))
    assert set(kept) == want and "chain_sm80.cu" in kept and "chain_sm90_one_pass.cu" in kept
    assert parts_for_models(every, [torch.float32], "tf32") == parts_for_models(
        every, [torch.float32], ["tf32"]
    )
    with pytest.raises(ValueError, match="precision 'fp64'"):
        parts_for_models(every, [torch.float32], ["fp64"])
