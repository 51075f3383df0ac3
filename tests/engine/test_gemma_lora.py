"""PEFT adapters on Gemma 2 and Gemma 3 (every targetable projection: q, k, v, o, gate, up, down):
mixed-adapter batches of prompts longer than the sliding window, base rows included, equal to PEFT's
greedy tokens; under chunked prefill and preemption too."""

from __future__ import annotations

import random

import pytest

from engine import LLM
from engine.lora.adapter_checkpoint import inspect_adapter
from engine.model_config import ModelConfig
from tests.engine.peft_cases import build_cases
from tests.helpers.peft_batch import check_requests
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import GEMMA_ARCHS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 8
WINDOW = 8  # the tiny Gemma checkpoints' sliding window


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """For gemma2 and gemma3: (base dir, {name: adapter dir}, PEFT oracle)."""
    specs = dict.fromkeys(GEMMA_ARCHS, ADAPTER_SPECS)
    return build_cases(checkpoint, tmp_path_factory, specs, "adapters", seed=0)


def _run_and_check(llm: LLM, dirs, oracle, seed: int, n: int) -> None:
    """n requests longer than the window, each on a random adapter or none; tokens == PEFT's."""
    rng = random.Random(seed)
    names = [*dirs, None]
    reqs = [([rng.randrange(3, 96) for _ in range(rng.randrange(WINDOW + 1, 30))], names[i % len(names)])
            for i in range(n)]  # fmt: skip
    check_requests(llm, dirs, oracle, reqs, NEW)


def _llm(base, **kwargs) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 32, "max_loras": 3}
    return LLM(str(base), **(defaults | kwargs))


@pytest.mark.parametrize(
    ("arch", "backend"), [("gemma2", "native"), ("gemma3", "native"), ("gemma3", "torch")]
)
def test_mixed_adapters_match_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = _llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    _run_and_check(llm, dirs, oracle, seed=1, n=14)


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_mixed_adapters_under_chunking_and_preemption(arch, adapters):
    base, dirs, oracle = adapters[arch]
    llm = _llm(base, num_kv_blocks=14, max_num_batched_tokens=9, max_loras=2)
    _run_and_check(llm, dirs, oracle, seed=2, n=10)
    assert llm.engine.get_stats().num_preemptions > 0


def test_all_seven_projections_are_targets(adapters):
    base, dirs, _ = adapters["gemma3"]
    ckpt = inspect_adapter(dirs["all7-r4"], ModelConfig.from_dir(base), max_lora_rank=32)
    assert set(ckpt.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


# PEFT on the vision-language model: list names and all-linear reach its vision tower too
MULTIMODAL_SPECS = {
    "qv-list-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "text-regex-r8": dict(
        r=8, lora_alpha=8, target_modules=r".*language_model.*\.(k_proj|o_proj|gate_proj|down_proj)"
    ),
    "all-linear-r2": dict(r=2, lora_alpha=4, target_modules="all-linear"),
}


def test_adapters_of_a_conditional_generation_checkpoint_match_peft(checkpoint, tmp_path):
    """Adapters trained on a `Gemma3ForConditionalGeneration` checkpoint (PEFT's module names
    `model.language_model.*`, regex targets written against them, LoRA on the vision tower that a
    text-only pass never runs): mixed text batches equal PEFT on that model."""
    from tests.helpers.tiny_models import build_gemma3_multimodal

    base = build_gemma3_multimodal(tmp_path / "mm", checkpoint("gemma3"))
    dirs = {name: build_adapter(base, tmp_path / name, seed=i, **spec)
            for i, (name, spec) in enumerate(MULTIMODAL_SPECS.items())}  # fmt: skip
    ckpt = inspect_adapter(dirs["text-regex-r8"], ModelConfig.from_dir(base), max_lora_rank=32)
    assert set(ckpt.target_modules) == {"k_proj", "o_proj", "gate_proj", "down_proj"}
    oracle = PeftGreedyOracle(base)
    prompt = list(range(3, 23))
    assert all(oracle.greedy(prompt, NEW, d) != oracle.greedy(prompt, NEW, None) for d in dirs.values())
    _run_and_check(_llm(base), dirs, oracle, seed=3, n=8)
