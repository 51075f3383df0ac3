"""`loraplex bench disagg`'s numbers: one `SetupResult` per (setup, run); the summary over the runs
(median, min and max per metric), each run's disaggregated / colocated ratios against the issue's goals
(ITL p99 <= 0.5x, throughput >= 0.9x), and whether the long prompts' greedy tokens are identical."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

# "disaggregated-zmq": disaggregated with `--kv-staging zmq` (the KV bytes inline to the decode engine)
SETUPS = {"colocated", "disaggregated", "disaggregated-zmq"}


@dataclass(slots=True)
class SetupResult:
    setup: str
    seconds: float
    requests: int
    failed: int
    output_tokens: int
    itl_p50_ms: float
    itl_p99_ms: float
    ttft_stream_p50_ms: float
    ttft_stream_p99_ms: float
    ttft_long_p50_ms: float
    ttft_long_p99_ms: float
    tokens_per_s: float
    transfer_ms_per_request: float | None = None
    transfer_kib_per_request: float | None = None
    long_tokens: dict[str, list[int]] = field(default_factory=dict)
    run: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)  # os.getloadavg() when the run ended
    # the tail past p99: stalls that touch under 1% of the ITLs (a long prompt's prefill chunks
    # colocated with the streams at a low arrival rate) show here and not at p99
    itl_p999_ms: float = float("nan")


# (SetupResult field, column, format) of the summary table
METRICS = (
    ("itl_p50_ms", "ITL p50 (ms)", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 (ms)", "{:.1f}"),
    ("itl_p999_ms", "ITL p99.9 (ms)", "{:.1f}"),
    ("ttft_stream_p50_ms", "TTFT streams p50 (ms)", "{:.0f}"),
    ("ttft_stream_p99_ms", "TTFT streams p99 (ms)", "{:.0f}"),
    ("ttft_long_p50_ms", "TTFT long p50 (ms)", "{:.0f}"),
    ("ttft_long_p99_ms", "TTFT long p99 (ms)", "{:.0f}"),
    ("tokens_per_s", "output tok/s", "{:.1f}"),
    ("transfer_ms_per_request", "KV transfer / request (ms)", "{:.1f}"),
    ("transfer_kib_per_request", "KV / request (KiB)", "{:.0f}"),
)


def _values(results: list[SetupResult], setup: str, key: str) -> list[float]:
    """`key` of each run of `setup` that measured it."""
    rows = [getattr(r, key) for r in results if r.setup == setup]
    return [v for v in rows if v is not None and not math.isnan(v)]


def summary(results: list[SetupResult]) -> dict[str, dict[str, dict[str, float]]]:
    """Per setup, per metric of `METRICS`: {"median", "min", "max"} over its runs (metrics a setup does
    not have, e.g. the colocated KV transfer, left out)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for setup in dict.fromkeys(r.setup for r in results):
        out[setup] = {}
        for key, _, _ in METRICS:
            values = _values(results, setup, key)
            if values:
                out[setup][key] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
    return out


def pairs(results: list[SetupResult]) -> list[tuple[SetupResult, SetupResult]]:
    """(colocated, disaggregated) of each run that has both."""
    by_run: dict[int, dict[str, SetupResult]] = {}
    for r in results:
        by_run.setdefault(r.run, {})[r.setup] = r
    both = {"colocated", "disaggregated"}
    return [(d["colocated"], d["disaggregated"]) for d in by_run.values() if both <= d.keys()]


def ratios(results: list[SetupResult]) -> dict[str, list[float]]:
    """Disaggregated over colocated, per run: ITL p99, p99.9 and p50, throughput, TTFT p99 of the long
    prompts."""
    keys = ("itl_p99_ms", "itl_p999_ms", "itl_p50_ms", "tokens_per_s", "ttft_long_p99_ms")
    out: dict[str, list[float]] = {k: [] for k in keys}
    for colo, dis in pairs(results):
        for k in keys:
            a, b = getattr(colo, k), getattr(dis, k)
            if a and not math.isnan(a) and not math.isnan(b):
                out[k].append(b / a)
    return out


def identical_long(results: list[SetupResult]) -> tuple[int, int]:
    """(long prompts with the same greedy tokens in both setups of their run, long prompts in both)."""
    same = total = 0
    for colo, dis in pairs(results):
        common = colo.long_tokens.keys() & dis.long_tokens.keys()
        total += len(common)
        same += sum(colo.long_tokens[k] == dis.long_tokens[k] for k in common)
    return same, total


def markdown(results: list[SetupResult]) -> str:
    """The summary table (median and min–max over the runs), the per-run ratios and the goal checks."""
    from bench.cluster.report import spread

    runs = max(r.run for r in results) + 1
    head = "| setup | " + " | ".join(title for _, title, _ in METRICS) + " | requests (failed) |"
    rows = [f"{runs} run(s) per setup; median (min–max) over the runs:", "", head]
    rows.append("|---" * (len(METRICS) + 2) + "|")
    for setup in summary(results):
        cells = []
        for key, _, fmt in METRICS:
            values = _values(results, setup, key)
            cells.append(spread(values, fmt) if values else "—")
        reqs = sum(r.requests for r in results if r.setup == setup)
        failed = sum(r.failed for r in results if r.setup == setup)
        rows.append(f"| {setup} | " + " | ".join(cells) + f" | {reqs} ({failed}) |")
    rat = ratios(results)
    if rat["itl_p99_ms"]:
        rows += ["", "Disaggregated / colocated, each run's pair: median (min–max):"]
        for key, goal in (("itl_p99_ms", "goal <= 0.5"), ("tokens_per_s", "goal >= 0.9"),
                          ("itl_p999_ms", ""), ("itl_p50_ms", ""), ("ttft_long_p99_ms", "")):  # fmt: skip
            vs = rat[key]
            if not vs:
                continue
            met = ""
            if goal:
                ok = statistics.median(vs) <= 0.5 if key == "itl_p99_ms" else statistics.median(vs) >= 0.9
                met = f" ({goal}: {'met' if ok else 'NOT met'})"
            rows.append(f"- {key}: {spread(vs, '{:.2f}x')}{met}")
        same, total = identical_long(results)
        rows.append(f"- long prompts with identical greedy tokens in both setups: {same} of {total}")
    loads = ", ".join(f"{r.setup} run {r.run}: {r.load[0]:.1f}" for r in results)
    rows += ["", f"Load average (1 min) at the end of each run: {loads}"]
    return "\n".join(rows)
