"""Requests admitted for an adapter version finish on it, whatever happens to the adapter meanwhile.

`remove_lora` while requests wait only retires an adapter (dropped after its last request); the files
of an adapter that is not in memory are held open from admission, so deleting them does not fail the
request; an adapter whose files are gone before admission is refused with `AdapterFilesGone`.
"""

from __future__ import annotations

import random
import shutil

import pytest

from engine import LLMEngine, LoRARequest, SamplingParams
from engine.lora.adapter_checkpoint import adapter_digest
from engine.lora.held_files import AdapterFilesGone
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter

NAMES = ("all7-r4", "qv-r8-rslora", "gud-r12")
PROMPT = [5, 6, 7]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(checkpoint, tmp_path_factory):
    """(base dir, {name: adapter dir}, {name: greedy tokens of PROMPT by PEFT})."""
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("retire")
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    oracle = PeftGreedyOracle(base)
    expected = {n: oracle.greedy(PROMPT, PARAMS.max_tokens, dirs[n]) for n in NAMES}
    return base, dirs, expected


def _engine(base, **kw) -> LLMEngine:
    return LLMEngine.from_args(str(base), **({"device": "cpu", "dtype": "float32", "max_lora_rank": 32} | kw))


def _lr(name: str, path) -> LoRARequest:
    return LoRARequest(name, str(path), adapter_digest(path))


def _drain(eng: LLMEngine) -> dict:
    done = {}
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert not eng.has_unfinished_requests()
    return done


def _assert_nothing_held(eng: LLMEngine) -> None:
    assert eng.get_stats().kv_blocks_used == 0
    assert eng.lora is not None
    assert eng.lora.loader.held_digests() == [] and eng.lora.residency.held == set()
    assert eng.lora.retiring == set()


def test_files_deleted_after_admission_still_serve_the_admitted_version(tiny, tmp_path):
    base, dirs, expected = tiny
    eng = _engine(base)
    path = shutil.copytree(dirs["gud-r12"], tmp_path / "gud")
    lr = _lr("gud", path)
    eng.add_request("r", PROMPT, PARAMS, lr)  # not in memory: its files are held open now
    assert eng.lora is not None and eng.lora.loader.held_digests() == [lr.digest]
    shutil.rmtree(path)  # the registry deleted it before the engine read it
    assert eng.remove_lora("gud")  # retired: the waiting request still uses it
    done = _drain(eng)
    assert done["r"].error is None and done["r"].outputs[0].token_ids == expected["gud-r12"]
    assert eng.list_loras() == []  # dropped after its last request
    _assert_nothing_held(eng)


def test_files_gone_before_admission(tiny, tmp_path):
    """Not in memory and gone: refused (the server answers 404). In memory: served from memory."""
    base, dirs, expected = tiny
    eng = _engine(base)
    gone = shutil.copytree(dirs["all7-r4"], tmp_path / "gone")
    lr_gone = _lr("gone", gone)
    shutil.rmtree(gone)
    with pytest.raises(AdapterFilesGone):
        eng.add_request("refused", PROMPT, PARAMS, lr_gone)
    assert not eng.has_unfinished_requests()
    kept = shutil.copytree(dirs["qv-r8-rslora"], tmp_path / "kept")
    lr_kept = _lr("kept", kept)
    eng.add_lora(lr_kept)
    shutil.rmtree(kept)
    eng.add_request("served", PROMPT, PARAMS, lr_kept)
    done = _drain(eng)
    assert done["served"].outputs[0].token_ids == expected["qv-r8-rslora"]
    assert [i.tier for i in eng.list_loras()] == ["device"]  # not removed: it stays cached


def test_reactivation_cancels_a_pending_removal(tiny):
    base, dirs, expected = tiny
    eng = _engine(base)
    lr = _lr("a", dirs["all7-r4"])
    eng.add_request("r", PROMPT, PARAMS, lr)
    assert eng.remove_lora("a")
    eng.prefetch_lora(lr)  # activated again before its request finished
    done = _drain(eng)
    assert done["r"].outputs[0].token_ids == expected["all7-r4"]
    assert [i.names for i in eng.list_loras()] == [["a"]]
    assert eng.lora is not None and eng.lora.retiring == set()


def test_request_admitted_after_the_removal_does_not_bring_the_adapter_back_for_good(tiny):
    """A request sent before a deactivation may reach the engine after it: it is served, and the adapter
    is dropped again after it; once activated again (prefetch) the adapter stays cached."""
    base, dirs, expected = tiny
    eng = _engine(base)
    lr = _lr("a", dirs["all7-r4"])
    eng.add_lora(lr)
    assert eng.remove_lora("a") and eng.list_loras() == []  # not in use: forgotten at once
    eng.add_request("late", PROMPT, PARAMS, lr)
    done = _drain(eng)
    assert done["late"].outputs[0].token_ids == expected["all7-r4"]
    assert eng.list_loras() == []
    _assert_nothing_held(eng)
    eng.prefetch_lora(lr)
    eng.add_request("again", PROMPT, PARAMS, lr)
    assert _drain(eng)["again"].outputs[0].token_ids == expected["all7-r4"]
    assert [i.names for i in eng.list_loras()] == [["a"]]


@pytest.mark.parametrize("seed", [0, 1])
def test_remove_and_activate_race_with_requests_in_flight(tiny, seed):
    """Random adds, aborts, removals and re-activations between steps, with a pool that fits one
    adapter and a host cache of one (so adapters are evicted and reloaded): every request finishes
    without error on its adapter's exact greedy tokens, and nothing is left held once all are removed."""
    base, dirs, expected = tiny
    eng = _engine(base, max_loras=1, max_cpu_loras=1, num_kv_blocks=64, block_size=4)
    rng = random.Random(seed)
    lrs = {n: _lr(n, dirs[n]) for n in NAMES}
    asked: dict[str, str] = {}
    done: dict = {}
    removes = 0
    for i in range(400):
        op = rng.random()
        name = rng.choice(NAMES)
        if op < 0.3:
            rid = f"r{i}"
            eng.add_request(rid, PROMPT, PARAMS, lrs[name])
            asked[rid] = name
        elif op < 0.4:
            removes += eng.remove_lora(name)
        elif op < 0.45:
            eng.prefetch_lora(lrs[name])
        elif op < 0.48 and asked:
            eng.abort_request(rng.choice(list(asked)))
        else:
            done |= {o.request_id: o for o in eng.step() if o.finished}
    done |= _drain(eng)
    assert removes > 10
    finished = [rid for rid in asked if rid in done]
    assert len(finished) > 50
    for rid in finished:
        out = done[rid]
        assert out.error is None, out.error
        if out.outputs[0].finish_reason == "length":
            assert out.outputs[0].token_ids == expected[asked[rid]], rid
    for name in NAMES:
        eng.remove_lora(name)
    assert eng.list_loras() == []
    _assert_nothing_held(eng)
