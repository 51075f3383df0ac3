"""Sampling: seeds, n > 1, top-k/top-p, logprobs against HF, stop strings and stop tokens."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint("llama")), device="cpu", dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def text_llm(checkpoint):
    return LLM(str(checkpoint("llama", tokenizer=True, vocab_size=100)), device="cpu", dtype="float32")


def _sample(**kw) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 12, "temperature": 1.0, "ignore_eos": True} | kw))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompt = [5, 9, 11, 40]
    alone = llm.generate([prompt], _sample(seed=123))[0].outputs[0].token_ids
    crowd = llm.generate([[7, 8], prompt, [50] * 9], [_sample(), _sample(seed=123), _sample()])
    assert crowd[1].outputs[0].token_ids == alone
    other = llm.generate([prompt], _sample(seed=124))[0].outputs[0].token_ids
    assert other != alone


def test_unseeded_sampling_varies(llm):
    outs = llm.generate([[5, 9, 11]] * 4, _sample())
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_top_k_one_is_greedy(llm):
    prompt = [5, 9, 11, 40]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    topk = llm.generate([prompt], _sample(top_k=1, temperature=0.8))
    assert topk[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_tiny_top_p_is_greedy(llm):
    prompt = [6, 9, 12]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    nucleus = llm.generate([prompt], _sample(top_p=1e-6))
    assert nucleus[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    prompt = list(range(3, 23))  # 20 tokens = 5 full blocks of 4
    engine.add_request("group", prompt, _sample(n=4, seed=7))
    engine.step()  # prefill of all four sequences
    seqs = engine._groups["group"].seqs
    tables = [engine.kv.block_ids(s) for s in seqs]
    # The first 4 blocks (the last prompt token is recomputed) are the same physical blocks in all 4.
    assert all(t[:4] == tables[0][:4] for t in tables)
    assert engine.kv.stats().num_used < 4 * len(tables[0])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.get_stats().kv_blocks_used == 0


def test_choice_j_of_n_is_the_single_request_with_seed_plus_j(llm):
    """`n` fans out in one way for `LLM` and the server (`SamplingParams.choices()`): choice j of an
    n-way request draws exactly what a single request with seed + j draws."""
    prompt = [5, 9, 11, 40]
    grouped = llm.generate([prompt], _sample(n=3, seed=40))[0].outputs
    singles = [llm.generate([prompt], _sample(seed=40 + j))[0].outputs[0] for j in range(3)]
    assert [c.token_ids for c in grouped] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in grouped}) > 1
    assert [c.seed for c in _sample(n=3, seed=40).choices()] == [40, 41, 42]
    assert {c.n for c in _sample(n=3).choices()} == {1} and _sample(n=2).choices()[1].seed is None


def test_logprobs_match_hf(llm, checkpoint, oracle):
    prompt = [5, 9, 11, 40, 3]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))[0]
    comp = out.outputs[0]
    ref = oracle(checkpoint("llama")).logprobs(prompt + comp.token_ids)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert entry[tok].rank == 1  # greedy picks the most likely token
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(entry)
        total += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert math.isfinite(comp.cumulative_logprob)


def test_stop_string_cuts_text_exactly(text_llm):
    base = text_llm.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    text = base[0].outputs[0].text
    assert len(text) == 20  # character-level tokenizer: one character per token
    stop = text[5:7]
    cut = text.find(stop)
    out = text_llm.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    comp = out.outputs[0]
    assert comp.text == text[:cut]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.token_ids == base[0].outputs[0].token_ids[: cut + len(stop)]


def test_stop_token_ids_and_text(text_llm):
    base = text_llm.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    out = text_llm.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[ids[3]]))[0]
    j = ids.index(ids[3])
    assert out.outputs[0].token_ids == ids[: j + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ids[3]
    assert base.outputs[0].text == text_llm.tokenizer.decode(ids)


def test_eos_stops_unless_ignored(checkpoint):
    ckpt = checkpoint("llama", eos_token_id=None)
    llm = LLM(str(ckpt), device="cpu", dtype="float32")
    ids = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    llm2_ckpt = checkpoint("llama", eos_token_id=ids[2])
    llm2 = LLM(str(llm2_ckpt), device="cpu", dtype="float32")
    stopped = llm2.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert stopped.token_ids == ids[: ids.index(ids[2]) + 1] and stopped.finish_reason == "stop"
    ignored = llm2.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ignored[0].outputs[0].token_ids == ids and ignored[0].outputs[0].finish_reason == "length"
