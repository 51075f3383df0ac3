"""`KeyCache`: API keys checked from memory, so keyed requests keep working while the database is away.

Like `RegistryFollower` does for active adapters, the cache holds every key's record (its sha256 and
its info: scopes, revocation) by public prefix, re-read whole on every (re)connect of the event bus
and every resync, and key by key on each `key.*` event. A request's key is checked against memory
(constant-time hash compare); only a prefix the cache has never seen is looked up in the database
(it may have been created a moment ago on another server), and added.

Revocation is final, so it is applied from the event itself, before (and whatever the outcome of) the
re-read, and never undone by an older read: a revoked key stops working on a server as soon as the
event reaches it — at once on the server that revoked it (`EventBus.deliver_local`), through Redis
on the others, within the resync interval without Redis.

    cache = KeyCache(registry.keys, registry.bus).start()
    known, info = cache.lookup(secret)       # memory only; known=False: ask the database
    info = cache.fetch(secret)               # the database (RegistryUnavailable when unreachable)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from datetime import UTC, datetime

from lora_registry import events as ev
from lora_registry.errors import RegistryUnavailable
from lora_registry.events import EventBus, RegistryEvent, Subscription
from lora_registry.keys import KeyRecord, KeyService, public_prefix
from lora_registry.schemas import ApiKeyInfo

log = logging.getLogger(__name__)


class KeyCache:
    def __init__(self, keys: KeyService, bus: EventBus) -> None:
        self.keys = keys
        self.bus = bus
        self.resyncs = 0
        self._by_prefix: dict[str, KeyRecord] = {}
        self._prefix_of: dict[str, str] = {}  # key name -> prefix
        self._lock = threading.Lock()
        self._sub: Subscription | None = None

    def start(self) -> KeyCache:
        self._sub = self.bus.subscribe(self._on_event, on_resync=self.resync)
        return self

    def __len__(self) -> int:
        return len(self._by_prefix)

    def lookup(self, secret: str) -> tuple[bool, ApiKeyInfo | None]:
        """(known, info) from memory only: known=True with the key's info, or None when `secret` is not a
        valid unrevoked key; known=False when the cache holds no key with `secret`'s prefix."""
        prefix = public_prefix(secret)
        if prefix is None:
            return True, None  # not shaped like a key: no database could make it valid
        record = self._by_prefix.get(prefix)
        if record is None:
            return False, None
        return True, record.check(secret)

    def fetch(self, secret: str) -> ApiKeyInfo | None:
        """Look `secret`'s prefix up in the database (blocking; `RegistryUnavailable` when it cannot be
        reached), remember the record, and check `secret` against it."""
        prefix = public_prefix(secret)
        record = self.keys.record(prefix=prefix) if prefix is not None else None
        if record is None:
            return None
        return self._put(record).check(secret)

    def resync(self) -> None:
        """Re-read every key (a key is never deleted, so nothing is dropped; revocations stay)."""
        records = self.keys.records()
        with self._lock:
            self.resyncs += 1
            for record in records:
                self._put_locked(record)

    def _on_event(self, event: RegistryEvent) -> None:
        if not event.type.startswith("key."):
            return
        if event.type == ev.KEY_REVOKED:
            self.revoke(event.name)
        try:
            record = self.keys.record(name=event.name)
        except RegistryUnavailable as exc:  # a revocation is applied already; a new key is fetched on use
            log.warning("API keys: cannot re-read key %r after %s: %s", event.name, event.type, exc)
            return
        if record is not None:
            self._put(record)

    def revoke(self, name: str) -> None:
        """Stop accepting key `name` now (memory only; the database already says so)."""
        with self._lock:
            prefix = self._prefix_of.get(name)
            record = self._by_prefix.get(prefix) if prefix is not None else None
            if record is not None and record.info.revoked_at is None:
                info = dataclasses.replace(record.info, revoked_at=datetime.now(UTC))
                self._by_prefix[record.info.prefix] = KeyRecord(record.key_hash, info)

    def _put(self, record: KeyRecord) -> KeyRecord:
        with self._lock:
            return self._put_locked(record)

    def _put_locked(self, record: KeyRecord) -> KeyRecord:
        """Store `record`, unless memory already knows the key as revoked (an older read)."""
        prefix = record.info.prefix
        current = self._by_prefix.get(prefix)
        if current is not None and current.info.revoked_at is not None and record.info.revoked_at is None:
            return current
        self._by_prefix[prefix] = record
        self._prefix_of[record.info.name] = prefix
        return record

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close()
            self._sub = None
