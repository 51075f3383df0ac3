"""modules_to_save copies of embed_tokens / lm_head serve in mixed batches equal to PEFT (float32): rows
of such an adapter look up its own embedding matrix and score with its own head, in one batch with base
rows, plain LoRA, embedding LoRA and trainable tokens; Llama (untied) and Qwen2 (tied: each copy replaces
only its own module, as in PEFT); both CPU LoRA backends, chunked prefill with a small pool, the Triton
path (interpreted). Registration refuses modules_to_save entries without a saved copy, a copy not named
by modules_to_save, and a resized vocabulary (saving other modules: tests/lora_registry/test_service.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.lora.adapter_checkpoint import AdapterError, inspect_adapter
from engine.model_config import ModelConfig
from tests.engine.peft_cases import PLAIN_R4, build_cases, check_greedy
from tests.helpers.peft_batch import check_mixed_batch, cpu_llm
from tests.helpers.tiny_adapters import SAVED_ADAPTER_SPECS, TOKEN_ADAPTER_SPECS, VOCAB_ADAPTER_SPECS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

SPECS = (
    {"plain-r4": PLAIN_R4}
    | SAVED_ADAPTER_SPECS
    | {"embed-q-r4": VOCAB_ADAPTER_SPECS["embed-q-r4"], "tokens-list": TOKEN_ADAPTER_SPECS["tokens-list"]}
)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir}, PEFT oracle); saved copies perturbed at random."""
    return build_cases(
        checkpoint, tmp_path_factory, dict.fromkeys(("llama", "qwen2"), SPECS), "saved", seed=40
    )


@pytest.mark.parametrize(
    ("arch", "backend"), [("llama", "native"), ("llama", "torch"), ("qwen2", "native"), ("qwen2", "torch")]
)
def test_mixed_batch_with_modules_to_save_matches_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    check_mixed_batch(llm, dirs, oracle, seed=5, n=2 * (len(dirs) + 1), logprobs=True)


def test_modules_to_save_under_chunked_prefill_and_a_small_pool(adapters):
    """Chunks of 7 tokens and 2 resident adapters, so the saved copies are evicted and uploaded again."""
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, max_num_batched_tokens=7, max_loras=2, num_kv_blocks=40)
    check_mixed_batch(llm, dirs, oracle, seed=6, n=10)


def test_registration_reads_copies_and_refuses_other_modules(adapters, tmp_path):
    base, dirs, _ = adapters["llama"]
    model = ModelConfig.from_dir(base)
    ckpt = inspect_adapter(dirs["saved-both"], model)
    assert [(s.module, tuple(s.weight.shape)) for s in ckpt.saved] == [
        ("embed_tokens", (model.vocab_size, model.hidden_size)),
        ("lm_head", (model.vocab_size, model.hidden_size)),
    ]
    cfg = json.loads((dirs["saved-both"] / "adapter_config.json").read_text())
    weights = (dirs["saved-both"] / "adapter_model.safetensors").read_bytes()
    for entries, words in (
        (["embed_tokens", "lm_head", "norm"], "modules_to_save[2]: 'norm' has no saved weight"),
        (["embed_tokens"], "a saved copy of lm_head, not in modules_to_save"),
    ):
        raw = json.dumps(cfg | {"modules_to_save": entries}).encode()
        with pytest.raises(AdapterError, match=words.replace("[", r"\[").replace("]", r"\]")):
            inspect_adapter(tmp_path, model, contents=(raw, weights))
    resized = dataclasses.replace(model, vocab_size=model.vocab_size + 8)  # the copy has the old width
    with pytest.raises(AdapterError, match="a resized vocabulary is not supported"):
        inspect_adapter(dirs["saved-head"], resized)


def test_triton_path_with_modules_to_save(adapters):
    """The CUDA path (Triton SGMV, interpreted on CPU here): saved copies apply on their rows only."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton")
    names = ["saved-both", "plain-r4", None, "saved-head", "saved-embed"]
    prompts = [[9, 10, 11, 12], [13, 14], [15, 16, 17], [18, 19, 20, 21, 22], [23, 24, 25]]
    check_greedy(llm, dirs, oracle, prompts, names, 4)
