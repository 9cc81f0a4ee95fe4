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


def test_the_harness_keeps_the_first_rounds_figures_and_every_rounds_mean(monkeypatch):
    """bench_harness.run_problem times every row once a round; a row shows its first round's
    figures (KernelBench times once) and keeps each round's mean, in timing order."""
    import gemmfuse.bench_harness as harness

    class Model:
        last_path = "fused"

    model, calls = Model(), []

    def fake_entries(name):
        return [(f"{name} forward", f"eager {name}", "eager", (), None),
                (f"{name} forward", f"gemmfuse {name}", "ours", (), model)]  # fmt: skip

    def fake_time(fn, args, trials):
        calls.append(fn)
        ms = float(len(calls))
        return {"mean": ms, "median": ms + 0.5, "min": ms, "max": ms}

    monkeypatch.setattr(harness, "_fp32_entries", lambda n, c: (fake_entries("fp32"), None, None))
    monkeypatch.setattr(harness, "_16bit_entries", lambda n, dtype, name, x, g: fake_entries(name))
    monkeypatch.setattr(harness, "time_cuda_events", fake_time)
    rows = harness.run_problem(62, trials=100, compile_=False, rounds=3)
    impls = ["eager fp32", "gemmfuse fp32", "eager bf16", "gemmfuse bf16", "eager fp16",
             "gemmfuse fp16"]  # fmt: skip
    assert [r["impl"] for r in rows] == impls
    assert calls == ["eager", "ours"] * 9  # each round times every row once, in order
    assert [r["mean"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert rows[1]["round_means"] == [2.0, 8.0, 14.0] and rows[1]["median"] == 2.5
    assert [r["path"] for r in rows[:2]] == ["-", "fused"]


def test_the_harness_table_gives_the_ratio_to_eager_round_by_round():
    from gemmfuse.bench_harness import format_rows

    def row(impl, means):
        return {"problem": 62, "what": "forward", "impl": impl, "path": "-", "mean": means[0],
                "median": means[0], "round_means": means}  # fmt: skip

    table = format_rows([row("eager", [3.0, 3.0, 3.3]), row("gemmfuse", [0.6, 0.5, 0.6])])
    assert "| 5.00x | 5.00x | 5.00-6.00x |" in table
    old = [{k: v for k, v in r.items() if k != "round_means"}
           for r in (row("eager", [3.0]), row("gemmfuse", [0.6]))]  # fmt: skip
    assert "| 5.00x | 5.00x | - |" in format_rows(old)  # a JSON from before the rounds
