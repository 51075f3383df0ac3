"""Rate limiting: token buckets and concurrency slots in the process and in a real Redis, the 429s and
headers of `RequestLimiter`, and fail-open / fail-closed when Redis is unreachable."""

from __future__ import annotations

import asyncio
import time

import pytest

from api.errors import APIError
from api.limits.backend import Bucket, LocalLimiter, Slot
from api.limits.headers import duration
from api.limits.limiter import LimitTable, RequestLimiter
from api.limits.redis_limiter import RedisLimiter
from lora_registry.limits import LimitInfo
from tests.helpers.live_server import free_port
from tests.helpers.redis_service import require_redis, unique_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(*infos: LimitInfo) -> LimitTable:
    t = LimitTable(lambda: list(infos))
    t.reload()
    return t


def limit(kind: str, name: str, rpm=None, tpm=None, conc=None) -> LimitInfo:
    return LimitInfo(kind, name, rpm, tpm, conc)


def test_local_bucket_refills_continuously_and_says_when_to_retry() -> None:
    clock = Clock()
    lim = LocalLimiter(clock)
    b = Bucket("a:tokens", capacity=60, cost=25)  # refills 1 token per second
    assert lim.try_acquire([b], [], "1").allowed
    assert lim.try_acquire([b], [], "2").allowed
    refused = lim.try_acquire([b], [], "3")  # 10 left, 25 needed: 15 s to wait
    assert not refused.allowed and refused.refused == 0
    assert refused.retry_after == pytest.approx(15.0)
    clock.now += 15
    ok = lim.try_acquire([b], [], "3")
    assert ok.allowed and ok.levels == [pytest.approx(0.0)]
    lim.release_now([], "3", [Bucket("a:tokens", 60, 100)])  # a refund never overfills the bucket
    assert lim.try_acquire([Bucket("a:tokens", 60, 60)], [], "4").allowed
    assert not lim.try_acquire([Bucket("a:tokens", 60, 1)], [], "5").allowed


def test_local_all_or_nothing_and_concurrency_slots() -> None:
    lim = LocalLimiter(Clock())
    key, adapter = Bucket("key:k:requests", 10, 1), Bucket("adapter:a:requests", 1, 1)
    assert lim.try_acquire([key, adapter], [], "1").allowed
    refused = lim.try_acquire([key, adapter], [], "2")
    assert not refused.allowed and refused.refused == 1
    assert refused.levels[0] == pytest.approx(9.0)  # the key's bucket was not charged for the refusal
    slot = Slot("adapter:a:concurrent", 2)
    assert lim.try_acquire([], [slot], "x").allowed and lim.try_acquire([], [slot], "y").allowed
    third = lim.try_acquire([], [slot], "z")
    assert not third.allowed and third.refused == 0 and lim.in_use(slot.key) == 2
    lim.release_now([slot], "x", [])
    assert lim.try_acquire([], [slot], "z").allowed


def test_reset_durations_use_openai_format() -> None:
    assert [duration(s) for s in (0.25, 1, 6.4, 60, 90.2)] == ["250ms", "1s", "6s", "1m0s", "1m30s"]


async def _admit_all(limiter: RequestLimiter, n: int, tokens: int):
    async def one():
        try:
            return await limiter.admit("team", "support", tokens)
        except APIError as exc:
            return exc

    return await asyncio.gather(*(one() for _ in range(n)))


def test_request_limiter_429_carries_retry_after_and_headers_then_refunds() -> None:
    async def main() -> None:
        limiter = RequestLimiter(LocalLimiter(), table(limit("adapter", "support", rpm=100, tpm=300)))
        results = await _admit_all(limiter, 4, 100)
        grants = [r for r in results if not isinstance(r, APIError)]
        refusals = [r for r in results if isinstance(r, APIError)]
        assert len(grants) == 3 and len(refusals) == 1
        err = refusals[0]
        assert err.status == 429 and err.code == "rate_limit_exceeded"
        assert "300 tokens per minute for adapter 'support'" in err.message
        assert err.headers is not None and int(err.headers["Retry-After"]) >= 1
        assert err.headers["x-ratelimit-limit-tokens"] == "300"
        assert err.headers["x-ratelimit-remaining-tokens"] == "0"
        assert err.headers["x-ratelimit-limit-requests"] == "100"
        assert err.headers["x-ratelimit-remaining-requests"] == "97"
        assert grants[-1].headers["x-ratelimit-remaining-tokens"] == "0"
        grants[0].release(used_tokens=10)  # 90 of the 100 charged come back
        await asyncio.sleep(0)
        again = await limiter.admit("team", "support", 90)
        assert again.headers["x-ratelimit-remaining-tokens"] in ("0", "1")
        too_big = await _admit_all(limiter, 1, 301)
        assert isinstance(too_big[0], APIError) and "lower max_tokens" in too_big[0].message
        unlimited = await limiter.admit("other", "other", 10**6)  # no limits: nothing checked
        assert unlimited.limiter is None and unlimited.headers == {}

    asyncio.run(main())


def test_redis_bursts_from_two_instances_never_pass_the_limit() -> None:
    """Two limiters (as two replicas) share one Redis: a burst of 60 requests of 50 tokens against
    1000 tokens/minute admits the bucket's 1000 tokens plus at most what refilled while it ran."""
    url = require_redis()
    prefix = unique_prefix()

    async def main() -> None:
        limits = table(limit("adapter", "support", tpm=1000, conc=40))
        a = RequestLimiter(RedisLimiter(url, prefix=prefix), limits)
        b = RequestLimiter(RedisLimiter(url, prefix=prefix), limits)
        t0 = time.monotonic()
        results = await asyncio.gather(_admit_all(a, 30, 50), _admit_all(b, 30, 50))
        elapsed = time.monotonic() - t0
        flat = [r for rs in results for r in rs]
        admitted = [r for r in flat if not isinstance(r, APIError)]
        refill = 1000 / 60 * elapsed
        assert len(admitted) >= 20 and len(admitted) * 50 <= 1000 + refill + 50
        assert all(
            r.status == 429 and "Retry-After" in (r.headers or {}) for r in flat if isinstance(r, APIError)
        )
        # concurrency: the admitted requests hold their slots (limit 40) until released
        assert len(admitted) <= 40
        for g in admitted:
            g.release(used_tokens=50)
        await asyncio.sleep(0.1)
        await a.close()
        await b.close()

    asyncio.run(main())


def test_redis_concurrency_slots_are_released_and_shared() -> None:
    url = require_redis()
    prefix = unique_prefix()

    async def main() -> None:
        limits = table(limit("key", "team", conc=2))
        a = RequestLimiter(RedisLimiter(url, prefix=prefix), limits)
        b = RequestLimiter(RedisLimiter(url, prefix=prefix), limits)
        g1 = await a.admit("team", None, 1)
        g2 = await b.admit("team", None, 1)
        with pytest.raises(APIError) as refused:
            await a.admit("team", None, 1)
        assert refused.value.status == 429 and "2 concurrent requests" in refused.value.message
        g2.release(1)
        await asyncio.sleep(0.1)
        g3 = await a.admit("team", None, 1)
        for g in (g1, g3):
            g.release(1)
        await a.close()
        await b.close()

    asyncio.run(main())


def test_unreachable_redis_fails_open_with_a_counter_or_closed_with_503() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    limits = table(limit("adapter", "support", rpm=1))

    async def main() -> None:
        errors: list[int] = []
        open_ = RequestLimiter(RedisLimiter(dead), limits, "open", on_backend_error=lambda: errors.append(1))
        t0 = time.monotonic()
        for _ in range(3):  # more than the limit of 1 per minute: admitted, since Redis is down
            grant = await open_.admit(None, "support", 5)
            grant.release(5)
        assert time.monotonic() - t0 < 2.0  # no request waits for the dead Redis
        assert len(errors) >= 1
        await open_.close()
        closed = RequestLimiter(RedisLimiter(dead), limits, "closed")
        with pytest.raises(APIError) as refused:
            await closed.admit(None, "support", 5)
        assert refused.value.status == 503
        await closed.close()

    asyncio.run(main())
