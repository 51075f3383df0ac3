"""The single pure-torch reference for every kernel op; it defines their semantics (and the CPU path's).

All math is done in float32; results are cast to the output dtype once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.intmath import cdiv
from kernels.lora_meta import LoRABatchMeta
from kernels.moe_lora_meta import MoELoRA


def _adapter_rows(pool: Tensor, pages: Tensor, rank: int) -> Tensor:
    """Concatenate pages ``pool[pages[j]]`` along the rank axis and keep the first ``rank`` rows."""
    n_pages = cdiv(rank, pool.shape[1])
    return torch.cat([pool[int(p)] for p in pages[:n_pages].tolist()], dim=0)[:rank]


def _segments(meta: LoRABatchMeta) -> list[tuple[int, Tensor]]:
    """``(slot, token indices)`` for each distinct adapter slot (>= 0) in the batch."""
    slots = meta.token_slots.long()
    return [(int(s), (slots == s).nonzero().squeeze(1)) for s in torch.unique(slots).tolist() if s >= 0]


def lora_shrink_ref(
    x: Tensor,  # [T, H_in]
    a_pools: Sequence[Tensor],  # per slice [num_pages, page_rank, H_in]
    page_table: Tensor,  # [num_slices, max_slots, max_pages] int32
    ranks: Tensor,  # [num_slices, max_slots] int32
    meta: LoRABatchMeta,
    out: Tensor,  # [num_slices, T, max_rank] float32, overwritten
) -> None:
    """LoRA shrink (x·Aᵀ) for every slice of a packed projection, reading A through page tables::

        out[:] = 0
        for t, s: slot = meta.token_slots[t]; r = ranks[s, slot]
            if slot >= 0 and r > 0:
                A = cat_j(a_pools[s][page_table[s, slot, j]])[:r]      # [r, H_in]
                out[s, t, :r] = x[t] @ A.T

    ``out`` is fully overwritten (zeros where no adapter contributes).
    """
    out.zero_()
    for slot, tokens in _segments(meta):
        xs = x[tokens].float()
        for s, pool in enumerate(a_pools):
            r = int(ranks[s, slot])
            if r > 0:
                a = _adapter_rows(pool, page_table[s, slot], r).float()
                out[s, tokens, :r] = (xs @ a.T).to(out.dtype)


def lora_expand_ref(
    v: Tensor,  # [num_slices, T, max_rank]
    b_pools: Sequence[Tensor],  # per slice [num_pages, H_out_s, page_rank]
    page_table: Tensor,  # [num_slices, max_slots, max_pages] int32
    ranks: Tensor,  # [num_slices, max_slots] int32
    scalings: Tensor,  # [num_slices, max_slots] float32
    meta: LoRABatchMeta,
    y: Tensor,  # [T, sum_s H_out_s], updated in place
) -> None:
    """LoRA expand (v·Bᵀ, scaled) added in place into the packed projection's output::

        off_s = sum(H_out of slices before s)
        for t, s: slot = meta.token_slots[t]; r = ranks[s, slot]
            if slot >= 0 and r > 0:
                B = cat_j(b_pools[s][page_table[s, slot, j]], dim=1)[:, :r]   # [H_out_s, r]
                y[t, off_s : off_s + H_out_s] += scalings[s, slot] * v[s, t, :r] @ B.T

    Entries of ``v`` outside ``[:r]`` and rows of tokens without adapter are never read.
    """
    offsets = [0]
    for pool in b_pools:
        offsets.append(offsets[-1] + pool.shape[1])
    for slot, tokens in _segments(meta):
        for s, pool in enumerate(b_pools):
            r = int(ranks[s, slot])
            if r == 0:
                continue
            n_pages = cdiv(r, pool.shape[2])
            pages = page_table[s, slot, :n_pages].tolist()
            b = torch.cat([pool[int(p)] for p in pages], dim=1)[:, :r].float()
            delta = float(scalings[s, slot]) * (v[s, tokens, :r].float() @ b.T)
            cols = slice(offsets[s], offsets[s + 1])
            y[tokens, cols] = (y[tokens, cols].float() + delta).to(y.dtype)


def lora_shrink_expand_ref(
    x: Tensor,  # [T, H_in]
    a_pools: Sequence[Tensor],  # per slice [num_pages, page_rank, H_in]
    b_pools: Sequence[Tensor],  # per slice [num_pages, H_out_s, page_rank]
    page_table: Tensor,  # [num_slices, max_slots, max_pages] int32
    ranks: Tensor,  # [num_slices, max_slots] int32
    scalings: Tensor,  # [num_slices, max_slots] float32
    meta: LoRABatchMeta,
    y: Tensor,  # [T, sum_s H_out_s], updated in place
) -> None:
    """The whole LoRA delta of a packed projection (the fused kernel's semantics): `lora_shrink_ref` into
    a float32 ``v [num_slices, T, max_pages * page_rank]``, then `lora_expand_ref` of ``v`` into ``y``, i.e.
    ``y[t, slice s] += scalings[s, slot] * (x[t] @ A.T) @ B.T`` for every row with an adapter.
    """
    max_rank = page_table.shape[2] * a_pools[0].shape[1]
    v = torch.zeros(len(a_pools), x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    lora_shrink_ref(x, a_pools, page_table, ranks, meta, v)
    lora_expand_ref(v, b_pools, page_table, ranks, scalings, meta, y)


def write_kv_ref(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: Tensor,  # [T] int64
) -> None:
    """Scatter new K/V into the paged cache::

        for t with slot_mapping[t] >= 0:
            blk, off = divmod(slot_mapping[t], block_size)
            k_cache[blk, off] = key[t]; v_cache[blk, off] = value[t]

    Values are cast to the cache dtype.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = key[keep].to(k_cache.dtype)
    v_cache[blk, off] = value[keep].to(v_cache.dtype)


def _gather_kv(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first ``length`` positions of one sequence, ``[length, Hkv, D]`` in float32."""
    block_size = cache.shape[1]
    n_blocks = cdiv(length, block_size)
    blocks = block_table[:n_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length].float()


def _attend(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, window: int = 0, softcap: float = 0.0
) -> Tensor:
    """Causal attention of ``q [n, Hq, D]`` at positions ``q_pos`` over ``k/v [L, Hkv, D]`` (GQA).

    ``window > 0``: a query at position p sees only keys p - window + 1 .. p (HF's sliding window:
    ``kv_idx > q_idx - window``). ``softcap > 0``: scores become ``softcap * tanh(scores / softcap)``
    before the mask (Gemma 2's attention-logit soft-capping).
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(k.shape[0], device=q.device)
    hidden = k_pos[None, None, :] > q_pos[None, :, None]
    if window > 0:
        hidden |= k_pos[None, None, :] <= q_pos[None, :, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_attention_decode_ref(
    q: Tensor,  # [B, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    seq_lens: Tensor,  # [B] int32
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """One query per sequence at position ``L_b - 1`` over positions ``0 .. L_b - 1`` (the last ``window``
    of them when ``window > 0``; scores soft-capped when ``softcap > 0``, see ``_attend``)::

        out[b, h] = softmax(scale * q[b, h] · K_b[:, h // (Hq // Hkv)]ᵀ) · V_b[:, h // (Hq // Hkv)]
        where K_b[p] = k_cache[block_tables[b, p // block_size], p % block_size]
    Returns ``[B, Hq, D]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        k = _gather_kv(k_cache, block_tables[b], length)
        v = _gather_kv(v_cache, block_tables[b], length)
        pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, pos, scale, window, softcap)[0].to(q.dtype)
    return out


def paged_attention_prefill_ref(
    q: Tensor,  # [T, Hq, D], sequences' query tokens concatenated
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    query_start_loc: Tensor,  # [B + 1] int32
    seq_lens: Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Causal (chunked) prefill over a cached prefix; K/V of the new tokens are already in the cache::

        for seq b: n = qsl[b+1] - qsl[b]; query i of b sits at pos = seq_lens[b] - n + i
            lo = max(0, pos - window + 1) if window > 0 else 0
            out[qsl[b] + i, h] = softmax(cap(scale * q · K_b[lo..pos]ᵀ)) · V_b[lo..pos]   (GQA as in decode)
        where cap(s) = softcap * tanh(s / softcap) when softcap > 0, else s
    Returns ``[T, Hq, D]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k = _gather_kv(k_cache, block_tables[b], length)
        v = _gather_kv(v_cache, block_tables[b], length)
        pos = torch.arange(length - (hi - lo), length, device=q.device)
        out[lo:hi] = _attend(q[lo:hi], k, v, pos, scale, window, softcap).to(q.dtype)
    return out


def fused_moe_ref(
    x: Tensor,  # [T, H]
    w_gate_up: Tensor,  # [E, 2I, H]: gate rows, then up rows
    w_down: Tensor,  # [E, H, I]
    topk_weights: Tensor,  # [T, k]
    topk_ids: Tensor,  # [T, k] in [0, E)
    lora: MoELoRA | None = None,  # each token's adapter's LoRA on the experts (`kernels/moe_lora.py`)
) -> Tensor:
    """The routed experts' output of a MoE feed-forward block::

        out[t] = Σ_j topk_weights[t, j] * Wd'[e] · (silu(Wg'[e] · x[t]) * (Wu'[e] · x[t])), e = topk_ids[t, j]
        where W'[e] · z = W[e] · z + s_a · B_{a,e} · (A_{a,e} · z) with a = lora.token_adapter[t] (a token
        without an adapter, or a projection without LoRA: W[e] · z), Wg = w_gate_up[:, :I],
        Wu = w_gate_up[:, I:], Wd = w_down; A_{a,e} / B_{a,e}: adapter a's pages of expert e, concatenated

    Experts no token chose are never read. Returns ``[T, H]`` in ``x.dtype``.
    """
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tokens, choice = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[tokens].float()
        gu = xe @ w_gate_up[e].float().T
        _expert_lora_ref(lora, "gate_up", e, tokens, xe, gu)
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ w_down[e].float().T
        _expert_lora_ref(lora, "down", e, tokens, h, y)
        out.index_add_(0, tokens, y * topk_weights[tokens, choice].float().unsqueeze(1))
    return out.to(x.dtype)


def _expert_lora_ref(lora: MoELoRA | None, proj: str, e: int, tokens: Tensor, z: Tensor, y: Tensor) -> None:
    """`y[i] += s_a · (z[i] · A_{a,e}ᵀ) · B_{a,e}ᵀ` (float32) for the rows of tokens with an adapter a."""
    w = getattr(lora, proj) if lora is not None else None
    if lora is None or w is None:
        return
    adapters = lora.token_adapter[tokens].long()
    for a in torch.unique(adapters).tolist():
        if a >= lora.num_adapters:
            continue
        rows = (adapters == a).nonzero().squeeze(1)
        pages = [p for p in w.pages[a].tolist() if p >= 0]
        if not pages:
            continue
        a_rows = torch.cat([w.a[p, e] for p in pages]).float()  # [rank, in]
        b_cols = torch.cat([w.b[p, e] for p in pages], dim=1).float()  # [out, rank]
        y[rows] += float(w.scale[a]) * (z[rows] @ a_rows.T) @ b_cols.T
