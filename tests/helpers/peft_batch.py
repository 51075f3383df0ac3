"""One mixed-adapter batch checked against HF + PEFT: the shared oracle check of the adapter-kind tests."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams

NEW = 6  # tokens generated per prompt


def cpu_llm(base: Path, **kwargs) -> LLM:
    """A float32 CPU engine on checkpoint `base` with small blocks and room for 4 rank-16 adapters."""
    defaults = {"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 16, "max_loras": 4}
    return LLM(str(base), **(defaults | kwargs))


def lora_request(name: str, dirs: Mapping[str, Path], mixes=None) -> LoRARequest:
    """The adapter `name` of `dirs`, or the weighted mix `mixes[name]` of them."""
    if mixes and name in mixes:
        return LoRARequest.weighted([(LoRARequest(m, str(dirs[m])), w) for m, w in mixes[name]], name=name)
    return LoRARequest(name, str(dirs[name]))


def build_weighted_cat(
    base: Path, dirs: Mapping[str, Path], members: list[tuple[str, float]], out: Path
) -> Path:
    """PEFT's `add_weighted_adapter(combination_type="cat")` of the adapters `members` names (with their
    weights), saved as an adapter directory `out` (the oracle of a weighted mix)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    (first, _), *rest = members
    peft = PeftModel.from_pretrained(model, dirs[first], adapter_name=first)
    for name, _ in rest:
        peft.load_adapter(dirs[name], adapter_name=name)
    names, weights = [n for n, _ in members], [w for _, w in members]
    peft.add_weighted_adapter(names, weights, "mix", combination_type="cat")
    peft.save_pretrained(out, selected_adapters=["mix"])
    return out / "mix"


def check_mixed_batch(
    llm: LLM, dirs: Mapping[str, Path], oracle, seed: int, n: int, logprobs: bool = False
) -> None:
    """n prompts of mixed lengths, each on one of `dirs`' adapters or the base in turn, in one batch,
    checked by `check_requests`."""
    rng = random.Random(seed)
    names = [*dirs, None]
    reqs = [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))], names[i % len(names)]) for i in range(n)
    ]
    check_requests(llm, dirs, oracle, reqs, NEW, logprobs)


def check_requests(
    llm: LLM,
    dirs: Mapping[str, Path],
    oracle,
    reqs: list[tuple[list[int], str | None]],
    new: int,
    logprobs: bool = False,
    mixes: Mapping[str, list[tuple[str, float]]] | None = None,
) -> None:
    """Generate `new` greedy tokens for each (prompt, adapter name or None) of `reqs` in one batch: the
    tokens (and with `logprobs` each token's log-probability, to 1e-4) equal `oracle`'s (PEFT), and every
    KV block is free or cached afterwards. A name in `mixes` is requested as that weighted mix of other
    adapters of `dirs` (its own dir, for the oracle, holds PEFT's `add_weighted_adapter` result)."""
    loras = [lora_request(name, dirs, mixes) if name else None for _, name in reqs]
    top = 1 if logprobs else None
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=top)
    outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    for (prompt, name), out in zip(reqs, outs, strict=True):
        comp = out.outputs[0]
        adapter = dirs[name] if name else None
        assert comp.token_ids == oracle.greedy(prompt, new, adapter), f"adapter {name}"
        if logprobs:
            ref = torch.log_softmax(oracle.logits(prompt + comp.token_ids, adapter), -1)
            for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
                want = float(ref[len(prompt) - 1 + i, tok])
                assert entry[tok].logprob == pytest.approx(want, abs=1e-4), name
    assert llm.engine.get_stats().kv_blocks_used == 0
