"""What the prefix cache stored and evicted, as events a consumer takes in batches (bounded memory).

A server that routes by prefix (the cluster's affinity router) must know which blocks an engine holds,
not guess them from what it routed there: the engine evicts blocks LRU, and two engines never agree. The
block pool tells its `CacheJournal` each time a block hash enters or leaves the cache; `take()` hands over
what changed since the last take:

    CacheEvents(reset=False, stored=[h...], removed=[h...])   # apply in order: add stored, drop removed
    CacheEvents(reset=True, stored=[every hash cached now])    # forget what you knew: a snapshot

The journal never holds more than `bound` hashes: past it, it stops recording and the next take is a
snapshot instead (so nothing grows while no one takes). The first take is always a snapshot, so a
consumer that (re)connects to a new engine starts from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class CacheEvents:
    """The prefix cache's changes since the previous take (see the module doc)."""

    reset: bool
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class CacheJournal:
    """Records hashes stored in and removed from the prefix cache, at most `bound` of them."""

    bound: int
    _stored: list[bytes] = field(default_factory=list)
    _removed: list[bytes] = field(default_factory=list)
    _overflow: bool = True  # the first take is a snapshot

    def stored(self, block_hash: bytes) -> None:
        if not self._overflow:
            self._stored.append(block_hash)
            self._check()

    def removed(self, block_hash: bytes) -> None:
        if not self._overflow:
            self._removed.append(block_hash)
            self._check()

    def cleared(self) -> None:
        """Every cached block was forgotten: the next take is a (now empty) snapshot."""
        self._drop()

    def _check(self) -> None:
        if len(self._stored) + len(self._removed) > self.bound:
            self._drop()

    def _drop(self) -> None:
        self._overflow = True
        self._stored, self._removed = [], []

    def take(self, cached_now: Callable[[], Iterable[bytes]]) -> CacheEvents:
        """The events since the last take; a snapshot of `cached_now()` after an overflow or a clear."""
        if self._overflow:
            events = CacheEvents(True, list(cached_now()))
        else:
            events = CacheEvents(False, self._stored, self._removed)
        self._overflow = False
        self._stored, self._removed = [], []
        return events
