"""Redis down during admin changes, on a live server: the admin API answers what really happened (the
change committed: 200/201, never 503), the server that made a change applies it at once (no waiting for
Redis or the periodic resync), and once Redis is back the outbox relay delivers the events, so another
replica — following Redis directly, without periodic re-reads — converges.

The server reaches Redis only through a `FaultProxy`; the second replica is a `RegistryFollower` in
this process on the same registry database and the real Redis.
"""

from __future__ import annotations

import io
import zipfile

import httpx
import pytest

from lora_registry import RegistrySettings, open_registry
from lora_registry.follower import RegistryFollower
from lora_registry.redis_bus import RedisEventBus
from tests.helpers.live_server import start_server, wait_until
from tests.helpers.redis_service import REDIS_URL, require_redis
from tests.helpers.served import register
from tests.helpers.tcp_proxy import FaultProxy

pytestmark = pytest.mark.slow  # a live server

BODY = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(text_model, tmp_path_factory):
    """(server, proxy, replica follower) sharing one SQLite registry and one Redis channel."""
    require_redis()
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("events")
    register(data, base, "bot", adapters["all7-r4"], activate=False)
    with FaultProxy("127.0.0.1", 6379) as proxy:
        srv = start_server(
            base,
            data,
            env={"LORAPLEX_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"},
            settings_overrides={"registry_resync_seconds": 120},  # only events (and reconnects) count
        )
        bus = RedisEventBus(REDIS_URL)
        replica_registry = open_registry(RegistrySettings.from_env({"LORAPLEX_DATA_DIR": str(data)}), bus=bus)
        replica = RegistryFollower(replica_registry.adapters, bus, lambda *_: None).start()
        try:
            assert bus._subs[0].wait_connected(10)
            yield srv, proxy, replica
        finally:
            proxy.restore()
            replica.close()
            replica_registry.close()
            srv.stop()


def _zip(adapter_dir) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            z.write(adapter_dir / f, f)
    return buf.getvalue()


def test_admin_changes_with_redis_down_answer_success_and_replicas_converge(cluster, text_model):
    srv, proxy, replica = cluster
    admin = srv.admin()
    proxy.refuse()
    try:
        r = admin.post("/admin/api/adapters/bot/activate")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "active"
        files = {"file": ("new.zip", _zip(text_model[1]["gud-r12"]), "application/zip")}
        up = admin.post("/admin/api/adapters", data={"name": "fresh", "activate": "true"}, files=files)
        assert up.status_code == 201, up.text
        # What the answers said is what happened: audited, and served by this server at once.
        actions = [(e["action"], e["target"]) for e in admin.get("/admin/api/audit").json()["data"][:2]]
        assert actions == [("adapter.registered", "fresh"), ("adapter.activated", "bot")]
        for name in ("bot", "fresh"):
            done = httpx.post(f"{srv.url}/v1/completions", json=BODY | {"model": name}, timeout=60)
            assert done.status_code == 200, done.text
        # The other replica has heard nothing yet: the events wait in the outbox.
        assert "bot" not in replica.snapshot() and "fresh" not in replica.snapshot()
        assert srv.state.registry.outbox.pending() >= 3
        assert httpx.get(f"{srv.url}/ready").json()["events"] == "redis (disconnected)"
    finally:
        proxy.restore()
    assert wait_until(lambda: {"bot", "fresh"} <= set(replica.snapshot()), timeout=20)
    # the replica may converge by its periodic re-read before the outbox's flush has run: wait for both
    assert wait_until(lambda: srv.state.registry.outbox.pending() == 0, timeout=20)
    # A change while Redis is up again reaches the replica the ordinary way.
    assert admin.post("/admin/api/adapters/bot/deactivate").status_code == 200
    assert wait_until(lambda: "bot" not in replica.snapshot(), timeout=10)
    # This server's own set caught up too (its subscription resynced on reconnecting).
    assert wait_until(lambda: srv.state.follower.snapshot().get("fresh") == replica.snapshot()["fresh"])


def _status(srv, name: str) -> int:
    return httpx.post(f"{srv.url}/v1/completions", json=BODY | {"model": name}, timeout=60).status_code


def test_this_server_applies_its_own_changes_at_once_while_redis_is_down(cluster, text_model):
    srv, proxy, replica = cluster
    admin, adapters = srv.admin(), text_model[1]
    proxy.refuse()
    try:
        # vLLM's load/unload routes.
        r = admin.post(
            "/v1/load_lora_adapter", json={"lora_name": "side", "lora_path": str(adapters["all7-r4"])}
        )
        assert r.status_code == 200, r.text
        first = r.json()["digest"]
        assert _status(srv, "side") == 200
        assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "side"}).status_code == 200
        assert "side" not in srv.state.follower.snapshot() and _status(srv, "side") == 404
        # Activate / deactivate / rollback through the admin API.
        assert admin.post("/admin/api/adapters/side/activate").status_code == 200
        assert _status(srv, "side") == 200
        assert admin.post("/admin/api/adapters/side/deactivate").status_code == 200
        assert _status(srv, "side") == 404
        r = admin.post(
            "/v1/load_lora_adapter", json={"lora_name": "side", "lora_path": str(adapters["gud-r12"])}
        )
        assert r.status_code == 200 and srv.state.follower.get("side").digest == r.json()["digest"] != first
        assert admin.post("/admin/api/adapters/side/rollback", json={"version": 1}).status_code == 200
        assert srv.state.follower.get("side").digest == first
        # Limits: committed (200, not an error for the event that could not be sent) and enforced here.
        r = admin.patch("/admin/api/adapters/side/limits", json={"tokens_per_minute": 1})
        assert r.status_code == 200, r.text
        assert _status(srv, "side") == 429
        assert (
            admin.patch("/admin/api/adapters/side/limits", json={"tokens_per_minute": 0}).status_code == 200
        )
        assert _status(srv, "side") == 200
        # Keys: a revoked key is refused by this server's key cache at once.
        secret = admin.post("/admin/api/keys", json={"name": "redis-down", "admin": True}).json()["secret"]
        assert srv.state.key_cache.lookup(secret)[1] is not None
        assert admin.delete("/admin/api/keys/redis-down").status_code == 200
        assert srv.state.key_cache.lookup(secret) == (True, None)
        # Delete.
        assert admin.delete("/admin/api/adapters/side").status_code == 200
        assert "side" not in srv.state.follower.snapshot() and _status(srv, "side") == 404
    finally:
        proxy.restore()
    assert wait_until(lambda: srv.state.registry.outbox.pending() == 0, timeout=20)
    assert wait_until(lambda: "side" not in replica.snapshot(), timeout=10)
