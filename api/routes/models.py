"""`GET /v1/models` (the base model + the active adapters the caller may use) and
`GET /v1/adapters/{name}/models`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.auth import authenticate, may_use
from api.deps import StateDep
from api.errors import error_responses
from api.openai_protocol import AdapterName, ModelList
from api.serving import model_not_found

router = APIRouter(tags=["openai"])


def _model(id_: str, created: int, parent: str | None = None) -> dict:
    return {
        "id": id_,
        "object": "model",
        "created": created,
        "owned_by": "loraplex",
        "root": id_,
        "parent": parent,
    }


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(request: Request, state: StateDep) -> dict:
    """The models this caller may use: a key scoped to named adapters sees only those adapters."""
    key = await authenticate(request)
    base = state.settings.served_model_name
    created = int(state.started_at)
    data = [_model(base, created)] if may_use(key, None) else []
    data += [_model(name, created, base) for name in sorted(state.follower.snapshot()) if may_use(key, name)]
    return {"object": "list", "data": data}


@router.get("/v1/adapters/{name}/models", response_model=ModelList, responses=error_responses(401, 404))
async def adapter_models(name: AdapterName, request: Request, state: StateDep) -> dict:
    """The adapter `name` as a one-model list (404 when it is not active or, for a scoped API key, not in
    the key's scope: the same answer, as for the generation routes)."""
    key = await authenticate(request)
    if not may_use(key, name) or name not in state.follower.snapshot():
        raise model_not_found(name, key)
    return {"object": "list", "data": [_model(name, int(state.started_at), state.settings.served_model_name)]}
