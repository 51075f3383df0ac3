"""Adapter directories on the serving host: the PEFT directory of a content digest written from its
verified blobs (complete or absent), and the clean-up of blobs and directories no version references."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.blobstore import BlobStore
from lora_registry.dbsession import transaction
from lora_registry.errors import NotFound
from lora_registry.models import AdapterVersion


def adapter_dir(data_dir: Path, digest: str) -> Path:
    """Where the PEFT directory of `digest` lives: `<data dir>/adapters/<digest>`."""
    return data_dir / "adapters" / digest


def materialized_path(data_dir: Path, digest: str) -> Path | None:
    """The PEFT directory of `digest` if it was already written, else None (no database)."""
    target = adapter_dir(data_dir, digest)
    return target if (target / "adapter_model.safetensors").is_file() else None


def materialize(sessions: sessionmaker[Session], blobs: BlobStore, data_dir: Path, digest: str) -> Path:
    """The PEFT directory of the adapter with content `digest`, written from its blobs if absent: into a
    temp dir renamed into place, so it is complete or absent (a concurrent writer may win the rename)."""
    ready = materialized_path(data_dir, digest)
    if ready is not None:
        return ready
    target = adapter_dir(data_dir, digest)
    with transaction(sessions) as s:
        v = s.scalars(select(AdapterVersion).where(AdapterVersion.digest == digest).limit(1)).first()
        if v is None:
            raise NotFound(f"no adapter version with digest {digest}")
        config_blob, weights_blob = v.config_blob, v.weights_blob
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=target.parent))
    try:
        blobs.fetch(config_blob, tmp / "adapter_config.json")
        blobs.fetch(weights_blob, tmp / "adapter_model.safetensors")
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # a concurrent materialization won the race otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def drop_unreferenced(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    data_dir: Path,
    blob_ids: Iterable[str],
    digests: Iterable[str] = (),
) -> None:
    """Delete the given blobs (and materialized dirs) that no remaining version references."""
    with transaction(sessions) as s:
        used = set(s.scalars(select(AdapterVersion.config_blob)))
        used |= set(s.scalars(select(AdapterVersion.weights_blob)))
        live = set(s.scalars(select(AdapterVersion.digest)))
    for b in set(blob_ids) - used:
        blobs.delete(b)
    for d in set(digests) - live:
        shutil.rmtree(adapter_dir(data_dir, d), ignore_errors=True)
