"""Router weight sweep: the affinity router's own code against simulated replicas, to choose its defaults.

    python -m bench.cluster.router_sweep --replicas 2 --requests 1500 --rate 8 --seeds 3

No Ray and no model: each simulated replica has the engine's real KV cache (`KVCacheManager`, its prefix
cache evicting LRU, reporting through `HeldBlocks` once per `--report-s`, as a replica does), an adapter
pool of `--pool` slots (LRU; a miss costs `--load-s`), and one FIFO server whose time per request is
`prefill_s_per_token · uncached prompt tokens + decode_s · new tokens`. Routing uses the router's real
`rank` (score, prefix index with its TTL) and `Placements` (spread, contract, rebalance). Traffic, with
arrivals (Poisson) above what the replicas drain: 8 shared system prompts × 16 adapters with power-law
popularity, base-model multi-turn chats (each turn's prompt extends the last), and a burst phase in the
middle where one adapter takes 70% of the traffic. Reported per setting, mean and min–max over
`--seeds` runs with identical arrivals for every setting: prefix-hit rate (engine's hit tokens / prompt
tokens), adapter loads per 1k requests, p50/p99 TTFT, p99 TTFT in the burst, throughput.

    python -m bench.cluster.router_sweep --serve --replicas 2 --requests 1500 --rate 8 --seeds 3

runs the routers (`multiplex`, `pow2`, the affinity router) behind a model of Ray Serve's dispatch
instead (`max_ongoing_requests`, its queue; `bench.cluster.serve_sim`), over the affinity router's
queue settings (`--router-max-ongoing`, `--router-hold-margin`) rather than the weight grid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from api.cluster.options import RouterWeights, SpreadPolicy
from api.cluster.placement import Placements
from api.cluster.prefix_report import HeldBlocks
from api.cluster.router_score import PrefixIndex, ReplicaView, prompt_block_hashes, rank, share
from api.engine_protocol import KVEventsMsg
from engine.kv_cache import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 16


@dataclass(slots=True)
class Req:
    t: float
    tokens: list[int]
    adapter: str | None
    new_tokens: int
    burst: bool


@dataclass
class Sim:
    prefill_s_per_token: float = 0.0004
    decode_s: float = 0.004
    load_s: float = 0.25
    pool: int = 4
    kv_blocks: int = 512
    max_seqs: int = 16
    report_s: float = 1.0


@dataclass
class Replica:
    rid: str
    sim: Sim
    kv: KVCacheManager = field(init=False)
    held: HeldBlocks = field(init=False)
    pool: OrderedDict[str, None] = field(default_factory=OrderedDict)
    free_at: float = 0.0
    loads: int = 0
    finishing: list[tuple[float, int, str | None, int]] = field(default_factory=list)  # (t, tokens, ...)

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.sim.kv_blocks, BS)
        self.kv.pool.enable_events()
        self.held = HeldBlocks(self.sim.kv_blocks)

    def report(self) -> None:
        ev = self.kv.pool.take_events()
        assert ev is not None
        self.held.apply(KVEventsMsg(ev.reset, ev.stored, ev.removed))

    def serve(self, req: Req, now: float, n: int) -> tuple[float, float]:
        """(time of first token, finish time) of `req` arriving now."""
        start = max(now, self.free_at)
        cost = 0.0
        if req.adapter is not None:
            if req.adapter in self.pool:
                self.pool.move_to_end(req.adapter)
            else:
                self.loads += 1
                cost += self.sim.load_s
                self.pool[req.adapter] = None
                if len(self.pool) > self.sim.pool:
                    self.pool.popitem(last=False)
        seq = Sequence(
            f"s{n}",
            req.tokens,
            SamplingParams(max_tokens=1),
            0.0,
            lora_key=req.adapter,
            max_total_tokens=1 << 20,
        )
        blocks, cached = self.kv.find_cached_prefix(seq)
        self.kv.record_lookup(seq, cached)
        if self.kv.allocate_slots(seq, len(req.tokens) - cached, blocks):
            self.kv.free(seq)
        cost += self.sim.prefill_s_per_token * (len(req.tokens) - cached)
        first = start + cost
        self.free_at = first + self.sim.decode_s * req.new_tokens
        return first, self.free_at


def workload(n: int, rate: float, seed: int) -> list[Req]:
    """The traffic of the module doc, `n` requests at `rate` per second."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(rng.choice((128, 256, 384)))] for _ in range(8)]
    adapters = [f"adapter-{i:02d}" for i in range(16)]
    weights = [1 / (k + 1) ** 1.1 for k in range(16)]
    chats: list[list[int]] = [[rng.randrange(1, 30000) for _ in range(64)] for _ in range(24)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        burst = 0.4 * n <= i < 0.6 * n
        kind = rng.random()
        if burst and kind < 0.7:
            adapter = adapters[5]
            tokens = systems[5 % 8] + [rng.randrange(1, 30000) for _ in range(rng.randrange(16, 64))]
        elif kind < 0.75:
            k = rng.choices(range(16), weights)[0]
            adapter = adapters[k]
            tokens = systems[k % 8] + [rng.randrange(1, 30000) for _ in range(rng.randrange(16, 96))]
        else:
            adapter = None
            c = rng.randrange(len(chats))
            chats[c] = chats[c] + [rng.randrange(1, 30000) for _ in range(rng.randrange(16, 48))]
            if len(chats[c]) > 1500:
                chats[c] = chats[c][:64]
            tokens = list(chats[c])
        out.append(Req(t, tokens, adapter, rng.randrange(16, 96), burst))
    return out


def run(reqs: list[Req], replicas: int, weights: RouterWeights, policy: SpreadPolicy, sim: Sim) -> dict:
    """One simulated run; the metrics of the module doc."""
    reps = {f"r{i}": Replica(f"r{i}", sim) for i in range(replicas)}
    index = PrefixIndex(ttl_s=5.0)
    placements = Placements(policy, clock=lambda: now)
    inflight: dict[str, list[tuple[float, int, str | None]]] = {r: [] for r in reps}
    now, next_report = 0.0, sim.report_s
    ttft: list[float] = []
    burst_ttft: list[float] = []
    last = 0.0
    for n, req in enumerate(reqs):
        now = req.t
        while next_report <= now:
            for rid, r in reps.items():
                r.report()
                index.reported(rid, now=next_report)
            next_report += sim.report_s
        for rid, items in inflight.items():
            inflight[rid] = [x for x in items if x[0] > now]
        views = []
        for rid, r in reps.items():
            items = inflight[rid]
            views.append(
                ReplicaView(
                    rid,
                    device=frozenset(r.pool),
                    free_slot=len(r.pool) < sim.pool,
                    budget_tokens=sim.kv_blocks * BS,
                    in_flight_tokens=sum(x[1] for x in items),
                    max_seqs=sim.max_seqs,
                    in_flight_requests=len(items),
                    held=r.held.summary(),
                )
            )
        hashes = prompt_block_hashes(req.tokens, BS, req.adapter)
        ranked = rank(views, index, weights, hashes, BS, len(req.tokens), req.adapter)
        order = [v.replica_id for v, _ in ranked]
        if req.adapter is not None:
            by_id = {v.replica_id: v for v in views}
            load = {}
            for rid in order:
                mine = [x for x in inflight[rid] if x[2] == req.adapter]
                load[rid] = share(by_id[rid], sum(x[1] for x in mine), len(mine))
            allowed = placements.place(
                req.adapter,
                req.adapter,
                order,
                load,
                busy=lambda r, a=req.adapter: any(x[2] == a for x in inflight[r]),
            )
            order = [r for r in order if r in allowed]
        chosen = order[0]
        index.record(chosen, hashes, sim.kv_blocks, now=now)
        first, done = reps[chosen].serve(req, now, n)
        inflight[chosen].append((done, len(req.tokens) + req.new_tokens, req.adapter))
        ttft.append(first - now)
        if req.burst:
            burst_ttft.append(first - now)
        last = max(last, done)
    return summary(reps, len(reqs), ttft, burst_ttft, last, placements)


def summary(
    reps: dict[str, Replica],
    requests: int,
    ttft: list[float],
    burst_ttft: list[float],
    last: float,
    placements: Placements,
) -> dict[str, float]:
    """One simulated run's figures: the replicas' prefix-hit rate and adapter loads per 1k requests, TTFT
    p50/p99 (all requests, and the burst's p99), throughput (requests over the last completion time), and
    the placements' spreads and contractions."""
    queries = sum(r.kv.prefix_queries for r in reps.values())
    hits = sum(r.kv.prefix_hits for r in reps.values())
    q = statistics.quantiles(ttft, n=100)
    qb = statistics.quantiles(burst_ttft, n=100)
    return {
        "prefix_hit_rate": hits / queries,
        "loads_per_1k": 1000 * sum(r.loads for r in reps.values()) / requests,
        "ttft_p50": q[49],
        "ttft_p99": q[98],
        "burst_ttft_p99": qb[98],
        "throughput": requests / last,
        "spreads": sum(placements.events.spreads.values()),
        "contractions": sum(placements.events.contractions.values()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second (above what 2 drain)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--serve",
        action="store_true",
        help="through Serve's dispatch (max_ongoing_requests, its queue; bench.cluster.serve_sim): the "
        "routers and the affinity router's queue settings instead of the weight grid",
    )
    args = ap.parse_args(argv)
    sim = Sim()
    if args.serve:
        serve_main(args, sim)
        return
    loads = {0.25, 0.5, 1.0}
    grid = list(itertools.product((0.5, 1.0, 2.0, 4.0), (1.0,), (0.5, 1.0, 2.0, 4.0)))
    grid += [(1.0, 0.5, 2.0), (1.0, 2.0, 2.0), (2.0, 0.5, 2.0), (2.0, 2.0, 2.0), (1.0, 4.0, 2.0)]
    traffic = [workload(args.requests, args.rate, seed) for seed in range(args.seeds)]
    results = []
    settings = [(RouterWeights(*w), SpreadPolicy(0.5)) for w in grid]
    settings += [(RouterWeights(), SpreadPolicy(x)) for x in sorted(loads)]
    settings += [(RouterWeights(), SpreadPolicy(0.5, max_replicas=1))]  # no spreading at all
    for weights, policy in settings:
        runs = [run(reqs, args.replicas, weights, policy, sim) for reqs in traffic]
        row = {"w_prefix": weights.prefix, "w_adapter": weights.adapter, "w_load": weights.load}
        row |= {"spread_load": policy.load, "max_spread": policy.max_replicas}
        for k in runs[0]:
            vals = [r[k] for r in runs]
            row[k] = (statistics.mean(vals), min(vals), max(vals))
        results.append(row)
        print(_line(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def serve_settings(max_seqs: int) -> list:
    """The `--serve` settings: Serve's routers at `max_ongoing = max_num_seqs` as deployed, the affinity
    router as it was (every replica offered, spread by capacity share), then its queue settings."""
    from bench.cluster.serve_sim import ServeModel

    inf = float("inf")
    out = [
        ServeModel("multiplex", max_seqs),
        ServeModel("pow2", max_seqs),
        ServeModel("affinity", max_seqs, inf, relative_share=False),
        ServeModel("affinity", max_seqs, inf),
    ]
    for factor in (1, 4, 8, 64):
        for margin in (inf, 1.0, 0.5, 0.25):
            if (factor, margin) != (1, inf):
                out.append(ServeModel("affinity", factor * max_seqs, margin))
    return out


def serve_main(args: argparse.Namespace, sim: Sim) -> None:
    """`--serve`: every `serve_settings` on the same traffic, mean (min–max) over the seeds."""
    from bench.cluster.serve_sim import run_serve

    traffic = [workload(args.requests, args.rate, seed) for seed in range(args.seeds)]
    results = []
    for model in serve_settings(sim.max_seqs):
        runs = [run_serve(r, args.replicas, RouterWeights(), SpreadPolicy(), sim, model) for r in traffic]
        row: dict = {"setting": model.label(), "router": model.router, "max_ongoing": model.max_ongoing}
        row |= {"hold_margin": model.hold_margin, "relative_share": model.relative_share}
        for k in runs[0]:
            vals = [r[k] for r in runs]
            row[k] = (statistics.mean(vals), min(vals), max(vals))
        results.append(row)
        print(_serve_line(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def _serve_line(row: dict) -> str:
    def f(k: str, fmt: str = "{:.3f}") -> str:
        mean, lo, hi = row[k]
        return f"{fmt.format(mean)} ({fmt.format(lo)}–{fmt.format(hi)})"

    keys = ("prefix_hit_rate", "loads_per_1k", "ttft_p50", "ttft_p99", "burst_ttft_p99", "throughput")
    fmts = ("{:.3f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.2f}")
    cells = [f(k, fm) for k, fm in zip(keys, fmts, strict=True)]
    cells += [f"{row['peak_serve_queue'][0]:.0f}", f"{row['peak_engine_waiting'][0]:.0f}"]
    return f"| {row['setting']} | " + " | ".join(cells) + " |"


def _line(row: dict) -> str:
    def f(k: str, fmt: str = "{:.3f}") -> str:
        mean, lo, hi = row[k]
        return f"{fmt.format(mean)} ({fmt.format(lo)}–{fmt.format(hi)})"

    keys = ("w_prefix", "w_adapter", "w_load", "spread_load", "max_spread")
    head = "| " + " | ".join(str(row[k]) for k in keys) + " "
    cells = [
        f("prefix_hit_rate"),
        f("loads_per_1k", "{:.1f}"),
        f("ttft_p50"),
        f("ttft_p99"),
        f("burst_ttft_p99"),
    ]
    return head + "| " + " | ".join([*cells, f("throughput", "{:.1f}")]) + " |"


if __name__ == "__main__":
    main()
