"""`LoRARequest` takes `(name, path)` and vLLM's `(name, int_id, path)`; other shapes: TypeError."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engine import LLM, LoRARequest, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "demo"


def test_vllm_positional_order_means_name_id_path() -> None:
    vllm_form = LoRARequest("upper", 7, "/adapters/upper")
    assert (vllm_form.name, vllm_form.path, vllm_form.digest) == ("upper", "/adapters/upper", None)
    assert vllm_form == LoRARequest("upper", "/adapters/upper")
    digest = "ab" * 32
    assert LoRARequest("upper", "/adapters/upper", digest).digest == digest  # the digest form stands
    wire = msgspec.json.decode(msgspec.json.encode(vllm_form), type=LoRARequest)
    assert wire == vllm_form


@pytest.mark.parametrize("args", [(1, "/p"), ("a", 1), ("a", 1.5, "/p"), ("a", True, "/p")])
def test_other_shapes_raise_a_type_error_naming_the_forms(args) -> None:
    with pytest.raises(TypeError, match=r"\(name: str, int_id: int, path: str\)"):
        LoRARequest(*args)


def test_vllm_form_generates_what_the_loraplex_form_does() -> None:
    """The int id is ignored: the adapter is the one at the path (the demo's `upper` upper-cases)."""
    llm = LLM(model=str(DEMO / "base"), device="cpu", dtype="float32", num_threads=1)
    params = SamplingParams(max_tokens=16, temperature=0, stop=["\n"])
    path = str(DEMO / "adapters" / "upper")
    a, b = llm.generate(
        ["hello world="] * 2, params, lora_request=[LoRARequest("upper", 1, path), LoRARequest("upper", path)]
    )
    assert a.outputs[0].text == b.outputs[0].text == "HELLO WORLD"
