"""What a tensor-parallel rank holds of an adapter's DoRA and lora_bias vectors, and how it gets them.

The per-row epilogue `y ← y ⊙ f + c` (`engine/lora/dora.py`) runs on each rank's output of a projection
before the layer's all-reduce, so it follows the projection's sharding:

- column-parallel slices (q, k, v, gate, up): every rank owns its output rows, so it keeps those rows of
  the magnitude m and of lora_B's bias bB (cut like B's rows) and computes its rows of f and c from its
  rows of W, B and the whole A: no communication;
- row-parallel slices (o, down): every rank's output is a partial sum over its input columns, and
  `Σ_r (y_r ⊙ f + c_r) = y ⊙ f + Σ_r c_r`, so f is whole on every rank and c must sum to PEFT's c:
  bB is kept by rank 0 only (zeros elsewhere), as the base bias is (`TensorShard.projection`), which
  makes `c_r = f ⊙ s bB_r + (1 − f) ⊙ b0_r` vanish off rank 0. The DoRA norm of an output row,
  `‖W_i + s (BA)_i‖`, sums over input columns held by different ranks: each rank computes its partial
  squared norms from its columns of W and A (`dora_sq_norm`, every term is a column sum) and ONE
  all-reduce per adapter upload sums them (`finish_row_norms`), after which each rank computes f and c.
  Nothing is communicated per step.

Rank 0 uploads an adapter while it schedules (no worker listens then), so the pool leaves the row-parallel
DoRA rows of its epilogue at the identity (`rank_epilogues`) and the all-reduce runs when the upload is
replayed: each worker runs it right after placing the adapter, rank 0 right after sending that upload
(`WorkerGroup.flush_pool`, and again for every resident when a restarted group is sent the pool). Whether
an upload takes part in the all-reduce (`needs_norm_reduce`) is a fact of the adapter alone, so every
rank agrees. The partial norms are computed once per host copy (`ckpt.derived`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.distributed.shard import ROW, TensorShard
from engine.lora.adapter_checkpoint import PROJECTIONS, AdapterCheckpoint, LoRAModuleWeights
from engine.lora.dora import BaseWeights, dora_sq_norm, row_epilogue

if TYPE_CHECKING:
    from engine.lora.epilogue import EpilogueStore

MODULE_INDEX = {m: i for i, m in enumerate(PROJECTIONS)}
_PARTIALS = "tp_row_norm_partials"  # ckpt.derived key: [P, out] float32 partial squared norms


def local_slice(shard: TensorShard, w: LoRAModuleWeights) -> LoRAModuleWeights:
    """This rank's part of one adapted slice: A and B as `TensorShard.lora` cuts them, the magnitude and
    lora_B's bias cut like B's rows (column-parallel) or, row-parallel, the magnitude whole and the bias
    on rank 0 only (module docstring)."""
    assert w.lora_a is not None and w.lora_b is not None, "sharding an adapter needs its weights"
    a, b = shard.lora(w.module, w.lora_a, w.lora_b)
    names = (w.module,)
    mag = w.magnitude
    if mag is not None and w.module not in ROW:
        mag = shard.projection(names, "weight", mag)
    bias = None if w.bias_b is None else shard.projection(names, "bias", w.bias_b)
    return replace(w, lora_a=a, lora_b=b, magnitude=mag, bias_b=bias)


def _pending(shard: TensorShard, w: LoRAModuleWeights) -> bool:
    """Whether slice `w`'s DoRA norm sums over ranks (a row-parallel DoRA slice at more than one rank)."""
    return shard.world > 1 and w.magnitude is not None and w.module in ROW


def needs_norm_reduce(shard: TensorShard | None, ckpt: AdapterCheckpoint) -> bool:
    """Whether uploading `ckpt` takes one all-reduce of partial DoRA norms on every rank."""
    return shard is not None and any(_pending(shard, w) for w in ckpt.modules)


def rank_epilogues(
    ckpt: AdapterCheckpoint, num_layers: int, base: BaseWeights | None, shard: TensorShard
) -> dict[int, torch.Tensor]:
    """This rank's epilogue vectors of `ckpt` per module index ([layers, 2, local out], host float32: f
    then c), with the row-parallel DoRA slices left at the identity until `finish_row_norms`."""
    host: dict[int, torch.Tensor] = {}
    for w in ckpt.modules:
        if w.magnitude is None and w.bias_b is None:
            continue
        lw = local_slice(shard, w)
        m = MODULE_INDEX[w.module]
        fc = None if _pending(shard, w) else row_epilogue(lw, base)
        if m not in host:
            assert lw.lora_b is not None, "local_slice keeps B"
            host[m] = torch.zeros(num_layers, 2, lw.lora_b.shape[0])
            host[m][:, 0] = 1.0
        if fc is not None:
            host[m][w.layer, 0], host[m][w.layer, 1] = fc
    return host


def _partials(ckpt: AdapterCheckpoint, base: BaseWeights | None, shard: TensorShard) -> torch.Tensor:
    """[P, out] float32: this rank's partial squared DoRA norms of `ckpt`'s P row-parallel DoRA slices
    (in `ckpt.modules` order), cached with the host copy."""
    if _PARTIALS not in ckpt.derived:
        if base is None:
            raise ValueError("a DoRA adapter needs the base weights (the pool was made without them)")
        rows = [dora_sq_norm(local_slice(shard, w), base) for w in ckpt.modules if _pending(shard, w)]
        ckpt.derived[_PARTIALS] = torch.stack(rows)
    return ckpt.derived[_PARTIALS]


def finish_row_norms(
    ckpt: AdapterCheckpoint,
    base: BaseWeights | None,
    shard: TensorShard,
    all_reduce: Callable[[torch.Tensor], None],
    device: torch.device,
    store: EpilogueStore,
    epi_slot: int | None,
) -> None:
    """Sum the ranks' partial DoRA norms of `ckpt`'s row-parallel slices (one all-reduce, on `device`),
    and write each slice's f and c into `store` at `epi_slot` (None: `ckpt` is no longer resident on this
    rank; the all-reduce still runs, as the other ranks run it). Every rank calls this for the upload."""
    total = _partials(ckpt, base, shard).to(device, copy=True)  # the cached partials stay this rank's
    all_reduce(total)
    if epi_slot is None:
        return
    sums = total.cpu()
    pending = [w for w in ckpt.modules if _pending(shard, w)]
    for w, sq in zip(pending, sums, strict=True):
        fc = row_epilogue(local_slice(shard, w), base, norm=sq.clamp_min(0).sqrt())
        assert fc is not None, "a DoRA slice has an epilogue"
        store.write(epi_slot, MODULE_INDEX[w.module], w.layer, *fc)
