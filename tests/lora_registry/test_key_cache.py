"""`KeyCache`: API keys checked from memory, kept current by the registry's events and resyncs."""

from __future__ import annotations

from lora_registry.key_cache import KeyCache
from lora_registry.registry import Registry


def test_keys_are_checked_from_memory_and_revocation_applies_at_once(registry: Registry) -> None:
    keys = registry.keys
    before = keys.create("before", admin=True)
    cache = KeyCache(keys, registry.bus).start()  # the in-process bus resyncs on subscribe
    try:
        assert len(cache) == 1 and cache.lookup(before.secret) == (True, before.info)
        after = keys.create("after", adapters=["bot"])  # its event adds it at once
        known, info = cache.lookup(after.secret)
        assert known and info is not None and info.allows_adapter("bot") and not info.is_admin
        assert cache.lookup(after.secret[:-1] + ("a" if after.secret[-1] != "a" else "b")) == (True, None)
        assert cache.lookup("garbage") == (True, None)
        assert cache.lookup("lpx_0123456789ab_nope") == (False, None)  # never seen: ask the database
        assert cache.fetch("lpx_0123456789ab_nope") is None
        keys.revoke("after")
        assert cache.lookup(after.secret) == (True, None)
        # A full re-read never resurrects a revoked key, and keeps every key.
        cache.resync()
        assert cache.lookup(after.secret) == (True, None) and cache.lookup(before.secret)[1] is not None
    finally:
        cache.close()


def test_a_key_created_without_an_event_is_fetched_from_the_database(registry: Registry) -> None:
    cache = KeyCache(registry.keys, registry.bus)  # not subscribed: it hears of no change
    created = registry.keys.create("quiet", adapters=["bot"])
    assert cache.lookup(created.secret) == (False, None)
    assert cache.fetch(created.secret) == created.info
    assert cache.lookup(created.secret) == (True, created.info)
    registry.keys.revoke("quiet")
    cache.revoke("quiet")  # what the `key.revoked` event does, without the database
    assert cache.lookup(created.secret) == (True, None)
