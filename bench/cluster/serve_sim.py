"""Ray Serve's dispatch in front of the simulated replicas of `router_sweep` (its `--serve` mode).

`router_sweep.run` sends each request to its router's first choice at arrival, with no limit on a
replica's queue. Serve does not: a request goes to a replica only while that replica has fewer than
`max_ongoing_requests` requests (routed, not finished); otherwise Serve keeps it in its own FIFO queue,
and only `2 × replicas` routing tasks look at the queue's head at once. Each task asks the router for
ranks (`choose_replicas`) and takes the first rank with a replica under the limit (the one with the
fewest ongoing requests), the next rank only when that one is full; with every offered replica full the
task waits and asks again. Modelled here as an event loop (arrivals, completions, replica reports): at
every event the head's tasks are dispatched in order until none can go. Routers:

* `affinity`: the affinity router's own code (`rank`, `Placements`, `held_ranks`, the spread share,
  `PrefixIndex`), counting a waiting head request on its first choice meanwhile, as the router does;
* `multiplex`: Serve's multiplexing: the replicas holding the adapter (its LRU: the replica's pool),
  else those holding the fewest; after `multiplex_timeout_s` of waiting, those, then every replica;
* `pow2`: every replica (the fewest ongoing).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from api.cluster.options import RouterWeights, SpreadPolicy
from api.cluster.placement import Placements
from api.cluster.router_score import (
    PrefixIndex,
    ReplicaView,
    adapter_share,
    held_ranks,
    prompt_block_hashes,
    rank,
    score,
    share,
)
from bench.cluster.router_sweep import BS, Replica, Req, Sim, summary


@dataclass(frozen=True, slots=True)
class ServeModel:
    """Serve's side of one simulated setting."""

    router: str = "affinity"  # affinity | multiplex | pow2
    max_ongoing: int = 16  # per replica
    hold_margin: float = math.inf  # affinity: offer only replicas within this of the best score
    relative_share: bool = True  # affinity: an adapter's spread load as its share of a queued replica
    multiplex_timeout_s: float = 1.0  # Serve's RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S

    def label(self) -> str:
        if self.router != "affinity":
            return f"{self.router} (max_ongoing {self.max_ongoing})"
        margin = "inf" if math.isinf(self.hold_margin) else f"{self.hold_margin:g}"
        spread = "queue share" if self.relative_share else "capacity share"
        return f"affinity (max_ongoing {self.max_ongoing}, hold margin {margin}, spread by {spread})"


@dataclass(slots=True)
class _Routed:
    done: float
    tokens: int
    adapter: str | None


def run_serve(
    reqs: list[Req], replicas: int, weights: RouterWeights, policy: SpreadPolicy, sim: Sim, model: ServeModel
) -> dict:
    """One simulated run through Serve's dispatch; `router_sweep.run`'s metrics plus the peak of Serve's
    queue and of the replicas' queues."""
    reps = {f"r{i}": Replica(f"r{i}", sim) for i in range(replicas)}
    now = 0.0
    index = PrefixIndex(ttl_s=5.0)
    placements = Placements(policy, clock=lambda: now)
    routed: dict[str, dict[int, _Routed]] = {r: {} for r in reps}
    pending: deque[int] = deque()
    first_try: dict[int, float] = {}
    completions: list[tuple[float, str, int]] = []
    ttft: dict[int, float] = {}
    tasks = 2 * replicas
    next_report, i, last = sim.report_s, 0, 0.0
    peak_serve = peak_engine = 0
    spread_share: Callable[[ReplicaView, int, int], float] = adapter_share if model.relative_share else share

    def view(rid: str, extra: list[tuple[int, str | None]]) -> ReplicaView:
        items = list(routed[rid].values())
        r = reps[rid]
        return ReplicaView(
            rid,
            device=frozenset(r.pool),
            free_slot=len(r.pool) < sim.pool,
            budget_tokens=sim.kv_blocks * BS,
            in_flight_tokens=sum(x.tokens for x in items) + sum(t for t, _ in extra),
            max_seqs=sim.max_seqs,
            in_flight_requests=len(items) + len(extra),
            held=r.held.summary(),
        )

    def affinity_ranks(req: Req, waiting: dict[str, list[tuple[int, str | None]]]) -> list[list[str]]:
        views = [view(rid, waiting[rid]) for rid in reps]
        hashes = prompt_block_hashes(req.tokens, BS, req.adapter)
        ranked = rank(views, index, weights, hashes, BS, len(req.tokens), req.adapter)
        if req.adapter is not None:
            by_id = {v.replica_id: v for v in views}
            load = {}
            for rid in by_id:
                mine = [x.tokens for x in routed[rid].values() if x.adapter == req.adapter]
                mine += [t for t, a in waiting[rid] if a == req.adapter]
                load[rid] = spread_share(by_id[rid], sum(mine), len(mine))
            order = [v.replica_id for v, _ in ranked]
            allowed = set(
                placements.place(
                    req.adapter,
                    req.adapter,
                    order,
                    load,
                    busy=lambda r, a=req.adapter: any(x.adapter == a for x in routed[r].values()),
                )
            )
            ranked = [(v, c) for v, c in ranked if v.replica_id in allowed]
        scored = [(v.replica_id, score(v, weights, c, len(req.tokens), req.adapter)) for v, c in ranked]
        return held_ranks(scored, model.hold_margin)

    def multiplex_ranks(req: Req, n: int) -> list[list[str]]:
        every = list(reps)
        if req.adapter is None or model.router == "pow2":
            return [every]
        fewest = min(len(r.pool) for r in reps.values())
        fewest_reps = [rid for rid, r in reps.items() if len(r.pool) == fewest]
        holders = [rid for rid, r in reps.items() if req.adapter in r.pool]
        if now - first_try.setdefault(n, now) < model.multiplex_timeout_s:
            return [holders or fewest_reps]
        return [fewest_reps, every]

    def dispatch() -> None:
        """Route the head of Serve's queue until none of its routing tasks' requests can go."""
        progress = True
        while progress and pending:
            progress = False
            waiting: dict[str, list[tuple[int, str | None]]] = {r: [] for r in reps}
            for n in list(pending)[:tasks]:
                req = reqs[n]
                affinity = model.router == "affinity"
                ranks = affinity_ranks(req, waiting) if affinity else multiplex_ranks(req, n)
                chosen = None
                for group in ranks:
                    free = [r for r in group if len(routed[r]) < model.max_ongoing]
                    if free:
                        chosen = min(free, key=lambda r: (len(routed[r]), r))
                        break
                if chosen is None:
                    if ranks and ranks[0]:
                        waiting[ranks[0][0]].append((len(req.tokens) + req.new_tokens, req.adapter))
                    continue
                pending.remove(n)
                index.record(chosen, prompt_block_hashes(req.tokens, BS, req.adapter), sim.kv_blocks, now=now)
                first, done = reps[chosen].serve(req, now, n)
                routed[chosen][n] = _Routed(done, len(req.tokens) + req.new_tokens, req.adapter)
                heapq.heappush(completions, (done, chosen, n))
                ttft[n] = first - req.t
                progress = True
                break

    while i < len(reqs) or completions:
        t_arrival = reqs[i].t if i < len(reqs) else math.inf
        t_done = completions[0][0] if completions else math.inf
        now = min(t_arrival, t_done)
        while next_report <= now:
            for rid, r in reps.items():
                r.report()
                index.reported(rid, now=next_report)
            next_report += sim.report_s
        if t_done <= t_arrival:
            _, rid, n = heapq.heappop(completions)
            del routed[rid][n]
            last = max(last, now)
        else:
            pending.append(i)
            i += 1
        dispatch()
        peak_serve = max(peak_serve, len(pending))
        peak_engine = max(peak_engine, max(max(0, len(x) - sim.max_seqs) for x in routed.values()))
    assert not pending and len(ttft) == len(reqs)
    burst = [ttft[n] for n, r in enumerate(reqs) if r.burst]
    figures = summary(reps, len(reqs), list(ttft.values()), burst, last, placements)
    return figures | {"peak_serve_queue": peak_serve, "peak_engine_waiting": peak_engine}
