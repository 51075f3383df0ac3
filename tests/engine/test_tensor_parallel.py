"""Tensor parallel at TP=2 (gloo, two ranks on the CPU): greedy tokens equal HF transformers + PEFT (and
so TP=1) for Llama, Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norm) and Phi-3 (fused qkv / gate_up
checkpoint tensors and adapter targets, partial rotary), with base rows and adapters
of different ranks (rsLoRA, rank_pattern/alpha_pattern) in one batch, chunked prefill, preemption and a
prefix-cache hit. One TP=2 engine per family, shared by the module's tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PHI3_ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

ADAPTERS = ("all7-r4", "qv-r8-rslora", "pattern-r16", "gud-r12")
NEW = 6


def tp_llm(base: Path, tp: int = 2, **kwargs) -> LLM:
    """A float32 CPU engine at `tp` ranks with small blocks, a small step budget (prompts are prefilled
    in chunks) and few KV blocks (the batch preempts)."""
    defaults = dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=32, max_loras=4)
    defaults |= dict(max_num_batched_tokens=24, num_kv_blocks=40, tensor_parallel_size=tp)
    return LLM(str(base), **(defaults | kwargs))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "phi3"])
def family(request, tmp_path_factory):
    """(TP=2 engine, adapter dirs, PEFT oracle) for one family; the engine's workers stop afterwards."""
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    base = build_checkpoint(root / "base", request.param)
    specs = PHI3_ADAPTER_SPECS if request.param == "phi3" else {n: ADAPTER_SPECS[n] for n in ADAPTERS}
    dirs = {n: build_adapter(base, root / n, seed=i, **spec) for i, (n, spec) in enumerate(specs.items())}
    llm = tp_llm(base)
    yield llm, dirs, PeftGreedyOracle(base)
    llm.engine.shutdown()


def mixed_requests(dirs, seed: int, n: int, lengths=(2, 40)) -> list[tuple[list[int], str | None]]:
    rng = random.Random(seed)
    names = [*dirs, None]
    return [([rng.randrange(3, 96) for _ in range(rng.randrange(*lengths))], names[i % 5]) for i in range(n)]


def generate(llm: LLM, dirs, reqs, params=None):
    loras = [LoRARequest(name, str(dirs[name])) if name else None for _, name in reqs]
    params = params or SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return llm.generate([p for p, _ in reqs], params, lora_request=loras)


def test_mixed_adapters_equal_peft(family):
    """Base rows and four adapters of ranks 1..32 in one batch; prompts up to 40 tokens are prefilled in
    chunks under a 24-token budget and 40 KV blocks of 4 make the batch preempt."""
    llm, dirs, oracle = family
    reqs = mixed_requests(dirs, 0, 10)
    before = llm.engine.get_stats().num_preemptions
    for (prompt, name), out in zip(reqs, generate(llm, dirs, reqs), strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW, dirs[name] if name else None), name
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > before
    assert stats.kv_blocks_used == 0


def test_prefix_cache_hit_equal(family):
    """The same adapter prompts again: their KV comes from the prefix cache (every rank's heads of it)."""
    llm, dirs, oracle = family
    reqs = mixed_requests(dirs, 1, 3, lengths=(17, 30))
    first = [o.outputs[0].token_ids for o in generate(llm, dirs, reqs)]
    hits = llm.engine.get_stats().prefix_cache_hits
    again = [o.outputs[0].token_ids for o in generate(llm, dirs, reqs)]
    assert llm.engine.get_stats().prefix_cache_hits > hits
    assert again == first
    for (prompt, name), toks in zip(reqs, first, strict=True):
        assert toks == oracle.greedy(prompt, NEW, dirs[name] if name else None), name
