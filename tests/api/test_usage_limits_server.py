"""Usage accounting and rate limits on real servers, driven with the official `openai` client.

- One server whose Redis is unreachable: limits fail open (and count it), and the usage of every
  request (streamed or not, n > 1, per key and adapter) is written at graceful shutdown, its totals
  equal to the sum of the responses' `usage` fields.
- Two servers sharing a data dir and a real Redis (as two replicas): a limit set on one holds on both;
  a concurrent burst passes a tokens/minute limit by at most one request's tokens; 429s carry the
  OpenAI error body, `Retry-After` and `x-ratelimit-*`; a concurrency slot is freed when a streaming
  client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from lora_registry import RegistrySettings, open_registry
from lora_registry.events import InProcessBus
from tests.helpers.live_server import LiveServer, free_port, start_server, wait_until
from tests.helpers.redis_service import require_redis
from tests.helpers.served import SERVED_ADAPTERS, register

pytestmark = pytest.mark.slow  # live servers

ADAPTER = SERVED_ADAPTERS[0]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # token ids: 8 prompt tokens


def registry_of(data_dir, model):
    env = {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_MODEL": str(model)}
    return open_registry(RegistrySettings.from_env(env), bus=InProcessBus())


def client(server: LiveServer, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, **kw)


def test_usage_is_exact_and_flushed_at_shutdown_and_limits_fail_open(text_model, tmp_path) -> None:
    base, adapters, _ = text_model
    data = tmp_path / "data"
    for name in SERVED_ADAPTERS:
        register(data, base, name, adapters[name])
    reg = registry_of(data, base)
    try:
        keys = {n: reg.keys.create(n, admin=True).secret for n in ("team-a", "team-b")}
        reg.limits.set("adapter", ADAPTER, requests_per_minute=1)  # enforced only through Redis: down
    finally:
        reg.close()
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    env = {"LORAPLEX_REDIS_URL": dead_redis, "LORAPLEX_USAGE_FLUSH_SECONDS": "3600"}
    server = start_server(base, data, settings_overrides={"require_api_key": True}, env=env)
    expected: Counter = Counter()
    try:
        a, b = client(server, keys["team-a"]), client(server, keys["team-b"])
        for i in range(3):  # over the 1/minute limit: admitted because Redis is unreachable (fail-open)
            r = a.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=3 + i, temperature=0)
            expected[("team-a", ADAPTER)] += r.usage.total_tokens
        r = a.completions.create(model=ADAPTER, prompt=[PROMPT, PROMPT[:3]], max_tokens=4, n=2, seed=1)
        expected[("team-a", ADAPTER)] += r.usage.total_tokens
        stream = b.chat.completions.create(
            model=SERVED_ADAPTERS[1],
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        expected[("team-b", SERVED_ADAPTERS[1])] += usage[0].total_tokens
        r = b.completions.create(model=server.state.settings.served_model_name, prompt=PROMPT, max_tokens=2)
        expected[("team-b", None)] += r.usage.total_tokens
        metrics = server.admin().get("/metrics").text
        assert _metric(metrics, "loraplex_rate_limit_backend_errors_total") >= 1
        reg = registry_of(data, base)
        try:  # nothing written yet: the writer flushes once an hour in this test
            end = datetime.now(UTC) + timedelta(minutes=1)
            assert reg.usage.summary("key", end - timedelta(hours=1), end).rows == ()
        finally:
            reg.close()
    finally:
        server.stop()  # graceful: the queued records are written before the server exits
    reg = registry_of(data, base)
    try:
        end = datetime.now(UTC) + timedelta(minutes=1)
        got: Counter = Counter()
        requests: Counter = Counter()
        for key in ("team-a", "team-b"):
            for row in reg.usage.summary("adapter", end - timedelta(hours=1), end, api_key=key).rows:
                got[(key, row.name)] += row.total_tokens
                requests[key] += row.requests
        assert got == expected
        assert requests == {"team-a": 4, "team-b": 2}
    finally:
        reg.close()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def pair(text_model, tmp_path_factory):
    """Two servers on one data dir (SQLite) sharing a real Redis for events and limits."""
    url = require_redis()
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("pair-data")
    for name in SERVED_ADAPTERS:
        register(data, base, name, adapters[name])
    env = {"LORAPLEX_REDIS_URL": url}
    first = start_server(base, data, env=env)
    try:
        second = start_server(base, data, env=env)
    except BaseException:
        first.stop()
        raise
    _clear_redis_limits(url)
    yield first, second
    second.stop()
    first.stop()


def _clear_redis_limits(url: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    for k in r.scan_iter("loraplex:rl:*"):
        r.delete(k)
    r.close()


def test_burst_over_two_replicas_stays_within_one_request_of_the_limit(pair) -> None:
    first, second = pair
    tpm, max_tokens = 600, 10
    cost = len(PROMPT) + max_tokens
    with first.admin() as admin:
        r = admin.patch(f"/admin/api/adapters/{ADAPTER}/limits", json={"tokens_per_minute": tpm})
        assert r.status_code == 200 and r.json()["tokens_per_minute"] == tpm
    assert wait_until(lambda: second.state.usage.limiter.table.get("adapter", ADAPTER) is not None, 10)

    async def one(url: str):
        body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as c:
            return await c.post(f"{url}/v1/completions", json=body)

    async def burst():
        return await asyncio.gather(*(one(s.url) for s in (first, second) for _ in range(30)))

    t0 = time.monotonic()
    answers = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(refused) == len(answers) and refused
    assert all(a.json()["usage"]["total_tokens"] == cost for a in ok)  # ignore_eos: nothing refunded
    assert len(ok) * cost <= tpm + tpm / 60 * elapsed + cost
    assert len(ok) >= tpm // cost  # and the bucket's capacity was really usable
    r = refused[0]
    assert (
        r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "rate_limit_exceeded"
    )
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-limit-tokens"] == str(tpm)
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < cost
    assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert ok[0].headers["x-ratelimit-limit-tokens"] == str(tpm)  # admitted answers carry them too
    with first.admin() as admin:
        admin.patch(f"/admin/api/adapters/{ADAPTER}/limits", json={"tokens_per_minute": 0})


def test_429_through_the_openai_client_and_concurrency_freed_on_disconnect(pair) -> None:
    first, second = pair
    with first.admin() as admin:
        r = admin.patch(f"/admin/api/adapters/{SERVED_ADAPTERS[2]}/limits", json={"max_concurrent": 1})
        assert r.status_code == 200
    assert wait_until(lambda: second.state.usage.limiter.table.get("adapter", SERVED_ADAPTERS[2]), 10)
    with _stalled_stream(first, SERVED_ADAPTERS[2]) as sock:  # holds the adapter's only slot
        with pytest.raises(openai.RateLimitError) as refused:
            client(second, "unused").completions.create(model=SERVED_ADAPTERS[2], prompt=PROMPT, max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"
        assert "concurrent" in refused.value.message
        assert sock.recv(12) == b"HTTP/1.1 200"
    # the client went away mid-stream: the slot is released on both replicas
    ok = client(second, "unused").completions
    assert wait_until(lambda: _tries(ok), 20, 0.5)
    with first.admin() as admin:
        admin.patch(f"/admin/api/adapters/{SERVED_ADAPTERS[2]}/limits", json={"max_concurrent": 0})


@contextlib.contextmanager
def _stalled_stream(server: LiveServer, adapter: str):
    """A streaming request whose client reads nothing (a tiny receive window) and then disconnects: its
    events (64 choices × 240 tokens with logprobs, megabytes) cannot all leave, so it keeps running."""
    body = json.dumps(
        {"model": adapter, "prompt": PROMPT, "max_tokens": 240, "n": 64, "logprobs": 5}
        | {"stream": True, "ignore_eos": True}
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        assert wait_until(lambda: server.state.client.num_in_flight() > 0, 10)
        yield sock
    finally:
        sock.close()


def _tries(completions) -> bool:
    try:
        completions.create(model=SERVED_ADAPTERS[2], prompt=PROMPT, max_tokens=2)
    except openai.RateLimitError:
        return False
    return True


def test_admin_usage_api_and_limit_validation(pair) -> None:
    first, _ = pair
    body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": 3}
    done = httpx.post(f"{first.url}/v1/completions", json=body, timeout=60)
    assert done.status_code == 200
    with first.admin() as admin:
        for s in pair:
            assert s.state.usage.recorder.flush()
        r = admin.get("/admin/api/usage", params={"by": "adapter", "bucket": "hour"})
        assert r.status_code == 200
        rows = r.json()["rows"]
        assert rows and all(row["bucket"] and row["total_tokens"] >= 0 for row in rows)
        assert {row["name"] for row in rows} >= {ADAPTER}
        assert admin.get("/admin/api/usage", params={"by": "model"}).status_code == 400
        assert admin.get("/admin/api/usage", params={"from": "yesterday"}).status_code == 400
        bad = admin.patch(f"/admin/api/adapters/{ADAPTER}/limits", json={"requests_per_minute": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "requests_per_minute"
        assert admin.patch("/admin/api/adapters/nope/limits", json={"max_concurrent": 1}).status_code == 404
    assert httpx.get(f"{first.url}/admin/api/usage").status_code == 401
