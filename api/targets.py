"""Which model a generation request runs on (`Target`): the base model or an active adapter (or a weighted
mix of them), resolved from the body's `model` (or the per-adapter URL) under the caller's API key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from api.auth import authenticate, authorize, may_use
from api.errors import APIError
from api.mix import metric_label, mix_digest, mix_request
from api.openai_protocol import AdapterWeight
from engine.lora_request import LoRARequest
from lora_registry.errors import RegistryUnavailable


@dataclass(slots=True)
class Target:
    """What a request runs on: the base model, or an active adapter (registry PEFT dir + digest), and
    the caller's API key (None when keys are not required, "admin" for the admin token)."""

    model_name: str
    lora: LoRARequest | None
    key: Any = None

    @property
    def adapter(self) -> str | None:
        """The adapter's name (a weighted mix: `a*0.7+b*0.3`); None for the base model."""
        return self.lora.name if self.lora else None

    @property
    def adapters(self) -> tuple[str, ...]:
        """Every adapter the request applies (a mix's members): the subjects of adapter rate limits."""
        return tuple(lr.name for lr, _ in self.lora.members()) if self.lora else ()

    @property
    def label(self) -> str:
        """The adapter as metrics label it ("" for the base model; a mix's members without weights)."""
        if self.lora is None:
            return ""
        return metric_label(self.lora) if self.lora.mix else self.lora.name

    @property
    def digest(self) -> str | None:
        """The adapter's content digest (a mix: the engine's key of its members and weights)."""
        if self.lora is None:
            return None
        return mix_digest(self.lora) if self.lora.mix else self.lora.digest


def is_base_model(state, name: str) -> bool:
    """Whether `name` is the base model: its served name or the checkpoint's own name."""
    return name == state.settings.served_model_name or name in state.settings.model_aliases


async def resolve_target(
    request: Request,
    model: str | None,
    forced_adapter: str | None = None,
    mix: list[AdapterWeight] | None = None,
) -> Target:
    """The base model or an active adapter named by the request: 401 without a valid API key (when keys
    are required), 403 when the key may not use the base model, 404 for an adapter that is unknown,
    inactive or outside the key's scope (the same answer for all three, so a scoped key cannot probe which
    adapter names exist; the scope is checked first, so neither does the time to answer tell).

    With `mix` (the body's `adapters`), the weighted mix of those adapters (`api/mix.py`)."""
    state = request.app.state.loraplex
    key = await authenticate(request)
    name = forced_adapter or model or state.settings.served_model_name
    if mix is not None:
        named = None if forced_adapter is None and is_base_model(state, name) else name
        shown = name if named is not None else state.settings.served_model_name
        return Target(shown, await mix_request(state, key, mix, named, adapter_target), key)
    if forced_adapter is None and is_base_model(state, name):
        authorize(key, None)
        return Target(state.settings.served_model_name, None, key)
    if not may_use(key, name):
        raise model_not_found(name, key)
    target = await adapter_target(state, name, key)
    target.key = key
    return target


def model_not_found(name: str, key: Any = None) -> APIError:
    """The 404 for an adapter `name` that does not exist, is not active, or (for a key scoped to named
    adapters) is not in the key's scope: one body for all of them."""
    scoped = key is not None and key != "admin" and not key.is_admin
    why = "does not exist or is not active"
    if scoped:
        why = "does not exist, is not active, or this API key may not use it"
    return APIError(404, f"The model '{name}' {why}", param="model", code="model_not_found")


async def adapter_target(state, name: str, key: Any = None) -> Target:
    """The active adapter `name` with its PEFT directory; 404 when it is unknown or inactive.

    Hot path: an adapter in the in-memory active set (kept current by the registry's events) whose
    directory is already materialized costs no database call and no worker thread. Only a name the
    set does not hold is looked up in the database (it may have been activated a moment ago), on the
    registry lookup lane; an unreachable registry then answers 503.
    """
    registry = state.registry.adapters
    try:
        active = state.follower.get(name)
        if active is None:
            active = await state.lookups.run(registry.active_adapter, name)
        if active is None:
            raise model_not_found(name, key)
        path = registry.materialized_path(active.digest)
        if path is None:
            path = await state.lookups.run(registry.adapter_path, active.digest)
    except RegistryUnavailable as exc:
        raise registry_unavailable(name) from exc
    return Target(name, LoRARequest(name, str(path), active.digest))


def registry_unavailable(name: str) -> APIError:
    """503 for a request whose adapter cannot be looked up while the registry database is unreachable."""
    return APIError(
        503,
        f"the adapter registry is unreachable, so the model '{name}' cannot be looked up; retry shortly",
        param="model",
        code="registry_unavailable",
        headers={"Retry-After": "2"},
    )
