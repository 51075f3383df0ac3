"""What an engine replica tells the router about its prefix cache: the blocks it holds, as a Bloom filter.

The replica's engine (made with `kv_events=True`) sends the block hashes its prefix cache stored and
evicted with each stats message; `HeldBlocks` mirrors them, so it holds exactly the engine's cached
blocks (evicted ones removed), at most the KV cache's size. Shipping that set to every router each second
would cost 32 bytes a block, so the replica reports a `BlockSummary` instead: a Bloom filter of
`bits_per_block` bits per KV block (16: about 0.05% false positives per block, 2 bytes a block),
rebuilt only when the set changed. A router asks `contains(hash)` of the prompt's chained block hashes
in order; a false positive on block i counts only if blocks 0..i-1 hit too.

    bit positions of hash h (sha256, 32 bytes):  a = h[0:8], b = h[8:16] | 1 (big-endian)
                                                 pos_i = ((a + i·b) mod 2^64) mod num_bits, i < k
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from api.engine_protocol import KVEventsMsg

BITS_PER_BLOCK = 16
NUM_PROBES = 11  # ≈ bits_per_block · ln 2: the fewest false positives for 16 bits a block
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockSummary:
    """A Bloom filter over block hashes (see the module doc); `blocks` is how many went in."""

    bits: bytes
    num_bits: int
    probes: int
    blocks: int

    @staticmethod
    def build(
        hashes: Iterable[bytes], bits_per_block: int = BITS_PER_BLOCK, probes: int = NUM_PROBES
    ) -> BlockSummary:
        """The filter of `hashes` (32-byte block hashes), `bits_per_block` bits for each (at least 64)."""
        hs = list(hashes)
        num_bits = max(64, -(-len(hs) * bits_per_block // 8) * 8)
        bits = np.zeros(num_bits, dtype=bool)
        bits[_positions(hs, num_bits, probes)] = True
        return BlockSummary(np.packbits(bits, bitorder="little").tobytes(), num_bits, probes, len(hs))

    def contains(self, block_hash: bytes) -> bool:
        """True if `block_hash` may be in the set (never False for one that is)."""
        a = int.from_bytes(block_hash[0:8], "big")
        b = int.from_bytes(block_hash[8:16], "big") | 1
        for i in range(self.probes):
            pos = ((a + i * b) & _MASK) % self.num_bits
            if not self.bits[pos >> 3] >> (pos & 7) & 1:
                return False
        return True

    def as_stats(self) -> dict[str, object]:
        """The summary as plain routing-stats values."""
        return {"bits": self.bits, "num_bits": self.num_bits, "probes": self.probes, "blocks": self.blocks}

    @staticmethod
    def from_stats(d: dict | None) -> BlockSummary | None:
        """The summary a replica reported (None before its first report)."""
        if not d or not d.get("num_bits"):
            return None
        return BlockSummary(bytes(d["bits"]), int(d["num_bits"]), int(d["probes"]), int(d["blocks"]))


def _positions(hashes: list[bytes], num_bits: int, probes: int) -> np.ndarray:
    """The filter's bit positions of every hash (module doc), `probes` per hash, as one array."""
    if not hashes:
        return np.zeros(0, dtype=np.int64)
    words = np.frombuffer(b"".join(hashes), dtype=">u8").reshape(len(hashes), 4).astype(np.uint64)
    a, b = words[:, 0], words[:, 1] | np.uint64(1)
    m = np.uint64(num_bits)
    return np.concatenate([(a + np.uint64(i) * b) % m for i in range(probes)]).astype(np.int64)


class HeldBlocks:
    """The block hashes the replica's engine holds in its prefix cache, from its KV events, with a
    counting Bloom filter over them (one counter per bit, so evicted blocks leave the filter too). At
    most `max_blocks` (the engine's KV blocks: it cannot cache more); the filter has `bits_per_block`
    bits for each, so a report's size is fixed by the KV cache's, never by the traffic."""

    def __init__(
        self, max_blocks: int, bits_per_block: int = BITS_PER_BLOCK, probes: int = NUM_PROBES
    ) -> None:
        self.max_blocks = max(1, max_blocks)
        self.num_bits = max(64, -(-self.max_blocks * bits_per_block // 8) * 8)
        self.probes = probes
        self._held: dict[bytes, None] = {}
        self._counts = np.zeros(self.num_bits, dtype=np.uint16)
        self.version = 0  # changes whenever the set does
        self._summary: BlockSummary | None = None
        self._summary_version = -1

    def apply(self, msg: KVEventsMsg) -> None:
        """Apply one engine message: a snapshot replaces the set; else stored hashes join, removed leave."""
        if msg.reset:
            self._held.clear()
            self._counts[:] = 0
        added = [h for h in dict.fromkeys(msg.stored) if h not in self._held]
        self._held.update(dict.fromkeys(added))
        gone = [h for h in dict.fromkeys(msg.removed) if self._held.pop(h, 0) is None]
        while len(self._held) > self.max_blocks:  # never with a well-behaved engine
            oldest = next(iter(self._held))
            del self._held[oldest]
            gone.append(oldest)
        np.add.at(self._counts, _positions(added, self.num_bits, self.probes), 1)
        np.subtract.at(self._counts, _positions(gone, self.num_bits, self.probes), 1)
        if msg.reset or added or gone:
            self.version += 1

    def clear(self) -> None:
        """The engine died: it holds nothing (its replacement's first message is a snapshot)."""
        self._held.clear()
        self._counts[:] = 0
        self.version += 1

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held

    def __len__(self) -> int:
        return len(self._held)

    def summary(self) -> BlockSummary:
        """The Bloom filter of the held blocks (rebuilt only after a change)."""
        if self._summary is None or self._summary_version != self.version:
            bits = np.packbits(self._counts > 0, bitorder="little").tobytes()
            self._summary = BlockSummary(bits, self.num_bits, self.probes, len(self._held))
            self._summary_version = self.version
        return self._summary
