"""A failure inside `LLMEngine.step()` for one request ends that request only; the contract's bounds."""

from __future__ import annotations

import msgspec
import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.sampling_params import BOUNDS, SamplingParamsError


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint("llama")), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _run(engine, limit: int = 200) -> dict:
    outs: dict = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


@pytest.mark.parametrize(("in_prefill", "n"), [(True, 1), (False, 1), (False, 2)])
def test_request_failing_in_step_ends_alone(llm, in_prefill, n):
    engine = llm.engine
    expected = llm.generate([[7, 8, 9]], _greedy())[0].outputs[0].token_ids
    bad = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, n=n)
    engine.add_request("innocent", [7, 8, 9], _greedy())
    engine.add_request("hostile", [5, 6], bad)
    if not in_prefill:
        engine.step()  # both prefilled; the hostile one then fails while decoding
    # Bypass the checks after admission, as a bug for one request would: the sampler raises on it
    # (top-k log-probabilities over more tokens than the vocabulary has).
    for seq in engine._groups["hostile"].seqs:
        seq.params.logprobs = 10**6
    outs = _run(engine)
    assert outs["hostile"].error and "failed" in outs["hostile"].error
    assert outs["hostile"].outputs[0].finish_reason == "abort"
    assert outs["innocent"].error is None
    assert outs["innocent"].outputs[0].token_ids == expected
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    # The engine keeps serving.
    assert llm.generate([[7, 8, 9]], _greedy())[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("top_k", 0),
        ("max_tokens", 2**63),
        ("seed", 2**63),
        ("seed", -1),
        ("n", 65),
        ("logprobs", 21),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**31]),
        ("stop", ["x"] * 17),
        ("max_tokens", True),
    ],
)
def test_every_field_has_a_declared_range(field, value):
    with pytest.raises(SamplingParamsError, match=field) as exc:
        SamplingParams(**{field: value})
    assert exc.value.field == field


def test_bounds_hold_on_the_wire():
    """Decoding re-checks the ranges: the engine never trusts what it receives."""
    good = SamplingParams(top_k=5, seed=BOUNDS["seed"].hi, stop=["\n"])
    data = msgspec.msgpack.encode(good)
    assert msgspec.msgpack.decode(data, type=SamplingParams) == good
    bad = msgspec.msgpack.encode({"top_k": 0})
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        msgspec.msgpack.decode(bad, type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"name": "", "path": "p"}), type=LoRARequest)
