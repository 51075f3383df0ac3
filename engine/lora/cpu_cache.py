"""The host tier of adapters: validated checkpoints (weights in host memory) in LRU order."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet

from engine.lora.adapter_checkpoint import AdapterCheckpoint


class CpuAdapterCache:
    """Up to `capacity` adapters by digest; `put` evicts the least recently used unpinned one."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, AdapterCheckpoint] = OrderedDict()
        self.evictions = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: str) -> AdapterCheckpoint | None:
        ckpt = self._items.get(digest)
        if ckpt is not None:
            self._items.move_to_end(digest)
        return ckpt

    def put(self, ckpt: AdapterCheckpoint, keep: AbstractSet[str] = frozenset()) -> None:
        """Insert (or refresh) an adapter, dropping LRU entries not in `keep` while over capacity."""
        self._items[ckpt.digest] = ckpt
        self._items.move_to_end(ckpt.digest)
        for digest in list(self._items):
            if len(self._items) <= self.capacity:
                break
            if digest not in keep and digest != ckpt.digest:
                del self._items[digest]
                self.evictions += 1

    def drop(self, digest: str) -> None:
        self._items.pop(digest, None)

    def digests(self) -> list[str]:
        return list(self._items)
