"""The engine-level DoRA-vs-plain-LoRA batch benchmark runs at a tiny size and reports both kinds (no timing
assertions)."""

from __future__ import annotations

import math
import re

import pytest

from bench.common.workload import ModelSpec
from bench.offline.dora import run

pytestmark = pytest.mark.slow  # a benchmark run


def test_dora_offline_bench_tiny(tmp_path):
    spec = ModelSpec(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    lines = run(adapters=3, rank=4, prompt_len=6, new_tokens=3, repeats=1, spec=spec, workdir=tmp_path)
    assert [line.split(" (")[0] for line in lines] == ["plain LoRA", "DoRA"]
    assert all("hidden 64, inter 128, 2 layers" in line and "3 adapters rank 4" in line for line in lines)
    ratios = [float(x) for x in re.findall(r"\(([0-9.]+)x\)", lines[1])]
    assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert re.findall(r"\(([0-9.]+)x\)", lines[0]) == ["1.000", "1.000"]
