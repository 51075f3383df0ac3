"""Paged attention in plain torch: the CPU path (and CUDA fallback).

On the CPU, decode rows and short query runs go through the native kernel when it builds
(`cpu_native.py`: the K/V blocks are read in place, no gather); the torch code below is the path for
long prefill chunks, and for everything when the kernel is unavailable or `native` is off.

Decodes are batched: gather each sequence's blocks into `[B, Hkv, max_blocks*block_size, D]`, mask
positions past `seq_len`, and attend with one SDPA call. Short runs of a few query rows (speculative
verification, small chunks) are batched likewise (`short_runs.py`). Longer prefill chunks go one
sequence at a time through SDPA with a mask that lets query i (at absolute position ctx_start + i) see
keys 0..ctx_start+i (with a layer's sliding window, only its last `window` of them). Semantics match
`kernels.reference.paged_attention_decode_ref` / `paged_attention_prefill_ref`.

SDPA has no soft-capping: a soft-capped layer's rows that the native kernel does not serve go through
the same masks with the scores computed explicitly (`_masked_attention`), logged once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.cpu_native import NativeAttention
from engine.attention.masked import masked_attention
from engine.attention.short_runs import SHORT_RUN_MAX_ROWS, ShortRunsPlan, attend_short_runs, short_runs_plan
from kernels.intmath import cdiv

log = logging.getLogger(__name__)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native: bool = True) -> None:
        # `native`: decode rows and short runs on the CPU through the native kernel when it builds
        # (`self.native.enabled` may be flipped between steps, e.g. to compare the paths)
        self.native = NativeAttention(native)
        # The decode gather indices and mask depend only on the step's metadata and the layer's window:
        # built for the first layer of each window, reused by the others (keyed by the step's metadata).
        self._plan_meta: AttentionMetadata | None = None
        self._plans: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._short_meta: AttentionMetadata | None = None  # likewise for the short runs (short_runs.py)
        self._shorts: dict[int, ShortRunsPlan] = {}
        self._told_softcap = False

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))

    def attend(
        self,
        query,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if softcap > 0 and not self._told_softcap:
            self._told_softcap = True
            log.info("soft-capped attention: rows the native CPU kernel does not serve fall back from SDPA "
                     "(no soft-capping) to explicit masked softmax")  # fmt: skip
        step = self.native.step(query, k_cache, meta)
        if step is not None:
            out = torch.empty_like(query)
            q_in = query if query.stride(-1) == 1 else query.contiguous()
            step.call(q_in, k_cache, v_cache, out, scale, window, softcap)
            for b in step.rest:
                self._attend_one(query, k_cache, v_cache, meta, scale, b, out, window, softcap)
            return out
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, meta, scale, window, softcap)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale, window, softcap)
        qs = meta.query_start_list
        block_size = k_cache.shape[1]
        short = [b for b in range(nd, meta.num_seqs) if qs[b + 1] - qs[b] <= SHORT_RUN_MAX_ROWS]
        if len(short) > 1:  # e.g. speculative verification rows: one batched call
            if self._short_meta is not meta:
                self._short_meta, self._shorts = meta, {}
            if window not in self._shorts:
                self._shorts[window] = short_runs_plan(meta, short, block_size, window)
            attend_short_runs(query, k_cache, v_cache, self._shorts[window], scale, out, softcap)
        else:
            short = []
        for b in range(nd, meta.num_seqs):
            if not (short and b in short):
                self._attend_one(query, k_cache, v_cache, meta, scale, b, out, window, softcap)
        return out

    def _attend_one(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, b: int, out, window: int = 0,
        softcap: float = 0.0,
    ) -> None:  # fmt: skip
        """Sequence b's query rows (a prefill chunk) through SDPA over its gathered blocks, into `out`.
        With a window, only the blocks holding keys some row sees are gathered."""
        qs, sl, bs = meta.query_start_list, meta.seq_lens_list, k_cache.shape[1]
        q = query[qs[b] : qs[b + 1]]
        first = 0  # the first block any row sees
        if window > 0:
            first = max(0, sl[b] - q.shape[0] + 1 - window) // bs
        blocks = meta.block_tables[b, first : cdiv(sl[b], bs)].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[: sl[b] - first * bs]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[: sl[b] - first * bs]
        ctx_start = sl[b] - q.shape[0] - first * bs  # positions relative to the first gathered key
        out[qs[b] : qs[b + 1]] = _causal_attention(q, k, v, ctx_start, scale, window, softcap)

    def _decode_plan(
        self, meta: AttentionMetadata, block_size: int, window: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(flat block ids [B*max_blocks], additive key mask [B, 1, 1, L] (0 / -inf), L) for the decodes;
        keys before a decode's window (`window > 0`) are masked like those past its end."""
        if self._plan_meta is not meta:
            self._plan_meta, self._plans = meta, {}
        if window not in self._plans:
            nd = meta.num_decodes
            max_blocks = cdiv(max(meta.seq_lens_list[:nd]), block_size)
            length = max_blocks * block_size
            tables = meta.block_tables[:nd, :max_blocks].reshape(-1).long()
            pos = torch.arange(length, device=tables.device)
            hidden = pos[None, :] >= meta.seq_lens[:nd, None]
            if window > 0:
                hidden |= pos[None, :] < meta.seq_lens[:nd, None] - window
            hidden = hidden.view(nd, 1, 1, length)
            bias = torch.zeros(hidden.shape, device=tables.device).masked_fill_(hidden, float("-inf"))
            self._plans[window] = (tables, bias, length)
        return self._plans[window]

    def _decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """One query per sequence: gather each sequence's blocks, then one masked SDPA call for all.

        The `group = Hq / Hkv` query heads sharing a KV head are laid out as `group` query rows of that
        head, so SDPA sees `[B, Hkv, group, D]` queries against `[B, Hkv, L, D]` keys (no K/V repeat).
        """
        nd, hq, d = q.shape
        hkv = k_cache.shape[2]
        tables, bias, length = self._decode_plan(meta, k_cache.shape[1], window)
        k = k_cache.index_select(0, tables).view(nd, length, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache.index_select(0, tables).view(nd, length, hkv, d).transpose(1, 2)
        qv, kq, vq, mask = q.view(nd, hkv, hq // hkv, d), k.to(q.dtype), v.to(q.dtype), bias.to(q.dtype)
        if softcap > 0:
            o = masked_attention(qv, kq, vq, mask, scale, softcap)
        else:
            o = F.scaled_dot_product_attention(qv, kq, vq, attn_mask=mask, scale=scale)
        return o.reshape(nd, hq, d)


def _causal_attention(q, k, v, ctx_start: int, scale: float, window: int = 0, softcap: float = 0.0):
    """q [Tq, Hq, D] at positions ctx_start.., k/v [Tk, Hkv, D] at positions 0..Tk-1 -> [Tq, Hq, D];
    a row at position p sees keys max(0, p - window + 1) .. p (`window` 0: 0 .. p)."""
    tq, tk = q.shape[0], k.shape[0]
    qpos = torch.arange(ctx_start, ctx_start + tq, device=q.device)
    kpos = torch.arange(tk, device=q.device)[None, :]
    mask = kpos <= qpos[:, None]
    if window > 0:
        mask &= kpos > qpos[:, None] - window
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if softcap > 0:
        group = q.shape[1] // k.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        o = masked_attention(qh, kh, vh, mask, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return o.squeeze(0).transpose(0, 1)
