"""pointwise.py's table: every meaning of an op in its row, and what is generated from it."""

from pathlib import Path

import pytest
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse.chains import UNITS
from gemmfuse.modules import MODULE_OPS
from gemmfuse.optimize.grammar import _ACTS, _BINARY, _Refusal
from gemmfuse.pointwise import POINTWISE, pointwise_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_lists_the_table():
    """The README's list is pointwise_markdown()'s text (paste it there when a row changes)."""
    assert pointwise_markdown() in README.read_text(), pointwise_markdown()


def test_every_row_is_documented_and_drawn():
    """Each op has its README words and appears in the random chains (alone or in a guarded
    unit), so the GPU's chain tests reach its kernel code."""
    drawn = {op.name for unit in UNITS for op in unit}
    for name, d in POINTWISE.items():
        assert d.usage.startswith(f"`{name}"), name
        assert name in drawn, name


def test_spellings_reach_the_matcher():
    """Every spelling's targets are in optimize's tables with the row's op, every module class
    in MODULE_OPS; no target or module class is claimed by two rows."""
    rows_of = {}  # (F.relu_ is torch.relu_: one row may list a target twice)
    for name, d in POINTWISE.items():
        for t in [t for sp in d.spellings for t in sp.targets] + [c for c, _ in d.modules]:
            rows_of.setdefault(t, set()).add(name)
    assert all(len(rows) == 1 for rows in rows_of.values()), rows_of
    for name, d in POINTWISE.items():
        for spelling in d.spellings:
            table = _BINARY if d.tensor_arg else _ACTS
            for t in spelling.targets:
                assert t in table, (name, t)
                if d.tensor_arg:
                    assert table[t][0] == name
        for cls, _ in d.modules:
            assert MODULE_OPS[cls] is dict(d.modules)[cls]


@pytest.mark.parametrize(
    "module, expected",
    [
        (nn.ReLU6(), ("hardtanh", (0.0, 6.0))),
        (nn.GELU(approximate="tanh"), ("gelu_tanh", ())),
        (nn.GELU(approximate="none"), ("gelu", ())),
        (nn.LeakyReLU(0.2), ("leaky_relu", (0.2,))),
    ],
)
def test_module_settings_pick_the_op(module, expected):
    assert MODULE_OPS[type(module)](module) == expected


@pytest.mark.parametrize(
    "target, bound, expected",
    [
        ("clamp", {"min": 0.5, "max": None}, ("clamp", (0.5, float("inf")))),
        ("clamp_max", {"max": 2}, ("clamp", (float("-inf"), 2.0))),
        ("clamp", {"min": None, "max": None}, "clamp without bounds"),
        ("relu_", {"inplace": False}, ("relu", ())),
    ],
)
def test_spellings_make_ops(target, bound, expected):
    made = _ACTS[target].make(bound)
    assert (str(made) if isinstance(expected, str) else made) == expected


def test_a_setting_that_is_not_a_number_is_refused_by_name():
    made = _ACTS[F.leaky_relu].make({"negative_slope": "steep", "inplace": False})
    assert isinstance(made, _Refusal) and "negative_slope" in str(made)
