"""Models with sliding-window layers (window 8, prompts well past it) generate what transformers does:
a batch of 8 prompts, chunked prefill, preemption, and a prefix-cache hit whose cached blocks lie past
the window boundary."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

WINDOW = 8
NEW_TOKENS = 10
# family -> checkpoint overrides: every family with a window of 8 tokens (Gemma's tiny checkpoints have it)
WINDOWED = {
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": WINDOW},
    "gemma2": {},
    "gemma3": {},
}


def _prompts(seed: int, lengths: list[int], vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check(llm: LLM, oracle, prompts: list[list[int]], logprobs: bool = False):
    """Greedy tokens equal HF's; with `logprobs`, each generated token's log-probability too (1e-4)."""
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1 if logprobs else None
    )
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == oracle.greedy(prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
        if logprobs:
            ref = oracle.logprobs(prompt + comp.token_ids)
            for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
                assert entry[tok].logprob == pytest.approx(float(ref[len(prompt) - 1 + i, tok]), abs=1e-4)
    return llm.engine.get_stats()


@pytest.fixture(params=sorted(WINDOWED))
def windowed(request, checkpoint, oracle):
    """(checkpoint dir, its HF oracle) of a tiny model of the family whose layers have window 8."""
    ckpt = checkpoint(request.param, **WINDOWED[request.param])
    return ckpt, oracle(ckpt)


def test_eight_prompts_past_the_window_match_hf(windowed):
    ckpt, hf = windowed
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)
    _check(llm, hf, _prompts(1, [9, 17, 40, 12, 23, 31, 8, 26]), logprobs=True)
    assert llm.engine.runner.backend.native.steps_served > 0


def test_sdpa_paths_past_the_window_match_hf(windowed):
    """The torch backend's SDPA paths (native kernel off): decodes, short runs, long chunks."""
    ckpt, hf = windowed
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)
    llm.engine.runner.backend.native.enabled = False
    _check(llm, hf, _prompts(2, [30, 11, 19]))


def test_chunked_prefill_and_preemption_past_the_window_match_hf(windowed):
    ckpt, hf = windowed
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=7)
    _check(llm, hf, _prompts(3, [23, 30, 12]))
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=14)
    stats = _check(llm, hf, _prompts(4, [20, 18, 19, 17]))
    assert stats.num_preemptions > 0


def test_prefix_cache_hit_past_the_window_matches_hf(windowed):
    """A 24-token prefix (6 blocks, three windows) is cached; prompts extending it reuse all 6 blocks,
    their first new token attending to cached keys of the last window only."""
    ckpt, hf = windowed
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)
    prefix = _prompts(5, [24])[0]
    _check(llm, hf, [prefix + [5, 6, 7]])
    before = llm.engine.get_stats().prefix_cache_hits
    stats = _check(llm, hf, [prefix + t for t in _prompts(6, [3, 6, 1])])
    assert stats.prefix_cache_hits - before == 3 * 24


def test_triton_attention_past_the_window_matches_hf(checkpoint, oracle):
    """The CUDA path's Triton attention (interpreted) with Gemma 2's windows and soft-caps."""
    ckpt = checkpoint("gemma2")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, attention_backend="triton")
    assert llm.engine.runner.backend.name == "triton"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = _prompts(7, [13, 20])
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.outputs[0].token_ids == oracle(ckpt).greedy(prompt, 4)


@pytest.mark.parametrize("native", [True, False], ids=["native", "sdpa"])
def test_speculative_verification_past_the_window_matches_hf(windowed, native):
    """n-gram speculation: verification rows (short runs) attend through the window (and soft-cap)."""
    ckpt, hf = windowed
    llm = LLM(
        str(ckpt), device="cpu", dtype="float32", block_size=4, speculative="ngram", num_speculative_tokens=3
    )
    llm.engine.runner.backend.native.enabled = native
    base = _prompts(8, [6, 5])
    prompts = [base[0] * 4, base[1] * 5 + [7]]  # repeats: the proposer has n-grams to offer
    stats = _check(llm, hf, prompts)
    assert stats.spec_proposed_tokens > 0
