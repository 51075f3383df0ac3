"""The `adapters` extension of the generation routes: a weighted mix of active adapters for one request.

    "adapters": [{"name": "a", "weight": 0.7}, {"name": "b", "weight": 0.3}]

The engine applies every member on every token, `Σ w_i · s_i · B_i A_i x` (PEFT's
`add_weighted_adapter(combination_type="cat")`, engine/lora/mix.py). With `adapters`:

- `model` may be omitted or name the served base model; when it (or a per-adapter URL) names an
  adapter, that adapter must be one of the members (400 otherwise): the mix is applied as listed, and the
  answer's `model` echoes what the request named.
- every member must be active and allowed to the caller's API key (404 `model_not_found` otherwise, the
  same answer as for `model`, param `adapters`); at most `min(8, max_loras)` members (400); names
  listed once, weights finite, non-zero, |w| ≤ 100 (400, by the request schema);
- members a mix cannot combine (DoRA, lora_bias, trainable tokens, modules_to_save: PEFT's `cat` keeps
  none of them) are refused with a 400 naming the adapter and the feature.

Rate limits apply to every member (each adapter's requests, tokens and concurrency are charged, all or
nothing); the usage record and metrics name the mix (`a*0.7+b*0.3`, metrics without the weights).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from api.auth import may_use
from api.errors import APIError
from api.openai_protocol import AdapterWeight
from engine.lora.adapter_checkpoint import CONFIG_FILE
from engine.lora.mix import mix_key
from engine.lora_request import MAX_MIX_ADAPTERS, LoRARequest

Lookup = Callable[[Any, str, Any], Awaitable[Any]]


async def mix_request(
    state, key: Any, members: list[AdapterWeight], named: str | None, lookup: Lookup
) -> LoRARequest:
    """The engine's `LoRARequest` of a request with `adapters` (module docstring); `named`: the adapter
    its `model` or URL names (None: the base model); `lookup(state, name, key)`: the active adapter's
    target (404 when there is none), `api.targets.adapter_target`."""
    limit = min(MAX_MIX_ADAPTERS, state.client.config.max_loras)
    if len(members) > limit:
        raise APIError(
            400,
            f"adapters: {len(members)} adapters in the mix; this server runs at most {limit} per request",
            param="adapters",
        )
    names = [m.name for m in members]
    if named is not None and named not in names:
        raise APIError(
            400,
            f"model names the adapter {named!r}, which is not in adapters; list it there with its weight, "
            "or name the base model",
            param="adapters",
        )
    loras: list[tuple[LoRARequest, float]] = []
    for m in members:
        if not may_use(key, m.name):
            raise member_not_found(m.name, key)
        try:
            target = await lookup(state, m.name, key)
        except APIError as exc:
            raise member_not_found(m.name, key) if exc.status == 404 else exc from None
        assert target.lora is not None, "an adapter target carries its LoRARequest"
        why = unmixable(target.lora.digest or "", target.lora.path, m.name)
        if why is not None:
            raise APIError(400, f"adapters: {why}", param="adapters", code="adapter_not_mixable")
        loras.append((target.lora, m.weight))
    return LoRARequest.weighted(loras)


def member_not_found(name: str, key: Any) -> APIError:
    """The 404 for a mix member that does not exist, is not active or is outside the key's scope."""
    scoped = key is not None and key != "admin" and not key.is_admin
    why = "does not exist or is not active"
    if scoped:
        why = "does not exist, is not active, or this API key may not use it"
    return APIError(404, f"adapters: the adapter '{name}' {why}", param="adapters", code="model_not_found")


def mix_digest(lora: LoRARequest) -> str | None:
    """The engine's key of a mix (its members' digests and weights), None when a digest is unknown."""
    digests = [lr.digest for lr, _ in lora.mix]
    if any(d is None for d in digests):
        return None
    return mix_key([d for d in digests if d is not None], [w for _, w in lora.mix])


def metric_label(lora: LoRARequest) -> str:
    """A mix's name for metrics: its members without the weights (bounded label values)."""
    return "+".join(lr.name for lr, _ in lora.mix)


@lru_cache(maxsize=4096)
def unmixable(digest: str, path: str, name: str) -> str | None:
    """Why the adapter at `path` (content `digest`: adapters are immutable, so the answer is cached)
    cannot be a mix member, from its `adapter_config.json`; None when it can."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None  # the engine reads the files again and refuses what it must
    for field, feature in (
        ("use_dora", "DoRA"),
        ("lora_bias", "lora_bias"),
        ("trainable_token_indices", "trainable tokens"),
        ("modules_to_save", "modules_to_save"),
    ):
        if config.get(field):
            return (
                f"adapter {name!r} uses {feature}, which a weighted mix cannot combine (PEFT's "
                "add_weighted_adapter(combination_type='cat') mixes LoRA A/B weights only)"
            )
    return None
