"""gemmfuse.bench's tables and its timing order, on fake CUDA events (the timing itself needs a
GPU: scripts/gpu_check.py runs it)."""

import itertools
from collections import Counter

import pytest
import torch

import gemmfuse.bench
from gemmfuse.bench import Result, balanced_orders, format_table, time_interleaved


def result(**ms) -> Result:
    return Result(62, "1024x8192", 3, True, ["fused"], 4e-5, 5e-6, ms=ms)


def test_the_compiled_column_gives_its_overhead_against_the_paired_uncompiled_call():
    table = format_table([result(eager=3.0, gemmfuse=0.6, gemmfuse_compiled=0.63,
                                 gemmfuse_paired=0.6)])  # fmt: skip
    assert "| 0.630 (+5.0% paired) |" in table
    assert "| 5.00x |" in table


def test_a_run_without_the_paired_time_shows_the_compiled_time_alone():
    table = format_table([result(eager=3.0, gemmfuse=0.6, gemmfuse_compiled=0.66)])
    assert "| 0.660 |" in table and "paired" not in table
    assert "| - |" in format_table([result(eager=3.0, gemmfuse=0.6)])


class FakeClock:
    """CUDA events on a clock that each fake call advances: its own ms, plus a penalty where it
    runs right after ``slow_after`` (the sweep's call timed after eager's)."""

    def __init__(self, monkeypatch, slow_after=None, penalty=0.0):
        self.now, self.order, self.slow_after, self.penalty = 0.0, [], slow_after, penalty
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(gemmfuse.bench, "L2_FLUSH_BYTES", 16)

    def call(self, name, ms):
        def fn(_x):
            if self.order and self.order[-1] == self.slow_after and name != self.slow_after:
                self.now += self.penalty
            self.order.append(name)
            self.now += ms

        return fn


def test_interleaved_timing_gives_each_call_its_own_times(monkeypatch):
    clock = FakeClock(monkeypatch)
    calls = [(clock.call(name, ms), None) for name, ms in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    assert time_interleaved(calls, [torch.zeros(2)], iters=9, warmup=1) == [1.0, 2.0, 3.0]
    assert sorted(clock.order[3:]) == sorted(["a", "b", "c"] * 9)
    clock.order.clear()
    assert time_interleaved(calls, [torch.zeros(2)], iters=2, warmup=0, orders=[[2, 0, 1]]) == [
        1.0, 2.0, 3.0,
    ]  # fmt: skip
    assert clock.order == ["c", "a", "b"] * 2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_put_each_call_after_each_other_equally_often(n):
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    pairs = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(pairs.values())) <= 1
    assert len(set(Counter(order[0] for order in orders).values())) == 1


def test_no_call_always_follows_the_same_one(monkeypatch):
    """The call timed right after eager's pays for it (20-30 us at the sweep's smallest sizes,
    H100): in a fixed order the same call would pay every time, and its median with it."""
    clock = FakeClock(monkeypatch, slow_after="eager", penalty=0.5)
    names = ("eager", "auto", "hopper", "epilogue")
    calls = [(clock.call(name, 1.0), None) for name in names]
    times = time_interleaved(calls, [torch.zeros(2)], iters=31, warmup=1)
    assert times == [1.0] * 4, times
    timed = clock.order[4:]
    after_eager = [b for a, b in zip(timed, timed[1:], strict=False) if a == "eager"]
    for name in names[1:]:
        assert 0 < after_eager.count(name) < 31 / 2, (name, after_eager)
