"""Online peer benchmark: loraplex vs vLLM CPU's OpenAI server on one Poisson workload (`bench serve-peer`).

    python -m bench.peer.online --vllm-python .venv-vllm/bin/python [--adapters 32] [--rank 16] \\
        [--rates 2,4,8] [--duration 15] [--threads 2] [--dtype float32] [--ttft-bound 1.0] [--alpha 1.1] \\
        [--prompt-len 8,64] [--output-len 8,64] [--servers loraplex,vllm] [--vllm-omp-bind auto] \\
        [--workdir DIR] [--json out.json] [--plot out.png]

The model directory and the PEFT adapters are the offline peer benchmark's
(`bench.peer.offline.build_workload`: the benchmark's random Llama, N rank-r adapters on all 7
projections), registered as `a0..a{N-1}` in a fresh loraplex data dir and given to vLLM as
`--lora-modules a0=DIR ...`, so on both servers a request names its adapter the same way: `model` = the
adapter's name on `POST /v1/completions`. Every rate's requests are planned once, before either server
runs (`bench.serving.client.plan_rate`: Poisson arrival times, adapter k with probability ∝
1/(k+1)^alpha, prompt token ids, max_tokens with `ignore_eos`), and the same plan is sent to each server,
streaming.

The servers run one after the other, never together, in `--servers` order: `loraplex serve` with
`--threads`, and vLLM's `vllm.entrypoints.openai.api_server` in its own virtualenv with the offline peer
benchmark's CPU environment (`bench.peer.offline.vllm_env`: KV space, its libgomp preloaded) except the
thread binding: by default vLLM's own `auto` (one core for its API server and engine core, the rest for
the worker's OpenMP threads), which served far better than binding the worker to every core (`0-1`, the
offline benchmark's setting) on the 2-core machine here; `--max-loras N --max-lora-rank r`, token-id
prompts (`--skip-tokenizer-init`). Each gets one
short request per adapter to warm up before the first rate. Reported per rate and server: output tok/s,
TTFT p50/p99, TPOT p50, errors; and the headline: each server's highest rate whose p99 TTFT stays within
`--ttft-bound` with no errors (its throughput there, and the ratio), and the throughput ratio at the
highest rate both sustain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.serving.client import PlannedRequest, RateResult, plan_rate, request_body, send_planned
from bench.serving.online import popularity

SYSTEMS = ("loraplex", "vLLM")


@dataclass(slots=True)
class OnlinePeerResult:
    """Per-rate results of both servers on one planned workload, and how the run was set up."""

    adapters: int
    rank: int
    threads: int
    dtype: str
    duration: float
    alpha: float
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    ttft_bound: float
    rates: dict[str, list[RateResult]] = field(default_factory=dict)  # system -> one per offered rate
    start_s: dict[str, float] = field(default_factory=dict)  # system -> seconds until /health answered
    load_avg: dict[str, list[float]] = field(default_factory=dict)  # system -> 1-min load before, after
    cpu: str = ""
    notes: list[str] = field(default_factory=list)  # settings that differ from the defaults

    def sustained(self, system: str) -> RateResult | None:
        """`system`'s highest offered rate with no failed request and p99 TTFT <= the bound."""
        return sustained(self.rates.get(system, []), self.ttft_bound)

    def common(self) -> tuple[RateResult, RateResult] | None:
        """(loraplex, vLLM) results at the highest offered rate both sustain, or None."""
        return common_rate(self.rates.get("loraplex", []), self.rates.get("vLLM", []), self.ttft_bound)

    def markdown(self) -> str:
        head = (
            "| offered req/s | server | sent | errors | output tok/s | TTFT p50 / p99 (s) | TPOT p50 (ms) |"
        )
        lines = [head, "|---|---|---|---|---|---|---|"]
        by_rate = sorted({r.rate for rs in self.rates.values() for r in rs})
        for rate in by_rate:
            for system in SYSTEMS:
                for r in self.rates.get(system, []):
                    if r.rate == rate:
                        lines.append(
                            f"| {rate:g} | {system} | {r.sent} | {r.sent - r.ok} | "
                            f"{r.output_tokens_per_s:.0f} | {r.ttft_p50:.2f} / {r.ttft_p99:.2f} | "
                            f"{r.tpot_p50 * 1e3:.0f} |"
                        )
        lines += ["", *self.headline()]
        lines.append(
            f"- {self.adapters} rank-{self.rank} adapters, popularity ∝ 1/(k+1)^{self.alpha:g}; prompts "
            f"{self.prompt_len[0]}-{self.prompt_len[1]} token ids, {self.output_len[0]}-{self.output_len[1]} "
            f"output tokens (ignore_eos); {self.duration:g} s of arrivals per rate; {self.threads} threads, "
            f"{self.dtype}"
        )
        if self.start_s:
            lines.append(
                "- start-up (until /health): " + ", ".join(f"{k} {v:.1f} s" for k, v in self.start_s.items())
            )
        lines += [f"- {note}" for note in self.notes]
        loads = ", ".join(f"{k} {v[0]:.1f} / {v[-1]:.1f}" for k, v in self.load_avg.items())
        lines.append(f"- CPU: {self.cpu}; load average (1 min) before / after each server's run: {loads}")
        return "\n".join(lines)

    def headline(self) -> list[str]:
        """The comparison at an equal p99 TTFT bound, as markdown bullet lines."""
        bound = f"p99 TTFT <= {self.ttft_bound:g} s, no errors"
        best = {s: self.sustained(s) for s in SYSTEMS if s in self.rates}
        parts = [
            f"{s} {r.rate:g} req/s ({r.output_tokens_per_s:.0f} tok/s)" if r else f"{s} none of the rates"
            for s, r in best.items()
        ]
        lines = [f"- highest offered rate with {bound}: " + ", ".join(parts)]
        lp, vl = best.get("loraplex"), best.get("vLLM")
        if lp and vl:
            lines.append(
                f"- throughput at each one's highest sustained rate, loraplex / vLLM: "
                f"**{ratio(lp.output_tokens_per_s, vl.output_tokens_per_s):.2f}x**"
            )
        both = self.common()
        if both:
            a, b = both
            lines.append(
                f"- at {a.rate:g} req/s, the highest rate both sustain: loraplex / vLLM throughput "
                f"{ratio(a.output_tokens_per_s, b.output_tokens_per_s):.2f}x, p99 TTFT "
                f"{a.ttft_p99:.2f} s vs {b.ttft_p99:.2f} s"
            )
        return lines

    def to_dict(self) -> dict:
        return asdict(self)


def sustained(results: list[RateResult], bound: float) -> RateResult | None:
    """The result of the highest offered rate with no failed request and p99 TTFT <= `bound`."""
    ok = [r for r in results if r.sent > 0 and r.ok == r.sent and r.ttft_p99 <= bound]
    return max(ok, key=lambda r: r.rate) if ok else None


def common_rate(
    a: list[RateResult], b: list[RateResult], bound: float
) -> tuple[RateResult, RateResult] | None:
    """(a's, b's) results at the highest rate offered to both that both sustain within `bound`, or None."""
    b_by_rate = {r.rate: r for r in b}
    pairs = [(x, b_by_rate[x.rate]) for x in a if x.rate in b_by_rate]
    pairs = [(x, y) for x, y in pairs if sustained([x], bound) and sustained([y], bound)]
    return max(pairs, key=lambda p: p[0].rate) if pairs else None


def ratio(num: float, den: float) -> float:
    """num / den, infinite when only the denominator is 0."""
    return num / den if den > 0 else float("inf")


def plan_all(
    rates: list[float],
    adapters: int,
    alpha: float,
    duration: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[list[PlannedRequest]]:
    """One planned workload per rate, each request on one of the adapters. A rate's seed depends on the
    rate itself (not on its place in `rates`), so adding a rate to a run leaves the others' requests as
    they were."""
    weights = popularity(adapters, alpha)
    return [plan_rate(weights, r, duration, prompt_len, output_len, seed + round(r * 1000)) for r in rates]


async def warm_up(url: str, names: list[str]) -> None:
    """One 2-token request per adapter, concurrently; raises RuntimeError if any fails."""
    plan = [PlannedRequest(0.0, i, [5, 6, 7, 8], 2) for i in range(len(names))]
    res = await send_planned(url, names, plan, rate=0.0)
    if res.ok != res.sent:
        body = json.dumps(request_body(names[0], plan[0].prompt, 2))
        raise RuntimeError(
            f"{res.sent - res.ok} of {res.sent} warm-up requests to {url} failed (e.g. {body})"
        )


def bench_server(
    url: str, names: list[str], rates: list[float], plans: list[list[PlannedRequest]]
) -> list[RateResult]:
    """Warm the server up, then send each rate's planned workload in turn."""
    asyncio.run(warm_up(url, names))
    return [
        asyncio.run(send_planned(url, names, plan, rate)) for rate, plan in zip(rates, plans, strict=True)
    ]


def run_online_peer(
    vllm_python: Path | None,
    workdir: Path,
    rates: list[float],
    adapters: int = 32,
    rank: int = 16,
    threads: int = 2,
    dtype: str = "float32",
    duration: float = 15.0,
    alpha: float = 1.1,
    prompt_len: tuple[int, int] = (8, 64),
    output_len: tuple[int, int] = (8, 64),
    ttft_bound: float = 1.0,
    order: tuple[str, ...] = SYSTEMS,
    vllm_bind: str = "auto",
) -> OnlinePeerResult:
    """Build the workload, then serve and benchmark each system in `order`, one at a time (vLLM needs
    `vllm_python`; `vllm_bind` is its VLLM_CPU_OMP_THREADS_BIND, "auto" or a core list like "0-1")."""
    from bench.common.hog import cpu_summary, load_average
    from bench.peer.offline import build_workload
    from bench.peer.servers import peer_server

    result = OnlinePeerResult(
        adapters, rank, threads, dtype, duration, alpha, prompt_len, output_len, ttft_bound
    )
    result.cpu = cpu_summary()
    wl = build_workload(workdir, adapters=adapters, requests=1, rank=rank, dtype=dtype)
    named = {f"a{i}": d for i, d in enumerate(wl.adapters)}
    plans = plan_all(rates, adapters, alpha, duration, prompt_len, output_len)
    for system in order:
        if system == "vLLM" and vllm_python is None:
            raise ValueError("benchmarking vLLM needs the python of its virtualenv")
        t0, load0 = time.perf_counter(), load_average()[0]
        with peer_server(
            system, workdir, wl.model, named, threads, wl.max_lora_rank, dtype, vllm_python, vllm_bind
        ) as url:
            result.start_s[system] = time.perf_counter() - t0
            result.rates[system] = bench_server(url, list(named), rates, plans)
            result.load_avg[system] = [load0, load_average()[0]]
    if "vLLM" in order:
        result.notes.append(f"vLLM with VLLM_CPU_OMP_THREADS_BIND={vllm_bind}")
    return result


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    pair = (int(lo), int(hi or lo))
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return pair


def main(argv: list[str] | None = None) -> OnlinePeerResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, help="python of the vLLM CPU virtualenv")
    ap.add_argument(
        "--servers",
        default="loraplex,vllm",
        help="which servers to benchmark, in this order (loraplex, vllm)",
    )
    ap.add_argument(
        "--vllm-omp-bind",
        default="auto",
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's default: a core for its frontend, the rest to "
        "the worker) or a core list like 0-1 (all cores to the worker, as the offline peer benchmark)",
    )
    ap.add_argument("--rates", default="2,4,8", help="comma-separated offered arrival rates (req/s)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="engine threads of each server")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--alpha", type=float, default=1.1, help="power-law exponent of adapter popularity")
    ap.add_argument("--prompt-len", type=_pair, default=(8, 64), help="LO,HI prompt token ids")
    ap.add_argument("--output-len", type=_pair, default=(8, 64), help="LO,HI output tokens")
    ap.add_argument("--ttft-bound", type=float, default=1.0, help="p99 TTFT bound (s) of the headline")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/loraplex-peer"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG: throughput and p99 TTFT vs offered rate")
    args = ap.parse_args(argv)
    try:
        rates = sorted(float(r) for r in args.rates.split(","))
    except ValueError:
        ap.error(f"--rates: expected comma-separated numbers, got {args.rates!r}")
    if not rates or rates[0] <= 0 or args.duration <= 0 or args.adapters < 1 or args.threads < 1:
        ap.error("rates, --duration, --adapters and --threads must be > 0")
    known = {s.lower(): s for s in SYSTEMS}
    order = tuple(known.get(s.strip().lower(), s) for s in args.servers.split(","))
    if not order or any(s not in SYSTEMS for s in order) or len(set(order)) != len(order):
        ap.error(f"--servers: a comma-separated list of loraplex and vllm, got {args.servers!r}")
    if "vLLM" in order and (args.vllm_python is None or not args.vllm_python.exists()):
        ap.error(
            "give --vllm-python of a vLLM CPU virtualenv (`make bench-peer-venv` creates one), "
            "or --servers loraplex"
        )
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_online_peer(
        args.vllm_python, args.workdir, rates, adapters=args.adapters, rank=args.rank, threads=args.threads,
        dtype=args.dtype, duration=args.duration, alpha=args.alpha, prompt_len=args.prompt_len,
        output_len=args.output_len, ttft_bound=args.ttft_bound, order=order, vllm_bind=args.vllm_omp_bind,
    )  # fmt: skip
    from bench.common.plots import plot_online_peer
    from bench.common.workload import report

    report(result, args.json, args.plot, plot_online_peer)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
