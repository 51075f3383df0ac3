"""Paged attention in plain torch: the CPU path (and CUDA fallback).

On the CPU, decode rows and short query runs go through the native kernel when it builds
(`cpu_native.py`: the K/V blocks are read in place, no gather); the torch code below is the path for
long prefill chunks, and for everything when the kernel is unavailable or `native` is off.

Decodes are batched: gather each sequence's blocks into `[B, Hkv, max_blocks*block_size, D]`, mask
positions past `seq_len`, and attend with one SDPA call. Short runs of a few query rows (speculative
verification, small chunks) are batched likewise (`short_runs.py`). Longer prefill chunks go one
sequence at a time through SDPA with a mask that lets query i (at absolute position ctx_start + i) see
keys 0..ctx_start+i. Semantics match
`kernels.reference.paged_attention_decode_ref` / `paged_attention_prefill_ref`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.cpu_native import NativeAttention
from engine.attention.short_runs import SHORT_RUN_MAX_ROWS, ShortRunsPlan, attend_short_runs, short_runs_plan
from kernels.intmath import cdiv


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native: bool = True) -> None:
        # `native`: decode rows and short runs on the CPU through the native kernel when it builds
        # (`self.native.enabled` may be flipped between steps, e.g. to compare the paths)
        self.native = NativeAttention(native)
        # The decode gather indices and mask depend only on the step's metadata: built for the first
        # layer, reused by the others (keyed by the metadata object of the step).
        self._plan_meta: AttentionMetadata | None = None
        self._plan: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._short_meta: AttentionMetadata | None = None  # likewise for the short runs (short_runs.py)
        self._short: ShortRunsPlan | None = None

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        step = self.native.step(query, k_cache, meta)
        if step is not None:
            out = torch.empty_like(query)
            step.call(query if query.stride(-1) == 1 else query.contiguous(), k_cache, v_cache, out, scale)
            for b in step.rest:
                self._attend_one(query, k_cache, v_cache, meta, scale, b, out)
            return out
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale)
        qs = meta.query_start_list
        block_size = k_cache.shape[1]
        short = [b for b in range(nd, meta.num_seqs) if qs[b + 1] - qs[b] <= SHORT_RUN_MAX_ROWS]
        if len(short) > 1:  # e.g. speculative verification rows: one batched call
            if self._short_meta is not meta or self._short is None:
                self._short_meta, self._short = meta, short_runs_plan(meta, short, block_size)
            attend_short_runs(query, k_cache, v_cache, self._short, scale, out)
        else:
            short = []
        for b in range(nd, meta.num_seqs):
            if not (short and b in short):
                self._attend_one(query, k_cache, v_cache, meta, scale, b, out)
        return out

    def _attend_one(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, b: int, out
    ) -> None:
        """Sequence b's query rows (a prefill chunk) through SDPA over its gathered blocks, into `out`."""
        qs, sl = meta.query_start_list, meta.seq_lens_list
        q = query[qs[b] : qs[b + 1]]
        blocks = meta.block_tables[b, : cdiv(sl[b], k_cache.shape[1])].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[: sl[b]]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[: sl[b]]
        out[qs[b] : qs[b + 1]] = _causal_attention(q, k, v, sl[b] - q.shape[0], scale)

    def _decode_plan(
        self, meta: AttentionMetadata, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(flat block ids [B*max_blocks], additive key mask [B, 1, 1, L] (0 / -inf), L) for the decodes."""
        if self._plan_meta is not meta or self._plan is None:
            nd = meta.num_decodes
            max_blocks = cdiv(max(meta.seq_lens_list[:nd]), block_size)
            length = max_blocks * block_size
            tables = meta.block_tables[:nd, :max_blocks].reshape(-1).long()
            pos = torch.arange(length, device=tables.device)
            past_end = (pos[None, :] >= meta.seq_lens[:nd, None]).view(nd, 1, 1, length)
            bias = torch.zeros(past_end.shape, device=tables.device).masked_fill_(past_end, float("-inf"))
            self._plan_meta, self._plan = meta, (tables, bias, length)
        return self._plan

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query per sequence: gather each sequence's blocks, then one masked SDPA call for all.

        The `group = Hq / Hkv` query heads sharing a KV head are laid out as `group` query rows of that
        head, so SDPA sees `[B, Hkv, group, D]` queries against `[B, Hkv, L, D]` keys (no K/V repeat).
        """
        nd, hq, d = q.shape
        hkv = k_cache.shape[2]
        tables, bias, length = self._decode_plan(meta, k_cache.shape[1])
        k = k_cache.index_select(0, tables).view(nd, length, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache.index_select(0, tables).view(nd, length, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.view(nd, hkv, hq // hkv, d),
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=bias.to(q.dtype),
            scale=scale,
        )
        return o.reshape(nd, hq, d)


def _causal_attention(q, k, v, ctx_start: int, scale: float) -> torch.Tensor:
    """q [Tq, Hq, D] at positions ctx_start.., k/v [Tk, Hkv, D] at positions 0..Tk-1 -> [Tq, Hq, D]."""
    tq, tk = q.shape[0], k.shape[0]
    qpos = torch.arange(ctx_start, ctx_start + tq, device=q.device)
    mask = torch.arange(tk, device=q.device)[None, :] <= qpos[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.squeeze(0).transpose(0, 1)
