"""Requests in flight while a server shuts down, and what each may end as (SIGTERM tests)."""

from __future__ import annotations

import json
import threading
import time

import httpx


def healthy(url: str) -> bool:
    """Whether `url`'s `/health` answers 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def one_long_request(url: str, i: int, out: list, started: threading.Event, max_tokens: int) -> None:
    """One completion of `max_tokens` tokens (streamed for odd `i`, which sets `started` at its first
    line); appends (kind, status, content type, body, end time) to `out`."""
    body = {"prompt": f"bye {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        if i % 2:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120
            ) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
                out.append(
                    ("stream", r.status_code, r.headers.get("content-type", ""), lines, time.monotonic())
                )
        else:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            out.append(("json", r.status_code, r.headers.get("content-type", ""), r.text, time.monotonic()))
    except httpx.HTTPError as exc:  # a connection reset or a truncated body is a failure of the test
        out.append(("broken", 0, "", repr(exc), time.monotonic()))


def check_outcome(kind: str, status: int, ctype: str, body, cut: list) -> None:
    """Assert one response is complete or cleanly cut; record the cut ones in `cut`."""
    if status != 200:
        assert status == 503 and ctype.startswith("application/json"), (kind, status, ctype, body)
        err = json.loads(body if kind == "json" else "".join(body))["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "server_shutting_down", err
        cut.append(kind)
        return
    if kind == "json":
        assert json.loads(body)["choices"][0]["finish_reason"] == "length"
        return
    assert body[-1] == "data: [DONE]", body[-3:]  # never a stream cut mid-body
    last = json.loads(body[-2].removeprefix("data: "))
    if "error" in last:
        assert last["error"]["type"] == "service_unavailable", last
        cut.append("stream-event")
    else:
        assert last["choices"][0]["finish_reason"] == "length", last
