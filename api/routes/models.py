"""`GET /v1/models` (base model + every active adapter) and `GET /v1/adapters/{name}/models`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.auth import authenticate, authorize
from api.deps import StateDep
from api.errors import APIError

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


@router.get("/v1/models")
async def list_models(request: Request, state: StateDep) -> dict:
    await authenticate(request)
    base = state.settings.served_model_name
    created = int(state.started_at)
    data = [_model(base, created)]
    data += [_model(name, created, base) for name in sorted(state.follower.snapshot())]
    return {"object": "list", "data": data}


@router.get("/v1/adapters/{name}/models")
async def adapter_models(name: str, request: Request, state: StateDep) -> dict:
    authorize(await authenticate(request), name)
    if name not in state.follower.snapshot():
        raise APIError(404, f"The model '{name}' does not exist or is not active", code="model_not_found")
    return {"object": "list", "data": [_model(name, int(state.started_at), state.settings.served_model_name)]}
