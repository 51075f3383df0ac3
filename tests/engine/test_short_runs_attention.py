"""The torch backend's batched path for short query runs (speculative verification rows, small chunks)
equals the reference paged attention, next to decodes and a long prefill chunk, with GQA."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.attention.short_runs import SHORT_RUN_MAX_ROWS
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.intmath import cdiv
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref


def test_short_runs_match_reference():
    gen = torch.Generator().manual_seed(3)
    nb, bs, hkv, hq, d = 64, 4, 2, 8, 16
    k_cache, v_cache = torch.randn(nb, bs, hkv, d, generator=gen), torch.randn(nb, bs, hkv, d, generator=gen)
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    # two decodes; then runs of 5, 2, a long chunk of 30, 17 (the longest short run) and 3 rows
    q_lens = [1, 1, 5, 2, 30, SHORT_RUN_MAX_ROWS, 3]
    seq_lens = [6, 11, 9, 2, 41, 40, 4]
    max_blocks = max(cdiv(n, bs) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        k = cdiv(n, bs)
        tables[b, :k] = perm[used : used + k]
        used += k
    qs = [0]
    for n in q_lens:
        qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], hq, d, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qs, dtype=torch.int32),
        seq_lens_list=seq_lens,
        query_start_list=qs,
        num_decodes=2,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    backend = TorchAttentionBackend()
    out = backend.attend(q, k_cache, v_cache, meta, 0.25)
    assert backend._short is not None and backend._short.num_seqs == 4  # the batched path ran
    ref_dec = paged_attention_decode_ref(q[:2], k_cache, v_cache, tables[:2], meta.seq_lens[:2], 0.25)
    starts = meta.query_start_loc[2:] - 2
    ref_pre = paged_attention_prefill_ref(
        q[2:], k_cache, v_cache, tables[2:], starts, meta.seq_lens[2:], 0.25
    )
    torch.testing.assert_close(out[:2], ref_dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2:], ref_pre, rtol=1e-5, atol=1e-5)
    again = backend.attend(q, k_cache, v_cache, meta, 0.25)  # the plan is reused by the next layer
    torch.testing.assert_close(again, out, rtol=0, atol=0)
