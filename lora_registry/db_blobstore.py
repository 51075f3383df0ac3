"""`DatabaseBlobStore`: blobs kept in the registry database itself, cached on local disk.

Replicas on different machines share no filesystem, but they do share the registry database; this
backend needs no new service. A blob is one `blobs` row (digest, size, number of chunks) and its bytes
in `blob_chunks` rows of at most `chunk_bytes` each, all written in one transaction, so a blob is
complete or absent. Reads stream the chunks into a temp file while hashing, refuse a digest mismatch
(`BlobCorrupt`), and keep the verified file in a local `LocalBlobStore` cache: each replica reads a
blob from the database at most once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.blobstore import LocalBlobStore, Progress, sha256_file
from lora_registry.dbsession import transaction
from lora_registry.errors import BlobCorrupt, Conflict, NotFound
from lora_registry.models import Blob, BlobChunk

DEFAULT_CHUNK_BYTES = 8 << 20


class DatabaseBlobStore:
    def __init__(
        self, sessions: sessionmaker[Session], cache: LocalBlobStore, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        self.sessions = sessions
        self.cache = cache
        self.chunk_bytes = chunk_bytes

    def put_file(self, src: Path, progress: Progress | None = None) -> tuple[str, bool]:
        """Store `src` (hashed first, then copied chunk by chunk in one transaction)."""
        digest = sha256_file(src)
        if self.exists(digest):
            return digest, False
        with src.open("rb") as f:
            created = self._insert(digest, iter(lambda: f.read(self.chunk_bytes), b""), progress)
        return digest, created

    def put_bytes(self, data: bytes) -> tuple[str, bool]:
        digest = hashlib.sha256(data).hexdigest()
        if self.exists(digest):
            return digest, False
        step = self.chunk_bytes
        return digest, self._insert(digest, (data[i : i + step] for i in range(0, len(data), step)), None)

    def _insert(self, digest: str, chunks, progress: Progress | None) -> bool:
        """Write the blob row and its chunks; False if a concurrent writer stored the same blob first."""
        try:
            with transaction(self.sessions) as s:
                blob = Blob(digest=digest, size_bytes=0, num_chunks=0)
                s.add(blob)
                s.flush()
                h, size, n = hashlib.sha256(), 0, 0
                for chunk in chunks:
                    h.update(chunk)
                    s.add(BlobChunk(digest=digest, seq=n, data=chunk))
                    s.flush()
                    size, n = size + len(chunk), n + 1
                    if progress:
                        progress(len(chunk))
                if h.hexdigest() != digest:
                    raise BlobCorrupt(f"blob {digest}: the source changed while it was being stored")
                blob.size_bytes, blob.num_chunks = size, n
            return True
        except Conflict:
            if self.exists(digest):
                return False
            raise

    def fetch(self, digest: str, dest: Path, progress: Progress | None = None) -> None:
        """Write the verified blob to `dest`, from the local cache or else from the database."""
        if not self.cache.exists(digest):
            self._download(digest)
        self.cache.fetch(digest, dest, progress)

    def _download(self, digest: str) -> None:
        self.cache.path(digest)  # refuses a malformed digest
        with transaction(self.sessions) as s:
            blob = s.get(Blob, digest)
            if blob is None:
                raise NotFound(f"blob {digest}: missing from the blob store")
            tmp_dir = self.cache.root / "tmp"
            tmp_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="db-")
            tmp = Path(name)
            try:
                h = hashlib.sha256()
                with os.fdopen(fd, "wb") as out:
                    for seq in range(blob.num_chunks):
                        chunk = s.scalar(
                            select(BlobChunk.data).where(BlobChunk.digest == digest, BlobChunk.seq == seq)
                        )
                        if chunk is None:
                            raise BlobCorrupt(f"blob {digest}: chunk {seq} is missing")
                        h.update(chunk)
                        out.write(chunk)
                if h.hexdigest() != digest:
                    raise BlobCorrupt(f"blob {digest}: content does not match its digest (store corrupted)")
                self.cache.put_file(tmp)
            finally:
                tmp.unlink(missing_ok=True)

    def read_bytes(self, digest: str) -> bytes:
        if not self.cache.exists(digest):
            self._download(digest)
        return self.cache.read_bytes(digest)

    def exists(self, digest: str) -> bool:
        with transaction(self.sessions) as s:
            return s.get(Blob, digest) is not None

    def delete(self, digest: str) -> None:
        with transaction(self.sessions) as s:
            s.execute(delete(BlobChunk).where(BlobChunk.digest == digest))
            s.execute(delete(Blob).where(Blob.digest == digest))
        self.cache.delete(digest)

    def digests(self) -> list[str]:
        with transaction(self.sessions) as s:
            return sorted(s.scalars(select(Blob.digest)))
