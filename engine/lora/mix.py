"""Weighted adapter mixes: several adapters on one request's rows, computed without merging.

A request whose `LoRARequest` is a mix of adapters a_1..a_n with weights w_1..w_n gets, on every adapted
projection, the delta

    y[t] += Σ_i w_i · s_i · B_i A_i x[t]

which is PEFT's `add_weighted_adapter(adapters, weights, combination_type="cat")`: PEFT concatenates
`w_i · s_i · A_i` along the rank and `B_i` beside each other, and gives the new adapter r = lora_alpha =
Σ r_i, so scaling 1 (`peft/tuners/lora/model.py`; the weight is applied to A, not square-rooted). PEFT
copies the rest of the config from the first adapter, so with `use_rslora` on that one its merged
adapter gets scaling √(Σ r_i) instead; this engine computes the formula above either way.

**How.** A step with mix rows runs `MixedLoRAContext`: pass k is an ordinary LoRA context (any backend:
native, torch or Triton, kernels unchanged) in which every row takes its k-th adapter (its only adapter
for a plain-LoRA row, none for base rows and rows with fewer members: slot −1), and the weight is folded
into the pass's input: pass k computes `s · B A (w_k[t] · x[t])`, which is `w_k[t] · s · B A x[t]` by
linearity. Rows of plain and DoRA adapters are in pass 0 at weight 1, so their results (DoRA's epilogue
included) are exactly what they are without mixes. Embedding and LM-head LoRA of mix members is applied
by the step's vocabulary update at scaling `w · s`.

**What mixes.** PEFT's `cat` combines LoRA A/B only (embedding and LM-head LoRA included); it keeps
no DoRA magnitude, no LoRA bias, no trainable tokens and no `modules_to_save` copy of the members
(`member_problem` refuses those with a message naming the adapter and the feature).

**Identity.** A mix's `lora_key` (its prefix-cache key and batch-grouping key) is `mix_key` of its
members' digests and weights, so two mixes differing in a weight never share KV blocks, and neither do a
mix and its members.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.lora.adapter_checkpoint import PROJECTIONS, AdapterCheckpoint
from engine.lora.pool import AdapterPool, ResidentAdapter
from engine.lora.vocab_step import VocabLoRAStep
from engine.model.linear import LoRAStepContext

Member = tuple[ResidentAdapter, float]  # an adapter a row applies, with its weight
PassFactory = Callable[[list[int], list[ResidentAdapter | None], int], LoRAStepContext]


def mix_key(digests: Sequence[str], weights: Sequence[float]) -> str:
    """The content key of a mix: sha256 over its (member digest, weight) pairs, in order."""
    h = hashlib.sha256(b"loraplex-lora-mix\0")
    for digest, weight in zip(digests, weights, strict=True):
        h.update(f"{digest}:{float(weight)!r};".encode())
    return h.hexdigest()


def member_problem(res: ResidentAdapter, name: str) -> str | None:
    """Why the resident adapter `res` (called `name`) cannot be a member of a weighted mix, or None."""
    v = res.vocab
    if res.experts is not None:
        return _unsupported(name)
    if res.epi_slot >= 0:
        return _refusal(name, "DoRA or lora_bias")
    if v is not None and (v.tok_pos is not None or v.tok_head is not None):
        return _refusal(name, "trainable tokens")
    if v is not None and (v.saved_embed is not None or v.saved_head is not None):
        return _refusal(name, "modules_to_save")
    return None


def checkpoint_problem(ckpt: AdapterCheckpoint, name: str) -> str | None:
    """`member_problem` for an adapter known by its checkpoint (before it is resident)."""
    if ckpt.experts:
        return _unsupported(name)
    if ckpt.use_dora or ckpt.lora_bias:
        return _refusal(name, "DoRA or lora_bias")
    if ckpt.tokens:
        return _refusal(name, "trainable tokens")
    if ckpt.saved:
        return _refusal(name, "modules_to_save")
    return None


def capacity_problem(pool: AdapterPool, members: Sequence[MemberNeed]) -> str | None:
    """Why the mix of `members` can never be scheduled on `pool` (all of them must be resident at once:
    their pages on each projection, their slots and their side bytes, together), or None if it fits an
    empty pool."""
    for m, name in enumerate(PROJECTIONS):
        total = sum(need.pages[m] for need in members)
        if total > pool.num_pages:
            parts = ", ".join(f"{need.name!r} {need.pages[m]}" for need in members if need.pages[m])
            return (
                f"the weighted mix needs {total} adapter pool pages of {name} at once ({parts}) but the pool "
                f"has {pool.num_pages} per projection (raise lora_pool_pages, or mix fewer or lower-rank "
                "adapters)"
            )
    if len(members) > pool.max_slots:
        return f"the weighted mix has {len(members)} adapters but the pool has {pool.max_slots} slots"
    side = sum(need.side_bytes for need in members)
    if side > pool.side_budget:
        return (
            f"the weighted mix keeps {side} bytes beside its pages at once but the pool's side budget is "
            f"{pool.side_budget} (lora_side_memory_bytes)"
        )
    return None


@dataclass(frozen=True, slots=True)
class MemberNeed:
    """What one mix member takes in the pool while resident: pages per projection, side bytes."""

    name: str
    pages: list[int]
    side_bytes: int


def member_need(
    pool: AdapterPool, name: str, ckpt: AdapterCheckpoint | None, res: ResidentAdapter | None
) -> MemberNeed | None:
    """`MemberNeed` of the member `name` from its resident entry or its host copy (None: neither known)."""
    if res is not None:
        return MemberNeed(name, [len(p) for p in res.pages], res.side_bytes)
    if ckpt is not None:
        return MemberNeed(name, pool.pages_needed(ckpt), pool.side_need(ckpt))
    return None


def _refusal(name: str, feature: str) -> str:
    return (
        f"adapter {name!r} uses {feature}, which a weighted mix cannot combine (PEFT's "
        "add_weighted_adapter(combination_type='cat') mixes LoRA A/B weights only)"
    )


def _unsupported(name: str) -> str:
    return f"adapter {name!r} has LoRA on MoE experts, which weighted mixes do not support yet"


def needs_mix(rows: Sequence[Sequence[Member]]) -> bool:
    """Whether some row applies more than one adapter or an adapter at a weight other than 1."""
    return any(len(r) > 1 or (r and r[0][1] != 1.0) for r in rows)


@dataclass(slots=True)
class _Pass:
    ctx: LoRAStepContext
    weights: torch.Tensor | None  # [T, 1] float32 per flat row (0 where the row has no member); None: all 1
    _cast: torch.Tensor | None = None

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """`x` with each row multiplied by its weight in this pass."""
        if self.weights is None:
            return x
        if self._cast is None or self._cast.dtype != x.dtype:
            self._cast = self.weights.to(x.dtype)
        return x * self._cast


class MixedLoRAContext:
    """A step with weighted mixes: one ordinary LoRA pass per mix position (module docstring)."""

    def __init__(self, passes: list[_Pass], vocab: VocabLoRAStep) -> None:
        self.passes = passes
        self.vocab = vocab
        # expert LoRA: only pass 0 can hold it (mix members never have it, `member_problem`), and pass 0's
        # plain rows apply theirs at weight 1
        self.experts = getattr(passes[0].ctx, "experts", None) if passes else None

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """y[t] += Σ_k w_k[t] · s_k · B_k A_k x[t] over the passes (in place)."""
        for p in self.passes:
            p.ctx.apply(layer_index, slice_names, p.scale(x), y)


def mixed_context(
    counts: Sequence[int], rows: Sequence[Sequence[Member]], make: PassFactory, device: torch.device
) -> MixedLoRAContext:
    """The step context of items with `counts[i]` flat rows each applying `rows[i]` ((adapter, weight)
    members, in mix order; empty for base rows). `make(counts, adapters, k)` builds pass k's ordinary
    context with one adapter (or None) per item."""
    passes = []
    for k in range(max(len(r) for r in rows)):
        adapters = [r[k][0] if len(r) > k else None for r in rows]
        weights = [r[k][1] if len(r) > k else 0.0 for r in rows]
        w = None
        if any(wt not in (0.0, 1.0) for wt in weights):
            per_row = [wt for wt, n in zip(weights, counts, strict=True) for _ in range(n)]
            w = torch.tensor(per_row, dtype=torch.float32, device=device).unsqueeze(1)
        passes.append(_Pass(make(list(counts), adapters, k), w))
    runs: list[tuple[ResidentAdapter, range]] = []
    run_weights: list[float] = []
    start = 0
    for n, members in zip(counts, rows, strict=True):
        for ad, wt in members:
            if ad.vocab is not None:
                runs.append((ad, range(start, start + n)))
                run_weights.append(wt)
        start += n
    return MixedLoRAContext(passes, VocabLoRAStep(runs, run_weights))
