"""Rate limits shared by every replica: the rules of `backend.py` as Lua scripts run atomically in Redis.

Bucket state is a hash {level, ts} (ts in Redis's own clock, milliseconds, so replicas' clocks do not
matter) that expires once it would be full again anyway. A concurrency slot is a sorted set of leases
scored by their expiry: a replica that dies without releasing loses its leases after `lease_seconds`,
and a live replica renews its leases every `lease_seconds / 3`, so a long stream keeps its slot.

Every Redis failure (refused connection, or no answer within `timeout`) raises `LimiterUnavailable`;
after a failure Redis is not tried again for `retry_seconds`, so an outage makes at most one request
per `retry_seconds` wait (a refused connection fails at once; a silent host costs up to `timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from api.limits.backend import Bucket, LimiterUnavailable, Outcome, Slot

log = logging.getLogger("loraplex.limits")

# KEYS: nb bucket hashes, then ns slot sets. ARGV: nb, ns, lease, lease_ttl_ms, then (capacity, cost)
# per bucket, then limit per slot. Returns {allowed, retry_after_ms, refused_index, level_1, ...}.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nb, ns = tonumber(ARGV[1]), tonumber(ARGV[2])
local lease, ttl = ARGV[3], tonumber(ARGV[4])
local levels, allowed, retry, refused = {}, 1, 0, -1
for i = 1, nb do
  local cap, cost = tonumber(ARGV[3 + 2 * i]), tonumber(ARGV[4 + 2 * i])
  local rate = cap / 60000.0
  local h = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level, ts = tonumber(h[1]), tonumber(h[2])
  if level == nil or ts == nil then level, ts = cap, now end
  level = math.min(cap, level + math.max(0, now - ts) * rate)
  levels[i] = level
  if allowed == 1 and level < cost then
    allowed, retry, refused = 0, math.ceil((cost - level) / rate), i - 1
  end
end
for j = 1, ns do
  local key, limit = KEYS[nb + j], tonumber(ARGV[4 + 2 * nb + j])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if allowed == 1 and redis.call('ZCARD', key) >= limit then allowed, retry, refused = 0, 1000, nb + j - 1 end
end
local out = {allowed, retry, refused}
for i = 1, nb do
  local cap, cost = tonumber(ARGV[3 + 2 * i]), tonumber(ARGV[4 + 2 * i])
  if allowed == 1 then levels[i] = levels[i] - cost end
  redis.call('HSET', KEYS[i], 'level', tostring(levels[i]), 'ts', now)
  redis.call('PEXPIRE', KEYS[i], math.ceil((cap - levels[i]) / (cap / 60000.0)) + 1000)
  out[3 + i] = tostring(levels[i])
end
if allowed == 1 then
  for j = 1, ns do
    redis.call('ZADD', KEYS[nb + j], now + ttl, lease)
    redis.call('PEXPIRE', KEYS[nb + j], ttl)
  end
end
return out
"""

# KEYS: ns slot sets, then nr bucket hashes. ARGV: ns, nr, lease, then (capacity, refund) per bucket.
RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ns, nr, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for j = 1, ns do redis.call('ZREM', KEYS[j], lease) end
for i = 1, nr do
  local key, cap, refund = KEYS[ns + i], tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  local rate = cap / 60000.0
  local h = redis.call('HMGET', key, 'level', 'ts')
  local level, ts = tonumber(h[1]), tonumber(h[2])
  if level ~= nil and ts ~= nil then
    level = math.min(cap, level + math.max(0, now - ts) * rate + refund)
    redis.call('HSET', key, 'level', tostring(level), 'ts', now)
    redis.call('PEXPIRE', key, math.ceil((cap - level) / rate) + 1000)
  end
end
return 1
"""

# KEYS: slot sets; ARGV: lease, lease_ttl_ms. Pushes the lease's expiry out (only if it still holds one).
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for j = 1, #KEYS do
  redis.call('ZADD', KEYS[j], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[j], tonumber(ARGV[2]))
end
return 1
"""


class RedisLimiter:
    def __init__(
        self,
        url: str,
        prefix: str = "loraplex:rl:",
        lease_seconds: float = 300.0,
        timeout: float = 2.0,
        retry_seconds: float = 5.0,
        max_connections: int = 32,
    ) -> None:
        self.url, self.prefix = url, prefix
        self.lease_ms = int(lease_seconds * 1000)
        self.retry_seconds = retry_seconds
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,  # a burst waits for a connection instead of opening hundreds
            timeout=timeout,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._release = self._redis.register_script(RELEASE)
        self._renew = self._redis.register_script(RENEW)
        self._down_until = 0.0
        self._live: dict[str, list[str]] = {}  # lease -> its slot keys, renewed while held
        self._renewer: asyncio.Task | None = None

    def _key(self, key: str) -> str:
        return self.prefix + key

    async def _call(self, script, keys: list[str], args: list) -> list:
        if time.monotonic() < self._down_until:
            raise LimiterUnavailable(f"Redis at {self.url} failed recently; retrying in a moment")
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            self._down_until = time.monotonic() + self.retry_seconds
            raise LimiterUnavailable(f"Redis at {self.url}: {exc}") from exc

    async def acquire(self, buckets: Sequence[Bucket], slots: Sequence[Slot], lease: str) -> Outcome:
        keys = [self._key(b.key) for b in buckets] + [self._key(s.key) for s in slots]
        args: list = [len(buckets), len(slots), lease, self.lease_ms]
        for b in buckets:
            args += [b.capacity, b.cost]
        args += [s.limit for s in slots]
        raw = await self._call(self._acquire, keys, args)
        allowed = int(raw[0]) == 1
        if allowed and slots:
            self._live[lease] = [self._key(s.key) for s in slots]
            self._ensure_renewer()
        return Outcome(
            allowed=allowed,
            levels=[float(v) for v in raw[3:]],
            retry_after=int(raw[1]) / 1000.0,
            refused=int(raw[2]),
        )

    async def release(self, slots: Sequence[Slot], lease: str, refunds: Sequence[Bucket]) -> None:
        self._live.pop(lease, None)
        if not slots and not refunds:
            return
        keys = [self._key(s.key) for s in slots] + [self._key(b.key) for b in refunds]
        args: list = [len(slots), len(refunds), lease]
        for b in refunds:
            args += [b.capacity, b.cost]
        await self._call(self._release, keys, args)

    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        """Keep the leases of running requests alive (every third of their time to live)."""
        while self._live:
            await asyncio.sleep(self.lease_ms / 3000.0)
            for lease, keys in list(self._live.items()):
                try:
                    await self._call(self._renew, keys, [lease, self.lease_ms])
                except LimiterUnavailable as exc:
                    log.warning("rate limiter: cannot renew leases: %s", exc)
                    break

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._renewer
        with contextlib.suppress(Exception):
            await self._redis.aclose()
