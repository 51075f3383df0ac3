"""Greedy generation from a GGUF checkpoint equals transformers on the same file (`gguf_file=`), with and
without a PEFT adapter (HF + PEFT as the oracle); Llama 3 RoPE scaling stored as `rope_freqs` matches
the source checkpoint; text prompts use the tokenizer from the file's metadata."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.model_config import ModelConfig
from tests.helpers.gguf_files import build_gguf_pair, hf_gguf_model, llama3_rope_factors, write_gguf
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter
from tests.helpers.tiny_models import HFGreedyOracle, build_checkpoint

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

NEW_TOKENS = 8


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in lengths]


def _greedy_params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q8_0"), ("llama", "Q4_K"), ("qwen2", "Q4_1")])
def test_greedy_equals_transformers_on_the_same_file(tmp_path, arch, qtype):
    _, gguf = build_gguf_pair(tmp_path, arch, qtype)
    llm = LLM(str(gguf), device="cpu", dtype="float32", block_size=4, enable_lora=False)
    prompts = _prompts(1, [5, 19, 11])
    outs = llm.generate(prompts, _greedy_params())
    oracle = hf_gguf_model(gguf)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt)


def test_adapter_on_a_gguf_base_equals_peft(tmp_path):
    """An adapter trained against the HF checkpoint applies to its GGUF: equal to HF(gguf) + PEFT."""
    from peft import PeftModel

    hf, gguf = build_gguf_pair(tmp_path, "llama", "Q8_0")
    adapters = {
        name: build_adapter(hf, tmp_path / name, seed=i, **ADAPTER_SPECS[name])
        for i, name in enumerate(("all7-r4", "qv-r8-rslora"))
    }
    llm = LLM(str(gguf), device="cpu", dtype="float32", block_size=4, max_lora_rank=32)
    prompts = _prompts(2, [7, 13, 9, 4])
    which = [None, "all7-r4", "qv-r8-rslora", "all7-r4"]
    loras = [None if w is None else LoRARequest(w, str(adapters[w])) for w in which]
    outs = llm.generate(prompts, _greedy_params(), lora_request=loras)
    for prompt, name, out in zip(prompts, which, outs, strict=True):
        model = hf_gguf_model(gguf)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name])).eval()
        assert out.outputs[0].token_ids == _hf_greedy(model, prompt), name


def test_rope_freqs_reproduce_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3 RoPE scaling as per-frequency factors (`rope_freqs`); the engine applies
    them, so the F32 GGUF generates what transformers generates from the source checkpoint."""
    hf = build_checkpoint(tmp_path / "hf", "llama")  # llama3 scaling (see tiny_models)
    source = ModelConfig.from_dir(hf)
    assert source.rope_scaling is not None
    factors = llama3_rope_factors(source.head_dim, source.rope_theta, source.rope_scaling)
    assert max(factors) > 1.5, "the tiny model's scaling must change some frequencies"
    gguf = write_gguf(hf, tmp_path / "l3.gguf", "F32", rope_freqs=factors)
    llm = LLM(str(gguf), device="cpu", dtype="float32", block_size=4, enable_lora=False)
    assert llm.engine.model_config.rope_scaling["rope_type"] == "freq_factors"
    prompts = _prompts(3, [40, 23])
    oracle = HFGreedyOracle(hf)
    for prompt, out in zip(prompts, llm.generate(prompts, _greedy_params()), strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW_TOKENS)


def test_text_prompt_uses_the_files_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    _, gguf = build_gguf_pair(tmp_path, "llama", "Q8_0")
    llm = LLM(str(gguf.parent), device="cpu", dtype="float32", block_size=4, enable_lora=False)
    text = "Hi there, world"
    out = llm.generate([text], _greedy_params())[0]
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert out.prompt_token_ids == tok.encode(text)
    assert out.outputs[0].token_ids == _hf_greedy(hf_gguf_model(gguf), out.prompt_token_ids)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
