"""A random paged-attention case for the attention backend tests: KV caches, block tables and metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from kernels.intmath import cdiv


@dataclass(slots=True)
class AttentionCase:
    q: torch.Tensor  # [total query rows, hq, d]
    k_cache: torch.Tensor  # [num_blocks, block_size, hkv, d]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [num_seqs, max blocks] int32, distinct random blocks per sequence
    meta: AttentionMetadata


def attention_case(
    seed: int, num_blocks: int, block_size: int, hkv: int, hq: int, d: int, seq_lens: list[int],
    q_lens: list[int], num_decodes: int,
) -> AttentionCase:  # fmt: skip
    """Sequences of `seq_lens` tokens whose last `q_lens` tokens are queries (the first `num_decodes`
    with one query each), their blocks a random permutation of the cache's."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, hkv, d)
    k_cache, v_cache = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(cdiv(n, block_size) for n in seq_lens), dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        k = cdiv(n, block_size)
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
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    return AttentionCase(q, k_cache, v_cache, tables, meta)
