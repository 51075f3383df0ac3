"""The cluster benchmark's numbers: one `RunMetrics` per (router, run), then median and min–max per router.

* prefix-hit rate: prompt tokens the replicas' prefix caches found, over prompt tokens looked up (the
  engines' own counters, summed over the replicas);
* adapter loads per 1k requests: uploads into the replicas' device pools (and, beside them, host loads
  from the blob files), per 1,000 requests of the trace;
* throughput: finished requests (and generated tokens) per second, from the first arrival to the last
  finish;
* TTFT p50/p99 over every request, and p99 over the hot-adapter burst's requests;
* queue: requests outstanding (sent, not finished) at the end of the steady phase and at the peak, the
  replicas' own waiting queues at their peak, and the drain, from the last arrival to the last finish.
  An arrival rate the replicas keep up with shows as a drain near zero and a flat queue: the table then
  says "not overloaded", and its throughput only measures the arrival rate.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from bench.cluster.replay import Replayed
from bench.cluster.workload import Arrival

METRICS = (  # (key, column title, format, higher is better)
    ("prefix_hit_rate", "prefix-hit rate", "{:.1%}", True),
    ("loads_per_1k", "adapter loads / 1k req", "{:.0f}", False),
    ("host_loads_per_1k", "host loads / 1k req", "{:.0f}", False),
    ("req_per_s", "req/s", "{:.2f}", True),
    ("tok_per_s", "output tok/s", "{:.0f}", True),
    ("ttft_p50", "TTFT p50 (s)", "{:.2f}", False),
    ("ttft_p99", "TTFT p99 (s)", "{:.2f}", False),
    ("burst_ttft_p99", "burst TTFT p99 (s)", "{:.2f}", False),
)


@dataclass(slots=True)
class RunMetrics:
    router: str
    run: int
    requests: int
    ok: int
    seconds: float
    prefix_hit_rate: float
    loads_per_1k: float
    host_loads_per_1k: float
    req_per_s: float
    tok_per_s: float
    ttft_p50: float
    ttft_p99: float
    burst_ttft_p99: float
    queue_at_burst: int  # outstanding when the steady phase ends
    peak_queue: int  # most outstanding at once
    peak_waiting: int  # most requests waiting in the replicas' own schedulers
    drain_s: float  # last finish - last arrival

    def to_json(self) -> dict:
        return asdict(self)


def percentile(xs: list[float], q: float) -> float:
    """The `q`-quantile (0..1) of `xs` by nearest rank (0 for none)."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(q * len(ys)) - 1))]


def run_metrics(router: str, run: int, rep: Replayed, trace: list[Arrival], steady_s: float) -> RunMetrics:
    """One replay's numbers (see the module doc)."""
    sent = rep.sent
    done = [s for s in sent if s.ok]
    ttfts = [s.ttft for s in done if s.ttft is not None]
    burst = [s.ttft for s in done if s.phase == "burst" and s.ttft is not None]
    first = min(a.at for a in trace)
    last_end = max((s.end for s in sent if s.end is not None), default=first)
    span = max(last_end - first, 1e-9)
    c = rep.counters
    n = len(sent)
    at_burst = [o for t, o, _ in rep.samples if t <= steady_s]
    return RunMetrics(
        router=router,
        run=run,
        requests=n,
        ok=len(done),
        seconds=span,
        prefix_hit_rate=c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0,
        loads_per_1k=1000.0 * c.device_uploads / n if n else 0.0,
        host_loads_per_1k=1000.0 * c.host_loads / n if n else 0.0,
        req_per_s=len(done) / span,
        tok_per_s=sum(s.tokens for s in done) / span,
        ttft_p50=percentile(ttfts, 0.50),
        ttft_p99=percentile(ttfts, 0.99),
        burst_ttft_p99=percentile(burst, 0.99),
        queue_at_burst=at_burst[-1] if at_burst else 0,
        peak_queue=max((o for _, o, _ in rep.samples), default=0),
        peak_waiting=max((w for _, _, w in rep.samples), default=0),
        drain_s=last_end - max(a.at for a in trace),
    )


def spread(values: list[float], fmt: str) -> str:
    """`median (min–max)`, or the one value."""
    if len(values) == 1:
        return fmt.format(values[0])
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}–{fmt.format(hi)})"


def by_router(runs: list[RunMetrics]) -> dict[str, list[RunMetrics]]:
    out: dict[str, list[RunMetrics]] = {}
    for r in runs:
        out.setdefault(r.router, []).append(r)
    return out


def markdown(
    runs: list[RunMetrics], offered_per_s: float, attainable: float, single: float | None = None
) -> str:
    """The results table (median and min–max over the runs), the queue table and the goal checks."""
    groups = by_router(runs)
    head = "| router | " + " | ".join(title for _, title, _, _ in METRICS) + " |"
    rows = [head, "|---" * (len(METRICS) + 1) + "|"]
    for name, rs in groups.items():
        cells = [spread([getattr(r, key) for r in rs], fmt) for key, _, fmt, _ in METRICS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows += [
        "",
        f"Offered {offered_per_s:.2f} req/s. Queue (median over runs): outstanding at the end of the steady "
        "phase / at the peak, replicas' own waiting queues at the peak, drain after the last arrival:",
        "",
        "| router | outstanding at burst | peak outstanding | peak waiting in engines | drain (s) | failed "
        "| load |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in groups.items():
        med = {k: statistics.median(getattr(r, k) for r in rs) for k in ("queue_at_burst", "peak_queue")}
        drain = statistics.median(r.drain_s for r in rs)
        tput = statistics.median(r.req_per_s for r in rs)
        overloaded = drain > 2.0 and tput < 0.95 * offered_per_s
        failed = sum(r.requests - r.ok for r in rs)
        rows.append(
            f"| {name} | {med['queue_at_burst']:.0f} | {med['peak_queue']:.0f} | "
            f"{statistics.median(r.peak_waiting for r in rs):.0f} | {drain:.1f} | {failed} | "
            f"{'overloaded' if overloaded else 'not overloaded: throughput = arrival rate'} |"
        )
    rows += ["", f"Attainable prefix-hit rate (one engine, unbounded cache, same trace): {attainable:.1%}."]
    if single is not None:
        rows += [f"One replica's cache (LRU, same trace, running requests' blocks left out): {single:.1%}."]
    rows += goals(groups, attainable, single)
    return "\n".join(rows)


def goals(
    groups: dict[str, list[RunMetrics]], attainable: float = 0.0, single: float | None = None
) -> list[str]:
    """The issue's goals for `affinity`, each as measured (medians): met, or by how much it falls short."""
    if "affinity" not in groups or len(groups) < 2:
        return []

    def med(name: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in groups[name])

    others = [n for n in groups if n != "affinity"]
    best_tput = max(others, key=lambda n: med(n, "req_per_s"))
    best_p99 = min(others, key=lambda n: med(n, "ttft_p99"))
    lines = ["", "Goals (affinity, medians):"]

    def check(text: str, ok: bool) -> None:
        lines.append(f"- {text}: {'met' if ok else 'NOT met'}")

    hit = med("affinity", "prefix_hit_rate")
    best_hit = max(med(n, "prefix_hit_rate") for n in others)
    if single is not None:  # the goal: 90% of a single replica's (simulated: an upper bound)
        check(f"prefix-hit rate {hit:.1%} vs 90% of one replica's {single:.1%}", hit >= 0.9 * single)
    if attainable:  # the trace's ceiling (higher, so stricter)
        check(f"prefix-hit rate {hit:.1%} vs 90% of the attainable {attainable:.1%}", hit >= 0.9 * attainable)
    lines.append(f"- (prefix-hit rate of the best other router: {best_hit:.1%})")

    a_tput, b_tput = med("affinity", "req_per_s"), med(best_tput, "req_per_s")
    check(f"throughput {a_tput:.2f} req/s vs best other ({best_tput}) {b_tput:.2f} ({a_tput / b_tput:.2f}x)",
          a_tput > b_tput)  # fmt: skip
    a_p99, b_p99 = med("affinity", "ttft_p99"), med(best_p99, "ttft_p99")
    check(f"TTFT p99 {a_p99:.2f} s vs best other ({best_p99}) {b_p99:.2f} s", a_p99 < b_p99)
    if "multiplex" in groups:
        a_l, m_l = med("affinity", "loads_per_1k"), med("multiplex", "loads_per_1k")
        check(f"adapter loads/1k {a_l:.0f} vs multiplex {m_l:.0f}", a_l <= m_l)
        a_b, m_b = med("affinity", "burst_ttft_p99"), med("multiplex", "burst_ttft_p99")
        ratio = a_b / m_b if m_b else float("inf")
        text = f"burst TTFT p99 {a_b:.2f} s vs multiplex {m_b:.2f} s ({ratio:.2f}x; goal <= 0.5x)"
        check(text, ratio <= 0.5)
    return lines
