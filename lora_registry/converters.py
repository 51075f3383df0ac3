"""ORM rows -> API schema objects (`AdapterInfo`, `VersionInfo`, ...), and the audit-log writer."""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy.orm import Session

from lora_registry.models import Adapter, AdapterVersion, ApiKey, AuditEntry
from lora_registry.schemas import AdapterInfo, ApiKeyInfo, AuditRecord, VersionInfo


def version_info(v: AdapterVersion) -> VersionInfo:
    """The row's `VersionInfo` fields, read by name (the dataclass is the one list of them)."""
    return msgspec.convert(v, VersionInfo, from_attributes=True)


def current_version(a: Adapter) -> AdapterVersion | None:
    return next((v for v in a.versions if v.version == a.current_version), None)


def adapter_info(a: Adapter) -> AdapterInfo:
    cur = current_version(a)
    return AdapterInfo(
        name=a.name,
        description=a.description,
        status=a.status,
        owner=a.owner,
        tags=tuple(a.tags or ()),
        created_at=a.created_at,
        updated_at=a.updated_at,
        current=version_info(cur) if cur is not None else None,
        num_versions=len(a.versions),
    )


def key_info(k: ApiKey) -> ApiKeyInfo:
    return ApiKeyInfo(
        name=k.name, prefix=k.prefix, scopes=tuple(k.scopes), created_at=k.created_at, revoked_at=k.revoked_at
    )


def audit_record(e: AuditEntry) -> AuditRecord:
    return AuditRecord(
        at=e.at, actor=e.actor, action=e.action, target=e.target, details=dict(e.details or {})
    )


def audit(session: Session, actor: str, action: str, target: str, **details: Any) -> None:
    """Add an audit-log row to `session` (committed with the change it records)."""
    session.add(AuditEntry(actor=actor, action=action, target=target, details=details))
