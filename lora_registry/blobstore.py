"""Content-addressed blob storage: a blob's name is the sha256 of its bytes.

`BlobStore` is the interface (an object store could implement it); `LocalBlobStore` keeps blobs at
`root/sha256/ab/abcdef…`, written to a temp file in the same directory tree and renamed into place, so a
reader never sees a partial blob. Reads verify the digest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lora_registry.errors import BlobCorrupt, NotFound

Progress = Callable[[int], None]  # called with the number of bytes just processed
_CHUNK = 1 << 20


class BlobStore(Protocol):
    def put_file(self, src: Path, progress: Progress | None = None) -> tuple[str, bool]:
        """Store the bytes of `src`; return (sha256 hex, True if the blob was new)."""
        ...

    def put_bytes(self, data: bytes) -> tuple[str, bool]: ...

    def fetch(self, digest: str, dest: Path, progress: Progress | None = None) -> None:
        """Write blob `digest` to the local file `dest`, verifying it; raise `BlobCorrupt` on mismatch."""
        ...

    def read_bytes(self, digest: str) -> bytes: ...

    def exists(self, digest: str) -> bool: ...

    def delete(self, digest: str) -> None: ...

    def digests(self) -> list[str]: ...


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def _copy_hashing(src: Path, fd: int, progress: Progress | None, sync: bool = False) -> str:
    """Copy `src` into the open file `fd` (closing it), fsync'd if `sync`; return the sha256 hex."""
    h = hashlib.sha256()
    with src.open("rb") as fin, os.fdopen(fd, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            if progress:
                progress(len(chunk))
        if sync:
            fout.flush()
            os.fsync(fout.fileno())
    return h.hexdigest()


class LocalBlobStore:
    """Blobs as files under `root` (normally `<data dir>/blobs`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise NotFound(f"blob {digest!r}: not a sha256 digest")
        return self.root / "sha256" / digest[:2] / digest

    def _tmp_dir(self) -> Path:
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def _commit(self, tmp: Path, digest: str) -> bool:
        """Rename the verified temp file into place; False (and drop it) if the blob already existed."""
        final = self.path(digest)
        if final.exists():
            tmp.unlink()
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, final)
        return True

    def put_file(self, src: Path, progress: Progress | None = None) -> tuple[str, bool]:
        """Copy `src` into a temp file while hashing it, then rename it to its digest."""
        fd, name = tempfile.mkstemp(dir=self._tmp_dir(), prefix="put-")
        tmp = Path(name)
        try:
            got = _copy_hashing(src, fd, progress, sync=True)
            return got, self._commit(tmp, got)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, data: bytes) -> tuple[str, bool]:
        digest = hashlib.sha256(data).hexdigest()
        if self.path(digest).exists():
            return digest, False
        fd, name = tempfile.mkstemp(dir=self._tmp_dir(), prefix="put-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return digest, self._commit(Path(name), digest)
        finally:
            Path(name).unlink(missing_ok=True)

    def fetch(self, digest: str, dest: Path, progress: Progress | None = None) -> None:
        """Copy the blob to `dest` via a temp file next to it, verifying the digest before the rename."""
        src = self.path(digest)
        if not src.is_file():
            raise NotFound(f"blob {digest}: missing from the blob store")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}-")
        tmp = Path(name)
        try:
            if _copy_hashing(src, fd, progress) != digest:
                raise BlobCorrupt(f"blob {digest}: content does not match its digest (store corrupted)")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, digest: str) -> bytes:
        path = self.path(digest)
        if not path.is_file():
            raise NotFound(f"blob {digest}: missing from the blob store")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise BlobCorrupt(f"blob {digest}: content does not match its digest (store corrupted)")
        return data

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def delete(self, digest: str) -> None:
        path = self.path(digest)
        path.unlink(missing_ok=True)
        if path.parent.exists() and not any(path.parent.iterdir()):
            shutil.rmtree(path.parent, ignore_errors=True)

    def digests(self) -> list[str]:
        base = self.root / "sha256"
        return sorted(p.name for p in base.glob("*/*")) if base.exists() else []
