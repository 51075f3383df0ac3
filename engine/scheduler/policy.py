"""Scheduling policies: in which order waiting requests are admitted and running ones preempted."""

from __future__ import annotations

from collections.abc import Callable

from engine.sequence import Sequence

POLICIES = ("fcfs", "lpm", "priority")


def validate_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return name


def admission_order(
    policy: str, waiting: list[Sequence], cached_tokens: Callable[[Sequence], int]
) -> list[Sequence]:
    """Waiting requests in the order they should be admitted.

    - fcfs: queue order (preempted requests were put back at the front).
    - priority: lower `priority` value first, then arrival.
    - lpm: longest cached prefix first (most reuse before the cache churns), then queue order.
    """
    if policy == "fcfs":
        return list(waiting)
    if policy == "priority":
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))
    pos = {id(r): i for i, r in enumerate(waiting)}
    return sorted(waiting, key=lambda r: (-cached_tokens(r), pos[id(r)]))


def pick_victim(policy: str, candidates: list[Sequence]) -> Sequence:
    """The running request to preempt: the newest one, or under `priority` the least important."""
    if policy == "priority":
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))
    return candidates[-1]
