"""kill -9 of the engine process under load, on a real server.

Every request in flight ends promptly with a retryable 503 (streams already under way: an SSE error
event, then `[DONE]`); none hangs. The engine process is restarted (forked from the preloaded forkserver)
and `/health` is back; the new engine gives the same exact answers. The restart time is recorded
(docs/operations.md); the bound asserted here is generous because the test machine is shared.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers.live_server import start_server, wait_until

pytestmark = pytest.mark.slow  # a live server

CLIENTS = 12
RESTART_BOUND = 60.0  # seconds; the goal on an idle machine is <= 5 s (see docs/operations.md)


def _request(url: str, i: int, out: list, started: threading.Event) -> None:
    body = {"prompt": f"kill {i}", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    try:
        if i % 2:
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=90) as r:
                lines = [line for line in _mark(r.iter_lines(), started) if line]
                out.append(("stream", r.status_code, lines))
        else:
            started.set()
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=90)
            out.append(("json", r.status_code, r.text))
    except httpx.HTTPError as exc:
        out.append(("broken", 0, repr(exc)))


def _mark(lines, started: threading.Event):
    for line in lines:
        started.set()
        yield line


def test_engine_kill_under_load_ends_requests_and_restarts(text_model, tmp_path):
    base = text_model[0]
    # One client address for all: its share must not hold requests back from the engine.
    srv = start_server(
        base, tmp_path / "data", settings_overrides={"max_seqs_per_client": 64}, max_num_seqs=4
    )
    try:
        url = srv.url
        probe = {"prompt": "same answer", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        before = httpx.post(f"{url}/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
        results: list = []
        started = threading.Event()
        threads = [threading.Thread(target=_request, args=(url, i, results, started)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        assert started.wait(60)
        assert wait_until(lambda: srv.state.client.num_in_flight() > 0, timeout=30)
        # Short requests fired without pause across the kill: some reach the server in the moment the
        # engine is dead but not yet found dead.
        stop, late = threading.Event(), []
        firing = [threading.Thread(target=_fire, args=(url, stop, late)) for _ in range(3)]
        for t in firing:
            t.start()
        time.sleep(0.2)
        old_pid = srv.state.client.pid
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a request hung after the engine died"
        ended = time.monotonic() - killed
        assert wait_until(lambda: _healthy(url), timeout=RESTART_BOUND), "health did not come back"
        back = time.monotonic() - killed
        stop.set()
        for t in firing:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in firing), "a request sent around the kill hung"
        assert late and all(status in (200, 503) for status in late), late
        client = srv.state.client
        assert client.pid != old_pid and client.restarts == 1
        print(f"\nengine kill -9: requests ended {ended:.2f}s after, /health back {back:.2f}s after; "
              f"engine process start {client.last_start_seconds:.2f}s")  # fmt: skip
        assert len(results) == CLIENTS
        dead = 0
        for kind, status, body in results:
            assert kind != "broken", body
            if status == 503:
                assert (
                    json.loads(body if kind == "json" else "".join(body))["error"]["type"]
                    == "service_unavailable"
                )
                dead += 1
            elif kind == "stream" and status == 200 and "error" in body[-2]:
                assert body[-1] == "data: [DONE]"
                assert json.loads(body[-2].removeprefix("data: "))["error"]["type"] == "service_unavailable"
                dead += 1
            else:
                assert status == 200, (kind, status, body)  # finished before the kill
        assert dead > 0
        after = httpx.post(f"{url}/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
        assert after == before
    finally:
        srv.stop()


def _fire(url: str, stop: threading.Event, statuses: list) -> None:
    """Short completions back to back until `stop`; appends each status (0: no proper answer)."""
    body = {"prompt": "quick", "max_tokens": 2, "temperature": 0}
    while not stop.is_set():
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            ok = r.status_code == 200 or r.json()["error"]["type"] == "service_unavailable"
            statuses.append(r.status_code if ok else 0)
        except (httpx.HTTPError, ValueError) as exc:
            statuses.append(repr(exc))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_request_sent_as_the_engine_dies_does_not_hang(text_model):
    """A PUSH socket whose peer is gone blocks a send; a request sent between the engine's death and its
    detection must still end (503 material: engine dead or restarting), never wait forever."""
    from api.engine_client import EngineClient, EngineDeadError, EngineUnavailableError
    from api.engine_protocol import AddRequest
    from engine.engine_config import EngineConfig
    from engine.sampling_params import SamplingParams

    async def run() -> list[str]:
        cfg = EngineConfig(model=str(text_model[0]), device="cpu", dtype="float32", num_kv_blocks=64)
        client = EngineClient(cfg)
        await client.start()
        outcomes = []
        try:
            for attempt in range(3):
                os.kill(client.pid, signal.SIGKILL)
                time.sleep(0.05)  # dead, and (most likely) not yet noticed by the 0.2 s monitor
                req = AddRequest(f"r{attempt}", [5, 6, 7], SamplingParams(max_tokens=4))
                try:
                    async with asyncio.timeout(20):
                        async for _ in client.generate(req):
                            pass
                    outcomes.append("ok")
                except (EngineDeadError, EngineUnavailableError) as exc:
                    outcomes.append(type(exc).__name__)
                async with asyncio.timeout(60):
                    while not client.healthy:
                        await asyncio.sleep(0.05)
        finally:
            await client.shutdown()
        return outcomes

    outcomes = asyncio.run(run())
    assert set(outcomes) <= {"EngineDeadError", "EngineUnavailableError"}, outcomes
