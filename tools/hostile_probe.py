"""Send the hostile requests of issues 14 and 25 to a running loraplex server, timing each answer.

    .venv/bin/python tools/hostile_probe.py --url http://127.0.0.1:8000 [--innocent-adapter upper]

For every attack an innocent greedy request on another adapter runs at the same time; the report shows
the attack's status and time to answer, whether the innocent request still got its expected text, the
worst /health latency seen meanwhile, and the engine restart counter. Bodies are streamed from
generators, so the probe itself never holds a large body in memory. Loopback only.
"""

from __future__ import annotations

import argparse
import os
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


# ---- issue 25, items 6-8: unreadable lora_path, strict types, probing adapter names ----------------------
# Kept apart from the list above (other items of issue 25 add theirs there). The admin routes need
# `--admin-token`; item 8 also needs a server started with `--require-api-key` (the probe creates a key
# scoped to an adapter that does not exist, so it may use no adapter: another key's active adapter and a
# missing name must then get the same 404).


def issue25_api_attacks(
    url: str, admin_token: str | None, adapter: str
) -> list[tuple[str, Callable[[httpx.Client], httpx.Response]]]:
    """Items 6-8 of issue 25; each expects a 4xx (6, 7: 400; 8: the same 404 for both names)."""
    admin = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    comp = f"{url}/v1/completions"
    chat = f"{url}/v1/chat/completions"
    base = {"model": adapter, "prompt": "a", "max_tokens": 1}
    msgs = {"model": adapter, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    key: dict[str, str] = {}
    run = int(time.time() * 1000) % 10**9  # names of this run's keys

    def scoped_key(c: httpx.Client) -> dict[str, str]:
        """A key of this probe run, scoped to an adapter name that does not exist (created once)."""
        if "secret" not in key:
            name = f"probe25-{run}"
            r = c.post(
                f"{url}/admin/api/keys", json={"name": name, "adapters": ["probe25-none"]}, headers=admin
            )
            r.raise_for_status()
            key.update(name=name, secret=r.json()["secret"])
        return {"authorization": f"Bearer {key['secret']}"}

    def post(path: str, body: dict, headers: dict | None = None) -> Callable[[httpx.Client], httpx.Response]:
        return lambda c: c.post(path, json=body, headers=admin if headers is None else headers)

    def key_limits(body: dict) -> Callable[[httpx.Client], httpx.Response]:
        # On the probe's own key (never the innocent adapter: an unfixed server would set the limit).
        def send(c: httpx.Client) -> httpx.Response:
            scoped_key(c)
            return c.patch(f"{url}/admin/api/keys/{key['name']}/limits", json=body, headers=admin)

        return send

    def as_scoped(model: str) -> Callable[[httpx.Client], httpx.Response]:
        return lambda c: c.post(comp, json=base | {"model": model}, headers=scoped_key(c))

    load = f"{url}/v1/load_lora_adapter"
    return [
        (
            "25.6 lora_path component of 300 chars",
            post(load, {"lora_name": "p25", "lora_path": "/tmp/" + "a" * 300}),
        ),
        ("25.6 lora_path with a NUL byte", post(load, {"lora_name": "p25", "lora_path": "/tmp/a\0b"})),
        ("25.7 limits PATCH rpm=true", key_limits({"requests_per_minute": True})),
        ('25.7 limits PATCH max_concurrent="2"', key_limits({"max_concurrent": "2"})),
        ("25.7 echo=1", post(comp, base | {"echo": 1})),
        ('25.7 echo="yes"', post(comp, base | {"echo": "yes"})),
        ('25.7 max_tokens="1"', post(comp, base | {"max_tokens": "1"})),
        ("25.7 n=true", post(comp, base | {"n": True})),
        ('25.7 stream="false"', post(comp, base | {"stream": "false"})),
        ('25.7 parallel_tool_calls="false"', post(chat, msgs | {"parallel_tool_calls": "false"})),
        (
            '25.7 key admin="true"',
            post(f"{url}/admin/api/keys", {"name": f"probe25-admin-{run}", "admin": "true"}),
        ),
        ("25.8 scoped key: another's adapter", as_scoped(adapter)),
        ("25.8 scoped key: unknown adapter", as_scoped("probe25-missing")),
    ]


# ---- end of issue 25 items 6-8 ----------------------------------------------------------------------------


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


def innocent(url: str, adapter: str, out: dict, token: str | None = None) -> None:
    body = {"model": adapter, "prompt": "hello world=", "max_tokens": 16, "temperature": 0, "stop": ["\n"]}
    headers = {"authorization": f"Bearer {token}"} if token else {}  # a server that requires keys
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
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
    ap.add_argument("--admin-token", default=os.environ.get("LORAPLEX_ADMIN_TOKEN"), help="for admin routes")
    args = ap.parse_args()
    print(f"{'attack':40} {'status':>6} {'secs':>7}  innocent ok  worst /health s  restarts")
    chosen = {int(i) for i in args.only.split(",") if i}
    chosen_attacks = [
        *attacks(args.url),
        *issue25_api_attacks(args.url, args.admin_token, args.innocent_adapter),
        *structured_attacks(args.url),
    ]
    for i, (name, send) in enumerate(chosen_attacks, start=1):
        if chosen and i not in chosen:
            continue
        result: dict = {}
        health: dict = {}
        stop = threading.Event()
        watcher = threading.Thread(target=health_watch, args=(args.url, stop, health))
        bystander = threading.Thread(
            target=innocent, args=(args.url, args.innocent_adapter, result, args.admin_token)
        )
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
