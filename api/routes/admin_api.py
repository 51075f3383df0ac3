"""Admin JSON API under `/admin/api/` (Bearer admin token), plus vLLM's load/unload LoRA routes.

Every change goes through the registry service; the engine follows through the registry's events.
Responses are the registry's records (`lora_registry.schemas`), declared as each route's response model,
so the OpenAPI schema documents them and FastAPI serializes them (datetimes as ISO 8601).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import APIRouter, File, Form, Query, Response, UploadFile
from pydantic import Field
from starlette.datastructures import UploadFile as UploadedFile  # what forms hold (FastAPI's is a subclass)

from api.adapter_contents import AdapterDetailView, current_contents
from api.deps import AdminActor, StateDep
from api.errors import APIError, error_responses
from api.openai_protocol import LoadLoRARequest, RequestBody, UnloadLoRARequest
from api.state import AppState
from lora_registry.errors import RegistryError
from lora_registry.schemas import (
    AdapterDetail,
    AdapterInfo,
    ApiKeyInfo,
    AuditRecord,
    CreatedKey,
    RegisterResult,
)


@dataclass(slots=True, frozen=True)
class AdapterList:
    data: list[AdapterInfo]


@dataclass(slots=True, frozen=True)
class KeyList:
    data: list[ApiKeyInfo]


@dataclass(slots=True, frozen=True)
class AuditList:
    data: list[AuditRecord]


@dataclass(slots=True, frozen=True)
class Deleted:
    deleted: str


# Every admin route may answer these (bad input, credentials, unknown names, conflicts, size, throttling,
# registry down), always with the OpenAI error body; declared once for the OpenAPI document.
ADMIN_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503)
router = APIRouter(prefix="/admin/api", tags=["admin"], responses=ADMIN_ERRORS)
compat = APIRouter(tags=["admin"], responses=ADMIN_ERRORS)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


async def call_registry(state: AppState, fn, *args, **kwargs):
    """Run a (blocking) registry change on the admin lane (threads of its own, off the event loop, never
    taking the threads requests need); registry errors become API errors. No time limit is put on a
    change, so its answer is never a guess: the database's own timeouts end a stalled one."""
    try:
        return await state.admin_calls.run(fn, *args, **kwargs)
    except RegistryError as exc:
        raise APIError(exc.status_code, str(exc)) from exc


async def read_registry(state: AppState, fn, *args, **kwargs):
    """Run a (blocking) registry read on the lookup lane: 503 when the database does not answer in time."""
    try:
        return await state.lookups.run(fn, *args, **kwargs)
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
            state,
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
    response: Response,
    name: Annotated[str, Form()],
    file: Annotated[list[UploadFile], File()],
    description: Annotated[str | None, Form()] = None,
    activate: Annotated[bool, Form()] = False,
) -> RegisterResult:
    """201 with the new version; 200 when the same content was already registered under the name."""
    result = await register_upload(state, name, file, description=description, activate=activate, actor=actor)
    if not result.created:
        response.status_code = 200
    return result


@router.get("/adapters")
async def list_adapters(state: StateDep, _: AdminActor) -> AdapterList:
    return AdapterList(await read_registry(state, state.registry.adapters.list))


@router.get("/adapters/{name}")
async def show_adapter(name: str, state: StateDep, _: AdminActor) -> AdapterDetailView:
    """The adapter's record, its versions, and what its serving version contains (`contents`: DoRA,
    LoRA bias, modules with LoRA, trainable tokens, saved modules, device memory in this pool)."""
    detail: AdapterDetail = await read_registry(state, state.registry.adapters.show, name)
    return AdapterDetailView(detail.adapter, detail.versions, await current_contents(state, detail))


@router.post("/adapters/{name}/activate")
async def activate_adapter(name: str, state: StateDep, actor: AdminActor) -> AdapterInfo:
    return await call_registry(state, state.registry.adapters.activate, name, actor=actor)


@router.post("/adapters/{name}/deactivate")
async def deactivate_adapter(name: str, state: StateDep, actor: AdminActor) -> AdapterInfo:
    return await call_registry(state, state.registry.adapters.deactivate, name, actor=actor)


class RollbackBody(RequestBody):
    version: int = Field(ge=1)


@router.post("/adapters/{name}/rollback")
async def rollback_adapter(name: str, body: RollbackBody, state: StateDep, actor: AdminActor) -> AdapterInfo:
    return await call_registry(state, state.registry.adapters.rollback, name, body.version, actor=actor)


@router.delete("/adapters/{name}")
async def delete_adapter(name: str, state: StateDep, actor: AdminActor) -> Deleted:
    await call_registry(state, state.registry.adapters.delete, name, actor=actor)
    return Deleted(name)


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
async def audit_log(
    state: StateDep, _: AdminActor, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
) -> AuditList:
    return AuditList(await read_registry(state, state.registry.adapters.audit_log, limit))


class KeyBody(RequestBody):
    name: str
    admin: bool = False
    adapters: list[str] = Field(default_factory=list)


@router.post("/keys", status_code=201)
async def create_key(body: KeyBody, state: StateDep, actor: AdminActor) -> CreatedKey:
    return await call_registry(
        state, state.registry.keys.create, body.name, admin=body.admin, adapters=body.adapters, actor=actor
    )


@router.get("/keys")
async def list_keys(state: StateDep, _: AdminActor) -> KeyList:
    return KeyList(await read_registry(state, state.registry.keys.list))


@router.delete("/keys/{name}")
async def revoke_key(name: str, state: StateDep, actor: AdminActor) -> ApiKeyInfo:
    return await call_registry(state, state.registry.keys.revoke, name, actor=actor)


@compat.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, state: StateDep, actor: AdminActor) -> dict:
    """vLLM-compatible: register the adapter at a server-local path under `lora_name` and activate it.

    A path the server cannot even check (a name too long for the file system, a NUL byte) or an adapter
    under it that cannot be read is a 400 naming `lora_path`, never a 500."""
    source = Path(body.lora_path)
    try:
        exists = source.exists()
    except (OSError, ValueError) as exc:
        raise _unreadable_path(body.lora_path, exc) from exc
    if not exists:
        raise APIError(400, f"lora_path {body.lora_path!r} does not exist on the server", param="lora_path")
    try:
        result = await call_registry(
            state, state.registry.adapters.register, body.lora_name, source, activate=True, actor=actor
        )
    except OSError as exc:
        if not _is_under(exc.filename, source):
            raise  # the server's own files (data dir, blob store): a real server error
        raise _unreadable_path(body.lora_path, exc) from exc
    return {"loaded": body.lora_name, "version": result.version.version, "digest": result.version.digest}


def _unreadable_path(given: str, exc: OSError | ValueError) -> APIError:
    """The 400 for a `lora_path` the server cannot read: the OS's reason, without echoing a huge path."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    shown = given if len(given) <= 200 else f"{given[:100]}...{given[-40:]}"
    return APIError(400, f"lora_path {shown!r} cannot be read on the server: {reason}", param="lora_path")


def _is_under(filename: object, root: Path) -> bool:
    """Whether the file an OSError names is `root` or lies below it."""
    if not isinstance(filename, str | bytes | Path):
        return False
    name, top = Path(os.path.abspath(os.fsdecode(filename))), Path(os.path.abspath(root))
    return name == top or top in name.parents


@compat.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, state: StateDep, actor: AdminActor) -> dict:
    await call_registry(state, state.registry.adapters.deactivate, body.lora_name, actor=actor)
    return {"unloaded": body.lora_name}
