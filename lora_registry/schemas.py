"""API-facing views of registry records (separate from the ORM tables), as plain dataclasses.

`to_dict()` gives the JSON the admin API sends; each type's `from_dict()` reads it back (for the CLI's
remote mode), so that `T.from_dict(x.to_dict()) == x`. Unknown keys are ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Self

import msgspec


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


class _Json:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO 8601 strings)."""
        return _jsonable(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """Read `to_dict()`'s output back: msgspec converts by the field types (ISO strings to datetimes,
        lists to tuples, nested records); unknown keys are ignored; a malformed value raises ValueError."""
        try:
            return msgspec.convert(d, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from exc


@dataclass(slots=True, frozen=True)
class VersionInfo(_Json):
    version: int
    digest: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool
    size_bytes: int
    base_model_name: str | None
    base_model_fingerprint: str
    source: str
    created_at: datetime


@dataclass(slots=True, frozen=True)
class AdapterInfo(_Json):
    """An adapter name, its status and the version it points at (`current`)."""

    name: str
    description: str
    status: str
    owner: str | None
    tags: tuple[str, ...]
    created_at: datetime
    updated_at: datetime
    current: VersionInfo | None
    num_versions: int

    @property
    def is_active(self) -> bool:
        return self.status == "active"


@dataclass(slots=True, frozen=True)
class AdapterDetail(_Json):
    adapter: AdapterInfo
    versions: tuple[VersionInfo, ...]


@dataclass(slots=True, frozen=True)
class RegisterResult(_Json):
    """`created` is False when the same content was already registered under the name (a no-op)."""

    adapter: AdapterInfo
    version: VersionInfo
    created: bool


@dataclass(slots=True, frozen=True)
class ActiveAdapter(_Json):
    """What a serving engine needs for one active adapter: `LoRARequest(name, path)` keyed by digest."""

    name: str
    version: int
    digest: str


@dataclass(slots=True, frozen=True)
class ApiKeyInfo(_Json):
    name: str
    prefix: str
    scopes: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def allows_adapter(self, adapter: str) -> bool:
        """Whether this key may call adapter `adapter` (admin keys may call every adapter)."""
        return self.revoked_at is None and (self.is_admin or f"adapter:{adapter}" in self.scopes)


@dataclass(slots=True, frozen=True)
class CreatedKey(_Json):
    """A new key: `secret` is shown once and never stored."""

    info: ApiKeyInfo
    secret: str


@dataclass(slots=True, frozen=True)
class AuditRecord(_Json):
    at: datetime
    actor: str
    action: str
    target: str
    details: dict[str, Any]
