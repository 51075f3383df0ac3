"""Paged attention kernels (interpreted) vs dense causal attention on the same K/V, and vs the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.intmath import cdiv
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref, write_kv_ref

D = 32
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (5e-3, 5e-3)}


def _paged_setup(seq_lens: list[int], hkv: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """Dense K/V per sequence, written into NaN-poisoned caches through random block tables by write_kv."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(cdiv(n, block_size) for n in seq_lens) + 1
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    dense_k, dense_v, slots = [], [], []
    for b, n in enumerate(seq_lens):
        for j in range(cdiv(n, block_size)):
            block_tables[b, j] = perm.pop()
        dense_k.append(torch.randn(n, hkv, D, generator=gen).to(dtype))
        dense_v.append(torch.randn(n, hkv, D, generator=gen).to(dtype))
        slots += [int(block_tables[b, p // block_size]) * block_size + p % block_size for p in range(n)]
    k_cache = torch.full((num_blocks, block_size, hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    key, value = torch.cat(dense_k), torch.cat(dense_v)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    write_kv_ref(key, value, ref_k, ref_v, slot_mapping)
    assert torch.equal(k_cache.isnan(), ref_k.isnan()) and torch.equal(
        k_cache.nan_to_num(), ref_k.nan_to_num()
    )
    assert torch.equal(v_cache.nan_to_num(), ref_v.nan_to_num())
    return k_cache, v_cache, block_tables, dense_k, dense_v


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] = the last n positions of k/v [L, Hkv, D], causal; float32 result [n, Hq, D]."""
    n, length, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    q_pos = torch.arange(length - n, length)
    mask = torch.arange(length)[None, :] <= q_pos[:, None]
    kh = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vh = v.float().repeat_interleave(group, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "block_size"), [(8, 2, 4), (4, 4, 16), (6, 1, 8)])
def test_decode_matches_dense(hq: int, hkv: int, block_size: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 5, 16, 37]
    k_cache, v_cache, tables, dense_k, dense_v = _paged_setup(seq_lens, hkv, block_size, dtype)
    q = torch.randn(len(seq_lens), hq, D).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention_decode(q, k_cache, v_cache, tables, lens, D**-0.5)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, D**-0.5)
    dense = torch.cat([_dense_attention(q[b : b + 1], dense_k[b], dense_v[b], D**-0.5) for b in range(4)])
    rtol, atol = TOL[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), dense, rtol=rtol, atol=atol)
    torch.testing.assert_close(ref.float(), dense, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "block_size"), [(8, 2, 4), (2, 2, 16)])
def test_chunked_prefill_matches_dense(hq: int, hkv: int, block_size: int, dtype: torch.dtype) -> None:
    # (context length incl. new tokens, new tokens): full prefill, chunk after a cached prefix,
    # a single new token, a sequence with no new tokens this step, and a long chunk.
    seqs = [(7, 7), (20, 3), (9, 1), (5, 0), (26, 19)]
    seq_lens = [n for n, _ in seqs]
    k_cache, v_cache, tables, dense_k, dense_v = _paged_setup(seq_lens, hkv, block_size, dtype, seed=1)
    q_lens = [q for _, q in seqs]
    q = torch.randn(sum(q_lens), hq, D).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.2)
    ref = paged_attention_prefill_ref(q, k_cache, v_cache, tables, qsl, lens, 0.2)
    dense = torch.cat(
        [_dense_attention(q[qsl[b] : qsl[b + 1]], dense_k[b], dense_v[b], 0.2) for b in range(len(seqs))]
    )
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), dense, rtol=rtol, atol=atol)
    torch.testing.assert_close(ref.float(), dense, rtol=rtol, atol=atol)
    explicit = paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.2, max_query_len=19)
    torch.testing.assert_close(explicit, out, rtol=0, atol=0)


def test_decode_equals_prefill_of_last_token() -> None:
    k_cache, v_cache, tables, _, _ = _paged_setup([11, 3], 2, 4, torch.float32, seed=2)
    q = torch.randn(2, 4, D)
    lens = torch.tensor([11, 3], dtype=torch.int32)
    dec = paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3)
    pre = paged_attention_prefill(
        q, k_cache, v_cache, tables, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.3
    )
    torch.testing.assert_close(dec, pre, rtol=1e-5, atol=1e-5)
    wrong = paged_attention_decode(q, k_cache, v_cache, tables, lens - 1, 0.3)
    assert not torch.allclose(dec, wrong, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_skips_negative_slots_and_strided_inputs(dtype: torch.dtype) -> None:
    k_cache = torch.zeros(6, 4, 2, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 3, 2, D).to(dtype)  # key/value as strided views of a fused buffer
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, -1, 23, 9, -1])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slots)
    write_kv_ref(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache[5, 3], key[2]) and torch.equal(v_cache[2, 1], value[3])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3
