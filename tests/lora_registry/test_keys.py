"""API keys: shown once, stored hashed, scoped, revocable, verified in constant time."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from lora_registry.errors import Conflict, InvalidName, NotFound, RegistryError
from lora_registry.models import ApiKey
from lora_registry.registry import Registry


def test_create_verify_scope_revoke(registry: Registry, events) -> None:
    keys = registry.keys
    admin = keys.create("ops", admin=True)
    scoped = keys.create("support-team", adapters=["support-bot", "faq"])
    assert admin.secret.startswith("lpx_") and admin.secret != scoped.secret
    assert keys.verify(admin.secret).is_admin
    info = keys.verify(scoped.secret)
    assert info.name == "support-team" and info.scopes == ("adapter:support-bot", "adapter:faq")
    assert info.allows_adapter("faq") and not info.allows_adapter("copywriter") and not info.is_admin
    assert keys.verify(scoped.secret[:-1] + ("a" if scoped.secret[-1] != "a" else "b")) is None
    assert keys.verify("lpx_000000000000_nope") is None and keys.verify("garbage") is None
    keys.revoke("support-team")
    assert keys.verify(scoped.secret) is None
    assert [k.name for k in keys.list()] == ["ops", "support-team"]
    assert keys.list()[1].revoked_at is not None
    assert [e.type for e in events] == ["key.created", "key.created", "key.revoked"]
    assert [a.action for a in registry.adapters.audit_log()] == ["key.revoked", "key.created", "key.created"]


def test_only_the_hash_is_stored(registry: Registry) -> None:
    created = registry.keys.create("ops", admin=True)
    with registry.adapters.sessions() as s:
        row = s.scalars(select(ApiKey)).one()
    assert row.key_hash == hashlib.sha256(created.secret.encode()).hexdigest()
    assert created.secret not in (row.key_hash, row.prefix) and created.secret.startswith(row.prefix + "_")


def test_key_errors(registry: Registry) -> None:
    keys = registry.keys
    keys.create("ops", admin=True)
    with pytest.raises(Conflict, match="already exists"):
        keys.create("ops", admin=True)
    with pytest.raises(RegistryError, match="either --admin or"):
        keys.create("k2")
    with pytest.raises(RegistryError, match="either --admin or"):
        keys.create("k2", admin=True, adapters=["x"])
    with pytest.raises(InvalidName):
        keys.create("k2", adapters=["../x"])
    with pytest.raises(NotFound):
        keys.revoke("nope")
