"""Prefill/decode disaggregation in the engine (engine/kv_transfer): a prefill-only request on one engine,
its export imported by another, gives the tokens one engine gives alone; nothing stays held afterwards."""

from __future__ import annotations

import random

import pytest

from engine import LLMEngine, LoRARequest, SamplingParams
from engine.kv_transfer import KV_TRANSFER_FINISH, KVExport
from engine.kv_transfer.shm_stage import unstage
from engine.kv_transfer.state import decode_export, encode_export
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter

BS = 4  # tokens per KV block
NAMES = ("all7-r4", "qv-r8-rslora", "pattern-r16")


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("kvt_adapters")
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    return base, dirs


def _engine(base, **kw) -> LLMEngine:
    cfg = {"device": "cpu", "dtype": "float32", "block_size": BS, "max_lora_rank": 32, "num_kv_blocks": 64}
    return LLMEngine.from_args(str(base), **(cfg | kw))


def _drain(eng: LLMEngine) -> dict:
    """Step `eng` until idle; the last output of every request."""
    last = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            last[out.request_id] = out
    return last


def _lora(dirs, name):
    return None if name is None else LoRARequest(name, str(dirs[name]))


def _disaggregated(pre: LLMEngine, dec: LLMEngine, reqs, params) -> tuple[dict, dict]:
    """Prefill every request on `pre`, hand each export (through its wire form) to `dec`, decode there.
    Returns (final outputs by id, the prefill outputs by id)."""
    for rid, (prompt, _name, lora) in reqs.items():
        pre.add_request(rid, prompt, params[rid], lora, prefill_only=True)
    first = _drain(pre)
    done = {}
    for rid, out in first.items():
        if out.kv_export is None:  # the first token finished it
            done[rid] = out
            continue
        assert out.finished and out.outputs[0].finish_reason == KV_TRANSFER_FINISH
        assert len(out.outputs[0].token_ids) == 1
        export = decode_export(encode_export(out.kv_export))
        assert isinstance(export, KVExport)
        assert dec.import_request(export)
        unstage(export.blocks.path)  # "shm": the engine copied the staged file; its writer removes it
        pre.release_kv_transfer(rid)
    done |= _drain(dec)
    return done, first


def _assert_idle(*engines: LLMEngine) -> None:
    for eng in engines:
        st = eng.get_stats()
        assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
        assert eng.kv.num_requests() == 0


@pytest.mark.parametrize("connector", ["host", "host-layers", "shm"])
def test_greedy_equals_one_engine_mixed_adapters(setup, connector):
    base, dirs = setup
    rng = random.Random(7)
    names = [None, *NAMES]
    reqs = {}
    for i, length in enumerate([1, 3, 4, 5, 8, 13, 17, 26]):  # 1..7 blocks, exact and partial
        name = names[i % len(names)]
        reqs[f"r{i}"] = ([rng.randrange(3, 96) for _ in range(length)], name, _lora(dirs, name))
    params = {rid: SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True) for rid in reqs}

    one = _engine(base)
    for rid, (prompt, _, lora) in reqs.items():
        one.add_request(rid, prompt, params[rid], lora)
    want = {rid: o.outputs[0].token_ids for rid, o in _drain(one).items()}

    pre, dec = _engine(base, kv_connector=connector), _engine(base, kv_connector=connector)
    got, _ = _disaggregated(pre, dec, reqs, params)
    assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == want
    assert all(o.outputs[0].finish_reason == "length" for o in got.values())
    _assert_idle(pre, dec)

    # a second turn of a conversation: the prefill side hits its cache, and so does the decode side
    prompt, name, lora = reqs["r6"]
    turn2 = prompt + want["r6"] + [11, 12, 13, 14, 15]
    p2 = {"t2": SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)}
    one.add_request("t2", turn2, p2["t2"], lora)
    want2 = _drain(one)["t2"].outputs[0].token_ids
    got2, first2 = _disaggregated(pre, dec, {"t2": (turn2, name, lora)}, p2)
    assert got2["t2"].outputs[0].token_ids == want2
    assert first2["t2"].num_cached_tokens >= (len(prompt) // BS) * BS  # prefill-side prefix hit
    assert got2["t2"].num_cached_tokens == first2["t2"].num_cached_tokens
    _assert_idle(pre, dec)


def test_decode_side_keeps_imported_blocks_in_its_prefix_cache(setup):
    """After an import, the decode engine alone serves a follow-up turn from the imported blocks."""
    base, dirs = setup
    lora = _lora(dirs, "qv-r8-rslora")
    prompt = list(range(5, 27))  # 22 tokens: 5 full blocks + 2
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    pre, dec = _engine(base), _engine(base)
    got, _ = _disaggregated(pre, dec, {"a": (prompt, "qv-r8-rslora", lora)}, {"a": p})
    before = dec.kv.prefix_hits
    dec.add_request("b", prompt + got["a"].outputs[0].token_ids + [9, 9], p, lora)
    out = _drain(dec)["b"]
    assert out.num_cached_tokens >= 20  # the 5 imported prompt blocks
    assert dec.kv.prefix_hits - before >= 20
    # keyed by the adapter digest: the base model does not hit them
    dec.add_request("c", prompt + [1, 2], p)
    assert _drain(dec)["c"].num_cached_tokens == 0
    _assert_idle(pre, dec)


def test_seeded_sampling_reproducible(setup):
    base, dirs = setup
    reqs = {
        "s0": ([4, 8, 15, 16, 23, 42, 7], None, None),
        "s1": (list(range(30, 49)), "all7-r4", _lora(dirs, "all7-r4")),
    }
    params = {
        rid: SamplingParams(
            max_tokens=8, temperature=0.9, top_p=0.9, seed=1234 + i, ignore_eos=True, logprobs=2
        )
        for i, rid in enumerate(reqs)
    }
    one = _engine(base)
    for rid, (prompt, _, lora) in reqs.items():
        one.add_request(rid, prompt, params[rid], lora)
    want = _drain(one)
    got, _ = _disaggregated(_engine(base), _engine(base), reqs, params)
    for rid in reqs:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
        w, g = want[rid].outputs[0], got[rid].outputs[0]
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]


def test_first_token_finishing_needs_no_transfer_and_errors_are_clear(setup):
    base, _ = setup
    pre, dec = _engine(base), _engine(base)
    pre.add_request("one", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    out = _drain(pre)["one"]
    assert out.kv_export is None and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="one sequence"):
        pre.add_request("n2", [5, 6], SamplingParams(n=2), prefill_only=True)
    pre.add_request("x", list(range(3, 12)), SamplingParams(max_tokens=4, temperature=0.0), prefill_only=True)
    export = _drain(pre)["x"].kv_export
    other = _engine(base, block_size=8)  # another block size: the blocks do not fit
    with pytest.raises(ValueError, match="layout"):
        other.import_request(export)
    _assert_idle(other)
    assert dec.import_request(export)
    with pytest.raises(ValueError, match="already in use"):
        dec.import_request(export)
    dec.abort_request("x")  # aborted before it decoded: its imported blocks are released
    _assert_idle(pre, dec)


def test_no_room_recomputes_the_prompt(setup):
    """A decode engine without free blocks queues the import to recompute; the tokens are the same."""
    base, _ = setup
    prompt = list(range(10, 40))  # 8 blocks
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one = _engine(base)
    one.add_request("a", prompt, p)
    want = _drain(one)["a"].outputs[0].token_ids
    pre, dec = _engine(base), _engine(base, num_kv_blocks=14)
    pre.add_request("a", prompt, p, prefill_only=True)
    export = _drain(pre)["a"].kv_export
    dec.add_request("hog", list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    dec.step()  # the hog holds 10 of the 14 blocks while it runs
    assert not dec.import_request(export)
    outs = _drain(dec)
    assert outs["a"].outputs[0].token_ids == want
    _assert_idle(pre, dec)


def test_structured_output_and_text_continue_on_the_decode_side(checkpoint):
    """The grammar state travels as the tokens it accepted: the decode side replays them, and the output
    is the one engine's, text and JSON alike; stop strings are checked over the whole text."""
    import json

    from engine.structured import StructuredSpec

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    base = checkpoint("llama", tokenizer=True, vocab_size=100)
    spec = StructuredSpec.json_schema(schema)
    params = {
        "j0": SamplingParams(max_tokens=60, temperature=0.0, structured=spec),
        "j1": SamplingParams(max_tokens=60, temperature=1.0, seed=9, structured=spec),
        "st": SamplingParams(max_tokens=12, temperature=0.0, stop=["e"], ignore_eos=True),
    }
    prompts = {"j0": "hello", "j1": "Q: who?", "st": "abc xyz"}
    one = _engine(base)
    for rid, p in params.items():
        one.add_request(rid, prompts[rid], p)
    want = _drain(one)
    pre, dec = _engine(base), _engine(base)
    for rid, p in params.items():
        pre.add_request(rid, prompts[rid], p, prefill_only=True)
    got = {}
    for rid, out in _drain(pre).items():
        if out.kv_export is None:
            got[rid] = out
        else:
            assert dec.import_request(decode_export(encode_export(out.kv_export)))
    got |= _drain(dec)
    for rid in params:
        w, g = want[rid].outputs[0], got[rid].outputs[0]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), rid
    json.loads(got["j0"].outputs[0].text)
    _assert_idle(pre, dec)


def test_staged_file_gone_refuses_the_import_and_frees_its_blocks(setup):
    """A "shm" import whose staged file was removed first (the transfer timed out on the decode replica)
    is refused with a clear error, its blocks freed: the pool's counters back to zero."""
    base, _ = setup
    pre, dec = _engine(base, kv_connector="shm"), _engine(base)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pre.add_request("g", list(range(3, 20)), params, prefill_only=True)
    export = _drain(pre)["g"].kv_export
    pre.release_kv_transfer("g")
    unstage(export.blocks.path)
    with pytest.raises(ValueError, match="gone"):
        dec.import_request(export)
    dec.abort_request(["g"])
    _drain(dec)
    _assert_idle(pre, dec)
