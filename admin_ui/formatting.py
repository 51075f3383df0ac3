"""Jinja filters: human-readable sizes, times, durations and digests."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def human_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB'."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def ago(ts: float | datetime | None, now: float | None = None) -> str:
    """A unix time (or datetime) as 'just now', '5 min ago', '3 h ago', '2 d ago'; '—' for None."""
    if ts is None:
        return "—"
    if isinstance(ts, datetime):
        ts = ts.timestamp()
    delta = max(0.0, (time.time() if now is None else now) - ts)
    if delta < 10:
        return "just now"
    if delta < 60:
        return f"{int(delta)} s ago"
    if delta < 3600:
        return f"{int(delta // 60)} min ago"
    if delta < 86400:
        return f"{int(delta // 3600)} h ago"
    return f"{int(delta // 86400)} d ago"


def utc(ts: float | datetime | None) -> str:
    """'2025-01-02 12:34 UTC' (for titles and tables)."""
    if ts is None:
        return "—"
    dt = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def short_digest(digest: str | None, n: int = 12) -> str:
    return (digest or "")[:n]


def percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def rate(x: float | None) -> str:
    """A per-second rate with sensible precision; '—' until known."""
    if x is None:
        return "—"
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


FILTERS = {
    "human_bytes": human_bytes,
    "ago": ago,
    "utc": utc,
    "short_digest": short_digest,
    "percent": percent,
    "rate": rate,
}
