"""Embedding and LM-head LoRA in a mixed batch: the device copy per adapter and the per-step application.

`VocabLoRA` is a resident adapter's copy of its embed_tokens / lm_head LoRA on the pool's device (kept in
the pool beside its pages, `ResidentAdapter.vocab`; not counted in the page budget: per adapter
r x (vocab + hidden) elements for each of the two). The embedding LoRA keeps Aᵀ [vocab, r], so a
token's row of A is one gather.

`VocabLoRAStep` applies them over the step's runs of flat-batch rows of such adapters:

- `embed`: for the rows of an adapter with an embedding LoRA, `x[t] += s · (Aᵀ[id_t] @ Bᵀ)` (PEFT's
  `Embedding` forward), on the embedding lookup's output, before any family scaling (Gemma's
  √hidden, Granite's multiplier), as PEFT adds it to the `embed_tokens` module's output;
- `head`: for the logits rows (`logits_indices`) that fall in an adapter's run,
  `logits[i] += s · (h[i] @ Aᵀ) @ Bᵀ` at vocabulary width, before soft-caps and logit scaling.

Trainable tokens (`trainable_token_indices`) replace instead: an adapted row whose token id has a new
embedding row gets that row (before family scaling, as PEFT's `F.embedding` on the merged weight), and
the logits columns of tokens with new head rows (tied models: the embedding's new rows) become
`h @ rowsᵀ` on that adapter's logits rows.

A `modules_to_save` copy (`saved_embed` / `saved_head`, a whole [vocab, hidden] matrix per adapter, so
vocab × hidden elements each, e.g. 128256 × 4096 × 2 bytes ≈ 1 GiB for Llama 3 8B in bf16) is the
dense case of the same thing: every row of that adapter looks up its own matrix, and its logits rows are
`h @ Wᵀ` with its own head (replacing the base logits of those rows only).

Base rows and other adapters' rows are never touched. With tied embeddings the head LoRA applies to the
shared matrix's logits only, the embedding LoRA to the lookups only, as PEFT keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.adapter_checkpoint import AdapterCheckpoint
    from engine.lora.pool import ResidentAdapter


@dataclass(slots=True)
class VocabLoRA:
    """One adapter's embed_tokens / lm_head LoRA on the device (None: that module is not adapted)."""

    embed_at: torch.Tensor | None = None  # [vocab, r]: lora_embedding_A transposed
    embed_b: torch.Tensor | None = None  # [hidden, r]
    embed_scaling: float = 0.0
    head_a: torch.Tensor | None = None  # [r, hidden]
    head_b: torch.Tensor | None = None  # [vocab, r]
    head_scaling: float = 0.0
    tok_pos: torch.Tensor | None = None  # [vocab] int64: row of `tok_embed` holding token t's row, or -1
    tok_embed: torch.Tensor | None = None  # [n, hidden]: the new embedding rows
    tok_head_ids: torch.Tensor | None = None  # [m] int64: token ids whose LM-head rows are new
    tok_head: torch.Tensor | None = None  # [m, hidden]: those rows
    saved_embed: torch.Tensor | None = None  # [vocab, hidden]: modules_to_save's embed_tokens
    saved_head: torch.Tensor | None = None  # [vocab, hidden]: modules_to_save's lm_head

    def memory_bytes(self) -> int:
        ts = [self.embed_at, self.embed_b, self.head_a, self.head_b]
        ts += [self.tok_pos, self.tok_embed, self.tok_head_ids, self.tok_head]
        ts += [self.saved_embed, self.saved_head]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def device_vocab_lora(
    ckpt: AdapterCheckpoint, vocab_size: int, dtype: torch.dtype, device: torch.device
) -> VocabLoRA | None:
    """The device copy of `ckpt`'s vocabulary LoRA, trainable tokens and modules_to_save copies (None
    when it has none of them)."""
    if not ckpt.vocab and not ckpt.tokens and not ckpt.saved:
        return None
    out = VocabLoRA()
    for w in ckpt.vocab:
        assert w.lora_a is not None and w.lora_b is not None, "uploading an adapter needs its weights"
        a, b = w.lora_a.to(device, dtype), w.lora_b.to(device, dtype)
        if w.module == "embed_tokens":
            out.embed_at, out.embed_b, out.embed_scaling = a.T.contiguous(), b, w.scaling
        else:
            out.head_a, out.head_b, out.head_scaling = a, b, w.scaling
    for t in ckpt.tokens:
        assert t.values is not None, "uploading an adapter needs its weights"
        ids = torch.tensor(t.indices, dtype=torch.long, device=device)
        if t.module == "embed_tokens":
            out.tok_pos = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
            out.tok_pos[ids] = torch.arange(len(t.indices), device=device)
            out.tok_embed = t.values.to(device, dtype)
        else:
            out.tok_head_ids, out.tok_head = ids, t.values.to(device, dtype)
    for sm in ckpt.saved:
        assert sm.weight is not None, "uploading an adapter needs its weights"
        if sm.module == "embed_tokens":
            out.saved_embed = sm.weight.to(device, dtype)
        else:
            out.saved_head = sm.weight.to(device, dtype)
    return out


def adapter_runs(
    slots: Sequence[int], by_slot: dict[int, ResidentAdapter]
) -> list[tuple[ResidentAdapter, range]]:
    """Runs of consecutive flat-batch rows whose slot is in `by_slot`: (adapter, rows)."""
    runs: list[tuple[ResidentAdapter, range]] = []
    for t, slot in enumerate(slots):
        ad = by_slot.get(slot)
        if ad is None:
            continue
        if runs and runs[-1][0] is ad and runs[-1][1].stop == t:
            runs[-1] = (ad, range(runs[-1][1].start, t + 1))
        else:
            runs.append((ad, range(t, t + 1)))
    return runs


class VocabLoRAStep:
    """The step's embedding / LM-head LoRA over `runs`: (adapter with a `vocab` copy, its flat rows).

    `weights` (one per run, default 1): a weighted mix's member weight, which multiplies the scaling of
    that run's embedding and LM-head LoRA (`engine/lora/mix.py`; mix members have no trainable tokens
    or saved modules)."""

    def __init__(
        self, runs: Sequence[tuple[ResidentAdapter, range]], weights: Sequence[float] | None = None
    ) -> None:
        self._runs: list[tuple[VocabLoRA, range]] = []
        for i, (ad, rows) in enumerate(runs):
            v, w = ad.vocab, 1.0 if weights is None else weights[i]
            if v is None:
                continue
            if w != 1.0:
                v = replace(v, embed_scaling=v.embed_scaling * w, head_scaling=v.head_scaling * w)
            self._runs.append((v, rows))

    def __bool__(self) -> bool:
        return bool(self._runs)

    def embed(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        """`x[t] += s · Aᵀ[input_ids[t]] @ Bᵀ` on each embedding-LoRA adapter's rows, `x[t] = E_a[id_t]`
        on a modules_to_save adapter's rows, new rows for trainable tokens (in place)."""
        for v, rows in self._runs:
            ids = input_ids[rows.start : rows.stop]
            if v.saved_embed is not None:
                x[rows.start : rows.stop] = v.saved_embed.index_select(0, ids).to(x.dtype)
            if v.embed_at is not None and v.embed_b is not None:
                after_a = v.embed_at.index_select(0, ids).to(x.dtype)
                x[rows.start : rows.stop].add_((after_a @ v.embed_b.to(x.dtype).T).mul_(v.embed_scaling))
            if v.tok_pos is not None and v.tok_embed is not None:
                pos = v.tok_pos.index_select(0, ids)
                hit = (pos >= 0).nonzero().squeeze(1)
                if hit.numel():
                    new = v.tok_embed.index_select(0, pos.index_select(0, hit)).to(x.dtype)
                    x.index_copy_(0, hit + rows.start, new)

    def head(self, h: torch.Tensor, logits: torch.Tensor, logits_indices: torch.Tensor) -> None:
        """`logits[i] += s · (h[i] @ Aᵀ) @ Bᵀ` for each logits row i whose flat row is in an LM-head-LoRA
        adapter's run (in place); `h` [S, hidden] final-normed rows, `logits` [S, vocab]."""
        for v, rows in self._runs:
            if v.head_a is None and v.tok_head is None and v.saved_head is None:
                continue
            sel = ((logits_indices >= rows.start) & (logits_indices < rows.stop)).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            hs = h.index_select(0, sel)
            if v.saved_head is not None:
                logits.index_copy_(0, sel, (hs @ v.saved_head.to(h.dtype).T).to(logits.dtype))
            if v.head_a is not None and v.head_b is not None:
                d = ((hs @ v.head_a.to(h.dtype).T) @ v.head_b.to(h.dtype).T).mul_(v.head_scaling)
                logits.index_add_(0, sel, d.to(logits.dtype))
            if v.tok_head is not None and v.tok_head_ids is not None:
                cols = (hs @ v.tok_head.to(h.dtype).T).to(logits.dtype)  # [rows, m]
                logits.index_put_((sel.unsqueeze(1), v.tok_head_ids.unsqueeze(0)), cols)
