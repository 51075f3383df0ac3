"""`HostCopyConnector`: KV blocks copied out to host bytes and back (any transport that moves bytes).

send:    chunk = kv_cache[:, :, block_ids]            -> host, contiguous, as bytes
         (per layer: chunk_l = kv_cache[l, :, block_ids] for each layer l)
receive: kv_cache[:, :, block_ids] = chunk[:, :, first:] (per layer likewise)

The sender's blocks are free again as soon as `send` returns (they stay in its prefix cache).
"""

from __future__ import annotations

import torch

from engine.kv_transfer.connector import KVBlocks, KVConnector, KVLayout


class HostCopyConnector(KVConnector):
    holds_blocks = False

    def __init__(self, per_layer: bool = False) -> None:
        self.per_layer = per_layer
        self.name = "host-layers" if per_layer else "host"

    def send(
        self, request_id: str, kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int
    ) -> KVBlocks:
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        if self.per_layer:
            parts = [kv_cache[layer].index_select(1, idx) for layer in range(kv_cache.shape[0])]
        else:
            parts = [kv_cache.index_select(2, idx)]
        chunks = [_to_bytes(p) for p in parts]
        return KVBlocks(self.name, KVLayout.of(kv_cache), len(block_ids), num_tokens, chunks)

    def receive(self, blocks: KVBlocks, kv_cache: torch.Tensor, block_ids: list[int], first: int = 0) -> None:
        check_layout(blocks, kv_cache)
        if len(block_ids) != blocks.num_blocks - first:
            raise ValueError(f"{len(block_ids)} blocks to fill with {blocks.num_blocks - first} sent")
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        layers, two, _, bs, heads, dim = kv_cache.shape
        n = blocks.num_blocks
        if blocks.connector == "host-layers":
            for layer, chunk in enumerate(blocks.chunks):
                src = _from_bytes(chunk, kv_cache.dtype, (two, n, bs, heads, dim))[:, first:]
                kv_cache[layer].index_copy_(1, idx, src.to(kv_cache.device))
        else:
            src = _from_bytes(blocks.chunks[0], kv_cache.dtype, (layers, two, n, bs, heads, dim))[
                :, :, first:
            ]
            kv_cache.index_copy_(2, idx, src.to(kv_cache.device))


def check_layout(blocks: KVBlocks, kv_cache: torch.Tensor) -> None:
    """ValueError unless `blocks` came from an engine with this cache's layout and a known connector."""
    mine = KVLayout.of(kv_cache)
    if blocks.layout != mine:
        raise ValueError(f"the KV blocks' layout {blocks.layout} does not match this engine's {mine}")
    want = kv_cache.shape[0] if blocks.connector == "host-layers" else 1
    if blocks.connector not in ("host", "host-layers") or len(blocks.chunks) != want or blocks.path:
        raise ValueError(f"KV blocks from connector {blocks.connector!r} with {len(blocks.chunks)} chunks")
    if blocks.nbytes != blocks.num_blocks * mine.block_bytes():
        raise ValueError(
            f"KV blocks carry {blocks.nbytes} bytes, expected {blocks.num_blocks * mine.block_bytes()}"
        )


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
