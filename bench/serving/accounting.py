"""Per-request cost of rate limiting and usage accounting in the API process (no engine involved).

    python bench/serving/accounting.py [--redis redis://127.0.0.1:6379/0] [--requests 2000]

Times `RequestLimiter.admit` + `Grant.release` for a request under a key limit and an adapter limit (all
three limits each, never reached), with the in-process backend and, given `--redis`, the Redis one; and
`UsageRecorder.record` (the only accounting work on the request path). Complements
`bench/serving/online.py --accounting-cost`, whose end-to-end A/B is dominated by noise on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from api.limits.backend import LimiterBackend, LocalLimiter
from api.limits.limiter import LimitTable, RequestLimiter
from api.usage.recorder import UsageRecorder
from lora_registry.limits import LimitInfo
from lora_registry.usage import UsageEntry


async def admit_release_us(backend: LimiterBackend, n: int) -> float:
    """Mean microseconds of one admit + release (the release's own round trip included)."""
    infos = [LimitInfo("key", "k", 10**6, 10**9, 10**4), LimitInfo("adapter", "a", 10**6, 10**9, 10**4)]
    table = LimitTable(lambda: infos)
    table.reload()
    limiter = RequestLimiter(backend, table)
    t0 = time.perf_counter()
    for _ in range(n):
        grant = await limiter.admit("k", "a", 100)
        grant.release(50)
        await asyncio.sleep(0)
    await limiter.close()
    return (time.perf_counter() - t0) / n * 1e6


def record_us(n: int) -> float:
    rec = UsageRecorder(lambda batch: None).start()
    entry = UsageEntry(datetime.now(UTC), "k", "a", None, 1, 1, 0, 1, "ok")
    t0 = time.perf_counter()
    for _ in range(n):
        rec.record(entry)
    elapsed = time.perf_counter() - t0
    rec.close()
    return elapsed / n * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", help="also time the Redis backend at this URL (keys under bench:rl:)")
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args(argv)
    rows = ["| per request | µs |", "|---|---|"]
    local = asyncio.run(admit_release_us(LocalLimiter(), args.requests))
    rows.append(f"| limits, in-process: admit + release | {local:.0f} |")
    if args.redis:
        from api.limits.redis_limiter import RedisLimiter

        backend = RedisLimiter(args.redis, prefix="bench:rl:")
        shared = asyncio.run(admit_release_us(backend, args.requests))
        rows.append(f"| limits, Redis: admit + release | {shared:.0f} |")
    rows.append(f"| usage: record() | {record_us(args.requests * 50):.1f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
