"""Granite and the Phi-3 family on the model seam: greedy tokens equal transformers' (float32) however the
engine batches, chunks or preempts; Granite's logits scaling in the logprobs; Phi-3's LongRoPE past its
original length, with the short/long choice transformers makes, through chunked prefill and the prefix
cache."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers.hf_greedy import check_greedy, fp32_cpu_llm, random_prompts
from tests.helpers.tiny_models import LONGROPE_ORIGINAL, MORE_ARCHS

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

# 8 prompts; with phi3-longrope (original length 32): below it throughout, crossing it while
# generating, and past it from the start
LENGTHS = [3, 17, 40, 9, 1, 28, 33, 61]


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_greedy_matches_hf(arch, checkpoint, oracle):
    ckpt = checkpoint(arch)
    check_greedy(fp32_cpu_llm(ckpt), oracle(ckpt), random_prompts(1, LENGTHS))


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_chunked_prefill_matches_hf(arch, checkpoint, oracle):
    """Chunks of 7 tokens: a LongRoPE prompt past the original length is rotated with the long factors
    from its first chunk on (transformers decides by the whole prompt)."""
    ckpt = checkpoint(arch)
    check_greedy(
        fp32_cpu_llm(ckpt, max_num_batched_tokens=7), oracle(ckpt), random_prompts(2, [23, 45, 12, 30])
    )


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_preemption_matches_hf(arch, checkpoint, oracle):
    """Recomputed sequences (prompt + generated tokens) keep the rotation their tokens first had."""
    ckpt = checkpoint(arch)
    stats = check_greedy(
        fp32_cpu_llm(ckpt, num_kv_blocks=14), oracle(ckpt), random_prompts(3, [20, 18, 27, 25])
    )
    assert stats.num_preemptions > 0


def test_granite_logprobs_include_logits_scaling(checkpoint, oracle):
    """`logits_scaling` does not move the argmax; the logprobs show whether it was applied."""
    ckpt = checkpoint("granite")
    prompt = [5, 9, 11, 40, 3]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    comp = fp32_cpu_llm(ckpt).generate([prompt], params)[0].outputs[0]
    ref = oracle(ckpt).logprobs(prompt + comp.token_ids)
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert entry[tok].logprob == pytest.approx(float(ref[len(prompt) - 1 + i][tok]), abs=1e-4)


def test_longrope_prefix_cache_keeps_short_and_long_apart(checkpoint, oracle):
    """A short prompt's cached blocks (short factors) are not reused by a longer prompt that starts with
    it and is past the original length (transformers rotates all its tokens with the long factors)."""
    ckpt = checkpoint("phi3-longrope")
    llm, hf = fp32_cpu_llm(ckpt), oracle(ckpt)
    (short,) = random_prompts(4, [LONGROPE_ORIGINAL - 12])
    longer = short + random_prompts(5, [30])[0]
    check_greedy(llm, hf, [short])
    check_greedy(llm, hf, [longer])
    check_greedy(llm, hf, [short])  # and the short prompt still hits its own blocks
    assert llm.engine.get_stats().prefix_cache_hits > 0


def test_partial_rotary_runs_the_fused_cpu_ops(checkpoint, oracle, caplog):
    """Partial rotary (phi3: 8 of 16 head dims) takes the fused native CPU ops (RoPE on the leading dims);
    a model a family marks as beyond them (`fused_problem`) says so once and runs the torch ops, with
    the same tokens."""
    ckpt = checkpoint("phi3")
    prompts = random_prompts(6, [12, 5])
    with caplog.at_level("WARNING", logger="engine.model.decoder"):
        llm = fp32_cpu_llm(ckpt)
        assert llm.engine.model.rope.rotary_dim == 8 and llm.engine.model.fused_problem is None
        check_greedy(llm, oracle(ckpt), prompts)
        assert not [r for r in caplog.records if "fall back" in r.getMessage()]
        llm.engine.model.fused_problem = "a test's reason"
        check_greedy(llm, oracle(ckpt), prompts)
        check_greedy(llm, oracle(ckpt), prompts)
    fallbacks = [r.getMessage() for r in caplog.records if "fall back" in r.getMessage()]
    assert fallbacks == ["fused CPU ops fall back to torch ops for this model: a test's reason"]
