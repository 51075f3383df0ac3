"""What adapters keep beside their pages (modules_to_save copies, trainable token rows, vocabulary LoRA,
DoRA vectors) is counted in the pool's side budget: `side_bytes` equals what a resident copy takes, an
upload evicts for room, an adapter larger than the budget is refused at load and at registration with
the numbers, and served tokens stay PEFT's."""

from __future__ import annotations

import pytest

from engine import LoRARequest, SamplingParams
from engine.lora.adapter_checkpoint import AdapterError, inspect_adapter
from engine.lora.side_memory import side_bytes
from engine.model_config import ModelConfig
from lora_registry.errors import InvalidAdapter
from lora_registry.validation import validate_adapter
from tests.helpers.peft_batch import cpu_llm
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

SPECS = {
    "head-a": dict(r=4, lora_alpha=8, target_modules=["down_proj"], modules_to_save=["lm_head"]),
    "head-b": dict(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "both": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "tokens": dict(r=2, lora_alpha=4, target_modules=["o_proj"], trainable_token_indices=[5, 9, 17]),
    "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    "vocab": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"]),
}


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("side")
    dirs = {n: build_adapter(base, root / n, seed=30 + i, **s) for i, (n, s) in enumerate(SPECS.items())}
    return base, dirs, PeftGreedyOracle(base)


def test_side_bytes_is_what_a_resident_copy_takes(setup):
    base, dirs, _ = setup
    llm = cpu_llm(base)
    pool = llm.engine.lora.pool
    cfg = ModelConfig.from_dir(base)
    for name, path in dirs.items():
        digest = llm.engine.add_lora(LoRARequest(name, str(path)))
        assert llm.engine.lora.pin_lora(digest, set())
        res = pool.resident[digest]
        ckpt = inspect_adapter(path, cfg, max_lora_rank=16)
        epi = 0
        if res.epi_slot >= 0:
            epi = sum(cfg.num_layers * 2 * pool.epilogues.widths[m] * 4 for m in res.epi_modules)
        vocab = res.vocab.memory_bytes() if res.vocab is not None else 0
        assert side_bytes(ckpt, cfg, 4) == res.side_bytes == vocab + epi > 0, name
    assert pool.side_used == sum(r.side_bytes for r in pool.resident.values())
    stats = llm.engine.get_lora_stats()
    assert stats.side_bytes_used == pool.side_used and stats.side_bytes_budget == pool.side_budget


def test_a_small_side_budget_evicts_for_room_and_refuses_what_never_fits(setup):
    """Budget for one saved LM head: the two head adapters take turns in the pool (tokens equal PEFT's);
    an adapter saving both embedding and head is refused, naming both numbers."""
    base, dirs, oracle = setup
    cfg = ModelConfig.from_dir(base)
    one_head = side_bytes(inspect_adapter(dirs["head-a"], cfg, max_lora_rank=16), cfg, 4)
    llm = cpu_llm(base, lora_side_memory_bytes=one_head + 100)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [12, 13, 14]]
    for name in ("head-a", "head-b", "head-a"):
        out = llm.generate(prompts, params, lora_request=LoRARequest(name, str(dirs[name])))
        for prompt, o in zip(prompts, out, strict=True):
            assert o.outputs[0].token_ids == oracle.greedy(prompt, 4, dirs[name]), name
        assert llm.engine.lora.pool.side_used <= one_head + 100
    assert llm.engine.get_lora_stats().evictions >= 2
    both = side_bytes(inspect_adapter(dirs["both"], cfg, max_lora_rank=16), cfg, 4)
    with pytest.raises(AdapterError, match=f"needs {both} bytes .* side budget of {one_head + 100} bytes"):
        llm.generate(prompts, params, lora_request=LoRARequest("both", str(dirs["both"])))


def test_registration_refuses_an_adapter_over_the_side_budget(setup):
    base, dirs, _ = setup
    cfg = ModelConfig.from_dir(base)
    need = side_bytes(inspect_adapter(dirs["both"], cfg, max_lora_rank=16), cfg, 2)
    with pytest.raises(InvalidAdapter, match=f"needs {need} bytes .* side budget of {need - 1} bytes"):
        validate_adapter(dirs["both"], cfg, 16, side_budget=(need - 1, 2))
    validate_adapter(dirs["both"], cfg, 16, side_budget=(need, 2))
