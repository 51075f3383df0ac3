"""PEFT adapters on Granite and Phi-3 (fused `qkv_proj` / `gate_up_proj` targets, whose lora_B rows split
across the engine's q|k|v and gate|up slices): mixed-adapter batches with base rows equal PEFT's greedy
tokens, under chunking and preemption too; adapter validation takes the families' module names."""

from __future__ import annotations

import random

import pytest
from safetensors.torch import load_file

from engine import LLM
from engine.lora.adapter_checkpoint import AdapterError, inspect_adapter
from engine.model_config import ModelConfig
from lora_registry.validation import validate_adapter
from tests.engine.peft_cases import build_cases
from tests.helpers.peft_batch import check_requests
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PHI3_ADAPTER_SPECS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 8
SPECS = {"granite": ADAPTER_SPECS, "phi3": PHI3_ADAPTER_SPECS}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """For granite and phi3: (base dir, {name: adapter dir}, PEFT oracle)."""
    return build_cases(checkpoint, tmp_path_factory, SPECS, "adapters", seed=0)


def _run_and_check(llm: LLM, dirs, oracle, seed: int, n: int) -> None:
    """n requests of mixed lengths, each on a random adapter or none; tokens == PEFT's, per request."""
    rng = random.Random(seed)
    names = [*dirs, None]
    reqs = [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))], rng.choice(names)) for _ in range(n)
    ]
    check_requests(llm, dirs, oracle, reqs, NEW)


def _llm(base, **kwargs) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 32, "max_loras": 3}
    return LLM(str(base), **(defaults | kwargs))


@pytest.mark.parametrize(("arch", "backend"), [("granite", "native"), ("phi3", "native"), ("phi3", "torch")])
def test_mixed_adapters_match_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = _llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    _run_and_check(llm, dirs, oracle, seed=1, n=12)


@pytest.mark.parametrize("arch", list(SPECS))
def test_mixed_adapters_under_chunking_and_preemption(arch, adapters):
    base, dirs, oracle = adapters[arch]
    llm = _llm(base, num_kv_blocks=24, max_num_batched_tokens=9, max_loras=2)
    _run_and_check(llm, dirs, oracle, seed=2, n=10)
    assert llm.engine.get_stats().num_preemptions > 0


def test_phi3_fused_targets_split_into_slices(adapters):
    """A `qkv_proj` adapter's B rows become the q, k and v slices' B, in order, sharing its A."""
    base, dirs, _ = adapters["phi3"]
    model = ModelConfig.from_dir(base)
    ckpt = inspect_adapter(dirs["all-r4"], model, max_lora_rank=32)
    assert ckpt.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    weights = load_file(dirs["all-r4"] / "adapter_model.safetensors")
    b = weights["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    slices = {m.module: m for m in ckpt.modules if m.layer == 0}
    assert list(slices) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    q, kv = model.q_size, model.kv_size
    assert slices["q_proj"].lora_b.equal(b[:q]) and slices["v_proj"].lora_b.equal(b[q + kv :])
    assert slices["k_proj"].lora_b.equal(b[q : q + kv]) and slices["k_proj"].lora_a is slices["q_proj"].lora_a


def test_registry_validation_takes_each_familys_module_names(adapters):
    """The registry's validation accepts Phi-3's fused names and Granite's Llama names, and refuses an
    adapter whose module names the base model's family does not have."""
    phi3_base, phi3_dirs, _ = adapters["phi3"]
    granite_base, granite_dirs, _ = adapters["granite"]
    phi3, granite = ModelConfig.from_dir(phi3_base), ModelConfig.from_dir(granite_base)
    checkpoint, _ = validate_adapter(phi3_dirs["fused-pattern-r16"], phi3, 32)
    assert checkpoint.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    checkpoint, _ = validate_adapter(granite_dirs["all7-r4"], granite, 32)
    assert len(checkpoint.target_modules) == 7
    with pytest.raises(AdapterError, match=r"unknown module name '[qv]_proj' \(supported: qkv_proj, o_proj"):
        inspect_adapter(granite_dirs["qv-r8-rslora"], phi3, max_lora_rank=32)
    with pytest.raises(AdapterError, match="unknown module name 'qkv_proj'"):
        inspect_adapter(phi3_dirs["qkv-r8-rslora"], granite, max_lora_rank=32)
