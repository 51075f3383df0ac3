"""`HeldAdapterFiles`: an adapter's two files, opened when a request for it is admitted.

A request admitted for adapter version D must be able to finish on D even if the files behind its
`LoRARequest.path` are deleted or replaced before the engine gets to read them (the registry deletes an
adapter's directory when the adapter is deleted). An open file descriptor keeps the file's contents
readable after it is unlinked or renamed over, so the engine opens (without reading) the files of an
adapter that is not in memory yet at admission, and its loader reads through these descriptors.

The descriptors are read with `os.pread` (no shared file position, so the loader thread may read while
the engine thread holds the object) and closed when the last reference goes: nobody closes them while a
background load still uses them.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.lora.adapter_checkpoint import AdapterError, adapter_files


class AdapterFilesGone(ValueError):
    """The adapter's files are no longer there (deleted): a request for it cannot be admitted."""


class HeldAdapterFiles:
    """The config and weights files of the adapter directory `path`, held open."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._fds: list[int] = []
        try:
            for f in adapter_files(path):
                self._fds.append(os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except (OSError, AdapterError) as exc:
            self._close()
            raise AdapterFilesGone(f"adapter files at {self.path!r} are gone ({exc})") from exc

    def read(self) -> tuple[bytes, bytes]:
        """(config bytes, weights bytes): the files' contents as they were when they were opened."""
        cfg, weights = (_read_all(fd) for fd in self._fds)
        return cfg, weights

    def _close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        self._close()


def _read_all(fd: int) -> bytes:
    """Every byte of the open file `fd`, read from offset 0 (`os.pread` until end of file)."""
    size = os.fstat(fd).st_size
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, max(size - offset, 1 << 20), offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)
