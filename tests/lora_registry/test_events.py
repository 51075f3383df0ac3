"""Events: the in-process bus, and Redis pub/sub to subscribers in two other processes (real Redis)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from lora_registry.events import InProcessBus, RegistryEvent
from lora_registry.follower import RegistryFollower
from lora_registry.redis_bus import RedisEventBus
from lora_registry.registry import Registry, open_registry
from lora_registry.settings import RegistrySettings

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_client() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"Redis at {REDIS_URL} is unreachable: {exc}")
        pytest.skip(f"Redis at {REDIS_URL} is unreachable: {exc}")
    yield client
    client.close()


def test_event_json_round_trip() -> None:
    e = RegistryEvent(type="adapter.activated", name="bot", status="active", version=2, digest="ab" * 32)
    assert RegistryEvent.from_json(e.to_json()) == e


def test_follower_on_the_in_process_bus(registry: Registry, adapter_dirs) -> None:
    seen: list[tuple[str, str | None]] = []
    follower = RegistryFollower(
        registry.adapters, registry.bus, lambda n, a: seen.append((n, a and a.digest))
    )
    registry.adapters.register("pre", adapter_dirs["b"], activate=True)
    follower.start()  # the initial resync picks up what was active before
    d = registry.adapters.register("bot", adapter_dirs["a"], activate=True).version.digest
    registry.adapters.deactivate("bot")
    registry.adapters.delete("pre")
    assert [n for n, _ in seen] == ["pre", "bot", "bot", "pre"]
    assert seen[1] == ("bot", d) and seen[2] == ("bot", None) and follower.snapshot() == {}
    follower.close()


class _Proc:
    """A subscriber process whose JSON stdout lines are collected by a reader thread."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.p = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("redis_subscriber.py")), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[dict] = queue.Queue()
        self.errors: list[str] = []
        self.pending: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.errors.extend(self.p.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(json.loads(line))

    def expect(self, pred, timeout: float = 20.0) -> dict:
        """The first reported line, in order, that satisfies `pred` (non-matching lines stay queued)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, msg in enumerate(self.pending):
                if pred(msg):
                    return self.pending.pop(i)
            try:
                self.pending.append(self.lines.get(timeout=0.1))
            except queue.Empty:
                if self.p.poll() is not None:
                    raise AssertionError(f"subscriber exited: {''.join(self.errors)}") from None
        raise AssertionError(
            f"no expected report in time; got {self.pending}; stderr: {''.join(self.errors)}"
        )

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()


def _kill_client(client: redis.Redis, name: str) -> None:
    ids = [c["id"] for c in client.client_list(_type="pubsub") if c.get("name") == name]
    assert ids, f"no pubsub connection named {name}"
    for cid in ids:
        client.client_kill_filter(_id=cid)


def test_activation_reaches_two_processes_and_a_reconnecting_one_catches_up(
    settings: RegistrySettings, adapter_dirs, redis_client: redis.Redis, registry: Registry
) -> None:
    channel = f"loraplex:test:{uuid.uuid4().hex}"
    tag = uuid.uuid4().hex[:8]
    bus = RedisEventBus(REDIS_URL, channel)
    main = open_registry(settings, bus=bus, auto_upgrade=False)  # `registry` wiped the shared database
    procs = [
        _Proc([settings.database_url, str(settings.data_dir), REDIS_URL, channel, f"lpx-{tag}-{i}"])
        for i in (0, 1)
    ]
    try:
        for p in procs:
            p.expect(lambda m: m.get("ready"))
        assert redis_client.pubsub_numsub(channel)[0][1] == 2
        digest = main.adapters.register("bot", adapter_dirs["a"], activate=True).version.digest
        for p in procs:
            assert p.expect(lambda m: m.get("name") == "bot")["digest"] == digest

        # subscriber 1 loses its connection; what is published meanwhile never reaches it ...
        _kill_client(redis_client, f"lpx-{tag}-1")
        assert redis_client.pubsub_numsub(channel)[0][1] == 1
        d2 = main.adapters.register("copy", adapter_dirs["b"], activate=True).version.digest
        main.adapters.deactivate("bot")
        assert procs[0].expect(lambda m: m.get("name") == "copy")["digest"] == d2
        assert procs[0].expect(lambda m: m.get("name") == "bot")["digest"] is None
        # ... but after reconnecting it re-reads the registry and catches up
        caught = procs[1].expect(lambda m: m.get("name") == "copy")
        assert caught["digest"] == d2 and caught["resyncs"] >= 2
        assert procs[1].expect(lambda m: m.get("name") == "bot")["digest"] is None
    finally:
        for p in procs:
            p.stop()
        main.close()


def test_publish_to_unreachable_redis_is_a_clear_error() -> None:
    from lora_registry.errors import RegistryUnavailable

    bus = RedisEventBus("redis://127.0.0.1:1/0")
    with pytest.raises(RegistryUnavailable, match="cannot publish to Redis"):
        bus.publish(RegistryEvent(type="adapter.activated", name="x"))
    bus.close()


def test_in_process_bus_survives_a_failing_subscriber() -> None:
    bus = InProcessBus()
    got: list[RegistryEvent] = []
    bus.subscribe(lambda e: 1 / 0)
    bus.subscribe(got.append)
    bus.publish(RegistryEvent(type="adapter.deleted", name="x"))
    assert len(got) == 1
