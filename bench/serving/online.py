"""Online serving benchmark: a running server under Poisson arrivals with power-law adapter popularity.

    python bench/serving/online.py --url http://127.0.0.1:8000 --rates 1,2,4 --duration 20
    python bench/serving/online.py --self-host --adapters 16 --rates 1,2,4   # builds, serves a random model

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
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.serving.client import RateResult, pct, plan_rate, send_planned

__all__ = ["OnlineResult", "RateResult", "pct", "popularity", "run"]


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
    planned = plan_rate(weights, rate, duration, prompt_len, output_len, seed)
    return await send_planned(url, models, planned, rate)


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
    from bench.common.workload import ModelSpec, build_adapter, build_base
    from bench.serving.server_process import loraplex_env

    base = build_base(root)
    dirs = {f"a{i}": build_adapter(root / f"a{i}", ModelSpec(), 16, i) for i in range(adapters)}
    return base, loraplex_env(root, base, dirs)


@contextlib.contextmanager
def _serving(base: Path, env: dict[str, str], args):
    """`loraplex serve` on a free loopback port until the block ends; yields its URL."""
    from bench.serving.server_process import free_port, loraplex_cmd, serving

    port = free_port()
    with serving(loraplex_cmd(base, port, args.threads, 16), env, port, "`loraplex serve`") as url:
        yield url


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
