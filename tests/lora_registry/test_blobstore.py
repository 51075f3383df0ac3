"""The content-addressed blob store: atomic writes, dedup, verification on read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lora_registry.blobstore import LocalBlobStore
from lora_registry.errors import BlobCorrupt, NotFound


def test_put_fetch_dedup_delete(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    src = tmp_path / "w.bin"
    src.write_bytes(b"x" * 3_000_000)
    seen: list[int] = []
    digest, new = store.put_file(src, seen.append)
    assert new and digest == hashlib.sha256(src.read_bytes()).hexdigest() and sum(seen) == 3_000_000
    assert store.put_file(src) == (digest, False)
    assert store.put_bytes(b"x" * 3_000_000) == (digest, False)
    assert store.path(digest) == tmp_path / "blobs" / "sha256" / digest[:2] / digest
    assert list((tmp_path / "blobs" / "tmp").iterdir()) == []  # no temp files left behind
    store.fetch(digest, tmp_path / "out" / "w.bin")
    assert (tmp_path / "out" / "w.bin").read_bytes() == src.read_bytes()
    assert store.digests() == [digest] and store.read_bytes(digest) == src.read_bytes()
    store.delete(digest)
    assert not store.exists(digest) and store.digests() == []
    with pytest.raises(NotFound):
        store.fetch(digest, tmp_path / "again")


def test_corruption_is_detected_on_read(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    digest, _ = store.put_bytes(b"hello adapter")
    blob = store.path(digest)
    blob.chmod(0o644)
    blob.write_bytes(b"hello adaptor")
    with pytest.raises(BlobCorrupt):
        store.read_bytes(digest)
    with pytest.raises(BlobCorrupt):
        store.fetch(digest, tmp_path / "dest")
    assert not (tmp_path / "dest").exists() and list(tmp_path.glob(".dest-*")) == []


def test_rejects_non_digest_names(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        LocalBlobStore(tmp_path).path("../../etc/passwd")
