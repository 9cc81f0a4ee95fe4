import ast
import sys

import pytest
import torch

from gemmfuse.kernelbench.export import standalone_source
from gemmfuse.kernelbench.registry import PROBLEMS, get_problem


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_is_self_contained(number):
    source = standalone_source(number)
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            imported.add(node.module.split(".")[0])
    assert "gemmfuse" not in imported
    assert imported <= set(sys.stdlib_module_names) | {"torch"}
    assert "__file__" not in source
    assert "load_inline" in source and "mma.sync" in source  # CUDA inlined


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_runs_under_exec(number):
    namespace: dict = {}
    exec(standalone_source(number), namespace)
    problem = get_problem(number)
    module = problem.load()
    torch.manual_seed(5)
    ref = module.Model(*problem.small_init)
    torch.manual_seed(5)
    new = namespace["ModelNew"](*problem.small_init)
    x = torch.rand(7, problem.small_init[0])
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_embeds_every_structure_model_new_launches(number):
    """The fused chain built in forward is among the embedded kernel structures."""
    namespace: dict = {}
    exec(standalone_source(number), namespace)
    problem = get_problem(number)
    embedded = set(namespace["_SOURCES"])
    seen = []
    real = namespace["fused_linear_with_path"]

    def spy(x, weight, bias, epilogue, *args, **kwargs):
        seen.append(epilogue)
        return real(x, weight, bias, epilogue, *args, **kwargs)

    namespace["fused_linear_with_path"] = spy
    new = namespace["ModelNew"](*problem.small_init)
    with torch.no_grad():
        new(torch.rand(3, problem.small_init[0]))
    assert seen
    for epi in seen:
        assert repr(epi.structure) in embedded
