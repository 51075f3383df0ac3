"""Settings of usage accounting and rate limiting, from `LORAPLEX_*` variables (built by a factory)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from api.limits.limiter import FAIL_MODES

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(slots=True, frozen=True)
class UsageSettings:
    """`accounting`: record every finished request (`LORAPLEX_USAGE_ACCOUNTING`, default on).
    `limits`: enforce the registry's rate limits (`LORAPLEX_RATE_LIMITS`, default on).
    `fail_mode`: what a Redis outage does to limited requests, "open" (admit, count
    `loraplex_rate_limit_backend_errors`) or "closed" (503) (`LORAPLEX_RATE_LIMIT_FAIL_MODE`).
    `queue_size` / `flush_seconds` / `batch_size`: the background writer's bounded queue, how long a
    record may wait before it is written, and the most rows per insert (`LORAPLEX_USAGE_QUEUE_SIZE`,
    `LORAPLEX_USAGE_FLUSH_SECONDS`)."""

    accounting: bool = True
    limits: bool = True
    fail_mode: str = "open"
    queue_size: int = 100_000
    flush_seconds: float = 1.0
    batch_size: int = 1000
    limits_refresh_seconds: float = 5.0
    lease_seconds: float = 300.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> UsageSettings:
        env = os.environ if env is None else env
        fail_mode = (env.get("LORAPLEX_RATE_LIMIT_FAIL_MODE") or "open").lower()
        if fail_mode not in FAIL_MODES:
            raise ValueError(f"LORAPLEX_RATE_LIMIT_FAIL_MODE: expected open or closed, got {fail_mode!r}")
        queue_size = _number(env, "LORAPLEX_USAGE_QUEUE_SIZE", int, 100_000, 1, 10_000_000)
        flush = _number(env, "LORAPLEX_USAGE_FLUSH_SECONDS", float, 1.0, 0.01, 3600.0)
        return cls(
            accounting=_flag(env, "LORAPLEX_USAGE_ACCOUNTING"),
            limits=_flag(env, "LORAPLEX_RATE_LIMITS"),
            fail_mode=fail_mode,
            queue_size=int(queue_size),
            flush_seconds=float(flush),
        )


def _flag(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw not in _TRUE + _FALSE:
        raise ValueError(f"{name}: expected 1/0 (or true/false), got {raw!r}")
    return raw in _TRUE


def _number(env: Mapping[str, str], name: str, kind: type, default: float, low: float, high: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: expected a number, got {raw!r}") from exc
    if not low <= value <= high:
        raise ValueError(f"{name}: must be in [{low:g}, {high:g}], got {raw}")
    return value
