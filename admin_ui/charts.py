"""Per-adapter traffic as an inline SVG line chart, rendered on the server (no chart library)."""

from __future__ import annotations

import math

from markupsafe import Markup, escape

PALETTE = ("#2563eb", "#db2777", "#059669", "#d97706", "#7c3aed", "#0891b2", "#dc2626", "#4b5563")
LEFT, RIGHT, TOP, BOTTOM = 52, 16, 14, 30
LEGEND_ROW = 20


def nice_max(value: float) -> float:
    """The smallest 1/2/5×10^k at or above `value` (at least 1): a round top for the y axis."""
    if value <= 1:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for m in (1, 2, 5, 10):
        if m * exp >= value:
            return float(m * exp)
    return float(10 * exp)


def _legend_rows(names: list[str], width: int) -> list[list[tuple[str, int]]]:
    """Legend items (name, x) wrapped into rows that fit `width`."""
    rows: list[list[tuple[str, int]]] = [[]]
    x = LEFT
    for name in names:
        item = 22 + 7 * len(name) + 18
        if rows[-1] and x + item > width - RIGHT:
            rows.append([])
            x = LEFT
        rows[-1].append((name, x))
        x += item
    return rows


def traffic_chart(
    starts: list[int],
    series: dict[str, list[int]],
    *,
    width: int = 1100,
    height: int = 260,
    title: str = "Generated tokens per minute",
    chart_id: str = "traffic",
    x_labels: list[tuple[int, str]] | None = None,
    empty_text: str | None = None,
) -> Markup:
    """An SVG chart: one line per adapter over the minutes in `starts` (unix times of minute starts).
    `x_labels` ((index, text) pairs) and `empty_text` replace the minute axis labels and the empty-chart
    note, for other time steps (the usage page's hours and days)."""
    names = sorted(series)
    legend = _legend_rows(names, width) if names else []
    total_h = height + LEGEND_ROW * len(legend)
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM
    n = max(len(starts), 1)
    top = nice_max(max((v for vals in series.values() for v in vals), default=0))

    def px(i: int) -> float:
        return LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def py(v: float) -> float:
        return TOP + plot_h * (1 - v / top)

    span = f"Last {len(starts)} minutes" if x_labels is None else "Range"
    summary = "; ".join(f"{name}: {sum(series[name])} tokens" for name in names) or "no traffic"
    out = [
        f'<svg class="chart" viewBox="0 0 {width} {total_h}" role="img" '
        f'aria-labelledby="{chart_id}-title {chart_id}-desc" xmlns="http://www.w3.org/2000/svg">',
        f'<title id="{chart_id}-title">{escape(title)}</title>',
        f'<desc id="{chart_id}-desc">{span}: {escape(summary)}</desc>',
    ]
    steps = 4 if f"{top:g}"[0] == "2" else 5  # round tick values: 0-5-10-15-20, 0-10-20-…-50
    for k in range(steps + 1):  # horizontal grid and y labels
        v = top * k / steps
        y = py(v)
        label = f"{v:.0f}" if top >= 10 else f"{v:g}"
        out.append(f'<line class="grid" x1="{LEFT}" x2="{width - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="axis" x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    minute_labels = [(0, f"−{n - 1} min"), ((n - 1) // 2, f"−{n - 1 - (n - 1) // 2} min"), (n - 1, "now")]
    for i, label in x_labels if x_labels is not None else minute_labels:
        anchor = "start" if i == 0 else ("end" if i == n - 1 else "middle")
        out.append(
            f'<text class="axis" x="{px(i):.1f}" y="{height - 8}" text-anchor="{anchor}">{label}</text>'
        )
    if not names:
        out.append(
            f'<text class="empty" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
            f'text-anchor="middle">{escape(empty_text or f"No requests in the last {n} minutes")}</text>'
        )
    for idx, name in enumerate(names):
        color = PALETTE[idx % len(PALETTE)]
        pts = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(series[name]))
        out.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="2" stroke-linejoin="round" points="{pts}">'
            f"<title>{escape(name)}</title></polyline>"
        )
        last = series[name][-1] if series[name] else 0
        out.append(f'<circle cx="{px(n - 1):.1f}" cy="{py(last):.1f}" r="3" fill="{color}"/>')
    for r, row in enumerate(legend):
        y = height + LEGEND_ROW * r + 6
        for name, x in row:
            color = PALETTE[names.index(name) % len(PALETTE)]
            out.append(f'<rect x="{x}" y="{y - 9}" width="14" height="4" rx="2" fill="{color}"/>')
            out.append(f'<text class="legend" x="{x + 20}" y="{y - 3}">{escape(name)}</text>')
    out.append("</svg>")
    return Markup("".join(out))
