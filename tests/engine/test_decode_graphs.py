"""Decode steps from static, padded buffers (`engine/decode_graphs.py`), run on CPU.

CUDA graphs need a GPU; here the same static buffers, padding and bucket logic run through `EagerReplay`
(each "replay" re-runs the forward pass over the buffers) with the Triton kernels interpreted. The
greedy tokens must equal the eager path's and PEFT's, for mixed adapters and base rows, while the batch
shrinks through several buckets (sequences of different lengths finish) so that buffers still hold the
rows of a larger earlier step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.decode_graphs import EagerReplay, padded_segments
from kernels.lora_meta import build_lora_batch_meta
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter


@pytest.mark.parametrize("slots", [[3], [0, 0, 2, -1, 2, 5], [-1, -1], [4, 1, 4, 1, 7, 7, 7]])
@pytest.mark.parametrize("size", [8, 16])
def test_padded_segments_group_rows_like_the_lora_metadata(slots, size):
    order, ids, counts, starts = padded_segments(slots, size)
    padded = slots + [-1] * (size - len(slots))
    meta = build_lora_batch_meta(torch.tensor(padded, dtype=torch.int32))
    n = meta.slot_ids.numel()
    assert order.tolist() == meta.token_indices_sorted.tolist()
    assert ids[:n].tolist() == meta.slot_ids.tolist() and (ids[n:] == -1).all()
    assert counts[:n].tolist() == meta.slot_token_counts.tolist() and (counts[n:] == 0).all()
    assert starts[:n].tolist() == meta.slot_token_starts.tolist()
    assert counts.sum() == size and np.all(np.asarray(padded)[order][: counts[0]] == ids[0])


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("graph_adapters")
    names = ["all7-r4", "pattern-r16"]
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(names)}
    return base, dirs, PeftGreedyOracle(base)


@pytest.mark.slow
def test_static_padded_decode_equals_eager_and_peft(setup):
    base, dirs, oracle = setup
    prompts = [[5, 6, 7, 8, 9], [12, 13], [40, 41, 42], [7] * 6, [20, 21], [30, 31, 32, 33]]
    names = ["all7-r4", None, "pattern-r16", "all7-r4", None, "pattern-r16"]
    lengths = [6, 2, 5, 3, 1, 4]  # sequences finish at different steps: the batch shrinks 6 -> 1
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    kw = dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=16)
    kw |= dict(attention_backend="triton", lora_backend="triton")

    graphs_llm = LLM(str(base), **kw)
    eng = graphs_llm.engine
    eng.runner.use_decode_graphs(EagerReplay(), eng.lora.pool, max_batch=8)
    got = [o.outputs[0].token_ids for o in graphs_llm.generate(prompts, params, lora_request=loras)]
    base_only = graphs_llm.generate(prompts[:3], params[:3])  # steps without any adapter
    graphs = eng.runner.graphs
    assert graphs is not None
    assert {(4, "bgmv"), (8, "bgmv")} <= set(graphs.captured) and any(k is None for _, k in graphs.captured)

    eager = LLM(str(base), **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, lora_request=loras)]
    assert got == want
    assert [o.outputs[0].token_ids for o in base_only] == [
        o.outputs[0].token_ids for o in eager.generate(prompts[:3], params[:3])
    ]
    for prompt, name, n, tokens in zip(prompts, names, lengths, got, strict=True):
        assert tokens == oracle.greedy(prompt, n, dirs[name] if name else None)


def test_decode_graphs_refuse_the_torch_attention_backend(checkpoint):
    llm = LLM(str(checkpoint("llama")), device="cpu", dtype="float32", attention_backend="torch")
    with pytest.raises(ValueError, match="Triton attention"):
        llm.engine.runner.use_decode_graphs(EagerReplay())
