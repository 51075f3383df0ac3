"""The benchmarks on a model given as a GGUF file: loraplex loads the file, its peers (HF + PEFT, vLLM)
get transformers' dequantized copy of it, so every side runs the identical weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.common.workload import ModelSpec, hf_copy
from bench.offline.throughput import run_offline
from tests.helpers.gguf_files import build_gguf_pair, hf_gguf_model

pytestmark = pytest.mark.slow  # benchmark runs


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return build_gguf_pair(tmp_path_factory.mktemp("gguf-bench"), "llama", "Q8_0")[1]


def test_offline_on_a_gguf_model_matches_peft(gguf, tmp_path):
    sizes = {"adapters": 3, "requests": 4, "rank": 8, "prompt_len": 8, "new_tokens": 4}
    r = run_offline(**sizes, repeats=1, gemm_repeats=1, model=gguf, workdir=tmp_path, quiet=True)
    assert r.spec["hidden_size"] == ModelSpec.of_model(gguf).hidden_size == 64
    assert r.mixed.output_tokens == r.base.output_tokens == 4 * 4
    assert r.hf_token_match == 1.0  # HF + PEFT on the dequantized copy: the same greedy tokens


def test_peer_workload_gives_vllm_the_dequantized_weights(gguf, tmp_path):
    from bench.peer.offline import build_workload

    wl = build_workload(tmp_path, adapters=2, requests=3, rank=8, prompt_len=5, new_tokens=4, model=gguf)
    assert wl.loraplex_model == str(gguf) and Path(wl.model) == hf_copy(gguf, tmp_path)
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_pretrained(wl.model, dtype=torch.float32).state_dict()
    for key, value in hf_gguf_model(gguf).state_dict().items():
        assert torch.equal(copy[key], value), key
    assert all(3 <= t < 96 for p in wl.prompts for t in p)
