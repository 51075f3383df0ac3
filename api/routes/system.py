"""`GET /health` and `GET /metrics` (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import EngineClientDep, StateDep
from api.errors import error_responses

router = APIRouter(tags=["system"])


@router.get("/health", responses=error_responses(503))
async def health(client: EngineClientDep) -> JSONResponse:
    """200 while the engine process is up, 503 while it is down or restarting."""
    body = {"status": "ok" if client.healthy else "unhealthy", "engine_restarts": client.restarts}
    return JSONResponse(body, status_code=200 if client.healthy else 503)


@router.get("/metrics", responses=error_responses(401, 403))
async def metrics(state: StateDep) -> Response:
    state.metrics.refresh(state.client)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
