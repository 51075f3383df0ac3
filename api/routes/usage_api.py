"""Admin JSON API for usage and rate limits (Bearer admin token, like the rest of `/admin/api/`).

    GET   /admin/api/usage?by=key|adapter&from=&to=&bucket=hour|day[&adapter=NAME][&key=NAME]
    GET   /admin/api/limits
    GET   /admin/api/adapters/{name}/limits      PATCH  (same body for keys)
    GET   /admin/api/keys/{name}/limits          PATCH  {"requests_per_minute": N, "tokens_per_minute": N,
                                                         "max_concurrent": N}  (absent: unchanged, 0: none)

`from`/`to` are ISO 8601 (a time without a zone is UTC); the range is [from, to), by default the last
24 hours. Usage is written in the background, so the newest second or so may not show yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import Field

from api.deps import AdminActor, StateDep
from api.errors import APIError
from api.openai_protocol import RequestBody
from api.routes.admin_api import ADMIN_ERRORS, call_registry, read_registry
from api.state import AppState
from lora_registry.limits import MAX_LIMIT, LimitInfo
from lora_registry.usage import UsageReport

router = APIRouter(prefix="/admin/api", tags=["admin"], responses=ADMIN_ERRORS)
DEFAULT_RANGE = timedelta(hours=24)
MAX_BUCKETS = 24 * 93  # hourly buckets over three months at most per query


@dataclass(slots=True, frozen=True)
class LimitList:
    data: list[LimitInfo]


class LimitsBody(RequestBody):
    """Limits to change; a field left out is unchanged, 0 removes that limit."""

    requests_per_minute: int | None = Field(default=None, ge=0, le=MAX_LIMIT)
    tokens_per_minute: int | None = Field(default=None, ge=0, le=MAX_LIMIT)
    max_concurrent: int | None = Field(default=None, ge=0, le=MAX_LIMIT)


def parse_time(value: str | None, param: str) -> datetime | None:
    """An aware UTC datetime from ISO 8601 text (no zone = UTC); 400 when it is not one."""
    if value is None or not value.strip():
        return None
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise APIError(
            400, f"{param}: expected an ISO 8601 date or time, got {value!r}", param=param
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def usage_range(
    start: datetime | None, end: datetime | None, bucket: str | None
) -> tuple[datetime, datetime]:
    """[start, end) with the defaults filled in; 400 for an empty range or too many buckets."""
    end = end or datetime.now(UTC)
    start = start or end - DEFAULT_RANGE
    if end <= start:
        raise APIError(400, "from must be before to", param="from")
    if bucket is not None:
        size = 3600 if bucket == "hour" else 86400
        if (end - start).total_seconds() / size > MAX_BUCKETS:
            raise APIError(
                400, f"at most {MAX_BUCKETS} buckets per query; use a wider bucket", param="bucket"
            )
    return start, end


@router.get("/usage")
async def usage(
    state: StateDep,
    _: AdminActor,
    by: Literal["key", "adapter"] = "adapter",
    from_: Annotated[str | None, Query(alias="from", max_length=64)] = None,
    to: Annotated[str | None, Query(max_length=64)] = None,
    bucket: Literal["hour", "day"] | None = None,
    adapter: Annotated[str | None, Query(max_length=64)] = None,
    key: Annotated[str | None, Query(max_length=64)] = None,
) -> UsageReport:
    """Requests and tokens per API key or adapter over [from, to), per hour or day when `bucket` is set."""
    start, end = usage_range(parse_time(from_, "from"), parse_time(to, "to"), bucket)
    return await read_registry(
        state,
        state.registry.usage.summary,
        by,
        start,
        end,
        bucket,
        adapter=adapter or None,
        api_key=key or None,
    )


@router.get("/limits")
async def list_limits(state: StateDep, _: AdminActor) -> LimitList:
    """Every API key and adapter that has a limit."""
    return LimitList(await read_registry(state, state.registry.limits.list))


async def _set(state: AppState, kind: str, name: str, body: LimitsBody, actor: str) -> LimitInfo:
    return await call_registry(
        state,
        state.registry.limits.set,
        kind,
        name,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
        max_concurrent=body.max_concurrent,
        actor=actor,
    )


@router.get("/adapters/{name}/limits")
async def adapter_limits(name: str, state: StateDep, _: AdminActor) -> LimitInfo:
    return await read_registry(state, state.registry.limits.get, "adapter", name)


@router.patch("/adapters/{name}/limits")
async def set_adapter_limits(name: str, body: LimitsBody, state: StateDep, actor: AdminActor) -> LimitInfo:
    """Change adapter `name`'s limits (404 for an unknown adapter)."""
    return await _set(state, "adapter", name, body, actor)


@router.get("/keys/{name}/limits")
async def key_limits(name: str, state: StateDep, _: AdminActor) -> LimitInfo:
    return await read_registry(state, state.registry.limits.get, "key", name)


@router.patch("/keys/{name}/limits")
async def set_key_limits(name: str, body: LimitsBody, state: StateDep, actor: AdminActor) -> LimitInfo:
    """Change API key `name`'s limits (404 for an unknown key)."""
    return await _set(state, "key", name, body, actor)
