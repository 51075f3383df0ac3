"""Weighted adapter mixes (`LoRARequest.weighted`) equal PEFT's `add_weighted_adapter(combination_type="cat")`
in float32, token for token with logprobs: alone and in one batch with base rows, plain LoRA, DoRA and
embedding / LM-head LoRA, on Llama and Qwen2 (tied embeddings), on both CPU LoRA backends and the Triton
path (interpreted); under chunked prefill with prefix caching (a mix's KV is keyed by its weights); and
the refusals (DoRA member, more members than max_loras)."""

from __future__ import annotations

import pytest

from engine import LoRARequest, SamplingParams
from tests.engine.peft_cases import build_cases
from tests.helpers.peft_batch import build_weighted_cat, check_requests, cpu_llm, lora_request

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

SPECS = {
    "plain-a": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "qvd-rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "embed-head": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "o_proj"]),
    "dora-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], use_dora=True),
}
MIXES = {
    "mix-ab": [("plain-a", 0.7), ("qvd-rslora", 0.3)],
    "mix-ba": [("plain-a", 0.3), ("qvd-rslora", 0.7)],
    "mix-vocab": [("plain-a", 1.5), ("embed-head", -0.5), ("qvd-rslora", 0.4)],
}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir, mix name: PEFT's cat adapter dir}, PEFT oracle)."""
    cases = build_cases(
        checkpoint, tmp_path_factory, dict.fromkeys(("llama", "qwen2"), SPECS), "mix", seed=20
    )
    for arch, (base, dirs, _) in cases.items():
        root = tmp_path_factory.mktemp(f"mix_cat_{arch}")
        for name, members in MIXES.items():
            dirs[name] = build_weighted_cat(base, dirs, members, root / f"cat-{name}")
    return cases


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43, 44, 45], [7] * 9, [3, 90, 17, 60, 22]]


@pytest.mark.parametrize(("arch", "backend"), [("llama", "native"), ("llama", "torch"), ("qwen2", "native")])
def test_mix_alone_matches_peft_cat(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend)
    reqs = [(PROMPTS[0], "mix-ab"), (PROMPTS[2], "mix-ab")]
    check_requests(llm, dirs, oracle, reqs, 5, logprobs=True, mixes=MIXES)


@pytest.mark.parametrize(("arch", "backend"), [("llama", "native"), ("qwen2", "native"), ("qwen2", "torch")])
def test_mixes_in_a_batch_with_base_plain_and_dora_rows(arch, backend, adapters):
    """Base, plain LoRA, DoRA, two mixes that differ only in their weights and a three-member mix with a
    negative embedding / LM-head weight, in one batch (6 adapters in use: max_loras counts members)."""
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend, max_loras=4)
    names = ["mix-ab", None, "dora-r4", "mix-ba", "plain-a", "mix-vocab", "mix-ab"]
    reqs = [(PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(names)]
    check_requests(llm, dirs, oracle, reqs, 5, logprobs=True, mixes=MIXES)


def test_mix_on_the_triton_path(adapters):
    """The CUDA path's SGMV kernels (interpreted on CPU): one launch pair per mix position."""
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton", max_num_batched_tokens=12)
    reqs = [(PROMPTS[0], "mix-ab"), (PROMPTS[1], None), (PROMPTS[2], "dora-r4"), (PROMPTS[3], "mix-vocab")]
    check_requests(llm, dirs, oracle, reqs, 4, mixes=MIXES)


def test_mixes_under_chunked_prefill_keep_their_kv_apart(adapters):
    """One long prompt on mix-ab, mix-ba (same members, other weights), plain-a and mix-ab again, chunked
    over several steps with prefix caching: every answer equals PEFT's, and only the repeated mix hits
    the prefix cache (different weights never share KV blocks)."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, max_num_batched_tokens=7, max_loras=2)
    prompt = [(3 * i + 5) % 90 + 3 for i in range(26)]
    for name in ("mix-ab", "mix-ba", "plain-a"):
        check_requests(llm, dirs, oracle, [(prompt, name)], 4, logprobs=True, mixes=MIXES)
    assert llm.engine.get_stats().prefix_cache_hits == 0
    check_requests(llm, dirs, oracle, [(prompt, "mix-ab")], 4, mixes=MIXES)
    assert llm.engine.get_stats().prefix_cache_hits >= 24


def test_a_mix_with_a_dora_member_is_refused(adapters):
    """`LLM.generate` refuses it up front; a request queued on a fresh engine (as the server does, the
    members not loaded yet) ends with the same error once the member is resident while the engine goes
    on serving, and once the member is in memory `add_request` refuses it at once."""
    base, dirs, _ = adapters["llama"]
    dora = LoRARequest("dora-r4", str(dirs["dora-r4"]))
    mix = LoRARequest.weighted([(LoRARequest("plain-a", str(dirs["plain-a"])), 0.5), (dora, 0.5)])
    params = SamplingParams(max_tokens=2, temperature=0.0)
    why = "adapter 'dora-r4' uses DoRA or lora_bias, which a weighted mix cannot combine"
    with pytest.raises(ValueError, match=why):
        cpu_llm(base).generate([PROMPTS[0]], params, lora_request=mix)
    eng = cpu_llm(base).engine
    eng.add_request("bad", PROMPTS[0], params, mix)
    eng.add_request("good", PROMPTS[1], params, lora_request("mix-ab", dirs, MIXES))
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert why in (done["bad"].error or "")
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=why):
        eng.add_request("again", PROMPTS[0], params, mix)


def test_a_mix_larger_than_max_loras_is_refused(adapters):
    base, dirs, _ = adapters["llama"]
    llm = cpu_llm(base, max_loras=2)
    with pytest.raises(ValueError, match="3 adapters; this engine runs at most max_loras=2"):
        llm.generate(
            [PROMPTS[0]], SamplingParams(max_tokens=2), lora_request=lora_request("mix-vocab", dirs, MIXES)
        )


def test_mixes_under_preemption_match_peft(adapters):
    """A KV cache too small for the batch: mix rows are preempted and recomputed (their KV rebuilt under
    the same mix) and still equal PEFT's cat, beside plain and base rows."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, num_kv_blocks=14, max_num_batched_tokens=9, max_loras=4)
    prompts = [[(7 * i + 3 * j) % 90 + 3 for j in range(18 + i)] for i in range(5)]
    names = ["mix-ab", "mix-vocab", None, "mix-ba", "plain-a"]
    check_requests(llm, dirs, oracle, list(zip(prompts, names, strict=True)), 8, mixes=MIXES)
    assert llm.engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_mixes_under_ngram_speculation_match_peft(backend, adapters):
    """n-gram speculative decoding: verification scores several rows per mix sequence (each pass's
    weights spread over them); greedy tokens equal PEFT's cat. Repetitive prompts so proposals are made."""
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, lora_backend=backend, speculative="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 3, 4, 3], [11, 12, 11, 12, 11, 12, 11]]
    names = ["mix-ab", "mix-vocab", None, "plain-a"]
    check_requests(llm, dirs, oracle, list(zip(prompts, names, strict=True)), 8, mixes=MIXES)
    assert llm.engine.get_stats().spec_proposed_tokens > 0


@pytest.mark.parametrize("pages", [2, 3])
def test_a_mix_that_cannot_be_resident_at_once_is_refused_not_stuck(pages, adapters):
    """Pool of `pages` pages per projection at page rank 4: plain-a (r 4) takes 1 page of q_proj and
    qvd-rslora (r 8) 2, so mix-ab needs 3 at once. With 2 it can never be scheduled: a request queued
    before its members are known ends with an error naming the numbers (the engine goes on serving the
    others), and once they are known `add_request` refuses it at once. With 3 it runs and equals PEFT."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, max_lora_rank=8, lora_page_rank=4, lora_pool_pages=pages)
    if pages == 3:
        check_requests(llm, dirs, oracle, [(PROMPTS[0], "mix-ab"), (PROMPTS[1], "plain-a")], 4, mixes=MIXES)
        return
    eng = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0)
    why = "the weighted mix needs 3 adapter pool pages of q_proj at once"
    eng.add_request("big", PROMPTS[0], params, lora_request("mix-ab", dirs, MIXES))
    eng.add_request("ok", PROMPTS[1], params, lora_request("plain-a", dirs))
    done = {}
    for _ in range(100):  # bounded: a mix left waiting would fail here, not hang
        done |= {o.request_id: o for o in eng.step() if o.finished}
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert why in (done["big"].error or "") and "has 2 per projection" in done["big"].error
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=why):
        eng.add_request("again", PROMPTS[0], params, lora_request("mix-ab", dirs, MIXES))
    with pytest.raises(ValueError, match=why):
        llm.generate([PROMPTS[0]], params, lora_request=lora_request("mix-ab", dirs, MIXES))
