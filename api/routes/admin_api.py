"""Admin JSON API under `/admin/api/` (Bearer admin token), plus vLLM's load/unload LoRA routes.

Every change goes through the registry service; the engine follows through the registry's events.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile as UploadedFile  # what forms hold (FastAPI's is a subclass)

from api.deps import AdaptersDep, AdminActor, KeysDep, StateDep
from api.errors import APIError
from api.openai_protocol import LoadLoRARequest, UnloadLoRARequest
from api.state import AppState
from lora_registry.errors import RegistryError

router = APIRouter(prefix="/admin/api", tags=["admin"])
compat = APIRouter(tags=["admin"])
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


async def call_registry(fn, *args, **kwargs):
    """Run a (blocking) registry call off the event loop; registry errors become API errors."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except RegistryError as exc:
        raise APIError(exc.status_code, str(exc)) from exc


async def save_upload(files: Sequence[UploadedFile], dest: Path, limit: int) -> Path:
    """Write the uploaded zip (one file) or PEFT pair (two files) under `dest`; 413 past `limit` bytes.

    Returns the path to register: the zip file, or the directory holding the two files.
    """
    if not files:
        raise APIError(400, "no file uploaded", param="file")
    names = [Path(f.filename or "").name for f in files]
    if len(files) == 1 and names[0].lower().endswith(".zip"):
        targets = [dest / "upload.zip"]
    elif sorted(names) == sorted(PEFT_FILES):
        targets = [dest / "adapter" / n for n in names]
    else:
        raise APIError(
            400,
            "upload a .zip of a PEFT adapter directory, or exactly the two files "
            "adapter_config.json and adapter_model.safetensors",
            param="file",
        )
    total = 0
    for f, target in zip(files, targets, strict=True):
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as out:
            while chunk := await f.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    raise APIError(413, f"upload exceeds the {limit} byte limit", param="file")
                out.write(chunk)
    return targets[0] if len(targets) == 1 else targets[0].parent


async def register_upload(
    state: AppState,
    name: str,
    files: Sequence[UploadedFile],
    *,
    description: str | None,
    activate: bool,
    actor: str,
):
    """Save an upload in a private temp dir, register it as a version of `name`, remove the temp dir.

    Refusals come back as `APIError`s whose messages do not show the server's temp paths.
    """
    tmp_root = state.registry.settings.data_dir / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="upload-", dir=tmp_root))
    try:
        source = await save_upload(files, tmp, state.settings.max_upload_bytes)
        return await call_registry(
            state.registry.adapters.register,
            name,
            source,
            description=description,
            activate=activate,
            actor=actor,
        )
    except APIError as exc:
        for prefix in (f"{tmp}/adapter/", f"{tmp}/", str(tmp)):
            exc.message = exc.message.replace(prefix, "")
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@router.post("/adapters", status_code=201)
async def upload_adapter(
    state: StateDep,
    actor: AdminActor,
    name: Annotated[str, Form()],
    file: Annotated[list[UploadFile], File()],
    description: Annotated[str | None, Form()] = None,
    activate: Annotated[bool, Form()] = False,
):
    result = await register_upload(state, name, file, description=description, activate=activate, actor=actor)
    return JSONResponse(result.to_dict(), status_code=201 if result.created else 200)


@router.get("/adapters")
async def list_adapters(adapters: AdaptersDep, _: AdminActor) -> dict:
    rows = await call_registry(adapters.list)
    return {"data": [r.to_dict() for r in rows]}


@router.get("/adapters/{name}")
async def show_adapter(name: str, adapters: AdaptersDep, _: AdminActor) -> dict:
    return (await call_registry(adapters.show, name)).to_dict()


@router.post("/adapters/{name}/activate")
async def activate_adapter(name: str, svc: AdaptersDep, actor: AdminActor) -> dict:
    return (await call_registry(svc.activate, name, actor=actor)).to_dict()


@router.post("/adapters/{name}/deactivate")
async def deactivate_adapter(name: str, svc: AdaptersDep, actor: AdminActor) -> dict:
    return (await call_registry(svc.deactivate, name, actor=actor)).to_dict()


class RollbackBody(BaseModel):
    version: int = Field(ge=1)


@router.post("/adapters/{name}/rollback")
async def rollback_adapter(name: str, body: RollbackBody, svc: AdaptersDep, actor: AdminActor) -> dict:
    return (await call_registry(svc.rollback, name, body.version, actor=actor)).to_dict()


@router.delete("/adapters/{name}")
async def delete_adapter(name: str, svc: AdaptersDep, actor: AdminActor) -> dict:
    await call_registry(svc.delete, name, actor=actor)
    return {"deleted": name}


@router.get("/pool")
async def pool_status(state: StateDep, _: AdminActor) -> dict:
    """The engine's KV cache and adapter pool: pages used/free, residency of each adapter by tier."""
    stats = state.client.stats
    if stats is None:
        raise APIError(503, "the engine has not reported statistics yet")
    names = {a.digest: a.name for a in state.follower.snapshot().values()}
    adapters = [a | {"active_name": names.get(a["digest"])} for a in stats.adapters]
    return {
        "engine": stats.engine,
        "lora": stats.lora,
        "adapters": adapters,
        "healthy": state.client.healthy,
        "info": msgspec.structs.asdict(state.engine_info()),
    }


@router.get("/audit")
async def audit_log(svc: AdaptersDep, _: AdminActor, limit: int = 100) -> dict:
    rows = await call_registry(svc.audit_log, limit)
    return {"data": [r.to_dict() for r in rows]}


class KeyBody(BaseModel):
    name: str
    admin: bool = False
    adapters: list[str] = Field(default_factory=list)


@router.post("/keys", status_code=201)
async def create_key(body: KeyBody, keys: KeysDep, actor: AdminActor) -> dict:
    created = await call_registry(
        keys.create, body.name, admin=body.admin, adapters=body.adapters, actor=actor
    )
    return created.to_dict()


@router.get("/keys")
async def list_keys(keys: KeysDep, _: AdminActor) -> dict:
    return {"data": [k.to_dict() for k in await call_registry(keys.list)]}


@router.delete("/keys/{name}")
async def revoke_key(name: str, keys: KeysDep, actor: AdminActor) -> dict:
    return (await call_registry(keys.revoke, name, actor=actor)).to_dict()


@compat.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, svc: AdaptersDep, actor: AdminActor) -> dict:
    """vLLM-compatible: register the adapter at a server-local path under `lora_name` and activate it."""
    if not Path(body.lora_path).exists():
        raise APIError(400, f"lora_path {body.lora_path!r} does not exist on the server", param="lora_path")
    result = await call_registry(
        svc.register, body.lora_name, Path(body.lora_path), activate=True, actor=actor
    )
    return {"loaded": body.lora_name, "version": result.version.version, "digest": result.version.digest}


@compat.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, svc: AdaptersDep, actor: AdminActor) -> dict:
    await call_registry(svc.deactivate, body.lora_name, actor=actor)
    return {"unloaded": body.lora_name}
