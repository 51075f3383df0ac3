"""`loraplex usage`: requests and tokens per adapter or API key over a time range, as a table or JSON."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from api.cli.output import CliError, handle_errors, print_json, stdout
from api.cli.state import state_of
from lora_registry.usage import UsageReport, UsageRow

_SPAN = re.compile(r"(\d+)\s*([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class By(StrEnum):
    adapter = "adapter"
    key = "key"


class BucketSize(StrEnum):
    hour = "hour"
    day = "day"


def parse_when(text: str, now: datetime, option: str) -> datetime:
    """A point in time: a span back from `now` ("90m", "24h", "7d", "2w") or an ISO 8601 date/time (UTC
    unless it has a zone)."""
    raw = text.strip().lower()
    spans = _SPAN.findall(raw)
    if spans and _SPAN.sub("", raw).strip() == "":
        return now - timedelta(seconds=sum(int(n) * _UNITS[u] for n, u in spans))
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise CliError(
            f"{option} {text!r}: give a span like 24h, 7d, 90m or an ISO date like 2026-03-01"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _label(row: UsageRow, by: str) -> str:
    if row.name is not None:
        return row.name
    return "(base model)" if by == "adapter" else "(no key)"


@handle_errors
def usage(
    ctx: typer.Context,
    by: Annotated[By, typer.Option("--by", help="Group by adapter or by API key.")] = By.adapter,
    since: Annotated[
        str, typer.Option("--since", help="Start: a span back (24h, 7d) or an ISO time.")
    ] = "24h",
    until: Annotated[str | None, typer.Option("--until", help="End (default: now), like --since.")] = None,
    bucket: Annotated[BucketSize | None, typer.Option("--bucket", help="Per hour or per day (UTC).")] = None,
    adapter: Annotated[str | None, typer.Option("--adapter", help="Only this adapter.")] = None,
    key: Annotated[str | None, typer.Option("--key", help="Only this API key (by name).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Requests and tokens per adapter (or API key) since a time: which adapter used how much, for whom."""
    now = datetime.now(UTC)
    start = parse_when(since, now, "--since")
    end = parse_when(until, now, "--until") if until else now
    if end <= start:
        raise CliError("--since must be before --until")
    report = (
        state_of(ctx).backend().usage(by.value, start, end, bucket.value if bucket else None, adapter, key)
    )
    if as_json:
        print_json(report.to_dict())
        return
    print_report(report)


def print_report(report: UsageReport) -> None:
    out = stdout()
    span = f"{report.start:%Y-%m-%d %H:%M} to {report.end:%Y-%m-%d %H:%M} UTC"
    if not report.rows:
        out.print(f"No usage from {span}.")
        return
    cols = ["bucket"] if report.bucket else []
    cols += [report.by, "requests", "failed", "429s", "prompt", "completion", "cached", "total tokens"]
    table = Table(*cols, title=f"Usage by {report.by}, {span}")
    for c in table.columns[len(cols) - 7 :]:
        c.justify = "right"
    fmt = "%Y-%m-%d %H:00" if report.bucket == "hour" else "%Y-%m-%d"
    for r in report.rows:
        cells = [r.bucket.strftime(fmt)] if report.bucket and r.bucket else []
        numbers = (
            r.requests,
            r.failed,
            r.rate_limited,
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens,
        )
        table.add_row(*cells, _label(r, report.by), *(str(n) for n in numbers), str(r.total_tokens))
    total = sum(r.total_tokens for r in report.rows)
    out.print(table)
    out.print(f"{sum(r.requests for r in report.rows)} requests, {total} tokens")
