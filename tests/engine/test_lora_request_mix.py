"""`LoRARequest.weighted`: the checks a weighted mix passes on construction and on decoding, its wire
form, and `mix_key` (a mix's prefix-cache identity depends on every member digest and weight)."""

from __future__ import annotations

import msgspec
import pytest

from engine import LoRARequest
from engine.lora.mix import mix_key
from engine.lora_request import MAX_MIX_ADAPTERS

A, B = LoRARequest("a", "/adapters/a"), LoRARequest("b", "/adapters/b", "0" * 64)


def test_a_mix_names_its_members_and_keeps_the_plain_forms():
    mix = LoRARequest.weighted([(A, 0.7), (B, 0.3)])
    assert mix.name == "a*0.7+b*0.3" and mix.is_mix and mix.path == ""
    assert mix.members() == ((A, 0.7), (B, 0.3))
    assert A.members() == ((A, 1.0),) and not A.is_mix
    assert repr(A) == "LoRARequest(name='a', path='/adapters/a')"
    assert LoRARequest("a", 7, "/adapters/a") == A  # vLLM's (name, int_id, path)
    assert LoRARequest.weighted([(A, 2)], name="boost").mix == ((A, 2.0),)


def test_a_mix_survives_the_wire():
    mix = LoRARequest.weighted([(A, 0.7), (B, -0.3)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(mix), type=LoRARequest) == mix
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(A), type=LoRARequest) == A


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([(A, 1.0)] * 2, "adapter 'a' appears twice"),
        ([(A, 0.0)], "must be finite, non-zero"),
        ([(A, float("inf"))], "must be finite, non-zero"),
        ([(A, 101.0)], "at most 100 in magnitude"),
        ([(LoRARequest(f"x{i}", "/p"), 1.0) for i in range(MAX_MIX_ADAPTERS + 1)], "1 to 8 adapters"),
    ],
)
def test_bad_mixes_are_refused(members, error):
    with pytest.raises(ValueError, match=error):
        LoRARequest("m", "", None, tuple(members))


def test_an_empty_mix_is_refused():
    with pytest.raises(ValueError, match="1 to 8 adapters, got 0"):
        LoRARequest.weighted([])


def test_mixes_do_not_nest_and_have_no_files_of_their_own():
    inner = LoRARequest.weighted([(A, 0.5)])
    with pytest.raises(ValueError, match="mixes do not nest"):
        LoRARequest.weighted([(inner, 1.0)])
    with pytest.raises(ValueError, match="no path or digest of its own"):
        LoRARequest("m", "/some/dir", None, ((A, 1.0),))
    with pytest.raises(TypeError, match="must be a number"):
        LoRARequest("m", "", None, ((A, "heavy"),))  # type: ignore[arg-type]
    wire = msgspec.msgpack.encode({"name": "m", "path": "", "mix": [[{"name": "a", "path": "/p"}, 0.0]]})
    with pytest.raises(msgspec.ValidationError, match="non-zero"):
        msgspec.msgpack.decode(wire, type=LoRARequest)


def test_the_mix_key_depends_on_every_digest_and_weight():
    d1, d2 = "1" * 64, "2" * 64
    key = mix_key([d1, d2], [0.7, 0.3])
    assert len(key) == 64 and key not in (d1, d2)
    assert key == mix_key([d1, d2], [0.7, 0.3])
    others = {mix_key([d1, d2], [0.3, 0.7]), mix_key([d2, d1], [0.7, 0.3]), mix_key([d1], [0.7])}
    assert key not in others and len(others) == 3
