"""The native CPU paged attention, at every instruction-set level this CPU runs, vs the torch reference:
float32 / bfloat16 / float16 caches, GQA and MHA, ragged lengths (1, within a block, across blocks, not
multiples of the block size), shuffled block tables, decode rows and short causal runs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from kernels.paged_attention_cpu import available_isas, best_isa, paged_attention_cpu, supported
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref

ISAS = ["generic", "avx2", "avx512"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# |kernel - reference| <= TOL * (1 + |reference|): both compute in float32 from the same cached values
# (sums in another order), then round once to the query dtype, so at most one ulp apart: 2**(1 - p)
# for p significand bits (bfloat16 8, float16 11).
TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
SEQ_LENS = [1, 3, 4, 5, 16, 37, 9, 64]  # block size 4: one row, partial block, exact blocks, many blocks


def _isa(isa: str) -> str:
    if isa not in available_isas():
        pytest.skip(f"this CPU does not run the {isa} kernel (have {', '.join(available_isas())})")
    return isa


@dataclass(slots=True)
class _Meta:
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32


def _case(seed, block_size, hkv, hq, d, seq_lens, q_lens, q_dtype, kv_dtype, spread=1.0):
    """Random caches with a few blocks no sequence uses; each sequence's blocks drawn from a random
    permutation (non-contiguous, out of order); the last `q_lens[b]` tokens of sequence b are queries."""
    if not supported(q_dtype, kv_dtype, d):
        pytest.skip(f"no kernel for {q_dtype} x {kv_dtype} with this C compiler")
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    shape = (sum(counts) + 3, block_size, hkv, d)
    k, v = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    perm = torch.randperm(shape[0], generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    for b, start in enumerate(itertools.accumulate([0, *counts[:-1]])):
        tables[b, : counts[b]] = perm[start : start + counts[b]]
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=gen) * spread
    meta = _Meta(torch.tensor(seq_lens, dtype=torch.int32), qsl)
    return q.to(q_dtype), k.to(kv_dtype), v.to(kv_dtype), tables, meta


def _assert_close(out, ref, dtype, tol=None):
    assert out.dtype == ref.dtype and not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs() / (1 + ref.float().abs())
    assert err.max() <= (tol or TOL[dtype]), f"max relative error {err.max():.2e}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", DTYPES, ids=lambda d: f"cache-{str(d)[6:]}")
@pytest.mark.parametrize("q_dtype", DTYPES, ids=lambda d: f"q-{str(d)[6:]}")
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_decode_matches_reference(isa, q_dtype, kv_dtype, heads):
    """Head dim 40 = five 8-lane vectors, keys in 8-key tiles and their remainder."""
    hq, hkv = heads
    q, k, v, tables, meta = _case(1, 4, hkv, hq, 40, SEQ_LENS, [1] * len(SEQ_LENS), q_dtype, kv_dtype)
    out = paged_attention_cpu(q, k, v, tables, meta.seq_lens, meta.query_start_loc, 0.3, isa=_isa(isa))
    _assert_close(out, paged_attention_decode_ref(q, k, v, tables, meta.seq_lens, 0.3), q_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", DTYPES, ids=lambda d: f"cache-{str(d)[6:]}")
@pytest.mark.parametrize("d", [13, 64])
def test_short_runs_match_reference(isa, kv_dtype, d):
    """Causal runs of several rows (speculative verification) beside decodes; head dims with a scalar
    tail (13) and without; 5 x 4 and 17 x 4 query vectors take several passes over the keys."""
    q_lens, seq_lens = [1, 5, 2, 17, 1, 3], [7, 9, 2, 40, 1, 30]
    q, k, v, tables, meta = _case(2, 4, 2, 8, d, seq_lens, q_lens, torch.float32, kv_dtype)
    out = paged_attention_cpu(q, k, v, tables, meta.seq_lens, meta.query_start_loc, 0.25, isa=_isa(isa))
    ref = paged_attention_prefill_ref(q, k, v, tables, meta.query_start_loc, meta.seq_lens, 0.25)
    _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_large_blocks_and_peaked_scores(isa):
    """Blocks of 64 keys (two softmax chunks each), one of 200-token sequences over shuffled blocks, and
    scores 20x larger: the running max moves between chunks and exp underflows. Scores reach ~100
    here, so a float32 rounding of one (2**-24 relative, either side) moves its weight by ~1e-5."""
    q, k, v, tables, meta = _case(3, 64, 2, 4, 32, [200, 1, 65, 128], [1, 1, 1, 1], torch.float32,
                                  torch.float32, spread=20.0)  # fmt: skip
    out = paged_attention_cpu(q, k, v, tables, meta.seq_lens, meta.query_start_loc, 0.5, isa=_isa(isa))
    _assert_close(out, paged_attention_decode_ref(q, k, v, tables, meta.seq_lens, 0.5), torch.float32, 3e-5)


def test_threads_isas_and_subsets_agree():
    """Results do not depend on the thread count; levels agree up to float32 summation order; `seqs`
    writes only its sequences' rows; no isa= means the best level."""
    q, k, v, tables, meta = _case(4, 4, 2, 8, 40, SEQ_LENS, [1] * 8, torch.float32, torch.bfloat16)
    args = (q, k, v, tables, meta.seq_lens, meta.query_start_loc, 0.3)
    one = paged_attention_cpu(*args, num_threads=1)
    assert torch.equal(paged_attention_cpu(*args, num_threads=2), one)
    assert torch.equal(paged_attention_cpu(*args, num_threads=4), one)
    assert torch.equal(paged_attention_cpu(*args, isa=best_isa()), one)
    for isa in available_isas():
        torch.testing.assert_close(paged_attention_cpu(*args, isa=isa), one, rtol=1e-5, atol=1e-6)
    out = torch.full_like(q, 7.0)
    paged_attention_cpu(*args, out=out, seqs=[1, 5])
    assert torch.equal(out[[1, 5]], one[[1, 5]])
    assert bool((out[[0, 2, 3, 4, 6, 7]] == 7.0).all())


def test_bad_inputs_are_refused():
    q, k, v, tables, meta = _case(5, 4, 2, 8, 16, [5, 9], [1, 1], torch.float32, torch.float32)
    sl, qsl = meta.seq_lens, meta.query_start_loc
    bad_tables = tables.clone()
    bad_tables[1, 2] = k.shape[0]  # a used block past the cache
    with pytest.raises(ValueError, match="outside the cache"):
        paged_attention_cpu(q, k, v, bad_tables, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_attention_cpu(q, k, v, tables, torch.tensor([5, 13], dtype=torch.int32), qsl, 1.0)
    with pytest.raises(ValueError, match="query rows"):
        paged_attention_cpu(q, k, v, tables, sl, torch.tensor([0, 0, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention_cpu(q, k, v.to(torch.bfloat16), tables, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu(q, k, v, tables.long(), sl, qsl, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        paged_attention_cpu(q[..., :8], k, v, tables, sl, qsl, 1.0)
    big = torch.zeros(4, 2, 2, 300)
    with pytest.raises(ValueError, match="head dim 300"):
        paged_attention_cpu(torch.zeros(2, 2, 300), big, big, tables, sl, qsl, 1.0)
