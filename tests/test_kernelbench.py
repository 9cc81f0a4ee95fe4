import pytest
import torch

from gemmfuse.kernelbench.registry import PROBLEMS, get_problem
from helpers import build_pair, small_pair


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_seeded_construction_gives_identical_named_parameters(number):
    problem = get_problem(number)
    ref, new = build_pair(problem, list(problem.small_init), seed=123)  # raises if they differ
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in new.named_parameters()]


def test_parameter_names_are_the_problems():
    _, new62 = small_pair(62)
    assert list(new62.state_dict()) == ["fc.weight", "fc.bias", "gn.weight", "gn.bias"]
    _, new75 = small_pair(75)
    assert list(new75.state_dict()) == [
        "bias", "gemm.weight", "gemm.bias", "group_norm.weight", "group_norm.bias",
    ]  # fmt: skip


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_state_dict_loads_both_ways(number):
    ref, new = small_pair(number, seed=1)
    other_ref, other_new = small_pair(number, seed=2)
    new.load_state_dict(other_ref.state_dict())
    ref.load_state_dict(other_new.state_dict())
    for a, b in zip(new.state_dict().values(), other_ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("number", sorted(PROBLEMS))
@pytest.mark.parametrize("m", [2, 3, 40])
def test_cpu_forward_is_the_reference(number, m):
    ref, new = small_pair(number, seed=m)
    x = torch.rand(m, get_problem(number).small_init[0])
    with torch.no_grad():
        expect, got = ref(x), new(x)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert new.last_path == "torch"


def test_problem75_output_shape_is_the_broadcast():
    ref, new = small_pair(75)
    x = torch.rand(5, 96)
    with torch.no_grad():
        assert new(x).shape == ref(x).shape == (1, 64, 5, 1)


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_to_dtype_after_construction(number):
    ref, new = small_pair(number)
    ref, new = ref.to(dtype=torch.float64), new.to(dtype=torch.float64)
    x = torch.rand(4, get_problem(number).small_init[0], dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref(x))


def test_autograd_runs_the_differentiable_path():
    ref, new = small_pair(62)
    x = torch.rand(6, 96)
    new(x).sum().backward()
    ref(x).sum().backward()
    assert new.last_path == "torch"
    torch.testing.assert_close(new.fc.weight.grad, ref.fc.weight.grad)


def test_problem_files_follow_kernelbench_format():
    for problem in PROBLEMS.values():
        module = problem.load()
        init = module.get_init_inputs()
        inputs = module.get_inputs()
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in inputs)
        assert inputs[0].shape == (1024, 8192) and init[:3] == [8192, 8192, 512]
        assert 0.0 <= inputs[0].min() and inputs[0].max() < 1.0  # torch.rand


def test_unknown_problem():
    with pytest.raises(ValueError, match="gemmfuse ships problems"):
        get_problem(1)
