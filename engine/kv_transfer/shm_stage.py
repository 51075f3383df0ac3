"""`ShmStageConnector` ("shm"): KV blocks staged in a file in host shared memory (/dev/shm).

The file holds the blocks as one "host" chunk does: [layers, 2 (K, V), blocks, block_size, kv_heads,
head_dim], which is also the per-layer chunks of "host-layers" one after another. Whoever writes it
(`stage`: the decode replica, from the chunks it fetched from the object store, in a worker thread;
or `send`, an engine on the same host) hands over only its path, so no KV byte goes through ZeroMQ,
msgpack or an event loop. `receive` reads the file straight into the cache's blocks (`preadv`, one
call per layer and K/V; a device cache: read to host, one `index_copy_` per layer). The file is the
writer's to remove (`unstage`) once the receiving engine acknowledged the import (it has read the file
by then) or the transfer ended otherwise.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable

import torch

from engine.kv_transfer.connector import KVBlocks, KVConnector, KVLayout

SHM_DIR = "/dev/shm"
PREFIX = "loraplex-kv-"


def shm_available() -> bool:
    """Whether this host has a shared-memory filesystem to stage blocks in."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def stage(
    layout: KVLayout, num_blocks: int, num_tokens: int, chunks: Iterable[memoryview | bytes]
) -> KVBlocks:
    """Write `chunks` (a byte connector's, in order) to a new shared-memory file; the "shm" blocks for it.
    ValueError (and no file left) when they do not hold `num_blocks` blocks of `layout`."""
    want = num_blocks * layout.block_bytes()
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            size = f.tell()
        if size != want:
            raise ValueError(f"KV blocks carry {size} bytes, expected {want}")
    except BaseException:
        unstage(path)
        raise
    return KVBlocks("shm", layout, num_blocks, num_tokens, [], path=path)


def unstage(path: str | None) -> None:
    """Remove a staged file (gone already: nothing to do)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def sweep_orphans() -> int:
    """Remove staged files whose writer (the pid in their name) is gone, e.g. a decode replica that died
    mid-transfer; returns how many. A decode replica runs it as it starts."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        pid = name.removeprefix(PREFIX).split("-", 1)[0]
        if not name.startswith(PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                unstage(os.path.join(SHM_DIR, name))
            except OSError:  # another user's file in the sticky /dev/shm: not ours to remove
                continue
            removed += 1
        except PermissionError:  # alive, another user's
            pass
    return removed


class ShmStageConnector(KVConnector):
    name = "shm"
    holds_blocks = False

    def send(
        self, request_id: str, kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int
    ) -> KVBlocks:
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        parts = (
            kv_cache[layer].index_select(1, idx).contiguous().cpu().view(torch.uint8).numpy().data
            for layer in range(kv_cache.shape[0])
        )
        return stage(KVLayout.of(kv_cache), len(block_ids), num_tokens, parts)

    def receive(self, blocks: KVBlocks, kv_cache: torch.Tensor, block_ids: list[int], first: int = 0) -> None:
        mine = KVLayout.of(kv_cache)
        if blocks.connector != "shm" or blocks.path is None or blocks.layout != mine:
            raise ValueError(f"KV blocks from connector {blocks.connector!r}, layout {blocks.layout}; "
                             f"this engine reads 'shm' blocks of layout {mine}")  # fmt: skip
        if len(block_ids) != blocks.num_blocks - first:
            raise ValueError(f"{len(block_ids)} blocks to fill with {blocks.num_blocks - first} sent")
        want = blocks.num_blocks * mine.block_bytes()
        if os.path.dirname(blocks.path) != SHM_DIR or not os.path.basename(blocks.path).startswith(PREFIX):
            raise ValueError(f"not a staged KV file: {blocks.path!r}")
        try:
            fd = os.open(blocks.path, os.O_RDONLY)
        except OSError as exc:
            raise ValueError(f"the staged KV blocks are gone: {exc}") from exc
        try:
            if os.fstat(fd).st_size != want:
                raise ValueError(f"the staged KV file holds {os.fstat(fd).st_size} bytes, expected {want}")
            if not block_ids:
                return
            if kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
                _read_into(fd, kv_cache, block_ids, blocks.num_blocks, first)
            else:  # a device cache: read to host, then one copy per layer
                _read_then_copy(fd, kv_cache, block_ids, blocks.num_blocks, first, want)
        finally:
            os.close(fd)


def _read_into(fd: int, kv_cache: torch.Tensor, block_ids: list[int], num_blocks: int, first: int) -> None:
    """Read the file's blocks `first, ...` straight into `kv_cache`'s blocks `block_ids`: one `preadv`
    per layer and K/V, each block of the cache one of its buffers (the kernel's copy is the only one;
    a mapping's page faults cost more)."""
    layers, two = kv_cache.shape[:2]
    block = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    iov_max = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    for layer in range(layers):
        for kv in range(two):
            rows = kv_cache[layer, kv].view(torch.uint8).numpy()  # [blocks, block bytes]
            offset = ((layer * two + kv) * num_blocks + first) * block
            for start in range(0, len(block_ids), iov_max):
                bufs = [memoryview(rows[b]) for b in block_ids[start : start + iov_max]]
                want = len(bufs) * block
                if os.preadv(fd, bufs, offset + start * block) != want:
                    raise ValueError("the staged KV file ended early")


def _read_then_copy(
    fd: int, kv_cache: torch.Tensor, block_ids: list[int], num_blocks: int, first: int, size: int
) -> None:
    """Read the whole file to host memory, then copy its blocks `first, ...` in, one layer at a time."""
    buf = torch.empty(size, dtype=torch.uint8)
    if os.preadv(fd, [buf.numpy().data], 0) != size:
        raise ValueError("the staged KV file ended early")
    layers, two, _, bs, heads, dim = kv_cache.shape
    src = buf.view(kv_cache.dtype).view(layers, two, num_blocks, bs, heads, dim)
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    for layer in range(layers):
        kv_cache[layer].index_copy_(1, idx, src[layer, :, first:].to(kv_cache.device))
