"""Greedy generations checked against transformers' own cached greedy decoding (the family tests)."""

from __future__ import annotations

import random
from pathlib import Path

from engine import LLM, SamplingParams

NEW = 10  # tokens generated per prompt


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """One prompt of random token ids (3..95) per length in `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in lengths]


def fp32_cpu_llm(ckpt: Path, **kwargs) -> LLM:
    """A float32 CPU engine on checkpoint `ckpt` with 4-token blocks (kwargs override)."""
    return LLM(str(ckpt), **({"device": "cpu", "dtype": "float32", "block_size": 4} | kwargs))


def check_greedy(llm: LLM, oracle, prompts: list[list[int]]):
    """Greedy tokens == transformers' cached greedy decoding (what `generate` does) for every prompt;
    every KV block is free or cached afterwards. Returns the engine's stats."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy_cached(prompt, NEW), f"prompt of {len(prompt)}"
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_used == 0
    return stats
