"""The database blob store (SQLite and PostgreSQL): chunked, verified, cached; replicas with separate data
dirs and one shared database serve the same adapters."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
from sqlalchemy import update

from lora_registry.blobstore import LocalBlobStore
from lora_registry.db import make_engine, make_session_factory
from lora_registry.db_blobstore import DatabaseBlobStore
from lora_registry.errors import BlobCorrupt, NotFound
from lora_registry.models import BlobChunk
from lora_registry.registry import open_registry
from lora_registry.settings import RegistrySettings
from tests.lora_registry.conftest import wipe


@pytest.fixture
def store(db_url: str, tmp_path: Path):
    wipe(db_url)
    engine = make_engine(db_url)
    try:
        yield DatabaseBlobStore(
            make_session_factory(engine), LocalBlobStore(tmp_path / "cache"), chunk_bytes=1000
        )
    finally:
        engine.dispose()


def test_chunked_put_fetch_dedup_delete(store: DatabaseBlobStore, tmp_path: Path) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(bytes(range(256)) * 20)  # 5120 bytes: 6 chunks
    seen: list[int] = []
    digest, new = store.put_file(src, seen.append)
    assert new and digest == hashlib.sha256(src.read_bytes()).hexdigest() and sum(seen) == 5120
    assert store.put_file(src) == (digest, False) and store.put_bytes(src.read_bytes()) == (digest, False)
    assert store.digests() == [digest] and not store.cache.exists(digest)
    store.fetch(digest, tmp_path / "out" / "w.bin")
    assert (tmp_path / "out" / "w.bin").read_bytes() == src.read_bytes()
    assert store.cache.exists(digest)  # read from the database once, then from the local cache
    store.delete(digest)
    assert store.digests() == [] and not store.exists(digest) and not store.cache.exists(digest)
    with pytest.raises(NotFound):
        store.fetch(digest, tmp_path / "again")


def test_corrupted_chunk_is_refused_and_not_cached(store: DatabaseBlobStore, tmp_path: Path) -> None:
    digest, _ = store.put_bytes(b"a" * 2500)
    with store.sessions.begin() as s:
        s.execute(update(BlobChunk).where(BlobChunk.seq == 1).values(data=b"b" * 1000))
    with pytest.raises(BlobCorrupt):
        store.fetch(digest, tmp_path / "dest")
    assert not (tmp_path / "dest").exists() and not store.cache.exists(digest)


def test_two_replicas_with_own_data_dirs_share_adapters(settings, adapter_dirs, tmp_path: Path) -> None:
    wipe(settings.database_url)
    one = dataclasses.replace(settings, data_dir=tmp_path / "one", blob_store="database")
    two = dataclasses.replace(settings, data_dir=tmp_path / "two", blob_store="database")
    reg1 = open_registry(one, auto_upgrade=False)
    reg2 = open_registry(two, auto_upgrade=False)
    try:
        res = reg1.adapters.register("bot", adapter_dirs["a"], activate=True)
        active = reg2.adapters.active_adapter("bot")
        assert active is not None and active.digest == res.version.digest
        path = reg2.adapters.adapter_path(active.digest)
        assert path.is_relative_to(tmp_path / "two")
        want = (adapter_dirs["a"] / "adapter_model.safetensors").read_bytes()
        assert (path / "adapter_model.safetensors").read_bytes() == want
    finally:
        reg1.close()
        reg2.close()


def test_blob_store_setting_is_checked() -> None:
    env = {"LORAPLEX_DATA_DIR": "/tmp/x", "LORAPLEX_BLOB_STORE": "database"}
    assert RegistrySettings.from_env(env).blob_store == "database"
    assert RegistrySettings.from_env({"LORAPLEX_DATA_DIR": "/tmp/x"}).blob_store == "local"
    with pytest.raises(ValueError, match="LORAPLEX_BLOB_STORE"):
        RegistrySettings.from_env(env | {"LORAPLEX_BLOB_STORE": "s3"})
