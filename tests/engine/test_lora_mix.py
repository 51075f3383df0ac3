"""Weighted adapter mixes (`LoRARequest.weighted`) equal PEFT's `add_weighted_adapter(combination_type="cat")`
in float32, token for token with logprobs: alone and in one batch with base rows, plain LoRA, DoRA and
embedding / LM-head LoRA, on Llama and Qwen2 (tied embeddings), on both CPU LoRA backends and the Triton
path (interpreted); under chunked prefill with prefix caching (a mix's KV is keyed by its weights); and
the refusals (DoRA member, more members than max_loras)."""

from __future__ import annotations

import pytest

from engine import LoRARequest, SamplingParams
from tests.helpers.peft_batch import build_weighted_cat, check_requests, cpu_llm, lora_request
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter

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
    out = {}
    for arch in ("llama", "qwen2"):
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"mix_{arch}")
        dirs = {n: build_adapter(base, root / n, seed=20 + i, **s) for i, (n, s) in enumerate(SPECS.items())}
        for name, members in MIXES.items():
            dirs[name] = build_weighted_cat(base, dirs, members, root / f"cat-{name}")
        out[arch] = (base, dirs, PeftGreedyOracle(base))
    return out


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
