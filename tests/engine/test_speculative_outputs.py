"""Speculative decoding cuts exactly: stop strings, stop tokens and max_tokens end a sequence at the same
token as without speculation even when the step accepted several tokens; logprobs and seeds behave.

Uses the bundled demo model (character tokenizer; the base model echoes `text=` as `text\\n`), on which
prompt lookup is accepted almost every step, so many sequences end inside a multi-token step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLMEngine, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow  # two demo engines

DEMO = Path(__file__).resolve().parents[2] / "demo"
PROMPTS = ["hello world=", "abcab abcab=", "qwerty uiop=", "zz top zz=", "mississippi=", "aaa bbb aaa="]


@pytest.fixture(scope="module")
def engines():
    """(plain engine, speculative engine) on the demo model, float32 on CPU."""
    kw = dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=16)
    plain = LLMEngine.from_args(str(DEMO / "base"), **kw)
    spec = LLMEngine.from_args(str(DEMO / "base"), speculative="ngram", num_speculative_tokens=5, **kw)
    spec.spec.cost.fixed_theta = 0.05  # speculate whatever this machine's timings (reproducible)
    return plain, spec


def _run(eng: LLMEngine, prompts, params: SamplingParams, lora=None):
    """Step until done; returns (final outputs in prompt order, how many requests finished in a step
    that emitted several tokens for them)."""
    seen: dict[str, int] = {}
    final = {}
    multi_finish = 0
    base = len(eng._groups)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{id(params)}-{i}", p, params, lora)
    assert len(eng._groups) == base + len(prompts)
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids)
            grew = n - seen.get(out.request_id, 0)
            seen[out.request_id] = n
            if out.finished:
                final[out.request_id] = out
                multi_finish += grew > 1
    return [final[f"r{id(params)}-{i}"] for i in range(len(prompts))], multi_finish


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        ox, oy = x.outputs[0], y.outputs[0]
        assert (oy.token_ids, oy.text, oy.finish_reason, oy.stop_reason) == (
            ox.token_ids,
            ox.text,
            ox.finish_reason,
            ox.stop_reason,
        ), x.prompt


@pytest.mark.parametrize("stop", [["o"], ["ll"], ["b a", "pp"], ["\n"], ["top"], ["xyz"]])
def test_stop_strings_cut_exactly(engines, stop):
    plain, spec = engines
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=stop)
    a, _ = _run(plain, PROMPTS, params)
    b, _ = _run(spec, PROMPTS, params)
    _same(a, b)
    assert any(o.outputs[0].stop_reason in stop for o in b) or stop == ["xyz"]
    assert spec.get_stats().spec_accepted_tokens > 0


def test_max_tokens_and_stop_tokens_cut_inside_a_multi_token_step(engines):
    plain, spec = engines
    multi = 0
    for max_tokens in range(1, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        a, _ = _run(plain, PROMPTS, params)
        b, m = _run(spec, PROMPTS, params)
        _same(a, b)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in b)
        multi += m
    # stop on the token id of "l" (and of "p"): mid-word, where proposals run on past it
    ids = [spec.tokenizer.convert_tokens_to_ids(c) for c in "lp"]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=ids)
    a, _ = _run(plain, PROMPTS, params)
    b, m = _run(spec, PROMPTS, params)
    _same(a, b)
    assert any(o.outputs[0].stop_reason in ids for o in b)
    multi += m
    assert multi > 5  # many requests ended in a step that had accepted several tokens


def test_stop_string_inside_a_multi_token_step_drops_the_tokens_after_it(engines):
    """Echo of 'abcab abcab' with stop 'ca': the step that completes 'ca' has proposals for the rest."""
    plain, spec = engines
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=["ca"], logprobs=2)
    a, _ = _run(plain, ["abcab abcab abcab="], params)
    b, multi = _run(spec, ["abcab abcab abcab="], params)
    _same(a, b)
    assert multi == 1
    out = b[0].outputs[0]
    assert out.text == "ab" and out.stop_reason == "ca"
    assert len(out.logprobs) == len(out.token_ids)
    assert out.cumulative_logprob == pytest.approx(a[0].outputs[0].cumulative_logprob, abs=1e-4)


def test_logprobs_of_accepted_tokens_equal_non_speculative(engines):
    plain, spec = engines
    lora = LoRARequest("upper", str(DEMO / "adapters" / "upper"))
    for lr in (None, lora):
        params = SamplingParams(max_tokens=16, temperature=0.0, stop=["\n"], logprobs=3)
        a, _ = _run(plain, PROMPTS, params, lr)
        before = spec.get_stats().spec_accepted_tokens
        b, _ = _run(spec, PROMPTS, params, lr)
        _same(a, b)
        for x, y in zip(a, b, strict=True):
            lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
            assert len(lx) == len(ly)
            for ex, ey in zip(lx, ly, strict=True):
                assert ex.keys() == ey.keys()
                for tok in ex:
                    assert ey[tok].rank == ex[tok].rank
                    assert ey[tok].logprob == pytest.approx(ex[tok].logprob, abs=1e-4)
        assert spec.get_stats().spec_accepted_tokens > before


def test_seeded_sampling_is_reproducible_with_speculation(engines):
    """Twice on the speculating engine, and on the plain one: the same tokens (noise per position)."""
    plain, spec = engines
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=1234, n=3)
    a, _ = _run(spec, PROMPTS, params)
    b, _ = _run(spec, PROMPTS, params)
    c, _ = _run(plain, PROMPTS, params)
    for x, y, z in zip(a, b, c, strict=True):
        assert [t.token_ids for t in x.outputs] == [t.token_ids for t in y.outputs]
        assert [t.token_ids for t in x.outputs] == [t.token_ids for t in z.outputs]
    _assert_clean(spec)


def test_abort_mid_speculation_frees_every_block(engines):
    _, spec = engines
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        spec.add_request(f"abort-{i}", p, params)
    for _ in range(5):
        spec.step()
        if any(s.spec_token_ids for s in spec.scheduler.running):
            break
    assert spec.get_stats().spec_accepted_tokens > 0
    assert any(s.spec_token_ids for s in spec.scheduler.running)  # proposals were pending
    spec.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    assert not spec.has_unfinished_requests()
    _assert_clean(spec)


def _assert_clean(eng: LLMEngine) -> None:
    assert eng.kv.pool.num_free == eng.num_kv_blocks
    assert eng.kv.num_requests() == 0


class _BrokenProposer:
    def propose(self, seqs, ks):
        raise RuntimeError("proposer bug")

    def retain(self, alive):
        return None


def test_a_failing_proposer_only_turns_speculation_off(engines, caplog):
    plain, spec = engines
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=["\n"])
    working = spec.spec.proposer
    spec.spec.proposer = _BrokenProposer()
    try:
        before = spec.get_stats().spec_verifications
        a, _ = _run(plain, PROMPTS, params)
        b, _ = _run(spec, PROMPTS, params)
    finally:
        spec.spec.proposer = working
    _same(a, b)
    assert spec.get_stats().spec_verifications == before
    assert "speculative proposer failed" in caplog.text
    _assert_clean(spec)
