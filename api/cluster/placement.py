"""Where the affinity router places each adapter: one replica, spread over more while it is hot (no Ray).

Each adapter has an ordered placement (its replicas, the first its home). A request for it goes to one of
those replicas only (the best by score), so an adapter's pages live on as few replicas as its load needs:

* **first request** (or every replica it was on is gone): placed on the best replica by score;
* **spread**: when the adapter's own load (`share` of its in-flight tokens / requests) is at least
  `policy.load` on every replica it is on, it gains the best other replica by score, up to
  `policy.max_replicas`;
* **contract**: when, for `policy.contract_after_s` seconds, its load summed over its replicas would stay
  under half of `policy.load` on one replica fewer, it leaves the replica where its load is lowest;
* **rebalance**: a replica that holds more placements than its fair share (`ceil(placed / replicas)`)
  while another holds fewer (a replica came back after a restart, empty) hands one adapter over, one that
  has no request in flight there, so a restarted replica takes its share again instead of idling.

Spread adapters (on two replicas or more) are hot: `protected()` names, per replica, those placed there,
and the replica keeps their pages from being evicted by colder adapters (`api.cluster.replica`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from api.cluster.options import SpreadPolicy

log = logging.getLogger("loraplex.router")


@dataclass(slots=True)
class Placement:
    replicas: list[str]
    name: str = ""  # the adapter's name when last seen (for logs and metrics)
    last_used: float = 0.0
    low_since: float | None = None  # since when the adapter's load would fit on one replica fewer


@dataclass(slots=True)
class PlacementEvents:
    """Counts of placement changes, by adapter name (for the ingress's `/metrics`)."""

    spreads: dict[str, int] = field(default_factory=dict)
    contractions: dict[str, int] = field(default_factory=dict)
    rebalances: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def bump(counts: dict[str, int], name: str) -> None:
        counts[name] = counts.get(name, 0) + 1


class Placements:
    """Every adapter's placement and the policy that changes it (see the module doc)."""

    def __init__(
        self, policy: SpreadPolicy, clock: Callable[[], float] = time.monotonic, forget_after_s: float = 600.0
    ) -> None:
        self.policy = policy
        self.forget_after_s = forget_after_s  # an adapter unused this long no longer counts as placed
        self.clock = clock
        self.by_digest: dict[str, Placement] = {}
        self.events = PlacementEvents()

    def place(
        self,
        digest: str,
        name: str,
        by_score: Sequence[str],
        load: Mapping[str, float],
        busy: Callable[[str], bool] = lambda replica: False,
    ) -> list[str]:
        """The replicas a request for adapter `digest` may go to, after applying the policy. `by_score`:
        the live replicas best first for this request; `load`: the adapter's own load on each replica;
        `busy(replica)`: whether the adapter has requests in flight there (a rebalance moves only an idle
        adapter)."""
        live = set(by_score)
        p = self.by_digest.get(digest)
        if p is None:
            p = self.by_digest[digest] = Placement([])
        p.name = name or p.name
        p.last_used = self.clock()
        p.replicas = [r for r in p.replicas if r in live]
        if not p.replicas:
            p.replicas = [by_score[0]]
            return list(p.replicas)
        self._spread_or_contract(digest, p, by_score, load)
        if len(p.replicas) == 1 and not busy(p.replicas[0]):
            self._rebalance(digest, p, by_score)
        return list(p.replicas)

    def _spread_or_contract(
        self, digest: str, p: Placement, by_score: Sequence[str], load: Mapping[str, float]
    ) -> None:
        pol = self.policy
        loads = [load.get(r, 0.0) for r in p.replicas]
        bound = min(pol.max_replicas, len(by_score))
        if len(p.replicas) < bound and min(loads) >= pol.load:
            extra = next(r for r in by_score if r not in p.replicas)
            p.replicas.append(extra)
            p.low_since = None
            self.events.bump(self.events.spreads, p.name)
            log.info(
                "adapter %s (%s) is hot (load %s): spread to %s, now on %d replica(s)",
                p.name, digest[:12], ", ".join(f"{x:.2f}" for x in loads), extra, len(p.replicas),
            )  # fmt: skip
            return
        if len(p.replicas) < 2 or sum(loads) >= pol.load / 2 * (len(p.replicas) - 1):
            p.low_since = None
            return
        now = self.clock()
        if p.low_since is None:
            p.low_since = now
        if now - p.low_since < pol.contract_after_s:
            return
        coldest = min(p.replicas, key=lambda r: (load.get(r, 0.0), -p.replicas.index(r)))
        p.replicas.remove(coldest)
        p.low_since = None
        self.events.bump(self.events.contractions, p.name)
        log.info(
            "adapter %s (%s) cooled (load %.2f): contracted off %s, now on %d replica(s)",
            p.name, digest[:12], sum(loads), coldest, len(p.replicas),
        )  # fmt: skip

    def _rebalance(self, digest: str, p: Placement, by_score: Sequence[str]) -> None:
        """Move this idle, single-replica adapter to the best replica by score that holds fewer than the
        fair share of placements, if its own replica holds more than that share."""
        counts = self.counts(by_score)
        fair = math.ceil(sum(counts.values()) / max(1, len(by_score)))
        home = p.replicas[0]
        if counts[home] <= fair:
            return
        target = next((r for r in by_score if r != home and counts[r] < fair), None)
        if target is None:
            return
        p.replicas = [target]
        self.events.bump(self.events.rebalances, p.name)
        log.info(
            "adapter %s (%s) rebalanced from %s (%d adapters) to %s (%d)",
            p.name, digest[:12], home, counts[home], target, counts[target],
        )  # fmt: skip

    def counts(self, replicas: Sequence[str]) -> dict[str, int]:
        """How many adapters are placed on each of `replicas`."""
        counts = dict.fromkeys(replicas, 0)
        recent = self.clock() - self.forget_after_s
        for p in self.by_digest.values():
            for r in p.replicas if p.last_used >= recent else ():
                if r in counts:
                    counts[r] += 1
        return counts

    def protected(self) -> dict[str, list[str]]:
        """Per replica, the digests of the spread (hot) adapters placed there."""
        out: dict[str, list[str]] = {}
        for digest, p in self.by_digest.items():
            if len(p.replicas) > 1:
                for r in p.replicas:
                    out.setdefault(r, []).append(digest)
        return out

    def spread_of(self) -> dict[str, int]:
        """Replicas each adapter (by name) is placed on now."""
        for _ in range(10):  # read from another thread (the ingress's `/metrics`)
            try:
                return {p.name: len(p.replicas) for p in list(self.by_digest.values()) if p.replicas}
            except RuntimeError:
                continue
        return {}

    def forget_replica(self, replica: str) -> None:
        """A replica died: it leaves every placement (an adapter left with none is placed afresh)."""
        for p in self.by_digest.values():
            if replica in p.replicas:
                p.replicas.remove(replica)
