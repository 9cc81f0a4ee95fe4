import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_files import FIT, UNFIT, assert_computes_the_model, load, path_of

from gemmfuse.epilogue import Epilogue, GroupNormSpec, Param, Pointwise, Reduction
from gemmfuse.kernel_files import read_csrc
from gemmfuse.kernelbench import export
from gemmfuse.kernelbench.export import (
    ExportError,
    standalone_source,
    standalone_source_for_file,
)
from gemmfuse.kernelbench.harness import load_custom_model, static_check_errors
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
    export._check_names(export._bundle(export.BUNDLED_MODULES + export.OPTIMIZE_MODULES))


def test_a_name_bound_twice_is_an_export_error():
    pieces = [("a", "import os\nX = 1\n"), ("b", "import os\ndef X():\n    return 2\n")]
    with pytest.raises(ExportError, match=r"'X' \(a and b\)"):
        export._check_names(pieces)
    export._check_names(pieces[:1] + [("b", "import os\n")])  # one import twice is one binding


def test_package_imports_on_several_lines_are_dropped():
    source = (
        "import torch\nfrom gemmfuse.epilogue import (\n    Epilogue,\n    Param,\n)\n"
        "import gemmfuse.sources as sources\n\nX = Epilogue\n"
    )
    code, names, modules = export._strip_package_imports(source, "m")
    assert code == "import torch\n\nX = Epilogue\n"
    assert names == ["Epilogue", "Param", "sources"]
    assert modules == {"gemmfuse.epilogue", "gemmfuse.sources"}
    with pytest.raises(ExportError, match="lines \\[2\\] to the top level"):
        export._strip_package_imports("def f():\n    from gemmfuse import ops\n", "m")


def test_embedded_csrc_is_the_package_csrc_line_for_line():
    namespace: dict = {}
    exec(export._embedded_csrc(), namespace)
    assert namespace["read_csrc"]() == read_csrc()
    for text in read_csrc().values():  # raw multi-line literals: each CUDA line its own line
        assert all(line in export._embedded_csrc() for line in text.splitlines()[:50])


SHIPPED_EXPORTS = {number: standalone_source(number) for number in sorted(PROBLEMS)}


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_passes_kernelbench_static_checker(number):
    assert static_check_errors(SHIPPED_EXPORTS[number]) == []


def test_static_checker_replica_flags_what_kernelbench_flags():
    assert static_check_errors("x = 1\n") == [
        "Missing __global__ kernel definition",
    ]
    kernel = "s = '__global__ void k() {}'\nload_inline\n"
    assert static_check_errors(kernel) == []
    assert static_check_errors("s = '// __global__'\nload_inline\n") == [
        "Missing __global__ kernel definition"
    ]
    flagged = {
        "try:\n    x = 1\n": "try-except",
        "y = 'the forward pass'\n": "'pass' statement",
        "import threading\n": "threading",
        "time.perf_counter = f\n": "timing function",
        "class T(torch.Tensor):\n    x = 1\n": "tensor subclass",
    }
    for code, what in flagged.items():
        errors = static_check_errors(kernel + code)
        assert len(errors) == 1 and what.split()[0].lower() in errors[0].lower(), (code, errors)
    assert static_check_errors(kernel + "x = 1  # try: pass\n") == []  # comments are cut


def shipped_ref_and_input(number):
    problem = get_problem(number)
    torch.manual_seed(5)
    ref = problem.load().Model(*problem.small_init)
    return problem, ref, torch.rand(7, problem.small_init[0])


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_loads_as_kernelbench_loads_it(number, tmp_path, monkeypatch):
    """KernelBench's load_custom_model: the build-directory prefix, compile, then exec."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # restored after the test
    problem, ref, x = shipped_ref_and_input(number)
    model_new = load_custom_model(SHIPPED_EXPORTS[number], str(tmp_path / "build"))
    torch.manual_seed(5)
    new = model_new(*problem.small_init)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "build")
    assert new.__module__ != "gemmfuse.kernelbench.models"
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_export_loads_as_an_unregistered_module(number, tmp_path):
    """KernelBench's other loader: a temp file run by importlib, not put in sys.modules; and
    exec under any __name__ (dataclasses look annotations' modules up in sys.modules)."""
    problem, ref, x = shipped_ref_and_input(number)
    path = tmp_path / "solution.py"
    path.write_text(SHIPPED_EXPORTS[number])
    spec = importlib.util.spec_from_file_location("temp_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "temp_module" not in sys.modules
    namespace = {"__name__": "anything"}
    exec(SHIPPED_EXPORTS[number], namespace)
    for model_new in (module.ModelNew, namespace["ModelNew"]):
        torch.manual_seed(5)
        new = model_new(*problem.small_init)
        with torch.no_grad():
            torch.testing.assert_close(new(x), ref(x), rtol=0, atol=0)


@pytest.fixture(scope="module")
def exported():
    """name -> (standalone source, export report), built once for the module."""
    return {name: standalone_source_for_file(path_of(name)) for name in FIT}


@pytest.mark.parametrize("name", FIT)
def test_problem_file_export_is_self_contained(name, exported):
    source, report = exported[name]
    check_self_contained(source)
    assert export._problem_code(path_of(name).read_text()).strip() in source
    assert static_check_errors(source) == []
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
        assert_computes_the_model(name, ref, new(*inputs), inputs)
        assert_computes_the_model(name, ref, new(*inputs), inputs)  # second call
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
    assert "ModelNew" in str(new.gemmfuse_report) and len(new.gemmfuse_report.fused) == 5


@pytest.mark.parametrize("name", UNFIT)
def test_a_file_with_nothing_to_swap_is_refused_naming_why(name):
    with pytest.raises(ExportError, match=r"no Linear of Model can be swapped: \w+: not swapped"):
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
            "Model.forward calls no Linear (nn.Linear, F.linear, or x @ W.T on an attribute W)",
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
            "top-level names bound twice in the export's one namespace: 'TILE' "
            "(gemmfuse.dispatch and",
        ),
    ],
)
def test_unusable_files_raise_export_errors(tmp_path, text, message):
    with pytest.raises(ExportError, match=re.escape(message)):
        standalone_source_for_file(write(tmp_path, text))


def test_problem_future_import_is_dropped(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # restored after the test
    text = (path_of("activations_no_norm")).read_text()
    source, _ = standalone_source_for_file(
        write(tmp_path, "from __future__ import annotations\n" + text)
    )
    assert "from __future__" not in source
    exec(source, {})
    exec(f"import os\nos.environ['TORCH_EXTENSIONS_DIR'] = '{tmp_path}'\n{source}", {})


def test_problem_docstrings_are_dropped_keeping_the_code(tmp_path):
    text = (path_of("activations_no_norm")).read_text()
    documented = text.replace(
        "class Model(nn.Module):\n",
        'class Model(nn.Module):\n    """A model whose forward pass: try: it."""\n',
        1,
    )
    source, _ = standalone_source_for_file(write(tmp_path, documented))
    assert "A model whose" not in source and "try: it" not in source
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
    proc = cli(str(path_of("unfit_computed_weight")))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "gemmfuse export:" in proc.stderr
    assert "linear: not swapped: its weight is computed in the forward" in proc.stderr
