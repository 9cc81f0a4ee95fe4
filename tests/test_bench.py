"""gemmfuse.bench's tables (the timing itself needs a GPU: scripts/gpu_check.py runs it)."""

from gemmfuse.bench import Result, format_table


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
