"""`GET /health` and `GET|POST /ping` (liveness), `GET /ready` (readiness), `GET /version` and
`GET /metrics` (Prometheus text format)."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import EngineClientDep, StateDep
from api.errors import error_responses
from api.readiness import BlobCheck, Readiness, RegistryProbe, events_state

router = APIRouter(tags=["system"])


@router.get("/health", responses=error_responses(503))
async def health(client: EngineClientDep) -> JSONResponse:
    """Liveness: 200 while the engine process is up, 503 while it is down or restarting."""
    body = {"status": "ok" if client.healthy else "unhealthy", "engine_restarts": client.restarts}
    return JSONResponse(body, status_code=200 if client.healthy else 503)


@router.get("/ping", responses=error_responses(503))
async def ping(client: EngineClientDep) -> JSONResponse:
    """vLLM's (and SageMaker's) liveness probe: the same answer as `/health`."""
    return await health(client)


@router.post("/ping", responses=error_responses(503))
async def ping_post(client: EngineClientDep) -> JSONResponse:
    """`/ping` by POST, as vLLM also answers it."""
    return await health(client)


@router.get("/version")
async def version() -> dict[str, str]:
    """The loraplex version serving (`{"version": "0.1.0"}`)."""
    return {"version": loraplex_version()}


def loraplex_version() -> str:
    """The installed package's version ("unknown" when it is not installed)."""
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:
        return "unknown"


@router.get("/ready", responses=error_responses(503))
async def ready(request: Request, state: StateDep) -> JSONResponse:
    """Readiness: 200 when the engine is up, the registry database answers (within 2 s) and this replica
    can read every active adapter's weights, else 503; the body names the part that is down:
    `{"status", "engine", "registry", "events", "blobs"}`."""
    app = request.app.state
    probe = getattr(app, "registry_probe", None)
    if probe is None:
        probe = app.registry_probe = RegistryProbe(state.registry.ping)
        app.blob_probe = RegistryProbe(BlobCheck(state.registry, state.follower.snapshot).check)
    client = state.client
    engine = "ok" if client.healthy else ("restarting" if client.restarts else "down")
    registry = await probe.check()
    blobs = await app.blob_probe.check() if registry == "ok" else "unchecked"
    if blobs == "unreachable":
        blobs = "unchecked"
    result = Readiness(engine, registry, events_state(state.registry.bus), blobs)
    return JSONResponse(result.body(), status_code=200 if result.ready else 503)


@router.get("/metrics", responses=error_responses(401, 403))
async def metrics(state: StateDep) -> Response:
    state.metrics.refresh(state.client)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
