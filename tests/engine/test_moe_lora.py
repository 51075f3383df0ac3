"""PEFT adapters on mixture-of-experts models: attention adapters in mixed batches with base rows equal
PEFT's greedy tokens (under chunked prefill and preemption too); adapters on the router (as a module or
PEFT's `target_parameters`), on a parameter that is not an expert's, on a dense layer's MLP or on the
shared expert are refused by the registry's validation and by the engine's load, naming the module, and
leave nothing loaded. (LoRA on the experts: test_moe_expert_lora.py.)"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter_checkpoint import AdapterError
from engine.model_config import ModelConfig
from lora_registry.validation import InvalidAdapter, validate_adapter
from tests.helpers.peft_batch import check_requests
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import MOE_ARCHS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 8
# attention adapters of different ranks and targets (what MoE fine-tunes mostly are)
SPECS = {
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qv-r8-rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "pattern-r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "o_proj"],
        rank_pattern={"o_proj": 4, "k_proj": 2},
        alpha_pattern={"q_proj": 64},
    ),
    "regex-layer-r2": dict(r=2, lora_alpha=4, target_modules=r".*\.self_attn\.(k|o)_proj"),
}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per MoE arch: (base dir, {name: adapter dir}, PEFT oracle)."""
    out = {}
    for arch in MOE_ARCHS:
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"moe_adapters_{arch}")
        specs = enumerate(SPECS.items())
        dirs = {name: build_adapter(base, root / name, seed=i, **spec) for i, (name, spec) in specs}
        out[arch] = (base, dirs, PeftGreedyOracle(base))
    return out


def _run_and_check(llm: LLM, dirs, oracle, seed: int, n: int) -> None:
    """n requests of mixed lengths, each on a random adapter or none; tokens == PEFT's, per request."""
    rng = random.Random(seed)
    names = [*dirs, None]
    reqs = [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))], rng.choice(names)) for _ in range(n)
    ]
    assert None in {name for _, name in reqs} and len({name for _, name in reqs}) >= 3
    check_requests(llm, dirs, oracle, reqs, NEW)


def _llm(base, **kwargs) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 16, "max_loras": 4}
    return LLM(str(base), **(defaults | kwargs))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_attention_adapters_match_peft(arch, adapters):
    base, dirs, oracle = adapters[arch]
    _run_and_check(_llm(base), dirs, oracle, seed=1, n=12)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_adapters_under_chunking_and_preemption(arch, adapters):
    base, dirs, oracle = adapters[arch]
    llm = _llm(base, num_kv_blocks=24, max_num_batched_tokens=9, max_loras=2)
    _run_and_check(llm, dirs, oracle, seed=2, n=10)
    assert llm.engine.get_stats().num_preemptions > 0


def _variant(src: Path, dst: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of adapter `src` with `config` merged into its config and `tensors` added."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(cfg | config))
    weights = load_file(dst / "adapter_model.safetensors") | tensors
    save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


def _refused(adapters, tmp_path) -> list[tuple[Path, str]]:
    """Adapters on qwen3_moe's router, on a dense layer's MLP and on a parameter that is not an expert's,
    each with the refusal message it must get."""
    base, dirs, _ = adapters["qwen3_moe"]
    model = ModelConfig.from_dir(base)
    h, e, r = model.hidden_size, model.extra["moe"]["num_experts"], 4

    def lora(module: str, fin: int, out: int) -> dict[str, torch.Tensor]:
        pre = f"base_model.model.model.layers.{module}"
        return {f"{pre}.lora_A.weight": torch.ones(r, fin), f"{pre}.lora_B.weight": torch.ones(out, r)}

    router, dense = lora("0.mlp.gate", h, e), lora("1.mlp.gate_proj", h, model.intermediate_size)
    src, attn = dirs["attn-r4"], ["q_proj", "k_proj", "v_proj", "o_proj"]
    return [
        (
            build_adapter(base, tmp_path / "router-param", r=4, target_modules=["q_proj"],
                          target_parameters=["mlp.gate.weight"]),
            r"target_parameters: 'mlp.gate.weight': LoRA on the router is not supported",
        ),
        (
            build_adapter(base, tmp_path / "attn-param", r=4, target_modules=["v_proj"],
                          target_parameters=["self_attn.q_proj.weight"]),
            r"target_parameters: 'self_attn.q_proj.weight': LoRA on self_attn.q_proj.weight is not supported",
        ),
        (
            _variant(src, tmp_path / "router", {"target_modules": ["q_proj", "gate"]}, router),
            r"target_modules: 'gate' is part of the mixture-of-experts feed-forward block",
        ),
        (
            _variant(src, tmp_path / "dense-mlp", {"target_modules": [*attn, "gate_proj"]}, dense),
            r"module 'model.layers.1.mlp.gate_proj' is part of the mixture-of-experts",
        ),
    ]  # fmt: skip


def test_router_and_dense_mlp_adapters_are_refused(adapters, tmp_path):
    """Refused at registration (the registry's validation) and at load (nothing left loaded); the
    engine keeps serving the attention adapter afterwards."""
    base, dirs, oracle = adapters["qwen3_moe"]
    model = ModelConfig.from_dir(base)
    llm = _llm(base)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for path, message in _refused(adapters, tmp_path):
        with pytest.raises(InvalidAdapter, match=message):
            validate_adapter(path, model, 16)
        with pytest.raises(AdapterError, match=message):
            llm.generate([[5, 6]], params, lora_request=LoRARequest(path.name, str(path)))
        assert llm.engine.list_loras() == []
    good = dirs["attn-r4"]
    out = llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("good", str(good)))[0]
    assert out.outputs[0].token_ids == oracle.greedy([5, 6, 7], NEW, good)


def test_shared_expert_adapter_is_refused(adapters, tmp_path):
    """Qwen2-MoE: an adapter on the shared expert's projections is refused, naming the module."""
    base, dirs, _ = adapters["qwen2_moe"]
    model = ModelConfig.from_dir(base)
    h, r, pre = model.hidden_size, 2, "base_model.model.model.layers.1.mlp.shared_expert.up_proj"
    tensors = {f"{pre}.lora_A.weight": torch.ones(r, h), f"{pre}.lora_B.weight": torch.ones(48, r)}
    path = _variant(dirs["attn-r4"], tmp_path / "shared", {"target_modules": r".*_proj"}, tensors)
    with pytest.raises(InvalidAdapter, match=r"module 'model.layers.1.mlp.shared_expert.up_proj' is part of"):
        validate_adapter(path, model, 16)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_prefix_cache_and_ngram_speculation_match_peft(arch, adapters):
    """Repetitive prompts with a shared prefix, on attention adapters and base rows: prefix-cache hits,
    accepted and rolled-back n-gram drafts through the MoE layers, and PEFT's tokens."""
    base, dirs, oracle = adapters[arch]
    rng = random.Random(5)
    shared = [rng.randrange(3, 96) for _ in range(9)]
    names = [*dirs, None, None]
    reqs = []
    for i, name in enumerate(names):
        phrase = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 5))]
        reqs.append(((shared if i % 2 == 0 else []) + phrase * rng.randrange(2, 5), name))
    llm = _llm(base, speculative="ngram", num_speculative_tokens=3)
    loras = [LoRARequest(name, str(dirs[name])) if name else None for _, name in reqs]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second round reuses the first's cached blocks
        outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
        for (prompt, name), out in zip(reqs, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW, dirs[name] if name else None)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
