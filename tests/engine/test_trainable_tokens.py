"""Trainable tokens (`trainable_token_indices`) serve in mixed batches equal to PEFT (float32): new
embedding rows for some token ids, and new LM-head rows (of their own, or on tied models the embedding's),
on that adapter's rows only; together with base rows, plain LoRA and embedding/LM-head LoRA in one
batch; Llama (untied: the dict form with rows of each), Qwen2 and Gemma 2 (tied: the head follows the
embedding, Gemma's √hidden scale applies to the new rows); both CPU backends, chunked prefill."""

from __future__ import annotations

import pytest

from tests.engine.peft_cases import PLAIN_R4, build_cases
from tests.helpers.peft_batch import check_mixed_batch, cpu_llm
from tests.helpers.tiny_adapters import TOKEN_ADAPTER_SPECS, VOCAB_ADAPTER_SPECS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

SPECS = {"plain-r4": PLAIN_R4} | TOKEN_ADAPTER_SPECS | {"embed-q-r4": VOCAB_ADAPTER_SPECS["embed-q-r4"]}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir}, PEFT oracle); new rows, A and B random."""
    archs = ("llama", "qwen2", "gemma2")
    return build_cases(checkpoint, tmp_path_factory, dict.fromkeys(archs, SPECS), "tokens", seed=30)


@pytest.mark.parametrize(
    ("arch", "backend"),
    [("llama", "native"), ("llama", "torch"), ("qwen2", "native"), ("qwen2", "torch"), ("gemma2", "torch")],
)
def test_mixed_batch_with_trainable_tokens_matches_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend)
    check_mixed_batch(llm, dirs, oracle, seed=3, n=3 * (len(dirs) + 1), logprobs=True)


def test_trainable_tokens_under_chunked_prefill_and_a_small_pool(adapters):
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, max_num_batched_tokens=7, max_loras=2, num_kv_blocks=40)
    check_mixed_batch(llm, dirs, oracle, seed=4, n=10)
