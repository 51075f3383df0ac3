"""The registry on a mixture-of-experts base model: attention and expert adapters register; adapters on
the router are refused with the module named, leaving no row, no blob and no temp file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_registry.errors import InvalidAdapter
from lora_registry.registry import Registry
from tests.helpers.tiny_adapters import build_adapter
from tests.helpers.tiny_models import build_checkpoint
from tests.lora_registry.test_refusals import assert_nothing_left

pytestmark = pytest.mark.slow  # PEFT builds the adapters


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint (the registry's served model for this module's tests)."""
    return build_checkpoint(tmp_path_factory.mktemp("moe-base"), "qwen3_moe")


@pytest.fixture(scope="module")
def moe_adapters(base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`attn`: q/v LoRA; `params`: PEFT's `target_parameters` on the fused experts; `router`: `attn`
    plus LoRA tensors on layer 0's router; `router-param`: the router's weight in `target_parameters`."""
    root = tmp_path_factory.mktemp("moe-adapters")
    attn = build_adapter(base_model, root / "attn", r=4, target_modules=["q_proj", "v_proj"])
    params = build_adapter(
        base_model,
        root / "params",
        r=4,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.down_proj"],
    )
    router = root / "router"
    shutil.copytree(attn, router)
    cfg = json.loads((router / "adapter_config.json").read_text())
    (router / "adapter_config.json").write_text(
        json.dumps(cfg | {"target_modules": ["q_proj", "v_proj", "gate"]})
    )
    pre = "base_model.model.model.layers.0.mlp.gate"
    weights = load_file(router / "adapter_model.safetensors")
    weights |= {f"{pre}.lora_A.weight": torch.ones(4, 64), f"{pre}.lora_B.weight": torch.ones(8, 4)}
    save_file(weights, str(router / "adapter_model.safetensors"))
    router_param = build_adapter(
        base_model,
        root / "router-param",
        r=4,
        target_modules=["q_proj"],
        target_parameters=["mlp.gate.weight"],
    )
    return {"attn": attn, "params": params, "router": router, "router-param": router_param}


@pytest.mark.parametrize("case", ["attn", "params"])
def test_attention_and_expert_adapters_register(case: str, registry: Registry, moe_adapters) -> None:
    assert registry.adapters.register("bot", moe_adapters[case]).created


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("router-param", r"target_parameters: 'mlp.gate.weight': LoRA on the router is not supported"),
        ("router", r"target_modules: 'gate' is part of the mixture-of-experts feed-forward block"),
    ],
)
def test_router_adapters_refused(case: str, message: str, registry: Registry, moe_adapters) -> None:
    with pytest.raises(InvalidAdapter, match=message):
        registry.adapters.register("bot", moe_adapters[case])
    assert_nothing_left(registry)
