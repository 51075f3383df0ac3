"""`bench.offline.moe_lora` on a tiny shape: every leg timed each run, the adapters all resident without
evictions (the LoRA legs ran LoRA, and no load is timed as decode), the expert LoRA's fused and op-by-op
legs giving the same tokens, the ratios computed from the legs."""

from __future__ import annotations

import pytest

from bench.offline.moe import MoEShape
from bench.offline.moe_lora import LEGS, run_moe_lora_bench


def test_legs_and_the_overhead_quotient(tmp_path) -> None:
    shape = MoEShape(layers=2, experts=4, top_k=2, hidden=64, expert_inter=32, heads=4, kv_heads=2, vocab=256)
    r = run_moe_lora_bench(tmp_path, shape, adapters=3, batch=4, rank=4, new_tokens=4, runs=2)
    assert set(r.step_ms) == set(LEGS) and all(len(v) == 2 and min(v) > 0 for v in r.step_ms.values())
    assert r.resident == {"moe": 3, "dense": 3} and r.evictions == {"moe": 0, "dense": 0}
    moe = [a / b for a, b in zip(r.step_ms["moe_lora"], r.step_ms["moe_base"], strict=True)]
    assert r.overhead("moe") == pytest.approx(moe)
    assert r.quotient() == pytest.approx([m / d for m, d in zip(moe, r.overhead("dense"), strict=True)])
    op = [o / f for o, f in zip(r.step_ms["moe_lora_op"], r.step_ms["moe_lora"], strict=True)]
    assert r.op_over_fused() == pytest.approx(op) and r.fused_same_tokens
    assert r.lora_changed_tokens == {"moe": True, "dense": True}
    text = r.markdown()
    assert "MoE overhead / dense overhead" in text and text.count("| moe_") == 3
    assert set(r.to_dict()) >= {"summary", "overhead_moe", "overhead_dense", "quotient", "op_over_fused"}
