"""scripts/problem_floors.py and floor_doc.py (docs/PERFORMANCE.md's "Against the floor"): a
problem's work read off its Model on the meta device, and the floors it sets."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from floor_doc import floor_rows, format_floor_rows  # noqa: E402
from problem_floors import floors, problem_work  # noqa: E402

PROBLEMS = ROOT / "src" / "gemmfuse" / "kernelbench" / "problems"


def test_the_work_of_62_is_its_gemm_and_its_tensors_once():
    work = problem_work(PROBLEMS / "p62_matmul_groupnorm_leakyrelu_sum.py")
    m, k, n = 1024, 8192, 8192
    assert work["products"] == [(m, k, n)]
    assert work["flop"] == 2 * m * k * n
    # x, W, the Linear's bias, the GroupNorm's weight and bias, the output: float32 each
    assert work["bytes"] == 4 * (m * k + n * k + 3 * n + m * n)


def test_every_linear_counts():
    work = problem_work(ROOT / "tests" / "kernelbench_models" / "mixed_blocks.py")
    assert len(work["products"]) >= 3
    assert work["flop"] == sum(2 * m * k * n for m, k, n in work["products"])


def test_the_floor_is_the_larger_of_compute_and_bytes():
    compute_bound = floors(137.4e9, 336e6)
    assert compute_bound["floor"] == compute_bound["split_measured"]
    assert compute_bound["split_measured"] == pytest.approx(3 * 137.4e9 / 800e12)
    memory_bound = floors(274.9e9, 4312e6)
    assert memory_bound["floor"] == memory_bound["memory"] == pytest.approx(4312e6 / 2.86e12)


def test_the_table_gives_each_problem_its_fraction_of_the_floor():
    work = {"rows": [{"file": "p62_matmul_groupnorm_leakyrelu_sum.py", "products": [[1, 2, 3]],
                      "flop": 800e9 / 3, "bytes": 1.0}]}  # fmt: skip
    harness = [{"problem": 62, "what": "forward", "impl": impl, "mean": ms}
               for impl, ms in (("eager", 4.0), ("gemmfuse", 2.0))]  # fmt: skip
    rows = floor_rows(work, harness, "abc1234", None, "")
    assert [r["problem"] for r in rows] == ["#62"]
    table = format_floor_rows(rows)
    assert "| 1.000 (compute) | 2.000 | 50% |" in table  # 3 x (800/3) GFLOP at 800 TFLOP/s


def test_matrix_vector_products_count(tmp_path):
    problem = tmp_path / "mv.py"
    problem.write_text(
        "import torch\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.randn(8, 16))\n"
        "    def forward(self, x):\n"
        "        return torch.dot(torch.mv(self.w, x), torch.ones(8))\n"
        "def get_inputs():\n"
        "    return [torch.randn(16)]\n"
        "def get_init_inputs():\n"
        "    return []\n"
    )
    work = problem_work(problem)
    assert work["products"] == [(8, 16, 1), (1, 8, 1)]
    assert work["flop"] == 2 * 8 * 16 + 2 * 8
