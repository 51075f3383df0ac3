"""Gemma checkpoints' configs and names as transformers reads them: a `Gemma3ForConditionalGeneration`
checkpoint serves its text model (vision tower skipped), a minimal `text_config` gets Gemma3TextConfig's
defaults, the transformers 4.x RoPE spelling equals 5.x's, and what the engine cannot run is refused."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig, ModelConfigError

pytestmark = pytest.mark.slow  # the HF oracle on tiny models


def test_conditional_generation_checkpoint_serves_its_text_model(checkpoint, oracle, tmp_path):
    """A tiny Gemma 3 vision-language checkpoint whose language model has the tiny Gemma3ForCausalLM's
    weights generates what that text model does in transformers, for prompts past the window."""
    from tests.helpers.tiny_models import build_gemma3_multimodal

    text_dir = checkpoint("gemma3")
    build_gemma3_multimodal(tmp_path, text_dir)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    ref = ModelConfig.from_dir(text_dir)
    for name in ("num_layers", "head_dim", "sliding_window", "rope_theta", "rope_scaling", "extra"):
        assert getattr(cfg, name) == getattr(ref, name), name
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (12, 27, 9)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle(text_dir).greedy(prompt, 8)


# the text_config of a published Gemma 3 4B checkpoint: only what differs from Gemma3TextConfig's defaults
MINIMAL_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


def test_minimal_text_config_gets_transformers_defaults():
    import transformers as tf

    hf = tf.Gemma3Config(text_config=dict(MINIMAL_TEXT)).text_config
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": dict(MINIMAL_TEXT)}
    cfg = ModelConfig.from_dict(raw | {"dtype": "bfloat16"})
    got = (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings)
    assert got == (hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
                   hf.max_position_embeddings)  # fmt: skip
    assert cfg.extra["layer_types"] == tuple(hf.layer_types)
    assert cfg.sliding_window == hf.sliding_window == 1024
    assert cfg.extra["query_pre_attn_scalar"] == hf.query_pre_attn_scalar
    assert cfg.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_scaling == {
        "rope_type": "linear",
        "factor": hf.rope_parameters["full_attention"]["factor"],
    }
    assert cfg.extra["local_rope"] == (hf.rope_parameters["sliding_attention"]["rope_theta"], None)
    assert cfg.tie_word_embeddings and cfg.checkpoint_dtype == torch.bfloat16
    assert cfg.eos_token_ids == (hf.eos_token_id,) and cfg.bos_token_id == hf.bos_token_id


def test_transformers4_rope_spelling_equals_5():
    """`rope_theta` / `rope_local_base_freq` / `rope_scaling` / `sliding_window_pattern` (4.x) parse to
    what transformers 5 writes as nested `rope_parameters` and `layer_types`."""
    import transformers as tf

    legacy = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500_000.0,
                  rope_local_base_freq=20_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                  sliding_window_pattern=3)  # fmt: skip
    modern = tf.Gemma3TextConfig(**legacy).to_dict()
    assert "rope_local_base_freq" not in modern and "full_attention" in modern["rope_parameters"]
    arch = {"architectures": ["Gemma3ForCausalLM"]}
    old, new = ModelConfig.from_dict(legacy | arch), ModelConfig.from_dict(modern | arch)
    assert (old.rope_theta, old.rope_scaling, old.extra) == (new.rope_theta, new.rope_scaling, new.extra)
    assert old.extra["local_rope"] == (20_000.0, None)
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.extra["layer_types"] == tuple(modern["layer_types"])


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "causal only"),
        ("Gemma2ForCausalLM", {"hidden_activation": "relu"}, "only gelu_pytorch_tanh"),
        ("Gemma3ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope scaling 'yarn'"),
        ("Gemma2ForCausalLM", {"layer_types": ["sliding_attention"]}, "layer_types must name 2 layers"),
    ],
)
def test_what_the_engine_cannot_run_is_refused(arch, change, message):
    raw = dict(architectures=[arch], vocab_size=96, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw | change)
