"""Paged attention through the Triton kernels in `kernels.paged_attention` (the CUDA path).

Decodes (the first `num_decodes` sequences) go through the decode kernel, prefill chunks through the
prefill kernel with their cached prefix. On CPU this runs only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from kernels import paged_attention

        self._ops = paged_attention

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)

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
        ops, nd, n = self._ops, meta.num_decodes, meta.num_seqs
        if nd == n:
            return ops.paged_attention_decode(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, softcap
            )
        if nd == 0:
            return ops.paged_attention_prefill(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                meta.max_query_len,
                window,
                softcap,
            )
        out = torch.empty_like(query)
        out[:nd] = ops.paged_attention_decode(
            query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, window, softcap
        )
        starts = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
        out[nd:] = ops.paged_attention_prefill(
            query[nd:],
            k_cache,
            v_cache,
            meta.block_tables[nd:],
            starts,
            meta.seq_lens[nd:],
            scale,
            meta.max_query_len,
            window,
            softcap,
        )
        return out
