"""A lone client's burst on a live server with a small engine (default fair-share admission): every
request is answered 200 when the engine can drain the burst within the wait; when it cannot, the 429s
come no later than the wait after the request arrived (reading a slow body counts) and say what the
client really runs."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.helpers.live_server import start_server

pytestmark = pytest.mark.slow  # live servers

TINY = {"prompt": "hi", "max_tokens": 1, "temperature": 0}


async def _burst(url: str, n: int, body: dict) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


def test_a_lone_clients_burst_is_all_answered(text_model, tmp_path):
    base = text_model[0]
    srv = start_server(base, tmp_path / "data", max_num_seqs=4)
    try:
        t0 = time.monotonic()
        answers = asyncio.run(_burst(srv.url, 300, TINY | {"model": srv.state.settings.served_model_name}))
        took = time.monotonic() - t0
        statuses = [r.status_code for r in answers]
        assert statuses == [200] * 300, ({s: statuses.count(s) for s in set(statuses)}, answers[-1].text)
        assert srv.state.admission.total_in_use() == 0 and srv.state.admission.clients() == 0
        assert took < 60, took
    finally:
        srv.stop()


def _trickled(port: int, body: bytes, seconds: float) -> tuple[int, dict, float]:
    """POST `body` sending it a byte at a time over `seconds`; (status, JSON answer, seconds since the
    request's first byte)."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        t0 = time.monotonic()
        sock.sendall(head)
        for i in range(len(body)):
            time.sleep(seconds / len(body))
            sock.sendall(body[i : i + 1])
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
        took = time.monotonic() - t0
    status = int(raw.split(b" ", 2)[1])
    return status, json.loads(raw.split(b"\r\n\r\n", 1)[1]), took


def test_the_wait_counts_from_arrival_and_the_429_tells_the_truth(text_model, tmp_path):
    base = text_model[0]
    # 2 sequences: 1 guaranteed to a client, 1 kept free for newcomers, so one client runs 1 at a time.
    srv = start_server(
        base, tmp_path / "data", max_num_seqs=2, settings_overrides={"client_wait_seconds": 1.0}
    )
    model = srv.state.settings.served_model_name
    port = int(srv.url.rsplit(":", 1)[1])
    try:

        async def scene() -> tuple[list[httpx.Response], tuple[int, dict, float]]:
            """Keep the client's line full (a new long request every 50 ms) while a slow one arrives."""
            long = TINY | {"model": model, "max_tokens": 200, "ignore_eos": True}
            answers: list[httpx.Response] = []
            done = asyncio.Event()

            async def feed(client: httpx.AsyncClient) -> None:
                tasks = []
                while not done.is_set():
                    tasks.append(asyncio.ensure_future(client.post("/v1/completions", json=long)))
                    await asyncio.sleep(0.05)
                answers.extend(await asyncio.gather(*tasks))

            limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
                feeder = asyncio.ensure_future(feed(client))
                await asyncio.sleep(1.5)
                body = json.dumps(TINY | {"model": model}).encode()
                slow = await asyncio.to_thread(_trickled, port, body, 2.0)
                done.set()
                await feeder
            return answers, slow

        answers, (status, err, took) = asyncio.run(scene())
        # The slow request spent 2 s arriving: its 1 s wait was over once it could be admitted.
        assert status == 429, err
        assert 2.0 <= took < 2.0 + 0.9, took
        message = err["error"]["message"]
        assert "already runs 1 sequences (guaranteed 1)" in message, message
        refused = [r.json()["error"]["message"] for r in answers if r.status_code == 429]
        assert refused and all("already runs 1 sequences (guaranteed 1)" in m for m in refused), refused[:2]
        assert {r.status_code for r in answers} <= {200, 429}
    finally:
        srv.stop()
