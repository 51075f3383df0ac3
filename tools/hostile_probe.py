"""Send the hostile requests of issues 14 and 25 to a running loraplex server, timing each answer.

    .venv/bin/python tools/hostile_probe.py --url http://127.0.0.1:8000 [--innocent-adapter upper]

For every attack an innocent greedy request on another adapter runs at the same time; the report shows
the attack's status and time to answer, whether the innocent request still got its expected text, the
worst /health latency seen meanwhile, and the engine restart counter. Bodies are streamed from
generators, so the probe itself never holds a large body in memory. Loopback only.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator

import httpx

MB = 1024 * 1024


def _stream(prefix: bytes, filler: bytes, size: int, suffix: bytes) -> Iterator[bytes]:
    yield prefix
    sent, chunk = 0, filler * (MB // len(filler))
    while sent < size:
        yield chunk
        sent += len(chunk)
    yield suffix


def attacks(url: str) -> list[tuple[str, Callable[[httpx.Client], httpx.Response]]]:
    big = 2**63
    comp = f"{url}/v1/completions"
    chat = f"{url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]

    def post(path: str, body: dict) -> Callable[[httpx.Client], httpx.Response]:
        return lambda c: c.post(path, json=body)

    return [
        (
            "top_k=2**63 (engine crash)",
            post(comp, {"prompt": "a", "top_k": big, "temperature": 1, "max_tokens": 1}),
        ),
        ("5 MB prompt (event loop)", post(comp, {"prompt": "a" * (5 * MB), "max_tokens": 1})),
        (
            "200 MB body to /v1/completions",
            lambda c: c.post(
                comp,
                content=_stream(b'{"prompt":"', b"a", 200 * MB, b'","max_tokens":1}'),
                headers={"content-type": "application/json"},
            ),
        ),
        (
            "100 MB JSON to admin route, no token",
            lambda c: c.post(
                f"{url}/admin/api/keys",
                content=_stream(b'{"name":"', b"a", 100 * MB, b'"}'),
                headers={"content-type": "application/json"},
            ),
        ),
        (
            "100 MB multipart upload, no token",
            lambda c: c.post(
                f"{url}/admin/api/adapters",
                content=_stream(
                    b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\n',
                    b"\0",
                    100 * MB,
                    b"\r\n--x--\r\n",
                ),
                headers={"content-type": "multipart/form-data; boundary=x"},
            ),
        ),
        (
            "15 MB of token ids (JSON parse)",
            lambda c: c.post(
                comp,
                content=_stream(b'{"prompt":[', b"1,", 15 * MB, b'1],"max_tokens":1}'),
                headers={"content-type": "application/json"},
            ),
        ),
        ("fan-out 50 prompts x n=64", post(comp, {"prompt": ["ab="] * 50, "n": 64, "max_tokens": 8})),
        ("max_tokens=2**63", post(comp, {"prompt": "a", "max_tokens": big})),
        ("seed=2**63", post(comp, {"prompt": "a", "seed": big, "max_tokens": 1})),
        ("seed=-2**63-1", post(comp, {"prompt": "a", "seed": -big - 1, "max_tokens": 1})),
        ("priority=2**63", post(comp, {"prompt": "a", "priority": big, "max_tokens": 1})),
        ("stop_token_ids=[2**63]", post(comp, {"prompt": "a", "stop_token_ids": [big], "max_tokens": 1})),
        ("stop_token_ids=[-1]", post(comp, {"prompt": "a", "stop_token_ids": [-1], "max_tokens": 1})),
        ("chat max_completion_tokens=2**63", post(chat, {"messages": msgs, "max_completion_tokens": big})),
        ("chat max_completion_tokens=-1", post(chat, {"messages": msgs, "max_completion_tokens": -1})),
        ("audit limit=1e20", lambda c: c.get(f"{url}/admin/api/audit", params={"limit": 10**20})),
    ]


# ---- issue 25, items 1-5: structured output (schemas, tools) -------------------------------------------


def _props(tag: str, n: int, required: bool) -> dict:
    """An object schema of `n` properties named `tag0`... (~60 KiB at n=2,500)."""
    names = [f"{tag}{i}" for i in range(n)]
    schema: dict = {"type": "object", "properties": {k: {"type": "string"} for k in names}}
    return schema | {"required": names} if required else schema


def structured_attacks(url: str) -> list[tuple[str, Callable[[httpx.Client], httpx.Response]]]:
    """Schemas that were compiled on the event loop, before the limits (1), a forced call over 64 KiB
    (2), schemas llguidance refuses only while decoding (3), pydantic `$defs` (4), a self-`$ref` (5)."""
    comp = f"{url}/v1/completions"
    chat = f"{url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]

    def tools(n: int, size: int = 1700) -> list[dict]:
        fn = [{"name": f"f{i}", "parameters": _props(f"a{i}_", size, True)} for i in range(n)]
        return [{"type": "function", "function": f} for f in fn]

    def fmt(schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    def post(path: str, body: dict) -> Callable[[httpx.Client], httpx.Response]:
        return lambda c: c.post(path, json=body)

    segment = {
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/P"}, "end": {"$ref": "#/$defs/P"}},
        "required": ["start", "end"],
    }
    draw = [{"type": "function", "function": {"name": "draw", "parameters": segment}}]
    by_name = {"type": "function", "function": {"name": "draw"}}
    x60000 = {"type": "string", "pattern": "^x{60000}$"}
    return [
        ("8 tools x ~60 KiB schemas (chat)", post(chat, {"messages": msgs, "tools": tools(8)})),
        ("128 tools x ~60 KiB (7.5 MB body)", post(chat, {"messages": msgs, "tools": tools(128)})),
        (
            "forced call, combined schema > 64 KiB",
            post(chat, {"messages": msgs, "tools": tools(2, 1300), "tool_choice": "required"}),
        ),
        (
            "response_format 2,500 optional properties",
            post(comp, {"prompt": "a", "max_tokens": 4, "response_format": fmt(_props("p", 2500, False))}),
        ),
        (
            'response_format pattern "^x{60000}$"',
            post(comp, {"prompt": "a", "max_tokens": 4, "response_format": fmt(x60000)}),
        ),
        (
            "forced tool with pydantic $defs/$ref (200)",
            post(chat, {"messages": msgs, "max_tokens": 64, "tools": draw, "tool_choice": by_name}),
        ),
        (
            'response_format {"$ref": "#"}',
            post(comp, {"prompt": "a", "max_tokens": 4, "response_format": fmt({"$ref": "#"})}),
        ),
    ]


def innocent(url: str, adapter: str, out: dict) -> None:
    body = {"model": adapter, "prompt": "hello world=", "max_tokens": 16, "temperature": 0, "stop": ["\n"]}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        out["text"] = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"
    except Exception as exc:  # reported, not raised: the probe measures
        out["text"] = f"error: {exc!r}"


def health_watch(url: str, stop: threading.Event, out: dict) -> None:
    worst = 0.0
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            code = httpx.get(f"{url}/health", timeout=120).status_code
        except httpx.HTTPError:
            code = 0
        worst = max(worst, time.monotonic() - t0)
        out["worst"] = worst
        out["bad"] = out.get("bad", 0) + (code != 200)
        stop.wait(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--innocent-adapter", default="upper")
    ap.add_argument("--expected", default="HELLO WORLD")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--only", default="", help="comma-separated attack numbers to run (1-based)")
    args = ap.parse_args()
    print(f"{'attack':40} {'status':>6} {'secs':>7}  innocent ok  worst /health s  restarts")
    chosen = {int(i) for i in args.only.split(",") if i}
    for i, (name, send) in enumerate([*attacks(args.url), *structured_attacks(args.url)], start=1):
        if chosen and i not in chosen:
            continue
        result: dict = {}
        health: dict = {}
        stop = threading.Event()
        watcher = threading.Thread(target=health_watch, args=(args.url, stop, health))
        bystander = threading.Thread(target=innocent, args=(args.url, args.innocent_adapter, result))
        watcher.start()
        bystander.start()
        t0 = time.monotonic()
        try:
            with httpx.Client(timeout=args.timeout) as c:
                status = str(send(c).status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__[:6]
        secs = time.monotonic() - t0
        bystander.join(timeout=args.timeout)
        stop.set()
        watcher.join()
        try:
            restarts = httpx.get(f"{args.url}/health", timeout=120).json().get("engine_restarts")
        except Exception:
            restarts = "?"
        ok = result.get("text") == args.expected
        print(f"{name:40} {status:>6} {secs:7.2f}  {ok!s:11}  {health.get('worst', 0):15.2f}  {restarts}")
        if not ok:
            print(f"    innocent got {result.get('text')!r}")
        # give a restarting engine time to come back before the next attack
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{args.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)


if __name__ == "__main__":
    main()
