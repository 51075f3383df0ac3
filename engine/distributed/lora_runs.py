"""The LoRA rows of a tensor-parallel step plan: which pool slots, at which weights, each row applies.

Rank 0 describes the step's adapters as runs `(first row, end row, pool slot, mix position k, weight)`:
a plain adapter's rows are one run at k = 0 and weight 1; a weighted mix (`engine/lora/mix.py`) puts
each member i of a request's rows in a run at k = i with the member's weight. Consecutive items with
the same (slot, k, weight) share a run. A worker cuts the flat batch at every run boundary, gives each
piece the members that cover it (ordered by k) and builds the same context rank 0 built
(`residency.rows_context`): one ordinary pass, or one pass per mix position, with the same kernels.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.lora.residency import rows_context

if TYPE_CHECKING:
    from engine.lora.mix import Member
    from engine.lora.pool import AdapterPool
    from engine.model.linear import LoRAStepContext
    from engine.scheduler.output import ScheduledSequence

LoRARun = tuple[int, int, int, int, float]  # (start, end, pool slot, mix position, weight)


def step_lora_runs(pool: AdapterPool, items: Sequence[ScheduledSequence]) -> list[LoRARun]:
    """Rank 0: the runs (module docstring) of `items`, in flat-batch order, ordered by (start, k)."""
    runs: list[LoRARun] = []
    open_run: dict[int, int] = {}  # mix position -> index in `runs` of its latest run
    row = 0
    for it in items:
        seq, n = it.seq, it.num_tokens
        if seq.lora_key is not None:
            lr = seq.lora_request
            pairs = [(seq.lora_key, 1.0)]
            if lr is not None and lr.mix:
                pairs = list(zip(seq.lora_keys, (float(w) for _, w in lr.mix), strict=True))
            for k, (key, weight) in enumerate(pairs):
                slot = pool.resident[key].slot
                last = open_run.get(k)
                if last is not None and runs[last][1] == row and runs[last][2:] == (slot, k, weight):
                    runs[last] = (runs[last][0], row + n, slot, k, weight)
                else:
                    open_run[k] = len(runs)
                    runs.append((row, row + n, slot, k, weight))
        row += n
    return runs


def worker_lora_context(
    pool: AdapterPool,
    backend: str,
    runs: np.ndarray,
    weights: np.ndarray,
    num_tokens: int,
    device: torch.device,
) -> LoRAStepContext | None:
    """A worker: the step context of the runs `runs` [S, 4] (start, end, slot, k) with `weights` [S] over
    a flat batch of `num_tokens` rows, on this rank's pool (None: no run)."""
    if not len(runs):
        return None
    by_slot = {r.slot: r for r in pool.resident.values()}
    table = runs.tolist()
    bounds = sorted({0, num_tokens, *(r[0] for r in table), *(r[1] for r in table)})
    pieces: list[list[tuple[int, Member]]] = [[] for _ in range(len(bounds) - 1)]
    for (start, end, slot, k), weight in zip(table, weights.tolist(), strict=True):
        for p in range(bisect_left(bounds, start), bisect_left(bounds, end)):
            pieces[p].append((k, (by_slot[slot], float(weight))))
    counts = [hi - lo for lo, hi in pairwise(bounds)]
    rows = [[m for _, m in sorted(piece, key=lambda e: e[0])] for piece in pieces]
    return rows_context(pool, backend, counts, rows, device)
