"""The database rows of a registration: finding a version by content, adding a new version row (the
name's next number, made its current version), and the base model adapters are validated against."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.converters import version_info
from lora_registry.dbsession import transaction
from lora_registry.errors import Conflict, RegistryError
from lora_registry.models import STATUS_INACTIVE, Adapter, AdapterVersion, RegistryMeta
from lora_registry.schemas import VersionInfo

if TYPE_CHECKING:
    from lora_registry.registration import PreparedUpload

META_BASE_MODEL = "base_model_path"


def existing_version(sessions: sessionmaker[Session], name: str, digest: str) -> VersionInfo | None:
    """The version of `name` with content `digest`, or None."""
    with transaction(sessions) as s:
        q = select(AdapterVersion).join(Adapter).where(Adapter.name == name, AdapterVersion.digest == digest)
        v = s.scalars(q).first()
        return version_info(v) if v is not None else None


def add_version(
    s: Session, name: str, up: PreparedUpload, description: str | None
) -> tuple[Adapter, AdapterVersion]:
    """In transaction `s`: the adapter row of `name` (locked; created inactive if new, its description
    updated when given) and its new version row for `up`, numbered one past the highest and made current.
    `Conflict` when the same content was registered concurrently."""
    ck = up.checkpoint
    a = s.scalars(select(Adapter).where(Adapter.name == name).with_for_update()).first()
    if a is None:
        a = Adapter(name=name, description=description or "", status=STATUS_INACTIVE, tags=[])
        s.add(a)
        s.flush()
    elif description is not None:
        a.description = description
    if any(v.digest == ck.digest for v in a.versions):
        raise Conflict(f"adapter {name!r}: the same content was registered concurrently")
    last = s.scalar(select(func.max(AdapterVersion.version)).where(AdapterVersion.adapter_id == a.id))
    number = (last or 0) + 1
    v = AdapterVersion(
        version=number,
        digest=ck.digest,
        config_blob=up.config_digest,
        weights_blob=up.weights_digest,
        rank=ck.rank,
        alpha=ck.alpha,
        target_modules=list(ck.target_modules),
        use_rslora=ck.use_rslora,
        size_bytes=ck.size_bytes,
        base_model_name=ck.base_model_name,
        base_model_fingerprint=up.model_fingerprint,
        source=up.source[:512],
    )
    a.versions.append(v)
    a.current_version = number
    return a, v


def base_model_path(sessions: sessionmaker[Session], configured: Path | None) -> Path:
    """The base model to validate against: `configured` (`LORAPLEX_MODEL`, recorded for later), else the
    recorded one; `RegistryError` when there is neither."""
    with transaction(sessions) as s:
        row = s.get(RegistryMeta, META_BASE_MODEL)
        if configured is not None:
            if row is None:
                s.add(RegistryMeta(key=META_BASE_MODEL, value=str(configured)))
            else:
                row.value = str(configured)
            return configured
        if row is not None:
            return Path(row.value)
    raise RegistryError(
        "no base model to validate adapters against: set LORAPLEX_MODEL to the model's directory"
    )
