"""Hot-adapter placement without Ray: spread past the load threshold up to the bound, contract once the
load stays low, rebalance onto a replica that came back, and the hot adapters' pins on replicas."""

from __future__ import annotations

import asyncio

from api.cluster.hot_pins import HotPins
from api.cluster.options import SpreadPolicy
from api.cluster.placement import Placements


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _placements(**kw) -> tuple[Placements, Clock]:
    clock = Clock()
    return Placements(SpreadPolicy(**kw), clock=clock), clock


def test_an_adapter_stays_on_one_replica_until_it_is_hot_then_spreads_up_to_the_bound() -> None:
    p, _ = _placements(load=0.5, max_replicas=2, contract_after_s=10)
    order = ["a", "b", "c"]
    assert p.place("d", "hot", order, {}) == ["a"]
    assert p.place("d", "hot", order, {"a": 0.4}) == ["a"]  # below the threshold: stays
    assert p.place("d", "hot", ["b", "a", "c"], {"a": 0.6}) == ["a", "b"]  # spreads to the best other
    assert p.place("d", "hot", order, {"a": 0.9, "b": 0.9}) == ["a", "b"]  # the bound: 2
    assert p.events.spreads == {"hot": 1}
    assert p.protected() == {"a": ["d"], "b": ["d"]}
    assert p.place("e", "cold", ["a", "b"], {}) == ["a"]
    assert p.protected() == {"a": ["d"], "b": ["d"]}  # a cold adapter is never protected


def test_a_spread_adapter_contracts_only_after_its_load_stays_low() -> None:
    p, clock = _placements(load=0.5, max_replicas=4, contract_after_s=10)
    order = ["a", "b"]
    p.place("d", "x", order, {})
    p.place("d", "x", order, {"a": 0.7})
    assert p.by_digest["d"].replicas == ["a", "b"]
    assert p.place("d", "x", order, {"a": 0.1, "b": 0.05}) == ["a", "b"]  # low, but not for long yet
    clock.t = 5
    assert p.place("d", "x", order, {"a": 0.3, "b": 0.3}) == ["a", "b"]  # high again: the timer restarts
    clock.t = 6
    p.place("d", "x", order, {"a": 0.1, "b": 0.05})
    clock.t = 15.9
    assert p.place("d", "x", order, {"a": 0.1, "b": 0.05}) == ["a", "b"]
    clock.t = 16
    assert p.place("d", "x", order, {"a": 0.1, "b": 0.05}) == ["a"]  # left the replica with less load
    assert p.events.contractions == {"x": 1} and p.protected() == {}


def test_a_replica_that_comes_back_takes_its_share_of_adapters() -> None:
    p, _ = _placements()
    for i, d in enumerate("wxyz"):
        p.place(d, d, ["a", "b"] if i % 2 else ["b", "a"], {})
    assert p.counts(["a", "b"]) == {"a": 2, "b": 2}
    p.forget_replica("b")  # b died: its adapters go to a
    for d in "wxyz":
        assert p.place(d, d, ["a"], {}) == ["a"]
    assert p.counts(["a"]) == {"a": 4}
    # b's replacement "c" is up: idle adapters move until both hold their fair share
    placed = [p.place(d, d, ["a", "c"], {})[0] for d in "wxyz"]
    assert p.counts(["a", "c"]) == {"a": 2, "c": 2}, placed
    assert sum(p.events.rebalances.values()) == 2
    # an adapter with requests in flight on its replica is never moved
    p.forget_replica("c")
    for d in "wxyz":
        p.place(d, d, ["a"], {})
    assert p.place("w", "w", ["a", "c"], {}, busy=lambda r: True) == ["a"]


def test_hot_pins_follow_the_leases() -> None:
    calls: list[tuple[str, bool]] = []

    async def pin(digest: str, pinned: bool) -> None:
        calls.append((digest, pinned))

    clock = Clock()
    pins = HotPins("r1", pin, max_pinned=1, lease_s=5, clock=clock)

    async def scenario() -> None:
        pins.renew({"r1": ["hot", "warm"], "r2": ["other"]})
        await pins.sync(resident=["hot"])  # only resident adapters are pinned
        assert pins.pinned == {"hot"}
        clock.t = 3
        pins.renew({"r1": ["warm"]})
        await pins.sync(resident=["hot", "warm"])  # the most recent lease wins the one pin
        assert pins.pinned == {"warm"}
        clock.t = 9
        await pins.sync(resident=["hot", "warm"])  # no renewal: the lease ended
        assert pins.pinned == set()

    asyncio.run(scenario())
    assert calls == [("hot", True), ("hot", False), ("warm", True), ("warm", False)]
