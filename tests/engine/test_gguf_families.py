"""GGUF files of Granite and Phi-3 (written as llama.cpp's converter writes them): the engine's greedy
tokens equal transformers' on the checkpoint the file was made from (F32 files hold its exact weights;
transformers' own GGUF loader reads neither Granite nor Phi-3's partial rotary and LongRoPE)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from tests.helpers.gguf_files import write_gguf

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

NEW = 8


@pytest.mark.parametrize("arch", ["granite", "phi3", "phi3-longrope"])
def test_gguf_greedy_matches_hf_checkpoint(arch, checkpoint, oracle, tmp_path):
    hf = checkpoint(arch)
    gguf = write_gguf(hf, tmp_path / f"{arch}.gguf", "F32", tokenizer=False)
    from_gguf, from_hf = ModelConfig.from_dir(gguf), ModelConfig.from_dir(hf)
    assert from_gguf.architecture == from_hf.architecture
    assert (from_gguf.rope_scaling is None) == (from_hf.rope_scaling is None)
    assert from_gguf.extra["partial_rotary_factor" if "phi3" in arch else "logits_scaling"] == pytest.approx(
        from_hf.extra["partial_rotary_factor" if "phi3" in arch else "logits_scaling"]
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (5, 19, 40, 2)]
    llm = LLM(str(gguf), device="cpu", dtype="float32", block_size=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    hf_model = oracle(hf)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_model.greedy_cached(prompt, NEW)


# llama.cpp derives what GGUF files do not state: query_pre_attn_scalar = head dim (below 27B), Gemma 3's
# 5:1 local/global pattern and local RoPE base 10k; the tiny checkpoints are built to match
GEMMA_GGUF = {"gemma2": {"query_pre_attn_scalar": 16}, "gemma3": {"query_pre_attn_scalar": 16,
                                                                  "sliding_window_pattern": 6}}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(GEMMA_GGUF))
def test_gemma_gguf_greedy_matches_hf_checkpoint(arch, checkpoint, oracle, tmp_path):
    """Gemma GGUF files (norm weights stored as 1 + w, llama.cpp's tensor names, window and soft-caps
    in the metadata): the engine's greedy tokens equal transformers' on the source checkpoint, for
    prompts past the window of 8."""
    hf = checkpoint(arch, **GEMMA_GGUF[arch])
    gguf = write_gguf(hf, tmp_path / f"{arch}.gguf", "F32", tokenizer=False)
    from_gguf, from_hf = ModelConfig.from_dir(gguf), ModelConfig.from_dir(hf)
    for name in ("architecture", "sliding_window", "rope_theta", "rope_scaling", "head_dim", "extra"):
        got, want = getattr(from_gguf, name), getattr(from_hf, name)
        if name == "extra":
            got = {k: v for k, v in got.items() if k != "gguf_types"}
        assert got == want, name
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (5, 19, 30)]
    llm = LLM(str(gguf), device="cpu", dtype="float32", block_size=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    hf_model = oracle(hf)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_model.greedy_cached(prompt, NEW)
