"""`bench.offline.moe_lora` on a tiny shape: every leg timed each run, the adapters all resident without
evictions (the LoRA legs ran LoRA, and no load is timed as decode), the ratios computed from the legs."""

from __future__ import annotations

import pytest

from bench.offline.moe import MoEShape
from bench.offline.moe_lora import LEGS, run_moe_lora_bench


def test_four_legs_and_the_overhead_quotient(tmp_path) -> None:
    shape = MoEShape(layers=2, experts=4, top_k=2, hidden=64, expert_inter=32, heads=4, kv_heads=2, vocab=256)
    r = run_moe_lora_bench(tmp_path, shape, adapters=3, batch=4, rank=4, new_tokens=4, runs=2)
    assert set(r.step_ms) == set(LEGS) and all(len(v) == 2 and min(v) > 0 for v in r.step_ms.values())
    assert r.resident == {"moe": 3, "dense": 3} and r.evictions == {"moe": 0, "dense": 0}
    moe = [a / b for a, b in zip(r.step_ms["moe_lora"], r.step_ms["moe_base"], strict=True)]
    assert r.overhead("moe") == pytest.approx(moe)
    assert r.quotient() == pytest.approx([m / d for m, d in zip(moe, r.overhead("dense"), strict=True)])
    text = r.markdown()
    assert "MoE overhead / dense overhead" in text and text.count("| moe_") == 2
    assert set(r.to_dict()) >= {"summary", "overhead_moe", "overhead_dense", "quotient"}
