"""Batched paged attention for short query runs (a few rows per sequence) in plain torch.

Speculative verification gives each sequence `k + 1` query rows, small chunks of prefill give a few:
attending to them one sequence at a time costs a Python round per sequence and layer. Here every such
run is padded to the longest one (`Q` rows) and all of them go through one masked SDPA call:

    K, V  = the runs' blocks gathered:           [B, Hkv, L, D]        (L = max blocks * block_size)
    q     = their rows, padded with the last row: [B, Hkv, group * Q, D] (the query heads of a KV head
                                                                         are rows of that head)
    mask[b, i, j] = j <= ctx_start[b] + i        (ctx_start = seq_len - run length: causal, and keys
                                                  past the sequence are never visible)
                    and j > ctx_start[b] + i - window   (a sliding-window layer's plan, window > 0)
Padded rows are computed and dropped. Same semantics as `kernels.reference.paged_attention_prefill_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata
from engine.attention.masked import masked_attention
from kernels.intmath import cdiv

# Runs of at most this many query rows take the batched path (longer prefill chunks go one by one).
SHORT_RUN_MAX_ROWS = 17


@dataclass(slots=True)
class ShortRunsPlan:
    tables: torch.Tensor  # [B * max_blocks] int64 block ids, padded with block 0
    mask: torch.Tensor  # [B, 1, Q, L] bool: True where the key is visible
    src_rows: torch.Tensor  # [B * Q] int64: flat-batch row of each padded query row
    keep: torch.Tensor  # [R] int64: padded positions (b * Q + i) that are real rows
    dst_rows: torch.Tensor  # [R] int64: their flat-batch rows
    num_seqs: int
    rows: int  # Q
    length: int  # L


def short_runs_plan(
    meta: AttentionMetadata, seqs: list[int], block_size: int, window: int = 0
) -> ShortRunsPlan:
    """The gather indices and mask for the runs of sequences `seqs` (indices into the metadata), for a
    layer whose rows see their last `window` positions (0: all before them)."""
    qs, sl = meta.query_start_list, meta.seq_lens_list
    lens = [qs[b + 1] - qs[b] for b in seqs]
    q_max = max(lens)
    max_blocks = cdiv(max(sl[b] for b in seqs), block_size)
    length = max_blocks * block_size
    dev = meta.block_tables.device
    idx = torch.tensor(seqs, dtype=torch.int64, device=dev)
    tables = meta.block_tables.index_select(0, idx)[:, :max_blocks].reshape(-1).long()
    src: list[int] = []
    keep: list[int] = []
    dst: list[int] = []
    starts: list[int] = []
    for j, (b, n) in enumerate(zip(seqs, lens, strict=True)):
        src.extend(qs[b] + min(i, n - 1) for i in range(q_max))
        keep.extend(j * q_max + i for i in range(n))
        dst.extend(range(qs[b], qs[b] + n))
        starts.append(sl[b] - n)
    qpos = torch.tensor(starts, device=dev)[:, None] + torch.arange(q_max, device=dev)[None, :]  # [B, Q]
    kpos = torch.arange(length, device=dev)[None, None, :]
    mask = kpos <= qpos[:, :, None]  # [B, Q, L]
    if window > 0:
        mask &= kpos > qpos[:, :, None] - window
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)
    return ShortRunsPlan(tables, mask[:, None], as_t(src), as_t(keep), as_t(dst), len(seqs), q_max, length)


def attend_short_runs(
    query: torch.Tensor,  # [T, Hq, D] the whole flat batch
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    plan: ShortRunsPlan,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: the plan's rows are written
    softcap: float = 0.0,
) -> None:
    """Attention output of every row of the plan's runs, written into `out` at their flat-batch rows
    (scores soft-capped when `softcap > 0`)."""
    b, q_rows, length = plan.num_seqs, plan.rows, plan.length
    hq, d = query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    k = k_cache.index_select(0, plan.tables).view(b, length, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache.index_select(0, plan.tables).view(b, length, hkv, d).transpose(1, 2)
    q = query.index_select(0, plan.src_rows).view(b, q_rows, hkv, group, d)
    q = q.permute(0, 2, 3, 1, 4).reshape(b, hkv, group * q_rows, d)
    mask = plan.mask.expand(b, group, q_rows, length).reshape(b, 1, group * q_rows, length)
    if softcap > 0:
        o = masked_attention(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    o = o.view(b, hkv, group, q_rows, d).permute(0, 3, 1, 2, 4).reshape(b * q_rows, hq, d)
    out.index_copy_(0, plan.dst_rows, o.index_select(0, plan.keep))
