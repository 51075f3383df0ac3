"""GGUF files of the mixture-of-experts families (written as llama.cpp's converter writes them: experts
stacked in 3-D `ffn_*_exps` tensors, the router `ffn_gate_inp`, `{arch}.expert_*` metadata): the engine
reads the HF checkpoint's config and weights from them, and its greedy tokens equal transformers' on that
checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine.model.gguf_file import GGUFError
from engine.model.loader import load_model
from engine.model_config import ModelConfig
from tests.helpers.gguf_files import write_gguf
from tests.helpers.hf_greedy import check_greedy, fp32_cpu_llm, random_prompts
from tests.helpers.tiny_models import MOE_ARCHS

pytestmark = pytest.mark.slow  # the HF oracle on tiny models


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return load_model(cfg, torch.float32, torch.device("cpu")).state_dict()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_gguf_greedy_matches_hf_checkpoint(arch, checkpoint, oracle, tmp_path):
    """qwen3moe, llama-with-experts (Mixtral: q/k rows permuted), qwen2moe (shared expert), olmoe
    (clamp_kqv): the same config and weights as the checkpoint, and transformers' tokens."""
    hf = checkpoint(arch)
    gguf = write_gguf(hf, tmp_path / f"{arch}.gguf", "F32", tokenizer=False)
    from_gguf, from_hf = ModelConfig.from_dir(gguf), ModelConfig.from_dir(hf)
    assert from_gguf.architecture == from_hf.architecture
    assert {k: v for k, v in from_gguf.extra.items() if k != "gguf_types"} == from_hf.extra
    assert (from_gguf.head_dim, from_gguf.qk_norm, from_gguf.qkv_bias) == (
        from_hf.head_dim, from_hf.qk_norm, from_hf.qkv_bias,
    )  # fmt: skip
    a, b = _weights(from_gguf), _weights(from_hf)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    check_greedy(fp32_cpu_llm(gguf), oracle(hf), random_prompts(11, [5, 19, 33]))


def test_per_expert_tensors_of_older_mixtral_files(checkpoint, tmp_path):
    """Older Mixtral files hold one tensor per expert (`blk.N.ffn_gate.E.weight`): the same weights."""
    hf = checkpoint("mixtral")
    gguf = write_gguf(hf, tmp_path / "old.gguf", "F32", tokenizer=False, stacked_experts=False)
    a, b = _weights(ModelConfig.from_dir(gguf)), _weights(ModelConfig.from_dir(hf))
    assert all(a[k].equal(b[k]) for k in b)


def test_quantized_experts_dequantize_and_fused_checkpoints_convert(checkpoint, tmp_path):
    """A Q8_0 file written from a fused-expert checkpoint: expert weights within Q8_0's error of the
    checkpoint's, and the engine generates from it."""
    hf = checkpoint("qwen3_moe", fused_experts=True)
    gguf = write_gguf(hf, tmp_path / "q8.gguf", "Q8_0", tokenizer=False)
    cfg = ModelConfig.from_dir(gguf)
    assert "Q8_0" in cfg.extra["gguf_types"]
    a, b = _weights(cfg), _weights(ModelConfig.from_dir(hf))
    for key in ("layers.0.mlp.experts.gate_up", "layers.2.mlp.experts.down"):
        assert not a[key].equal(b[key])
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0.02)
    out = fp32_cpu_llm(gguf).generate([[5, 6, 7]])
    assert len(out[0].outputs[0].token_ids) > 0


def test_moe_file_without_expert_counts_is_refused(checkpoint, tmp_path):
    import gguf as gg

    from engine.model.gguf_file import field_value, open_reader

    src = write_gguf(checkpoint("olmoe"), tmp_path / "src.gguf", "F32", tokenizer=False)
    reader = open_reader(src)
    w = gg.GGUFWriter(str(tmp_path / "bad.gguf"), "olmoe")
    for key in ("embedding_length", "feed_forward_length", "block_count", "attention.head_count"):
        w.add_uint32(f"olmoe.{key}", int(field_value(reader, f"olmoe.{key}")))
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="expert_count and expert_used_count"):
        ModelConfig.from_dir(tmp_path / "bad.gguf")
