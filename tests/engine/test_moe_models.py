"""Mixture-of-experts families on the model seam (`engine/model/moe.py`): greedy tokens equal
transformers' (float32) for 8 prompts, however the engine batches, chunks or preempts; checkpoints in the
per-expert layout (what transformers 5 writes) and with fused 3-D expert tensors load to the same
weights; the dense-layer rule (`decoder_sparse_step`, `mlp_only_layers`) is transformers'."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.model.loader import CheckpointError, load_model
from engine.model.moe import SparseMoE
from engine.model_config import ModelConfig
from tests.helpers.hf_greedy import check_greedy, fp32_cpu_llm, random_prompts
from tests.helpers.tiny_models import MOE_ARCHS

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

LENGTHS = [3, 17, 40, 9, 1, 28, 33, 61]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_hf(arch, checkpoint, oracle):
    ckpt = checkpoint(arch)
    llm = fp32_cpu_llm(ckpt)
    assert any(isinstance(m, SparseMoE) for m in llm.engine.model.modules())
    check_greedy(llm, oracle(ckpt), random_prompts(1, LENGTHS))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_chunked_prefill_and_preemption_match_hf(arch, checkpoint, oracle):
    """Chunks of 7 tokens; then a KV cache small enough that sequences are preempted and recomputed."""
    ckpt = checkpoint(arch)
    check_greedy(
        fp32_cpu_llm(ckpt, max_num_batched_tokens=7), oracle(ckpt), random_prompts(2, [23, 45, 12, 30])
    )
    stats = check_greedy(
        fp32_cpu_llm(ckpt, num_kv_blocks=14), oracle(ckpt), random_prompts(3, [20, 18, 27, 25])
    )
    assert stats.num_preemptions > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_expert_checkpoint_loads_the_same_weights(arch, checkpoint, oracle):
    """transformers 5's fused `experts.gate_up_proj` / `down_proj` tensors give the per-expert
    checkpoint's weights, and transformers' tokens."""
    per_expert, fused = checkpoint(arch), checkpoint(arch, fused_experts=True)
    a = load_model(ModelConfig.from_dir(per_expert), torch.float32, torch.device("cpu")).state_dict()
    b = load_model(ModelConfig.from_dir(fused), torch.float32, torch.device("cpu")).state_dict()
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    check_greedy(fp32_cpu_llm(fused), oracle(fused), random_prompts(4, [5, 30]))


def test_a_missing_expert_is_named(checkpoint, tmp_path):
    """A per-expert checkpoint lacking one expert's projection is refused, naming the piece."""
    from safetensors.torch import load_file, save_file

    src = checkpoint("qwen3_moe")
    state = load_file(src / "model.safetensors")
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.gate_up#e5\.1"):
        load_model(ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"))


def test_sparse_layers_follow_transformers():
    """`decoder_sparse_step` and `mlp_only_layers` pick the same MoE layers as transformers."""
    import transformers as tf

    from engine.model.registry import model_family

    raw = dict(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**raw))
    want = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], **raw})
    with torch.device("meta"):
        ours = model_family(cfg.architecture).build(cfg)
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == want
    assert want == [False, True, False, False, False, True]


def test_moe_models_take_decode_graphs(checkpoint):
    """A MoE model's decode steps replay from graphs as a dense model's do (the paths that capture:
    Triton attention; on CUDA the routed experts run the Triton kernel, which has no host
    synchronization); every bucket is captured at start. Replays against PEFT, launch by launch: in
    test_moe_expert_lora.py."""
    from engine.decode_graphs import enable_decode_graphs

    kw = dict(device="cpu", dtype="float32", block_size=4, attention_backend="triton")
    moe, dense = LLM(str(checkpoint("qwen3_moe")), **kw), LLM(str(checkpoint("qwen3")), **kw)
    for llm in (moe, dense):
        assert enable_decode_graphs(llm.engine.runner, None, 8)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.captured == [(1, None), (2, None), (4, None), (8, None)]
