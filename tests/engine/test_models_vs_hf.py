"""Greedy generations must equal transformers' for every supported family, however the engine batches."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import ARCHS

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

NEW_TOKENS = 10


def _prompts(seed: int, lengths: list[int], vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _check(llm: LLM, oracle, prompts: list[list[int]]) -> None:
    outs = llm.generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_used == 0, "every block is free or cached after the run"
    assert llm.engine.runner.backend.native.steps_served > 0  # decodes took the native CPU attention
    return stats


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_mixed_lengths_matches_hf(arch, checkpoint, oracle):
    ckpt = checkpoint(arch)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)
    _check(llm, oracle(ckpt), _prompts(1, [3, 17, 40, 9, 1]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_matches_hf(arch, checkpoint, oracle):
    ckpt = checkpoint(arch)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=7)
    _check(llm, oracle(ckpt), _prompts(2, [23, 30, 12]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_under_small_cache_matches_hf(arch, checkpoint, oracle):
    ckpt = checkpoint(arch)
    # Each request needs up to ceil((20+10)/4) = 8 blocks; 4 of them cannot all fit in 14 blocks.
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=14)
    stats = _check(llm, oracle(ckpt), _prompts(3, [20, 18, 19, 17]))
    assert stats.num_preemptions > 0


def test_shared_prefix_hits_cache_and_matches_hf(checkpoint, oracle):
    ckpt = checkpoint("llama")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)
    prefix = _prompts(4, [24])[0]
    first = [prefix + [5, 6, 7]]
    _check(llm, oracle(ckpt), first)
    before = llm.engine.get_stats().prefix_cache_hits
    tails = _prompts(5, [3, 6, 1])
    stats = _check(llm, oracle(ckpt), [prefix + t for t in tails])
    # The 24-token prefix is 6 full blocks; each of the three prompts reuses all of them.
    assert stats.prefix_cache_hits - before == 3 * 24


def test_prefix_cache_disabled_recomputes(checkpoint, oracle):
    ckpt = checkpoint("llama")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, enable_prefix_caching=False)
    p = _prompts(6, [16])[0]
    _check(llm, oracle(ckpt), [p, p])
    assert llm.engine.get_stats().prefix_cache_hits == 0


def test_bfloat16_checkpoint_loads_as_auto(tmp_path):
    import torch

    from engine.cpu_features import native_bfloat16
    from tests.helpers.tiny_models import build_checkpoint

    ckpt = build_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    llm = LLM(str(ckpt), device="cpu")  # dtype="auto": bfloat16 where this CPU computes it natively
    expected = torch.bfloat16 if native_bfloat16() else torch.float32
    assert llm.engine.dtype == expected
    assert llm.engine.model.embed_tokens.weight.dtype == expected
    out = llm.generate([[5, 6, 7]], _greedy(4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_sharded_checkpoint_loads(tmp_path, checkpoint, oracle):
    from transformers import AutoModelForCausalLM

    src = checkpoint("mistral")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    _check(llm, oracle(src), _prompts(7, [5, 11]))
