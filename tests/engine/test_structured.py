"""Grammar-constrained decoding in the engine (`SamplingParams.structured`), with `LLM` directly.

The model is random, so only the constraint can make its outputs valid: every output must parse and
validate, whatever the sampling settings, adapters-free batch mix, `n`, or preemption.
"""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from api.engine_protocol import AddRequest, InvalidMessage, decode_to_engine, encode
from engine import LLM, SamplingParams
from engine.structured import StructuredSpec, StructuredSpecError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
PROMPTS = ["hello", "Q: who?", "abc xyz", "{", "list"]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(
        checkpoint("llama", tokenizer=True, vocab_size=100), device="cpu", dtype="float32", num_kv_blocks=96
    )


def _schema_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, structured=StructuredSpec.json_schema(SCHEMA), **kw)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0),
        dict(temperature=1.0, seed=3, n=3),
        dict(temperature=1.5, top_k=20, top_p=0.9, seed=5),
    ],
)
def test_json_schema_outputs_validate(llm, sampling):
    outs = llm.generate(PROMPTS, _schema_params(**sampling))
    for out in outs:
        assert len(out.outputs) == sampling.get("n", 1)
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text  # the grammar ends the output, not the length limit
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_grammar_completion_finishes_without_eos_and_despite_ignore_eos(llm):
    eos = set(llm.engine.scheduler.eos_token_ids)
    (out,) = llm.generate(["x"], _schema_params(temperature=0, ignore_eos=True))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and not eos & set(c.token_ids)
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_and_lark_grammar(llm):
    regex = StructuredSpec("regex", r"(yes|no), [0-9]{2,4}!")
    lark = StructuredSpec("grammar", 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/')
    outs = llm.generate(
        PROMPTS[:3],
        [
            SamplingParams(max_tokens=30, temperature=1.0, seed=s, structured=spec)
            for s, spec in enumerate([regex, lark, regex])
        ],
    )
    assert re.fullmatch(r"(yes|no), [0-9]{2,4}!", outs[0].outputs[0].text)
    assert re.fullmatch(r"<[a-z]{1,5}>", outs[1].outputs[0].text)
    assert re.fullmatch(r"(yes|no), [0-9]{2,4}!", outs[2].outputs[0].text)


def test_json_object_is_an_object_or_cut_by_length(llm):
    outs = llm.generate(
        PROMPTS,
        SamplingParams(max_tokens=60, temperature=1.0, seed=7, structured=StructuredSpec("json_object")),
    )
    for out in outs:
        c = out.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 60


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    mixed = llm.generate(
        PROMPTS + PROMPTS, [free] * len(PROMPTS) + [_schema_params(temperature=0)] * len(PROMPTS)
    )
    assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == alone
    for o in mixed[len(PROMPTS) :]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_preemption_keeps_each_matcher_in_step(checkpoint):
    # 12 blocks of 16 tokens for 4 sequences of ~65 tokens (5 blocks each): preemption and recompute
    llm = LLM(
        checkpoint("llama", tokenizer=True, vocab_size=100),
        device="cpu",
        dtype="float32",
        num_kv_blocks=12,
        max_num_seqs=4,
    )
    outs = llm.generate(PROMPTS[:4], _schema_params(temperature=1.0, seed=11, n=1))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_logprobs_are_those_of_the_masked_distribution(llm):
    (out,) = llm.generate(["hi"], _schema_params(temperature=0, logprobs=5))
    c = out.outputs[0]
    tok = llm.tokenizer
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    first = c.logprobs[0]  # the grammar allows only "{" first: probability 1, nothing else has mass
    assert tok.decode([c.token_ids[0]]) == "{"
    assert first[c.token_ids[0]].logprob == pytest.approx(0.0, abs=1e-5)
    assert all(lp.logprob == float("-inf") for t, lp in first.items() if t != c.token_ids[0])


def test_bad_spec_is_refused_before_queueing_and_engine_goes_on(llm):
    bad = SamplingParams(structured=StructuredSpec.json_schema({"type": "object", "not": {"type": "string"}}))
    with pytest.raises(StructuredSpecError, match="not"):
        llm.engine.add_request("bad", "hi", bad)
    with pytest.raises(ValueError, match="regex"):
        llm.engine.add_request("bad2", "hi", SamplingParams(structured=StructuredSpec("regex", "[a-")))
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(["hi"], _schema_params(temperature=0))
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_spec_bounds_and_wire_round_trip():
    with pytest.raises(StructuredSpecError, match="kind"):
        StructuredSpec("xml", "x")
    with pytest.raises(StructuredSpecError, match="characters"):
        StructuredSpec("regex", "a" * (64 * 1024 + 1))
    with pytest.raises(StructuredSpecError, match="JSON object"):
        StructuredSpec("json_schema", "[1]")
    params = _schema_params(temperature=0)
    msg = AddRequest("r1", [1, 2, 3], params)
    assert decode_to_engine(encode(msg)) == msg
    raw = msgspec.msgpack.encode(
        {
            "type": "add",
            "request_id": "r2",
            "prompt_token_ids": [1],
            "params": {"structured": {"kind": "json_schema", "spec": "nope"}},
        }
    )
    with pytest.raises(InvalidMessage) as err:
        decode_to_engine(raw)
    assert err.value.request_id == "r2"


def test_apply_bitmask_masks_only_the_given_rows():
    import numpy as np
    import torch

    from engine.structured.masking import apply_bitmask

    logits = torch.randn(4, 70)  # wider than the 64 ids the 2-word masks cover
    before = logits.clone()
    bitmask = np.zeros((2, 2), dtype=np.int32)
    bitmask[0, 0] = 0b1010  # row 1: ids 1 and 3
    bitmask[0, 1] = 1 << 5  # row 1: id 37
    # row 3: nothing allowed (a failed matcher) -> left as it is
    apply_bitmask(logits, [1, 3], bitmask)
    assert torch.equal(logits[[0, 2]], before[[0, 2]]) and torch.equal(logits[3], before[3])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == [1, 3, 37]
    assert torch.equal(logits[1, finite], before[1, finite])


def test_deeply_nested_spec_is_refused_on_the_wire():
    raw = msgspec.msgpack.encode(
        {"type": "add", "request_id": "deep", "prompt_token_ids": [1],
         "params": {"structured": {"kind": "json_schema", "spec": "[" * 60000}}}
    )  # fmt: skip
    with pytest.raises(InvalidMessage) as err:
        decode_to_engine(raw)
    assert err.value.request_id == "deep"


def test_model_without_tokenizer_refuses_structured_requests(checkpoint):
    llm = LLM(checkpoint("llama"), device="cpu", dtype="float32", num_kv_blocks=16)
    with pytest.raises(StructuredSpecError, match="tokenizer"):
        llm.generate([[5, 6, 7]], _schema_params())
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_constrained_rows_do_not_speculate_beside_speculating_ones(checkpoint):
    """With n-gram speculation on, constrained sequences decode one masked token per step (their outputs
    still validate and equal those of an engine without speculation), while repetitive unconstrained
    prompts in the same batch still get proposals accepted."""
    path = checkpoint("llama", tokenizer=True, vocab_size=100)
    plain = LLM(path, device="cpu", dtype="float32", num_kv_blocks=96)
    spec = LLM(path, device="cpu", dtype="float32", num_kv_blocks=96, speculative="ngram")
    constrained = _schema_params(temperature=0)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["hello", "ab ab ab ab ab ab", "{", "xy xy xy xy xy xy"]
    params = [constrained, free, constrained, free]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out in (got[0], got[2]):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    stats = spec.engine.get_stats()
    assert stats.spec_verifications > 0
