"""Keyed inference through a PostgreSQL outage, on a live server that requires API keys: known keys
are checked from memory (every keyed request answers 200 while the database is refused or black-holed),
a key revoked elsewhere stops working within 1 s through the Redis event (even while this server
cannot reach the database), and a key the server has never seen gets a retryable 503, not a guess.

The server reaches PostgreSQL through a `FaultProxy`; the test process plays a second server: the
real registry service on the same database and the real Redis channel.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy.engine import make_url

from lora_registry import RegistrySettings, open_registry
from lora_registry.migrate import upgrade
from lora_registry.redis_bus import RedisEventBus
from tests.helpers.live_server import start_server, wait_until
from tests.helpers.redis_service import REDIS_URL, require_redis
from tests.helpers.tcp_proxy import FaultProxy
from tests.lora_registry.pg import postgres_database

pytestmark = pytest.mark.slow  # a live server

ACTIVE = "all7-r4"
BODY = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed(text_model, tmp_path_factory):
    """(server, proxy, the test's own registry on the real database + Redis)."""
    require_redis()
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("keys-outage")
    with postgres_database() as url, FaultProxy("127.0.0.1", 5432) as proxy:
        upgrade(url)
        bus = RedisEventBus(REDIS_URL)
        other = open_registry(RegistrySettings(data, url, model_path=base, redis_url=REDIS_URL), bus=bus)
        try:
            other.adapters.register(ACTIVE, adapters[ACTIVE], activate=True)
            proxied = make_url(url).set(port=proxy.port).render_as_string(False)
            env = {
                "LORAPLEX_DATABASE_URL": proxied,
                "LORAPLEX_DB_CONNECT_TIMEOUT": "2",
                "LORAPLEX_REDIS_URL": REDIS_URL,
            }
            srv = start_server(base, data, env=env, settings_overrides={"require_api_key": True})
            try:
                yield srv, proxy, other
            finally:
                proxy.restore()
                srv.stop()
        finally:
            other.close()


def _call(url: str, secret: str) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {secret}"}
    r = httpx.post(f"{url}/v1/completions", json=BODY | {"model": ACTIVE}, headers=headers, timeout=60)
    return r.status_code, r.json()


def _served(srv, secret: str) -> bool:
    return _call(srv.url, secret)[0] == 200


def test_known_keys_keep_working_through_a_database_outage(keyed):
    srv, proxy, other = keyed
    admin_key = other.keys.create("outage-admin", admin=True).secret
    scoped_key = other.keys.create("outage-scoped", adapters=[ACTIVE]).secret
    assert wait_until(lambda: _served(srv, admin_key) and _served(srv, scoped_key), timeout=10)
    for mode in (proxy.refuse, proxy.blackhole):
        mode()
        try:
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda i: _call(srv.url, (admin_key, scoped_key)[i % 2]), range(40)))
            assert [s for s, _ in results] == [200] * 40, [b for s, b in results if s != 200][:2]
            # A wrong secret for a known prefix is refused from memory; so is a malformed key.
            status, body = _call(srv.url, scoped_key[:-2] + "xx")
            assert status == 401 and body["error"]["message"] == "invalid API key"
            assert _call(srv.url, "not-a-key")[0] == 401
            # A prefix this server has never seen may be a key created a moment ago: it cannot tell.
            status, body = _call(srv.url, "lpx_0123456789ab_" + "x" * 43)
            assert status == 503 and body["error"]["code"] == "registry_unavailable", body
            assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 503
        finally:
            proxy.restore()
    assert wait_until(lambda: httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200, timeout=30)
    assert _call(srv.url, "lpx_0123456789ab_" + "x" * 43)[0] == 401


def test_a_key_revoked_elsewhere_stops_within_a_second_even_while_the_database_is_away(keyed):
    srv, proxy, other = keyed
    secret = other.keys.create("revoked-elsewhere", adapters=[ACTIVE]).secret
    assert wait_until(lambda: _served(srv, secret), timeout=10)
    proxy.blackhole()  # this server cannot read the database: only the event can tell it
    try:
        assert _served(srv, secret)
        other.keys.revoke("revoked-elsewhere")  # another server: committed, published on Redis
        t0 = time.monotonic()
        assert wait_until(lambda: not _served(srv, secret), timeout=5, interval=0.05)
        assert time.monotonic() - t0 < 1.0
        status, body = _call(srv.url, secret)
        assert status == 401 and body["error"]["message"] == "invalid API key"
    finally:
        proxy.restore()
    # The database's view agrees once it is back (a resync never resurrects a revoked key).
    resyncs = srv.state.key_cache.resyncs
    assert wait_until(lambda: srv.state.key_cache.resyncs > resyncs, timeout=20)
    assert _call(srv.url, secret)[0] == 401
