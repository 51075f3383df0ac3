"""What continues across a KV handoff (engine/kv_transfer), in process: speculative decoding on the decode
side, `n > 1` fanned out as the server does, a stop string whose match spans the handoff, and an adapter
removed (deactivated) on the decode side around the import. Each is compared with one engine alone."""

from __future__ import annotations

import random

import pytest

from engine import LLMEngine, SamplingParams
from tests.engine.test_kv_transfer import BS, NAMES, _assert_idle, _disaggregated, _drain, _engine, _lora
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("kvt_cont_adapters")
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    return base, dirs


def _one(base, reqs, params, **kw) -> dict:
    """Token ids of every request run on one engine alone."""
    eng = _engine(base, **kw)
    for rid, (prompt, _, lora) in reqs.items():
        eng.add_request(rid, prompt, params[rid], lora)
    return {rid: o.outputs[0].token_ids for rid, o in _drain(eng).items()}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_decoding_on_the_decode_side(setup, speculative, sampled):
    """The decode engine speculates (prompt lookup, or a draft model whose KV was not transferred: it
    computes its own) over imported requests: greedy tokens, and seeded sampled ones (the noise is per
    output position, so the handoff carries only the seed), equal one engine's without speculation."""
    base, dirs = setup
    rng = random.Random(11)
    names = [None, *NAMES]
    reqs = {}
    for i in range(6):  # repeated phrases, so prompt lookup finds matches; 1 to several KV blocks
        phrase = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 5))]
        name = names[i % len(names)]
        reqs[f"q{i}"] = (phrase * rng.randrange(2, 6), name, _lora(dirs, name))
    temp = {"temperature": 1.0, "top_k": 8} if sampled else {"temperature": 0.0}
    params = {
        rid: SamplingParams(max_tokens=12, ignore_eos=True, seed=50 + i if sampled else None, **temp)
        for i, rid in enumerate(reqs)
    }
    want = _one(base, reqs, params)
    spec = "ngram" if speculative == "ngram" else f"draft:{base}"
    # `serve --speculative` configures both deployments; only the decode side has decode steps
    pre, dec = (_engine(base, speculative=spec, num_speculative_tokens=3) for _ in range(2))
    for eng in (pre, dec):
        assert eng.spec is not None
        eng.spec.cost.fixed_theta = 0.05  # speculate whatever this machine's timings
    got, _ = _disaggregated(pre, dec, reqs, params)
    assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == want
    total = dec.spec.stats.total()
    assert total.proposed > 0 and (sampled or total.accepted > 0)  # it did speculate, proposals landed
    assert pre.spec.stats.total().proposed == 0  # prefill-only requests end before any proposal
    _assert_idle(pre, dec)
    if speculative == "draft":
        for eng in (pre, dec):
            draft = eng.spec.proposer
            assert not draft.shadows and draft.kv.pool.num_free == draft.kv.pool.num_blocks


def test_n_choices_fanned_out_like_the_server(setup):
    """`n = 3` seeded sampling with logprobs: the server sends one prefill-only request per choice
    (`SamplingParams.choices()`, seed + j); their continuations equal one engine's `n = 3` request, and
    the later choices hit the first one's prompt blocks on the prefill side."""
    base, dirs = setup
    prompt = list(range(20, 37))  # 17 tokens: 4 full blocks + 1
    lora = _lora(dirs, "all7-r4")
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=77, logprobs=1, ignore_eos=True)
    one = _engine(base)
    one.add_request("r", prompt, params, lora)
    want = _drain(one)["r"].outputs
    assert len(want) == 3 and len({tuple(c.token_ids) for c in want}) > 1  # the choices differ
    choices = params.choices()
    reqs = {f"r#{j}": (prompt, "all7-r4", lora) for j in range(3)}
    pre, dec = _engine(base), _engine(base)
    got, first = _disaggregated(pre, dec, reqs, {f"r#{j}": choices[j] for j in range(3)})
    for j, w in enumerate(want):
        g = got[f"r#{j}"].outputs[0]
        assert g.token_ids == w.token_ids, j
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
    assert max(first[f"r#{j}"].num_cached_tokens for j in (1, 2)) >= (len(prompt) // BS) * BS
    _assert_idle(pre, dec)


def test_stop_string_spanning_the_handoff(checkpoint):
    """A stop string made of the first token's last character and the second token's first: the prefill
    side cannot see it, the decode side matches it over the whole text (the first token replayed)."""
    base = checkpoint("llama", tokenizer=True, vocab_size=100)
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    one = _engine(base)
    one.add_request("free", "abc xyz", free)
    out = _drain(one)["free"].outputs[0]
    first = one.tokenizer.decode(out.token_ids[:1])
    assert first and len(out.text) > len(first)
    stop = out.text[len(first) - 1 : len(first) + 1]
    assert out.text.find(stop) == len(first) - 1  # its first occurrence spans tokens 0 and 1
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop])
    one.add_request("stop", "abc xyz", params)
    want = _drain(one)["stop"].outputs[0]
    assert want.finish_reason == "stop" and want.text == out.text[: len(first) - 1]
    pre, dec = _engine(base), _engine(base)
    pre.add_request("stop", "abc xyz", params, prefill_only=True)
    export = _drain(pre)["stop"].kv_export
    assert export is not None  # the first token alone did not stop it
    assert dec.import_request(export)
    got = _drain(dec)["stop"].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    _assert_idle(pre, dec)


def _held(eng: LLMEngine) -> set[str]:
    assert eng.lora is not None
    return set(eng.lora.residency.held)


@pytest.mark.parametrize("when", ["after-import", "before-import"])
def test_adapter_removed_on_the_decode_side_around_the_import(setup, when):
    """The decode engine made the adapter resident during the prefill (the replica's `prepare`); the
    adapter is then deactivated (removed) there, after the import or before it arrives: the admitted
    request finishes on its version, with one engine's tokens; afterwards the adapter is gone and nothing
    holds it. An import aborted before it decodes (a cancelled transfer) releases its blocks and hold."""
    base, dirs = setup
    name = "qv-r8-rslora"
    lora = _lora(dirs, name)
    prompt = list(range(7, 26))
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _one(base, {"a": (prompt, name, lora)}, {"a": p})["a"]
    pre, dec = _engine(base), _engine(base)
    pre.add_request("a", prompt, p, lora, prefill_only=True)
    dec.add_lora(lora)  # prepared while the prefill runs
    export = _drain(pre)["a"].kv_export
    digest = export.state.lora_key
    assert digest is not None
    if when == "before-import":
        assert dec.remove_lora(name)
        dec.add_lora(lora)  # the replica loads the admitted version again by its digest (DecodeWorker._load)
    assert dec.import_request(export)
    if when == "after-import":
        assert dec.remove_lora(name)
    assert digest in _held(dec)
    assert _drain(dec)["a"].outputs[0].token_ids == want
    if when == "after-import":  # dropped once its last request ended
        assert digest not in {i.digest for i in dec.list_loras()}
    assert not _held(dec)
    _assert_idle(pre, dec)

    # a transfer cancelled after the import: the abort frees the blocks and the adapter's hold
    pre.add_request("b", prompt + [3], p, lora, prefill_only=True)
    dec.add_lora(lora)
    export = _drain(pre)["b"].kv_export
    assert dec.import_request(export)
    assert dec.kv.num_requests() == 1 and _held(dec) == {digest}
    dec.abort_request("b")
    assert not _held(dec)
    _assert_idle(pre, dec)
