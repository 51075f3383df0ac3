"""Paged attention (Triton): write new K/V into cache slots; decode and chunked prefill over block tables."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import (
    FLOAT_DTYPES,
    check_runnable,
    check_shape,
    check_tensor,
    is_interpreted,
    launch,
)
from kernels.intmath import cdiv, next_pow2
from kernels.tuning import resolve_config

_I32 = (torch.int32,)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,  # [T,Hkv,D] x2, [blocks,bs,Hkv,D] x2, [T] int64
    num_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < head_dim)[None, :]
    cache_off = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
    cache_off += offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,  # q/out [T, Hq, D]; caches [blocks, bs, Hkv, D]
    block_tables_ptr, query_start_ptr, seq_lens_ptr,  # [B, max_blocks], [B+1], [B] int32
    scale, head_dim, block_size, max_blocks, window, softcap,  # window > 0: sliding; softcap: SOFTCAP only
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows = (query token, query head of this KV head's group) pairs of one
    sequence; online softmax over KV blocks up to the last causal position of those rows, from the
    first position the earliest of them sees (its window's start, `window > 0`; else 0). SOFTCAP:
    scores become softcap * tanh(score / softcap)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    if DECODE:  # one query per sequence; query_start_loc is implicit (= arange)
        q_lo = b
        q_len = 1
    else:
        q_lo = tl.load(query_start_ptr + b)
        q_len = tl.load(query_start_ptr + b + 1) - q_lo
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    mask_m = q_idx < q_len
    q_pos = seq_len - q_len + q_idx
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q_off = (q_lo + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634  # softmax via exp2

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_end = tl.minimum(seq_len, seq_len - q_len + (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    kv_start = tl.where(
        window > 0, tl.maximum(seq_len - q_len + (pid_m * BLOCK_M) // GROUP - window + 1, 0), 0
    )
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = (pos < kv_end) & (pos // block_size < max_blocks)
        blocks = tl.load(block_tables_ptr + b * stride_bt + pos // block_size, mask=mask_n, other=0)
        kv_off = blocks.to(tl.int64) * stride_cb + (pos % block_size) * stride_co + kv_head * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale / softcap)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_lo + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def attention_config(max_query_len: int, group: int, head_dim: int, block_size: int) -> dict:
    """Heuristic block sizes (then the tuning hook's override for op ``"paged_attention"``)."""
    rows = max_query_len * group
    block_m = max(16, min(next_pow2(rows), 64))
    block_n = 64 if head_dim <= 128 else 32
    default = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}
    problem = {"max_query_len": max_query_len, "group": group, "head_dim": head_dim, "block_size": block_size}
    return resolve_config("paged_attention", problem, default)


def _launch_write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        num_heads, head_dim, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
    )  # fmt: skip


_write_kv_op = torch.library.custom_op(
    "loraplex::write_kv", _launch_write_kv, mutates_args=("k_cache", "v_cache")
)


@_write_kv_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping) -> None:
    return None


def _launch_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_query_len: int,
    decode: bool,
    out: Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    head_dim = q.shape[2]
    cfg = attention_config(max_query_len, group, head_dim, k_cache.shape[1])
    grid = (cdiv(max_query_len * group, cfg["BLOCK_M"]), num_seqs, num_kv_heads)
    _attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, query_start_loc, seq_lens,
        scale, head_dim, k_cache.shape[1], block_tables.shape[1], window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DECODE=decode, SOFTCAP=softcap > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


_attention_op = torch.library.custom_op("loraplex::paged_attention", _launch_attention, mutates_args=("out",))


@_attention_op.register_fake
def _(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, decode, out,
    window=0, softcap=0.0,
) -> None:  # fmt: skip
    return None


def _check_caches(
    op: str, k_cache: Tensor, v_cache: Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, cache, ndim=4, dtypes=(dtype,), device=device)
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"{op}: v_cache must have k_cache's shape and strides, got {tuple(v_cache.shape)}")


def _check_attention(
    op: str,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    num_seqs: int,
) -> None:
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _check_caches(op, k_cache, v_cache, q.dtype, q.device)
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"{op}: head_dim of q ({q.shape[2]}) and k_cache ({k_cache.shape[3]}) differ")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"{op}: query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})"
        )
    check_tensor(op, "block_tables", block_tables, ndim=2, dtypes=_I32, device=q.device)
    check_shape(op, "block_tables", block_tables, (num_seqs, None))
    check_tensor(op, "seq_lens", seq_lens, ndim=1, dtypes=_I32, device=q.device)
    check_shape(op, "seq_lens", seq_lens, (num_seqs,))
    check_runnable(op, q.device, is_interpreted(_attention_kernel))


def write_kv(
    key: Tensor,  # [T, Hkv, D], last dim contiguous
    value: Tensor,  # [T, Hkv, D], last dim contiguous
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D], last dim contiguous
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D], same shape/strides as k_cache
    slot_mapping: Tensor,  # [T] int64 (or int32): flat slot = block * block_size + offset; -1 = skip
) -> None:
    """Scatter new K/V into the paged cache (same semantics as :func:`kernels.reference.write_kv_ref`)::

        k_cache[slot // block_size, slot % block_size] = key[t]   (and v) for slot = slot_mapping[t] >= 0

    Values are cast to the cache dtype; one program per token.
    """
    op = "write_kv"
    check_tensor(op, "key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "value", value, ndim=3, dtypes=FLOAT_DTYPES, device=key.device)
    check_shape(op, "value", value, tuple(key.shape))
    _check_caches(op, k_cache, v_cache, k_cache.dtype, key.device)
    check_shape(op, "k_cache", k_cache, (None, None, key.shape[1], key.shape[2]))
    check_tensor(
        op, "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=key.device
    )
    check_shape(op, "slot_mapping", slot_mapping, (key.shape[0],))
    check_runnable(op, key.device, is_interpreted(_write_kv_kernel))
    launch(_write_kv_op, _launch_write_kv)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    q: Tensor,  # [B, Hq, D], last dim contiguous; query of sequence b sits at position seq_lens[b] - 1
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D], q.dtype, last dim contiguous
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D], same shape/strides as k_cache
    block_tables: Tensor,  # [B, max_blocks] int32, last dim contiguous
    seq_lens: Tensor,  # [B] int32, >= 1, context length including the query token
    scale: float,
    window: int = 0,  # > 0: the query sees its last `window` positions only
    softcap: float = 0.0,  # > 0: attention-logit soft-capping
) -> Tensor:
    """Decode attention over paged K/V, GQA; returns ``[B, Hq, D]`` in ``q.dtype``. Semantics: see
    :func:`kernels.reference.paged_attention_decode_ref`. Each program serves one (sequence, KV head)
    and all query heads of its group, so every K/V block is read once per KV head."""
    _check_attention("paged_attention_decode", q, k_cache, v_cache, block_tables, seq_lens, q.shape[0])
    out = torch.empty_like(q)
    launch(_attention_op, _launch_attention)(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        seq_lens,
        float(scale),
        1,
        True,
        out,
        int(window),
        float(softcap),
    )
    return out


def paged_attention_prefill(
    q: Tensor,  # [T, Hq, D], last dim contiguous; query tokens of all sequences concatenated
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D], q.dtype, last dim contiguous
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D], same shape/strides as k_cache
    block_tables: Tensor,  # [B, max_blocks] int32, last dim contiguous
    query_start_loc: Tensor,  # [B + 1] int32, cumulative query lengths (query_start_loc[0] == 0)
    seq_lens: Tensor,  # [B] int32, context length INCLUDING the new tokens (already written to the cache)
    scale: float,
    max_query_len: int | None = None,  # max query tokens of one sequence; computed (one sync) if None
    window: int = 0,  # > 0: each query sees its last `window` positions only
    softcap: float = 0.0,  # > 0: attention-logit soft-capping
) -> Tensor:
    """Causal (chunked) prefill over paged K/V with a cached prefix, GQA; returns ``[T, Hq, D]`` in
    ``q.dtype``. Semantics: see :func:`kernels.reference.paged_attention_prefill_ref`."""
    op = "paged_attention_prefill"
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, Tensor) and seq_lens.dim() == 1 else -1
    _check_attention(op, q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    check_tensor(op, "query_start_loc", query_start_loc, ndim=1, dtypes=_I32, device=q.device)
    check_shape(op, "query_start_loc", query_start_loc, (num_seqs + 1,))
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if num_seqs else 0
    out = torch.empty_like(q)
    launch(_attention_op, _launch_attention)(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        float(scale),
        max_query_len,
        False,
        out,
        int(window),
        float(softcap),
    )
    return out
