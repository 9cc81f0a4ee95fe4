import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_files import FIT, UNFIT, load, path_of

from gemmfuse.epilogue import Epilogue, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.kernelbench import export
from gemmfuse.kernelbench.export import (
    ExportError,
    standalone_source,
    standalone_source_for_file,
)
from gemmfuse.kernelbench.registry import PROBLEMS, get_problem
from gemmfuse.sources import extension_sources


def check_self_contained(source):
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
def test_export_is_self_contained(number):
    check_self_contained(standalone_source(number))


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


STRUCTURES = [
    Epilogue(norm=GroupNormSpec(1)),
    Epilogue(pre=(Pointwise("mul", (Param(0),)), Pointwise("gelu_tanh"))),
    Epilogue(
        pre=(Pointwise("add", (1.0,)),),
        norm=GroupNormSpec(4, affine=False),
        post=(Pointwise("clamp", (0.0, 1.0)), Pointwise("rdiv", (Param(1),))),
        reduce=Reduction("logsumexp", True),
        tail=(Pointwise("relu"),),
    ),
]


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_builds_the_sources_of_any_structure(number):
    """The embedded csrc/ files flatten to the package's own sources, for any chain: not only
    for the structures the problem's ModelNew launches."""
    namespace: dict = {}
    exec(standalone_source(number), namespace)
    for structure in STRUCTURES:
        theirs = eval(repr(structure.structure), namespace)  # the file's own IR classes
        assert namespace["extension_sources"](theirs) == extension_sources(structure.structure)


def test_bundled_modules_define_each_top_level_name_once():
    seen = {}
    for module in export.BUNDLED_MODULES + export.OPTIMIZE_MODULES:
        for name, binding in export._bindings(export._module_body(module)).items():
            assert seen.setdefault(name, (module.__name__, binding))[1] == binding, name


@pytest.fixture(scope="module")
def exported():
    """name -> (standalone source, export report), built once for the module."""
    return {name: standalone_source_for_file(path_of(name)) for name in FIT}


@pytest.mark.parametrize("name", FIT)
def test_problem_file_export_is_self_contained(name, exported):
    source, report = exported[name]
    check_self_contained(source)
    assert path_of(name).read_text().strip() in source  # the problem verbatim
    assert report.fused and all(r.verified is None for r in report.fused)  # meta: unchecked


@pytest.mark.parametrize("name", FIT)
def test_problem_file_export_matches_model(name, exported):
    namespace: dict = {}
    exec(exported[name][0], namespace)
    module = load(name)
    init = module.get_init_inputs()
    torch.manual_seed(11)
    ref = module.Model(*init)
    torch.manual_seed(11)
    new = namespace["ModelNew"](*init)
    ref_state, new_state = ref.state_dict(), new.state_dict()
    assert list(ref_state) == list(new_state)
    for key in ref_state:
        assert torch.equal(ref_state[key], new_state[key]), key
    torch.manual_seed(12)
    inputs = module.get_inputs()
    new.kernel = "portable"
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), ref(*inputs), rtol=0, atol=0)
        torch.testing.assert_close(new(*inputs), ref(*inputs), rtol=0, atol=0)  # second call
    assert list(new.state_dict()) == list(ref_state)  # the rewrite is not a submodule
    report = new.gemmfuse_report
    assert [r.name for r in report.fused] == [r.name for r in exported[name][1].fused]
    fused = [m for m in new.__dict__["_gemmfuse"][0].modules() if hasattr(m, "weight_split")]
    assert fused and all(m.kernel == "portable" for m in fused)
    assert new.last_path == "torch"


def test_model_new_traces_models_forward_not_its_own(exported):
    namespace: dict = {}
    exec(exported["mixed_blocks"][0], namespace)
    new = namespace["ModelNew"](*load("mixed_blocks").get_init_inputs())
    assert new.gemmfuse_report is None
    with torch.no_grad():
        new(torch.rand(3, 64))
    assert "ModelNew" in str(new.gemmfuse_report) and len(new.gemmfuse_report.fused) == 4


@pytest.mark.parametrize("name", UNFIT)
def test_a_file_with_nothing_to_swap_is_refused_naming_why(name):
    with pytest.raises(ExportError, match=r"no Linear of Model can be swapped: fc: not swapped"):
        standalone_source_for_file(path_of(name))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "problem.py"
    path.write_text(text)
    return path


PREAMBLE = "import torch\nimport torch.nn as nn\n\n"
INPUTS = (
    "def get_inputs():\n    return [torch.rand(4, 8)]\n\n\ndef get_init_inputs():\n    return []\n"
)


@pytest.mark.parametrize(
    "text, message",
    [
        ("x = 1\n", "not a KernelBench problem file (no Model, get_inputs, get_init_inputs)"),
        ("raise SystemError('no')\n", "loading it failed (SystemError: no)"),
        (
            PREAMBLE + "class Model(nn.Module):\n    def forward(self, x):\n"
            "        return torch.relu(x)\n\n\n" + INPUTS,
            "Model.forward calls no nn.Linear",
        ),
        (
            PREAMBLE + "class Model(nn.Module):\n    def __init__(self):\n"
            "        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
            "    def forward(self, x):\n        return self.fc(x) if x.sum() > 0 else x\n\n\n"
            + INPUTS,
            "tracing Model.forward with torch.fx failed",
        ),
        (
            PREAMBLE + "TILE = 3\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
            "        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
            "    def forward(self, x):\n        return self.fc(x)\n\n\n" + INPUTS,
            "top-level names ['TILE'] clash with the bundled gemmfuse code",
        ),
    ],
)
def test_unusable_files_raise_export_errors(tmp_path, text, message):
    with pytest.raises(ExportError, match=re.escape(message)):
        standalone_source_for_file(write(tmp_path, text))


def test_problem_future_import_is_dropped(tmp_path):
    text = (path_of("activations_no_norm")).read_text()
    source, _ = standalone_source_for_file(
        write(tmp_path, "from __future__ import annotations\n" + text)
    )
    assert source.count("from __future__ import annotations") == 1
    exec(source, {})


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "gemmfuse", "export", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_exports_a_problem_file():
    proc = cli(str(path_of("gemm_groupnorm_min_bias")))
    assert proc.returncode == 0, proc.stderr
    assert "gemm: fused gemm -> group_norm -> min(dim=1, keepdim=True) -> x + bias" in proc.stderr
    namespace: dict = {}
    exec(proc.stdout, namespace)
    assert "ModelNew" in namespace


def test_cli_refuses_a_file_with_nothing_to_swap():
    proc = cli(str(path_of("unfit_batched_linear")))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "gemmfuse export:" in proc.stderr
    assert "fc: not swapped: its input is 3-D (8, 16, 32)" in proc.stderr
