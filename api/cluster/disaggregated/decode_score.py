"""Which decode replica continues a request: adapter residency, free KV blocks and load (plain Python).

    score(r) = w_adapter · (1 if the adapter is in r's device pool, ½ if in its host memory, else 0)
             + w_kv · (free KV blocks of r / its KV blocks)
             − w_load · (requests routed to r and not finished / its max running sequences)

The base model's requests have no adapter term. Ties go to the replica with the fewest requests in
flight, then its id. A replica that has not reported yet counts as empty (all blocks free).
"""

from __future__ import annotations

from dataclasses import dataclass

W_ADAPTER, W_KV, W_LOAD = 1.0, 1.0, 1.0


@dataclass(frozen=True, slots=True)
class DecodeView:
    replica_id: str
    device: frozenset[str] = frozenset()
    host: frozenset[str] = frozenset()
    kv_free: int | None = None  # None: no report yet
    kv_total: int | None = None
    max_seqs: int = 1
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class DecodeWeights:
    adapter: float = W_ADAPTER
    kv: float = W_KV
    load: float = W_LOAD


def score(view: DecodeView, digest: str | None, w: DecodeWeights) -> float:
    """The replica's score for a request with adapter `digest` (None: the base model); see the module."""
    adapter = 0.0
    if digest is not None:
        adapter = 1.0 if digest in view.device else 0.5 if digest in view.host else 0.0
    free = 1.0 if not view.kv_total or view.kv_free is None else view.kv_free / view.kv_total
    load = view.in_flight / max(1, view.max_seqs)
    return w.adapter * adapter + w.kv * free - w.load * load


def rank(
    views: list[DecodeView], digest: str | None, w: DecodeWeights, prefer: str | None = None
) -> list[DecodeView]:
    """`views` best first; `prefer` (the replica a request was prepared on) first of all when present."""
    ordered = sorted(views, key=lambda v: (-score(v, digest, w), v.in_flight, v.replica_id))
    if prefer is not None:
        ordered.sort(key=lambda v: v.replica_id != prefer)
    return ordered
