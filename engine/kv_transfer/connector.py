"""`KVConnector`: the seam between an engine's KV cache and a transport that moves KV blocks.

The sending engine calls `send(request_id, kv_cache, block_ids)` once a prefill-only request has
sampled its first token; it returns `KVBlocks`, plain data the receiving engine needs (for a byte
transport the bytes themselves, for NIXL or NCCL a descriptor of registered memory). The receiving
engine allocates fresh blocks and calls `receive(blocks, kv_cache, block_ids, first)` to fill them.
`release(request_id)` on the sending side ends the transfer: a connector that reads the sender's blocks
in place (`holds_blocks`) keeps them referenced until then; one that copies them out needs nothing.

The KV cache tensor is the model runner's: [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import msgspec
import torch


class KVLayout(msgspec.Struct, frozen=True):
    """What a block holds; both engines must agree on it (same model, block size and KV dtype)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # e.g. "float32", "bfloat16"

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> KVLayout:
        layers, _, _, block_size, heads, head_dim = kv_cache.shape
        return cls(layers, block_size, heads, head_dim, str(kv_cache.dtype).removeprefix("torch."))

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


class KVBlocks(msgspec.Struct):
    """The sender's blocks, as the connector `name` describes them: `num_blocks` blocks of `layout`, the
    prompt's first `num_tokens` tokens. `chunks`: the bytes (a byte transport: one piece, or one per
    layer); a connector reading in place would put its descriptor there instead."""

    connector: str
    layout: KVLayout
    num_blocks: int
    num_tokens: int
    chunks: list[bytes] = msgspec.field(default_factory=list)
    # connector "shm": the blocks are in this host-local file instead (laid out as one "host" chunk)
    path: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of K/V these blocks carry (in `chunks`, or staged at `path`)."""
        if self.path is not None:
            return self.num_blocks * self.layout.block_bytes()
        return sum(len(c) for c in self.chunks)


class KVConnector(ABC):
    """One transport's two ends (see the module doc)."""

    name: str = ""
    holds_blocks: bool = False  # True: the sender's blocks stay referenced until `release`

    @abstractmethod
    def send(
        self, request_id: str, kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int
    ) -> KVBlocks:
        """Make the blocks `block_ids` (holding the request's first `num_tokens` tokens) available to the
        receiver; returns what the receiver needs."""

    @abstractmethod
    def receive(self, blocks: KVBlocks, kv_cache: torch.Tensor, block_ids: list[int], first: int = 0) -> None:
        """Write the sender's blocks `first, first + 1, ...` into this engine's `block_ids` (freshly
        allocated; blocks before `first` were found in this engine's own prefix cache)."""

    def release(self, request_id: str) -> None:  # noqa: B027  # optional: a copying connector holds nothing
        """End the request's transfer on the sending side (free buffers, unregister memory)."""


def make_connector(name: str) -> KVConnector:
    """The connector called `name`: "host" (host bytes, one piece), "host-layers" (one per layer) or
    "shm" (a file in host shared memory, for two engines on one host)."""
    from engine.kv_transfer.host_copy import HostCopyConnector
    from engine.kv_transfer.shm_stage import ShmStageConnector

    if name == "host":
        return HostCopyConnector(per_layer=False)
    if name == "host-layers":
        return HostCopyConnector(per_layer=True)
    if name == "shm":
        return ShmStageConnector()
    raise ValueError(f"unknown KV connector {name!r}; choose 'host', 'host-layers' or 'shm'")


def receiver_for(blocks: KVBlocks, mine: KVConnector) -> KVConnector:
    """The connector that reads `blocks` on the receiving side: the one they name when it differs
    from this engine's own (a byte connector's blocks staged in shared memory by the decode replica)."""
    return mine if blocks.connector == mine.name else make_connector(blocks.connector)
