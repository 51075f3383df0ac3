"""Soak: a steady trickle of requests (some cancelled by their client) against one server; RSS slope.

    python -m bench.serving.soak --duration 120 --rate 1 --cancel 0.05

Starts `loraplex serve` on the demo model (`demo/base`) with the four demo adapters on a free loopback
port, sends `--rate` requests per second for `--duration` seconds (a mix of the base model and the
adapters, completions and chat, streamed or not, a few JSON-constrained; a fraction `--cancel` of them
dropped by the client part-way: a stream closed after its first chunk, a plain request abandoned before
its answer), samples the resident set size of the API process and of the engine process every
`--sample-every` seconds, and reports each one's slope (MiB per minute, least squares) over the samples
taken after `--warmup` seconds. A process that keeps per-request state shows a steady positive slope.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.common.progress import progress
from bench.serving.server_process import free_port, loraplex_cmd, loraplex_env, serving

DEMO = Path(__file__).resolve().parents[2] / "demo"
ADAPTERS = ("rot13", "upper", "reverse", "novowels")
MAX_DURATION = 3600.0  # the loop stops by itself, whatever is asked


@dataclass(slots=True)
class ProcessRss:
    """One process's RSS samples (seconds since the start, MiB) and the slope after the warm-up."""

    role: str
    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)
    slope_mib_per_min: float = 0.0
    late_slope_mib_per_min: float = 0.0  # over the second half of the samples after the warm-up
    first_mib: float = 0.0
    last_mib: float = 0.0


@dataclass(slots=True)
class SoakResult:
    duration: float
    warmup: float
    rate: float
    cancel: float
    sent: int
    ok: int
    cancelled: int
    failed: int
    processes: list[ProcessRss]


def rss_mib(pid: int) -> float | None:
    """The resident set size of process `pid` in MiB (from /proc), None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    todo, seen = [pid], []
    while todo:
        for c in _children(todo.pop()):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


def server_pids(port: int) -> tuple[int, int]:
    """(API process, engine process) of the `loraplex serve --port PORT` running here: the API process is
    the one with that command line, the engine the largest process below it (the others are helpers)."""
    api = None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            api = int(proc.name)
            break
    if api is None:
        raise RuntimeError(f"no loraplex serve process on port {port}")
    below = [(rss_mib(p) or 0.0, p) for p in descendants(api)]
    if not below:
        raise RuntimeError("the server has no engine process")
    return api, max(below)[1]


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute (0 with fewer than two)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var


def _text(rng: random.Random) -> str:
    """A prompt from the demo models' input distribution: 1-3 lowercase words, at most 24 characters."""
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))]
    words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 6)))][
        : rng.randint(0, 1)
    ]
    return " ".join(words)[:24]


def _request(rng: random.Random) -> tuple[str, dict]:
    """(path, JSON body) of one random request."""
    model = rng.choice(["demo-base", *ADAPTERS])
    body: dict = {
        "max_tokens": rng.randint(8, 32),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": rng.randint(0, 999),
    }
    if rng.random() < 0.5:
        body |= {"stream": True}
    if rng.random() < 0.3:
        path = "/v1/chat/completions"
        body |= {"messages": [{"role": "user", "content": _text(rng) + "="}]}
        if rng.random() < 0.2:
            body |= {"response_format": {"type": "json_object"}}
    else:
        path = "/v1/completions"
        body |= {"prompt": _text(rng) + "=", "stop": ["\n"]}
    return path, body | {"model": model}


async def _one(client: httpx.AsyncClient, path: str, body: dict, cancel_after: float | None) -> str:
    """Send one request; 'ok', 'failed' or 'cancelled' (the client gave up part-way on purpose)."""

    async def go() -> str:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return "failed"
                async for _ in r.aiter_lines():
                    if cancel_after is not None:
                        return "cancelled"  # closing the stream here disconnects mid-generation
            return "ok"
        r = await client.post(path, json=body)
        return "ok" if r.status_code == 200 else "failed"

    if cancel_after is None or body.get("stream"):
        return await go()
    try:
        return await asyncio.wait_for(go(), cancel_after)
    except TimeoutError:
        return "cancelled"


async def _drive(url: str, args: argparse.Namespace, on_tick, on_done) -> dict[str, int]:
    """Open-loop arrivals at `args.rate` per second for `args.duration` seconds; counts by outcome."""
    rng = random.Random(args.seed)
    counts = {"sent": 0, "ok": 0, "cancelled": 0, "failed": 0}
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        start = time.monotonic()
        next_at = start
        while (now := time.monotonic()) - start < args.duration:
            if now >= next_at:
                path, body = _request(rng)
                cancel_after = rng.uniform(0.01, 0.3) if rng.random() < args.cancel else None
                task = asyncio.create_task(_one(client, path, body, cancel_after))
                counts["sent"] += 1

                def done(t: asyncio.Task) -> None:
                    tasks.discard(t)
                    outcome = "failed" if t.cancelled() or t.exception() is not None else t.result()
                    counts[outcome] += 1
                    on_done()

                task.add_done_callback(done)
                tasks.add(task)
                next_at += rng.expovariate(args.rate)
            on_tick(now - start)
            await asyncio.sleep(min(0.05, max(0.0, next_at - time.monotonic())))
        if tasks:
            await asyncio.wait(tasks, timeout=120)
    return counts


def run_soak(args: argparse.Namespace) -> SoakResult:
    """Start the demo server, soak it, and return RSS slopes of its API and engine processes."""
    duration = min(args.duration, MAX_DURATION)
    args.duration = duration
    warmup = min(args.warmup, duration / 2)
    with tempfile.TemporaryDirectory(prefix="loraplex-soak-") as tmp:
        env = loraplex_env(Path(tmp), DEMO / "base", {n: DEMO / "adapters" / n for n in ADAPTERS})
        port = free_port()
        cmd = loraplex_cmd(DEMO / "base", port, threads=args.threads, max_loras=len(ADAPTERS))
        cmd += ["--served-model-name", "demo-base"]
        log = Path(tmp) / "server.log" if args.quiet_server else None
        with serving(cmd, env, port, "loraplex serve", log=log) as url:
            api, engine = server_pids(port)
            procs = [ProcessRss("api", api), ProcessRss("engine", engine)]
            last_sample = -1e9

            with progress(args.quiet) as bar:
                task = bar.add_task("soak", total=round(duration))

                def on_tick(elapsed: float) -> None:
                    nonlocal last_sample
                    bar.update(task, completed=min(round(elapsed), round(duration)))
                    if elapsed - last_sample >= args.sample_every:
                        last_sample = elapsed
                        for p in procs:
                            v = rss_mib(p.pid)
                            if v is not None:
                                p.samples.append((elapsed, v))

                counts = asyncio.run(_drive(url, args, on_tick, lambda: None))
    for p in procs:
        kept = [s for s in p.samples if s[0] >= warmup]
        p.slope_mib_per_min = slope_per_min(kept)
        p.late_slope_mib_per_min = slope_per_min(kept[len(kept) // 2 :])
        p.first_mib = kept[0][1] if kept else 0.0
        p.last_mib = kept[-1][1] if kept else 0.0
    return SoakResult(duration, warmup, args.rate, args.cancel, processes=procs, **counts)


def render(res: SoakResult) -> str:
    """The result as a markdown table."""
    lines = [
        f"{res.sent} requests over {res.duration:.0f} s at {res.rate:g}/s ({res.ok} ok, {res.cancelled} "
        f"cancelled by the client, {res.failed} failed); slope over the samples after {res.warmup:.0f} s",
        "",
        "| process | RSS after warm-up (MiB) | RSS at the end (MiB) | slope (MiB/min) | second half |",
        "|---|---|---|---|---|",
    ]
    for p in res.processes:
        lines.append(
            f"| {p.role} | {p.first_mib:.1f} | {p.last_mib:.1f} | {p.slope_mib_per_min:+.2f} "
            f"| {p.late_slope_mib_per_min:+.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.serving.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load, warm-up included")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds left out of the slope")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson arrivals)")
    ap.add_argument("--cancel", type=float, default=0.05, help="fraction of requests the client drops")
    ap.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="engine threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the result (with every sample) here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--quiet-server", action="store_true", help="server output to a log, not the terminal")
    args = ap.parse_args(argv)
    if not 0 < args.rate <= 100 or not 0 <= args.cancel <= 1 or args.duration <= 0:
        ap.error("need 0 < --rate <= 100, 0 <= --cancel <= 1 and --duration > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.json
    res = run_soak(args)
    print(render(res))
    if out is not None:
        out.write_text(json.dumps(asdict(res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
