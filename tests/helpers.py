"""Shared test utilities: model pairs and error measures."""

from __future__ import annotations

import copy

import torch

from gemmfuse.bench import build_pair, max_abs_err, poison_allocator  # noqa: F401
from gemmfuse.kernelbench.registry import get_problem


def small_pair(number: int, seed: int = 0, init=None):
    problem = get_problem(number)
    return build_pair(problem, list(init or problem.small_init), seed)


def run_both(ref, new, x):
    """(eager fp32, float64 reference, gemmfuse) outputs for input x; new's output poisoned."""
    with torch.no_grad():
        expect = ref(x)
        exact = copy.deepcopy(ref).double()(x.double())
        if x.is_cuda:
            poison_allocator(expect.numel() * 4, x.device)
        got = new(x)
    return expect, exact, got


# The float64 bar of issue 4. The split-fp16 GEMM's error is below eager fp32's at the bar's
# shapes (5-7x below at K = 8192), but at small K, where eager's own accumulation error is a few
# ulps, the tensor cores' round-toward-zero accumulation leaves it larger: 1.2x to 3.0x eager's
# on the 26 cases at K = 64..128 of the 2026-11-22 H100 run (all allclose 1e-4). Below STRICT_K
# the bar is that measured gap, rounded up; docs/DESIGN.md section 2 and the issue notes say so.
STRICT_K = 1024
SMALL_K_FACTOR = 4.0


def float64_bar(err_eager: float, op_floor: float, k: int) -> float:
    """The largest max-abs error against float64 accepted: eager fp32's plus the chain's own fp32
    op rounding (its ops on the exactly rounded GEMM result), times SMALL_K_FACTOR below
    STRICT_K."""
    bar = err_eager + op_floor
    return bar if k >= STRICT_K else SMALL_K_FACTOR * bar
