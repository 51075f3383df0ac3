"""Typed FastAPI dependencies: what a route may ask for, instead of reaching into `request.app.state`.

    async def list_adapters(adapters: AdaptersDep, _: AdminActor) -> AdapterList: ...

`AppState` is created by the server's lifespan (`api.app`); every other dependency is a part of it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from api.auth import require_admin
from api.engine_client import EngineClient
from api.state import AppState, app_state
from lora_registry.keys import KeyService
from lora_registry.registry import Registry
from lora_registry.service import RegistryService

StateDep = Annotated[AppState, Depends(app_state)]


def registry(state: StateDep) -> Registry:
    return state.registry


def adapter_service(state: StateDep) -> RegistryService:
    return state.registry.adapters


def key_service(state: StateDep) -> KeyService:
    return state.registry.keys


def engine_client(state: StateDep) -> EngineClient:
    return state.client


RegistryDep = Annotated[Registry, Depends(registry)]
AdaptersDep = Annotated[RegistryService, Depends(adapter_service)]
KeysDep = Annotated[KeyService, Depends(key_service)]
EngineClientDep = Annotated[EngineClient, Depends(engine_client)]
AdminActor = Annotated[str, Depends(require_admin)]  # the actor name; 401/403 without the admin token
