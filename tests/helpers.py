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
