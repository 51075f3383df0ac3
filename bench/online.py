"""Online serving benchmark: a running server under Poisson arrivals with power-law adapter popularity.

    python bench/online.py --url http://127.0.0.1:8000 --rates 1,2,4 --duration 20
    python bench/online.py --self-host --adapters 16 --rates 1,2,4     # builds and serves a random model

For each arrival rate the client sends requests for `duration` seconds (Poisson process), each to adapter
k with probability ∝ 1/(k+1)^alpha (or the base model), with prompt and output lengths drawn uniformly
from the given ranges, streaming, and measures throughput, time to first token (TTFT) and time per output
token (TPOT). Prompts are token ids (so any model works, with or without a tokenizer). Reports p50/p99 per
rate and the highest rate whose p99 TTFT stays under 1 s. Traffic goes only to the given loopback URL;
each run is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_REQUESTS_PER_RATE = 2000


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    tokens: int = 0


@dataclass(slots=True)
class RateResult:
    rate: float
    sent: int
    ok: int
    duration: float
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


@dataclass(slots=True)
class OnlineResult:
    rates: list[RateResult] = field(default_factory=list)

    def best_rate_under(self, ttft_p99: float = 1.0) -> float | None:
        ok = [r.rate for r in self.rates if r.ok == r.sent and r.ttft_p99 < ttft_p99]
        return max(ok) if ok else None

    def markdown(self) -> str:
        rows = [
            "| rate (req/s) | sent | ok | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.rates:
            rows.append(
                f"| {r.rate:g} | {r.sent} | {r.ok} | {r.output_tokens_per_s:.0f} | "
                f"{r.ttft_p50:.2f} / {r.ttft_p99:.2f} | {r.tpot_p50 * 1e3:.0f} / {r.tpot_p99 * 1e3:.0f} |"
            )
        best = self.best_rate_under()
        rows.append(f"\nHighest rate with p99 TTFT < 1 s: **{best if best is not None else 'none'}** req/s")
        return "\n".join(rows)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` by nearest rank; 0 for an empty list."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False)
                new = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if new:
                    first = first or time.perf_counter()
                    tokens += new
    except httpx.HTTPError:
        return RequestResult(False)
    end = time.perf_counter()
    if first is None:
        return RequestResult(False)
    return RequestResult(True, first - t0, (end - first) / max(tokens - 1, 1), tokens)


async def run_rate(
    url: str,
    models: list[str],
    weights: list[float],
    rate: float,
    duration: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> RateResult:
    rng = random.Random(seed)
    tasks = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        next_at = 0.0
        while next_at < duration and len(tasks) < MAX_REQUESTS_PER_RATE:
            await asyncio.sleep(max(0.0, t0 + next_at - time.perf_counter()))
            model = rng.choices(models, weights)[0]
            prompt = [rng.randrange(3, 100) for _ in range(rng.randint(*prompt_len))]
            tasks.append(
                asyncio.create_task(one_request(client, url, model, prompt, rng.randint(*output_len)))
            )
            next_at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    good = [r for r in results if r.ok]
    ttft = [r.ttft for r in good]
    tpot = [r.tpot for r in good]
    return RateResult(
        rate,
        len(results),
        len(good),
        elapsed,
        sum(r.tokens for r in good) / elapsed,
        statistics.median(ttft) if ttft else 0,
        pct(ttft, 0.99),
        statistics.median(tpot) if tpot else 0,
        pct(tpot, 0.99),
    )


def popularity(n: int, alpha: float) -> list[float]:
    """Power-law weights 1/(k+1)^alpha for k = 0..n-1."""
    return [1.0 / (k + 1) ** alpha for k in range(n)]


def run(
    url: str,
    rates: list[float],
    duration: float,
    alpha: float = 1.1,
    prompt_len=(8, 64),
    output_len=(8, 64),
    seed: int = 0,
) -> OnlineResult:
    """Benchmark the server at `url` at each rate; adapters are the active ones it lists."""
    models = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    weights = popularity(len(models), alpha)
    out = OnlineResult()
    for i, rate in enumerate(rates):
        out.rates.append(
            asyncio.run(run_rate(url, models, weights, rate, duration, prompt_len, output_len, seed + i))
        )
    return out


def main(argv: list[str] | None = None) -> OnlineResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running loraplex server (loopback)")
    ap.add_argument("--self-host", action="store_true", help="build a random model + adapters and serve it")
    ap.add_argument("--adapters", type=int, default=16, help="adapters for --self-host")
    ap.add_argument("--threads", type=int, default=1, help="engine CPU threads for --self-host")
    ap.add_argument("--rates", default="1,2,4", help="comma-separated arrival rates (req/s)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--alpha", type=float, default=1.1, help="power-law exponent of adapter popularity")
    ap.add_argument(
        "--accounting-cost",
        action="store_true",
        help="with --self-host: throughput with usage accounting + rate limits off vs on, alternating",
    )
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs for --accounting-cost")
    ap.add_argument("--redis", help="Redis URL for the limits in --accounting-cost (default: in-process)")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if args.accounting_cost:
        if not args.self_host:
            ap.error("--accounting-cost needs --self-host")
        print(accounting_cost(args, rates))
        return OnlineResult()
    if args.url:
        result = run(args.url, rates, args.duration, args.alpha)
    elif args.self_host:
        result = _self_hosted(args, rates)
    else:
        ap.error("give --url of a running server, or --self-host")
    print(result.markdown())
    return result


def _self_hosted(args, rates: list[float]) -> OnlineResult:
    """Serve a random Llama with `args.adapters` registered rank-16 adapters on a free loopback port (a
    `loraplex serve` subprocess with a temporary data dir), benchmark it, then stop it."""
    with tempfile.TemporaryDirectory() as tmp:
        base, env = _build(Path(tmp), args.adapters)
        with _serving(base, env, args) as url:
            return run(url, rates, args.duration, args.alpha)


def _build(root: Path, adapters: int) -> tuple[Path, dict[str, str]]:
    """A random base model and `adapters` active rank-16 adapters in a fresh data dir; the server's env."""
    import os
    import secrets

    from bench.workload import ModelSpec, build_adapter, build_base
    from lora_registry import RegistrySettings, open_registry

    base = build_base(root)
    env = os.environ | {
        "LORAPLEX_DATA_DIR": str(root / "data"),
        "LORAPLEX_MODEL": str(base),
        "LORAPLEX_ADMIN_TOKEN": secrets.token_urlsafe(24),  # the server refuses tokens under 16 characters
    }
    reg = open_registry(RegistrySettings.from_env(env))
    try:
        for i in range(adapters):
            adapter = build_adapter(root / f"a{i}", ModelSpec(), 16, i)
            reg.adapters.register(f"a{i}", adapter, activate=True)
    finally:
        reg.close()
    return base, env


@contextlib.contextmanager
def _serving(base: Path, env: dict[str, str], args):
    """`loraplex serve` on a free loopback port until the block ends; yields its URL."""
    import signal
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exe = str(Path(sys.executable).parent / "loraplex")
    cmd = [exe, "serve", "--model", str(base), "--port", str(port), "--device", "cpu"]
    cmd += ["--max-loras", "16", "--threads", str(args.threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"`loraplex serve` exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError("`loraplex serve` was not ready after 300 s")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def accounting_cost(args, rates: list[float]) -> str:
    """Throughput with usage accounting + rate limiting off and on, alternating `args.repeats` times on
    one model (limits on: every adapter limited far above the load, so every request is checked and
    charged; with `--redis URL` the limits live in Redis). Returns a markdown table and the ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        base, env = _build(Path(tmp), args.adapters)
        from lora_registry import RegistrySettings, open_registry

        reg = open_registry(RegistrySettings.from_env(env))
        try:
            for i in range(args.adapters):
                reg.limits.set("adapter", f"a{i}", requests_per_minute=10**6, tokens_per_minute=10**9)
                reg.limits.set("adapter", f"a{i}", max_concurrent=10**4)
        finally:
            reg.close()
        modes = {
            "off": env | {"LORAPLEX_USAGE_ACCOUNTING": "0", "LORAPLEX_RATE_LIMITS": "0"},
            "on": env | {"LORAPLEX_USAGE_ACCOUNTING": "1", "LORAPLEX_RATE_LIMITS": "1"},
        }
        if args.redis:
            modes["on"] |= {"LORAPLEX_REDIS_URL": args.redis}
        tput: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for mode, mode_env in modes.items():
                with _serving(base, mode_env, args) as url:
                    result = run(url, rates, args.duration, args.alpha)
                tput[mode].append(sum(r.output_tokens_per_s for r in result.rates))
    rows = ["| accounting + limits | output tok/s per run | mean |", "|---|---|---|"]
    for mode, values in tput.items():
        rows.append(f"| {mode} | {', '.join(f'{v:.0f}' for v in values)} | {statistics.mean(values):.0f} |")
    ratio = statistics.mean(tput["on"]) / statistics.mean(tput["off"])
    rows.append(
        f"\nThroughput with accounting + limits: **{ratio:.3f}x** of without ({(1 - ratio) * 100:+.1f}% cost)"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
