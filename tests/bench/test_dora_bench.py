"""The DoRA-vs-LoRA CPU benchmark runs at a tiny size and reports both steps (no timing assertions)."""

from __future__ import annotations

import pytest

from bench.kernels.dora_cpu import run

pytestmark = pytest.mark.slow  # a benchmark run


def test_dora_bench_tiny():
    lines = run(adapters=2, prefill_rows=4, repeats=0)
    assert [line.split(":")[0] for line in lines] == ["decode", "prefill"]
    assert all("DoRA epilogue alone" in line and "x)" in line for line in lines)
