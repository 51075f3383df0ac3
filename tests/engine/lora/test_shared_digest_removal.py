"""`remove_lora` of one of two names with the same content keeps their shared entry (residency is per
digest); the entry goes with the last name."""

from __future__ import annotations

import pytest

from engine import LLMEngine, LoRARequest, SamplingParams
from engine.lora.adapter_checkpoint import adapter_digest
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def shared(checkpoint, tmp_path_factory):
    """(base dir, adapter dir, its digest)."""
    base = checkpoint("llama")
    path = build_adapter(base, tmp_path_factory.mktemp("shared") / "a", seed=0, **ADAPTER_SPECS["all7-r4"])
    return base, path, adapter_digest(path)


def _serve(eng: LLMEngine, lr: LoRARequest) -> None:
    eng.add_request(f"r-{lr.name}-{eng.get_stats().num_steps}", [5, 6, 7], PARAMS, lr)
    while eng.has_unfinished_requests():
        assert all(o.error is None for o in eng.step())


def _tier(eng: LLMEngine, digest: str) -> str | None:
    return next((i.tier for i in eng.list_loras() if i.digest == digest), None)


def test_removing_one_name_keeps_the_other_names_entry(shared):
    base, path, digest = shared
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    for name in ("rot13", "rot13-alias"):
        _serve(eng, LoRARequest(name, str(path), digest))
    loads = eng.get_lora_stats().loads
    assert eng.remove_lora("rot13-alias")
    assert _tier(eng, digest) == "device"
    assert [i.names for i in eng.list_loras()] == [["rot13"]]
    _serve(eng, LoRARequest("rot13", str(path), digest))
    assert eng.get_lora_stats().loads == loads
    assert eng.remove_lora("rot13")
    assert eng.list_loras() == []


def test_keep_protects_a_digest_the_engine_knows_under_no_other_name(shared):
    """The API passes the digests its other active names serve (the engine may not have seen them yet)."""
    base, path, digest = shared
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    _serve(eng, LoRARequest("rot13-alias", str(path), digest))
    assert eng.remove_lora("rot13-alias", keep={digest})
    assert _tier(eng, digest) == "device"
    assert not eng.remove_lora("rot13-alias") and _tier(eng, digest) == "device"  # name already gone
    assert eng.remove_lora(digest) and eng.list_loras() == []
