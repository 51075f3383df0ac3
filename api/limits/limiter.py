"""`RequestLimiter`: admit a generation request under the limits of its API key and its adapter.

    grant = await limiter.admit(key_name, adapter, tokens=prompt + choices × max_tokens)  # or 429
    ...run...
    grant.release(used_tokens=prompt + completion)   # frees the concurrency slots, refunds the rest

Tokens per minute are charged up front as the most the request can use (prompt tokens plus
`max_tokens` for every choice) and the unused part is refunded when it finishes, so a burst can pass a
limit by at most the tokens of the one request that was admitted last before its refund. A request
that could never fit (more tokens than its limit per minute) is refused at once.

The limits come from the registry (`LimitTable`), re-read on every `limits.changed` event and every
`refresh_seconds`. A request under no limit never touches the backend. When the backend (Redis) fails:
`fail_mode="open"` admits the request and counts `loraplex_rate_limit_backend_errors`, "closed"
answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from api.errors import APIError
from api.limits.backend import Bucket, LimiterBackend, LimiterUnavailable, Slot
from api.limits.headers import limit_headers
from lora_registry.limits import LimitInfo

log = logging.getLogger("loraplex.limits")
FAIL_MODES = ("open", "closed")


class LimitTable:
    """The registry's limits by (kind, name), replaced whole on every reload."""

    def __init__(self, load: Callable[[], list[LimitInfo]]) -> None:
        self._load = load
        self._limits: dict[tuple[str, str], LimitInfo] = {}
        self._lock = threading.Lock()

    def reload(self) -> None:
        fresh = {(i.kind, i.name): i for i in self._load()}
        with self._lock:
            self._limits = fresh

    def get(self, kind: str, name: str | None) -> LimitInfo | None:
        return self._limits.get((kind, name)) if name is not None else None


@dataclass(slots=True)
class Grant:
    """An admitted request's hold on its limits; `release` must run once, on every path."""

    limiter: RequestLimiter | None = None
    lease: str = ""
    slots: list[Slot] = field(default_factory=list)
    token_buckets: list[Bucket] = field(default_factory=list)  # charged `cost` tokens each
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False

    def release(self, used_tokens: int) -> None:
        """Free the slots and refund `cost - used_tokens` to each token bucket (runs in the background)."""
        if self.released or self.limiter is None:
            return
        self.released = True
        refunds = [
            Bucket(b.key, b.capacity, b.cost - used_tokens)
            for b in self.token_buckets
            if b.cost > used_tokens
        ]
        if self.slots or refunds:
            self.limiter._release_later(self.slots, self.lease, refunds)


class RequestLimiter:
    def __init__(
        self,
        backend: LimiterBackend,
        table: LimitTable,
        fail_mode: str = "open",
        on_backend_error: Callable[[], None] | None = None,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        if fail_mode not in FAIL_MODES:
            raise ValueError(
                f"rate limit fail mode must be one of {', '.join(FAIL_MODES)}, got {fail_mode!r}"
            )
        self.backend, self.table, self.fail_mode = backend, table, fail_mode
        self.on_backend_error = on_backend_error or (lambda: None)
        self.on_refusal = on_refusal or (lambda kind: None)
        self._pending: set[asyncio.Task] = set()
        self._last_warning = 0.0

    async def admit(self, key: str | None, adapter: str | Sequence[str] | None, tokens: int) -> Grant:
        """A grant for one request of `key` on `adapter` (a weighted mix: each of its adapters, all or
        nothing) that may use `tokens`; `APIError` 429 when a limit is reached (503 when the backend is
        down and the fail mode is "closed")."""
        buckets: list[Bucket] = []
        slots: list[Slot] = []
        adapters = [adapter] if adapter is None or isinstance(adapter, str) else list(adapter)
        for kind, name in (("key", key), *(("adapter", a) for a in adapters)):
            info = self.table.get(kind, name)
            if info is None:
                continue
            subject = f"{kind}:{name}"
            if info.tokens_per_minute and tokens > info.tokens_per_minute:
                self.on_refusal("tokens")
                raise APIError(
                    429,
                    f"this request may use {tokens} tokens (prompt + max_tokens × choices), more than the "
                    f"{info.tokens_per_minute} tokens per minute of {kind} {name!r}; lower max_tokens",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": "60"}
                    | limit_headers("tokens", info.tokens_per_minute, info.tokens_per_minute, 0),
                )
            if info.requests_per_minute:
                buckets.append(Bucket(f"{subject}:requests", info.requests_per_minute, 1))
            if info.tokens_per_minute:
                buckets.append(Bucket(f"{subject}:tokens", info.tokens_per_minute, tokens))
            if info.max_concurrent:
                slots.append(Slot(f"{subject}:concurrent", info.max_concurrent))
        if not buckets and not slots:
            return Grant()
        lease = uuid.uuid4().hex
        try:
            outcome = await self._acquire_shielded(buckets, slots, lease)
        except LimiterUnavailable as exc:
            self.on_backend_error()
            self._warn(exc)
            if self.fail_mode == "closed":
                raise APIError(
                    503, "rate limiter unavailable; retry shortly", code="rate_limiter_unavailable"
                ) from exc
            return Grant()
        headers = _headers(buckets, outcome.levels)
        if not outcome.allowed:
            what, message = _refusal(buckets, slots, outcome.refused)
            self.on_refusal(what)
            retry = max(1, int(outcome.retry_after + 0.999))
            raise APIError(
                429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry)} | headers
            )
        token_buckets = [b for b in buckets if b.key.endswith(":tokens")]
        return Grant(self, lease, slots, token_buckets, headers)

    async def _acquire_shielded(self, buckets: list[Bucket], slots: list[Slot], lease: str):
        """Acquire; if the caller is cancelled meanwhile, release whatever the acquisition took."""
        task = asyncio.ensure_future(self.backend.acquire(buckets, slots, lease))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            tokens = [b for b in buckets if b.key.endswith(":tokens")]

            def undo(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None and t.result().allowed:
                    self._release_later(slots, lease, tokens)

            task.add_done_callback(undo)
            raise

    def _release_later(self, slots: list[Slot], lease: str, refunds: list[Bucket]) -> None:
        """Run the backend's release without making the finishing request wait for it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (interpreter shutdown): the leases expire on their own
            return
        task = loop.create_task(self._release(slots, lease, refunds))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, slots: list[Slot], lease: str, refunds: list[Bucket]) -> None:
        try:
            await self.backend.release(slots, lease, refunds)
        except LimiterUnavailable as exc:
            self.on_backend_error()
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("rate limiter backend failed (fail mode %s): %s", self.fail_mode, exc)

    async def close(self) -> None:
        """Finish the releases in flight, then close the backend."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=5)
        await self.backend.close()


def _headers(buckets: list[Bucket], levels: list[float]) -> dict[str, str]:
    """The x-ratelimit-* headers of the tightest requests bucket and the tightest tokens bucket."""
    out: dict[str, str] = {}
    for what in ("requests", "tokens"):
        mine = [(lv, b) for b, lv in zip(buckets, levels, strict=False) if b.key.endswith(f":{what}")]
        if mine:
            level, b = min(mine, key=lambda p: p[0] / p[1].capacity)
            out |= limit_headers(what, b.capacity, level, (b.capacity - level) / b.rate)
    return out


def _refusal(buckets: list[Bucket], slots: list[Slot], index: int) -> tuple[str, str]:
    """(what, message) for the limit at `index` (buckets first, then slots)."""
    if 0 <= index < len(buckets):
        b = buckets[index]
        subject, what = b.key.rsplit(":", 1)
        kind, name = subject.split(":", 1)
        return what, f"rate limit reached: {b.capacity} {what} per minute for {kind} {name!r}; retry later"
    s = slots[index - len(buckets)] if 0 <= index - len(buckets) < len(slots) else None
    if s is None:
        return "unknown", "rate limit reached; retry later"
    kind, name = s.key.rsplit(":", 1)[0].split(":", 1)
    return (
        "concurrent",
        f"{kind} {name!r} already runs {s.limit} concurrent requests (its limit); retry later",
    )
