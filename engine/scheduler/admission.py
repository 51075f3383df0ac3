"""Adapter-aware admission: requests whose adapter is resident go ahead of those whose adapter is not, for
a bounded number of steps.

When the adapters of the waiting requests do not all fit in the device pool, admitting in plain policy
order makes every admission upload an adapter, evicting (least recently used) the adapters that requests
further back in the queue are about to need: with a cyclic or random adapter order almost every request
misses the pool. Resident-first ordering instead takes the requests whose adapter is already resident
first, so an adapter's requests run while it is in the pool, and lists the missing adapters after the
resident ones in `Scheduler.adapters_wanted`, so uploads evict only adapters no earlier request wants.

    deferred(r) = r uses an adapter (of a mix: any member) that is not resident (or not known yet)
                  and r was never preempted and r.num_admission_bypasses < max_bypass_steps
    order       = policy order, stably re-sorted by (priority class, deferred)

The priority class is the request's `priority` under the `priority` policy and a single class otherwise:
a resident request never goes ahead of a more important one. The bound: each step in which a request is
deferred and some request behind it in policy order is admitted counts as a bypass; after
`max_bypass_steps` of them the request is no longer deferred and keeps its policy position from then on
(its adapter is wanted before those of every later request, so the engine loads it next). A preempted
request is never deferred: it was admitted once and goes back to the front. When every adapter is
resident nothing is deferred and the order is the policy's.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.sequence import Sequence


def is_deferred(seq: Sequence, is_resident: Callable[[str], bool], max_bypass_steps: int) -> bool:
    """Whether resident-first ordering puts `seq` behind the resident requests of its priority class."""
    if seq.lora_request is None and seq.lora_key is None:
        return False  # base model: nothing to load
    if seq.num_preemptions > 0 or seq.num_admission_bypasses >= max_bypass_steps:
        return False
    return seq.lora_key is None or not all(is_resident(k) for k in seq.adapter_keys)


def resident_first(policy: str, order: list[Sequence], deferred: set[int]) -> list[Sequence]:
    """`order` (the policy's) with the requests whose id() is in `deferred` moved behind the others of
    their priority class; stable otherwise."""
    if not deferred:
        return order

    def key(item: tuple[int, Sequence]) -> tuple[int, bool, int]:
        pos, seq = item
        return (seq.priority if policy == "priority" else 0, id(seq) in deferred, pos)

    return [seq for _, seq in sorted(enumerate(order), key=key)]


def count_bypasses(policy_order: list[Sequence], deferred: set[int], admitted: set[int]) -> None:
    """Count one bypass for every deferred request still waiting that is ahead, in `policy_order`, of a
    request admitted this step."""
    last = max((i for i, s in enumerate(policy_order) if id(s) in admitted), default=-1)
    for seq in policy_order[:last]:
        if id(seq) in deferred and id(seq) not in admitted:
            seq.num_admission_bypasses += 1
