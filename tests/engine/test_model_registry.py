"""The model seam's registry: every supported architecture resolves to a family that names it, whose
LoRA targets feed the engine's slices, and whose packed projections are runs of the adapter pool's
module order (what the LoRA paths index by); config errors of the new families are clear."""

from __future__ import annotations

import pytest
import torch

from engine.lora.adapter_checkpoint import PROJECTIONS
from engine.model.linear import ProjectionLinear
from engine.model.registry import SUPPORTED_ARCHITECTURES, model_family
from engine.model_config import ModelConfig, ModelConfigError

TINY = dict(
    vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_each_architecture_is_one_family_entry(arch):
    family = model_family(arch)
    assert arch in family.architectures
    for name, target in family.lora_targets.items():
        assert set(target.slices) <= set(PROJECTIONS), name
    cfg = ModelConfig.from_dict({"architectures": [arch], **TINY})
    with torch.device("meta"):
        model = family.build(cfg)
    for module in model.modules():
        if isinstance(module, ProjectionLinear):
            first = PROJECTIONS.index(module.slice_names[0])
            assert module.slice_names == PROJECTIONS[first : first + len(module.slice_names)]
    names = {
        n.split(".", 2)[2].rsplit(".", 1)[0] for n, _ in model.named_parameters() if n.startswith("layers.0")
    }
    for ours, _ in family.checkpoint_modules.values():  # (a MoE layer has no dense MLP)
        assert ours in names or (ours.startswith("mlp.") and "mlp.experts" in names)


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        ("GraniteForCausalLM", {"mlp_bias": True}, "mlp_bias is not supported"),
        (
            "Phi3ForCausalLM",
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
            "needs short_factor",
        ),
        (
            "Phi3ForCausalLM",
            {
                "original_max_position_embeddings": 16,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4},
            },
            "short_factor has 3 values, expected 4",
        ),
        ("LlamaForCausalLM", {"rope_scaling": {"type": "longrope"}}, "not supported for LlamaForCausalLM"),
    ],
)
def test_new_family_config_errors_are_clear(arch, extra, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({"architectures": [arch], **TINY, **extra})


@pytest.mark.parametrize(
    ("arch", "biased"),
    [
        ("LlamaForCausalLM", {"q_proj", "o_proj", "gate_proj", "down_proj"}),
        ("Qwen3ForCausalLM", {"q_proj", "o_proj"}),  # transformers' Qwen3: no MLP bias
        ("Qwen2ForCausalLM", {"q_proj"}),  # Qwen2: q/k/v bias only, whatever attention_bias says
    ],
)
def test_attention_and_mlp_bias_by_family(arch, biased):
    """`attention_bias` and `mlp_bias` give the projections transformers gives them a bias (the
    weights: `tests/engine/test_tensor_parallel_cases.py`)."""
    cfg = ModelConfig.from_dict({"architectures": [arch], **TINY, "attention_bias": True, "mlp_bias": True})
    with torch.device("meta"):
        model = model_family(arch).build(cfg)
    layer = model.layers[0]
    projections = (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )
    assert {p.slice_names[0] for p in projections if p.bias is not None} == biased
