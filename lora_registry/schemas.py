"""API-facing views of registry records (separate from the ORM tables), as plain dataclasses.

`to_dict()` gives the JSON the admin API sends; each type's `from_dict()` reads it back (for the CLI's
remote mode), so that `T.from_dict(x.to_dict()) == x`. Unknown keys are ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any


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


def _dt(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _opt_dt(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


class _Json:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO 8601 strings)."""
        return _jsonable(asdict(self))  # type: ignore[call-overload]


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VersionInfo:
        """Read `to_dict()`'s output back."""
        return cls(
            version=int(d["version"]),
            digest=d["digest"],
            rank=int(d["rank"]),
            alpha=float(d["alpha"]),
            target_modules=tuple(d["target_modules"]),
            use_rslora=bool(d["use_rslora"]),
            size_bytes=int(d["size_bytes"]),
            base_model_name=d.get("base_model_name"),
            base_model_fingerprint=d["base_model_fingerprint"],
            source=d["source"],
            created_at=_dt(d["created_at"]),
        )


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterInfo:
        """Read `to_dict()`'s output back."""
        current = d.get("current")
        return cls(
            name=d["name"],
            description=d["description"],
            status=d["status"],
            owner=d.get("owner"),
            tags=tuple(d.get("tags") or ()),
            created_at=_dt(d["created_at"]),
            updated_at=_dt(d["updated_at"]),
            current=None if current is None else VersionInfo.from_dict(current),
            num_versions=int(d["num_versions"]),
        )


@dataclass(slots=True, frozen=True)
class AdapterDetail(_Json):
    adapter: AdapterInfo
    versions: tuple[VersionInfo, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterDetail:
        """Read `to_dict()`'s output back."""
        return cls(
            adapter=AdapterInfo.from_dict(d["adapter"]),
            versions=tuple(VersionInfo.from_dict(v) for v in d["versions"]),
        )


@dataclass(slots=True, frozen=True)
class RegisterResult(_Json):
    """`created` is False when the same content was already registered under the name (a no-op)."""

    adapter: AdapterInfo
    version: VersionInfo
    created: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegisterResult:
        """Read `to_dict()`'s output back."""
        return cls(
            adapter=AdapterInfo.from_dict(d["adapter"]),
            version=VersionInfo.from_dict(d["version"]),
            created=bool(d["created"]),
        )


@dataclass(slots=True, frozen=True)
class ActiveAdapter(_Json):
    """What a serving engine needs for one active adapter: `LoRARequest(name, path)` keyed by digest."""

    name: str
    version: int
    digest: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActiveAdapter:
        """Read `to_dict()`'s output back."""
        return cls(name=d["name"], version=int(d["version"]), digest=d["digest"])


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ApiKeyInfo:
        """Read `to_dict()`'s output back."""
        return cls(
            name=d["name"],
            prefix=d["prefix"],
            scopes=tuple(d["scopes"]),
            created_at=_dt(d["created_at"]),
            revoked_at=_opt_dt(d.get("revoked_at")),
        )


@dataclass(slots=True, frozen=True)
class CreatedKey(_Json):
    """A new key: `secret` is shown once and never stored."""

    info: ApiKeyInfo
    secret: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CreatedKey:
        """Read `to_dict()`'s output back."""
        return cls(info=ApiKeyInfo.from_dict(d["info"]), secret=d["secret"])


@dataclass(slots=True, frozen=True)
class AuditRecord(_Json):
    at: datetime
    actor: str
    action: str
    target: str
    details: dict[str, Any]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditRecord:
        """Read `to_dict()`'s output back."""
        return cls(
            at=_dt(d["at"]), actor=d["actor"], action=d["action"], target=d["target"], details=d["details"]
        )
