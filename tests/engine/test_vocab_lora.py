"""LoRA on embed_tokens and lm_head serves in mixed batches equal to PEFT (float32): base rows, plain
LoRA rows, embedding-LoRA rows, LM-head-LoRA rows and an adapter with only those two, in one batch; on
Llama (untied head), Qwen2 (tied embeddings: the two LoRAs stay independent, as in PEFT), Granite (the
embedding multiplier and logit scaling around the deltas) and Gemma 2 (√hidden embedding scale,
soft-capped logits); both CPU LoRA backends, chunked prefill with a small pool, n-gram speculation (several
logits rows per sequence) and the Triton path (interpreted) with decode graphs on."""

from __future__ import annotations

import pytest

from tests.engine.peft_cases import PLAIN_R4, build_cases, check_greedy, triton_llm_replaying_plain_lora
from tests.helpers.peft_batch import check_mixed_batch, cpu_llm
from tests.helpers.tiny_adapters import VOCAB_ADAPTER_SPECS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

SPECS = {"plain-r4": PLAIN_R4} | VOCAB_ADAPTER_SPECS


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir}, PEFT oracle); A and B are random."""
    archs = ("llama", "qwen2", "granite", "gemma2")
    return build_cases(checkpoint, tmp_path_factory, dict.fromkeys(archs, SPECS), "vocab", seed=20)


@pytest.mark.parametrize(
    ("arch", "backend"),
    [
        ("llama", "native"),
        ("llama", "torch"),
        ("qwen2", "native"),
        ("qwen2", "torch"),
        ("granite", "native"),
        ("gemma2", "torch"),
    ],
)
def test_mixed_batch_with_vocab_lora_matches_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    check_mixed_batch(llm, dirs, oracle, seed=1, n=2 * (len(dirs) + 1), logprobs=True)


def test_vocab_lora_under_chunked_prefill_and_a_small_pool(adapters):
    """Prefill chunks of 7 tokens (so a prompt's embedding rows span steps) and 2 resident adapters
    (so vocabulary copies are evicted and uploaded again)."""
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, max_num_batched_tokens=7, max_loras=2, num_kv_blocks=40)
    check_mixed_batch(llm, dirs, oracle, seed=2, n=10)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_speculative_decoding_with_lm_head_lora_matches_peft(backend, adapters):
    """n-gram speculation scores several logits rows per sequence; each gets its adapter's head LoRA."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, lora_backend=backend, speculative="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 3, 4, 3], [8, 9, 8, 9, 8]]
    names = ["head-v-r8", "both-only-rslora", None, "embed-q-r4"]
    check_greedy(llm, dirs, oracle, prompts, names, 8)
    assert llm.engine.get_stats().spec_proposed_tokens > 0


def test_triton_path_and_decode_graphs_with_vocab_lora(adapters):
    """The CUDA path (Triton SGMV, interpreted on CPU here) with decode graphs on: steps with vocabulary
    LoRA rows run eagerly and equal PEFT; plain-LoRA decode steps still replay graphs."""
    base, dirs, oracle = adapters["qwen2"]
    llm = triton_llm_replaying_plain_lora(base, dirs, oracle)
    names = ["embed-q-r4", "plain-r4", None, "head-v-r8", "both-only-rslora"]
    prompts = [[9, 10, 11, 12], [13, 14], [15, 16, 17], [18, 19, 20, 21, 22], [23, 24, 25]]
    check_greedy(llm, dirs, oracle, prompts, names, 4)
