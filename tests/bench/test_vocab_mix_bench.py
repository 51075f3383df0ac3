"""The saved-LM-head / weighted-mix batch benchmark runs at a tiny size and reports every kind (no timing
assertions)."""

from __future__ import annotations

import pytest

from bench.common.workload import ModelSpec
from bench.offline.vocab_mix import run

pytestmark = pytest.mark.slow  # a benchmark run


def test_vocab_mix_bench_tiny(tmp_path):
    spec = ModelSpec(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    lines = run(requests=4, prompt_len=6, new_tokens=3, repeats=1, spec=spec, workdir=tmp_path)
    assert [line.split(":")[0] for line in lines] == [
        "plain LoRA",
        "saved LM head",
        "saved LM head, default side budget",
        "mix of 2",
    ]
    assert "side stores 0.0 MiB" in lines[0] and "side stores 0.0 MiB" not in lines[1]
    assert all("resident" in line and "x)" in line for line in lines)
