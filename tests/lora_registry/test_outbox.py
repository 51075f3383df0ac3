"""The transactional outbox: with Redis refused or black-holed (a `FaultProxy` in front of the real
Redis), admin changes succeed and are audited, their events wait in the outbox, and the relay delivers
them, in order, once Redis is back; a change that rolls back leaves no event."""

from __future__ import annotations

import contextlib
import queue
import time
import uuid

import pytest

from lora_registry import events as ev
from lora_registry.errors import NotFound
from lora_registry.events import RegistryEvent
from lora_registry.outbox import OutboxRelay
from lora_registry.redis_bus import RedisEventBus
from lora_registry.registry import Registry, open_registry
from lora_registry.settings import RegistrySettings
from tests.helpers.redis_service import REDIS_URL, require_redis
from tests.helpers.tcp_proxy import FaultProxy


@pytest.fixture
def redis_proxy():
    require_redis()
    with FaultProxy("127.0.0.1", 6379) as proxy:
        yield proxy


@pytest.fixture
def channel() -> str:
    return f"loraplex:test:{uuid.uuid4().hex}"


@pytest.fixture
def behind_proxy(settings: RegistrySettings, registry: Registry, redis_proxy: FaultProxy, channel: str):
    """A registry (the wiped test database) whose event bus reaches Redis only through the proxy."""
    bus = RedisEventBus(f"redis://127.0.0.1:{redis_proxy.port}/0", channel)
    reg = open_registry(settings, bus=bus, auto_upgrade=False)
    try:
        yield reg
    finally:
        reg.close()


@pytest.fixture
def received(channel: str):
    """Events on `channel`, as a replica connected to Redis directly sees them."""
    got: queue.Queue[RegistryEvent] = queue.Queue()
    bus = RedisEventBus(REDIS_URL, channel)
    sub = bus.subscribe(got.put)
    assert sub.wait_connected(10)
    yield got
    bus.close()


def _drain(q: queue.Queue[RegistryEvent], n: int, timeout: float = 15.0) -> list[RegistryEvent]:
    out: list[RegistryEvent] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            out.append(q.get(timeout=0.1))
    return out


def test_changes_commit_while_redis_is_refused_and_are_delivered_when_it_is_back(
    behind_proxy: Registry, redis_proxy: FaultProxy, received, adapter_dirs
) -> None:
    reg = behind_proxy
    redis_proxy.refuse()
    result = reg.adapters.register("bot", adapter_dirs["a"], activate=True)  # no exception: committed
    reg.adapters.deactivate("bot")
    reg.keys.create("team", adapters=["bot"])
    assert result.adapter.is_active and reg.adapters.show("bot").adapter.status == "inactive"
    actions = [a.action for a in reg.adapters.audit_log()]
    assert actions[:3] == [ev.KEY_CREATED, ev.ADAPTER_DEACTIVATED, ev.ADAPTER_REGISTERED]
    assert reg.outbox.pending() == 4
    assert _drain(received, 1, timeout=1.0) == []  # nothing reached the other replica yet

    redis_proxy.restore()
    relay = OutboxRelay(reg.outbox, interval=0.2).start()
    try:
        got = _drain(received, 4)
    finally:
        relay.close()
    assert [(e.type, e.name) for e in got] == [
        (ev.ADAPTER_REGISTERED, "bot"),
        (ev.ADAPTER_ACTIVATED, "bot"),
        (ev.ADAPTER_DEACTIVATED, "bot"),
        (ev.KEY_CREATED, "team"),
    ]
    assert got[1].digest == result.version.digest and got[2].status == "inactive"
    assert reg.outbox.pending() == 0


def test_blackholed_redis_does_not_fail_or_hang_a_change(
    behind_proxy: Registry, redis_proxy: FaultProxy, received, adapter_dirs
) -> None:
    reg = behind_proxy
    reg.adapters.register("bot", adapter_dirs["a"])
    assert [e.type for e in _drain(received, 1)] == [ev.ADAPTER_REGISTERED]  # delivered at once
    redis_proxy.blackhole()
    t0 = time.monotonic()
    info = reg.adapters.activate("bot")
    assert info.is_active and time.monotonic() - t0 < 10  # the publish gives up; the change stands
    assert reg.outbox.pending() == 1
    redis_proxy.cut()
    redis_proxy.restore()
    assert reg.outbox.flush() == 0
    got = _drain(received, 1)
    assert [(e.type, e.status) for e in got] == [(ev.ADAPTER_ACTIVATED, "active")]


def test_a_change_that_fails_leaves_no_event(behind_proxy: Registry, received) -> None:
    with pytest.raises(NotFound):
        behind_proxy.adapters.activate("nobody")
    assert behind_proxy.outbox.pending() == 0
    assert _drain(received, 1, timeout=0.5) == []


def test_this_process_applies_its_own_changes_at_once_while_redis_is_refused(
    behind_proxy: Registry, redis_proxy: FaultProxy, adapter_dirs
) -> None:
    """The server that made a change must not wait for Redis: its own subscribers (the follower, the
    limits, the key cache) get the committed change right away, and exactly once when Redis is back."""
    from lora_registry.follower import RegistryFollower
    from lora_registry.limits import LIMITS_CHANGED

    reg = behind_proxy
    reg.adapters.register("bot", adapter_dirs["a"], activate=True)
    follower = RegistryFollower(reg.adapters, reg.bus, lambda *_: None).start()
    seen: list[RegistryEvent] = []
    reg.bus.subscribe(seen.append)
    try:
        assert all(s.wait_connected(10) for s in reg.bus._subs)
        follower.resync()
        assert "bot" in follower.snapshot()
        redis_proxy.refuse()
        reg.adapters.deactivate("bot")
        assert "bot" not in follower.snapshot()  # at once: no resync, no Redis
        reg.adapters.activate("bot")
        assert "bot" in follower.snapshot()
        reg.keys.create("team", adapters=["bot"])
        limits = reg.limits.set("adapter", "bot", requests_per_minute=5)  # committed, no exception
        assert limits.requests_per_minute == 5 and reg.limits.get("adapter", "bot").requests_per_minute == 5
        reg.adapters.delete("bot")
        assert follower.snapshot() == {}
        local = [(e.type, e.name) for e in seen]
        assert local == [
            (ev.ADAPTER_DEACTIVATED, "bot"),
            (ev.ADAPTER_ACTIVATED, "bot"),
            (ev.KEY_CREATED, "team"),
            (LIMITS_CHANGED, "adapter:bot"),
            (ev.ADAPTER_DELETED, "bot"),
        ]
        assert reg.outbox.pending() == 5
        redis_proxy.restore()
        assert all(s.wait_connected(10) for s in reg.bus._subs)
        assert reg.outbox.flush() == 0
        time.sleep(1.0)  # the Redis copies arrive, and are dropped as already delivered
        assert [(e.type, e.name) for e in seen] == local
    finally:
        follower.close()
