"""What the usage page shows: tokens per adapter and per API key over a range, as chart series + totals."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from markupsafe import Markup

from admin_ui.charts import traffic_chart
from lora_registry.usage import UsageReport, UsageRow

# range choice -> (length, bucket)
RANGES = {
    "24h": (timedelta(hours=24), "hour"),
    "7d": (timedelta(days=7), "day"),
    "30d": (timedelta(days=30), "day"),
}
STEP = {"hour": 3600, "day": 86400}


@dataclass(slots=True)
class UsageView:
    """One grouping (adapter or key): its chart and its rows of totals, biggest first."""

    by: str
    chart: Markup
    totals: list[UsageRow]


def bucket_starts(start: datetime, end: datetime, bucket: str) -> list[int]:
    """Unix times of the bucket starts covering [start, end)."""
    step = STEP[bucket]
    first = int(start.timestamp()) // step * step
    return list(range(first, int(end.timestamp()), step))


def label(name: str | None, by: str) -> str:
    if name is not None:
        return name
    return "(base model)" if by == "adapter" else "(no key)"


def usage_view(report: UsageReport, totals: UsageReport, starts: list[int]) -> UsageView:
    """The chart (total tokens per bucket, one line per name) and the totals of `report.by`."""
    index = {t: i for i, t in enumerate(starts)}
    series: dict[str, list[int]] = {}
    for r in report.rows:
        values = series.setdefault(label(r.name, report.by), [0] * len(starts))
        if r.bucket is not None and int(r.bucket.timestamp()) in index:
            values[index[int(r.bucket.timestamp())]] += r.total_tokens
    fmt = "%H:00" if report.bucket == "hour" else "%b %d"
    n = len(starts)
    ticks = sorted({0, (n - 1) // 2, n - 1})
    x_labels = [(i, datetime.fromtimestamp(starts[i], UTC).strftime(fmt)) for i in ticks] if n else []
    chart = traffic_chart(
        starts,
        series,
        title=f"Tokens per {report.bucket} by {report.by}",
        chart_id=f"usage-{report.by}",
        x_labels=x_labels,
        empty_text="No usage in this range",
    )
    rows = sorted(totals.rows, key=lambda r: -r.total_tokens)
    return UsageView(report.by, chart, rows)


def usage_range(choice: str, now: datetime | None = None) -> tuple[datetime, datetime, str]:
    """[start, end) and bucket of a range choice ("24h", "7d", "30d"); end is the next bucket start."""
    span, bucket = RANGES.get(choice, RANGES["24h"])
    now = now or datetime.now(UTC)
    step = STEP[bucket]
    end = datetime.fromtimestamp((int(now.timestamp()) // step + 1) * step, UTC)
    return end - span, end, bucket
