"""The attention backend interface and the per-step metadata every backend reads.

The batch is flat: all sequences' new tokens concatenated, decodes (one query token) first, then
prefill chunks. Sequence b's queries are rows `query_start_loc[b]:query_start_loc[b+1]`; its context is
`seq_lens[b]` tokens (cached ones + this step's), whose K/V live in the blocks `block_tables[b]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens_list: list[int]
    query_start_list: list[int]
    num_decodes: int  # sequences 0..num_decodes-1 have exactly one query token
    max_seq_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class AttentionBackend(ABC):
    """Writes the step's K/V into the paged cache and computes causal attention through block tables."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Causal attention of the step's query rows over their sequences' cached K/V.

        `window > 0` (a sliding-window layer): a query at position p sees keys p - window + 1 .. p only.
        `softcap > 0`: scores are soft-capped, softcap * tanh(score / softcap), before the mask.
        Semantics: `kernels.reference.paged_attention_prefill_ref`."""
        ...


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def validate_attention_backend(name: str) -> str:
    """`name` if it is one of ATTENTION_BACKENDS; else ValueError."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be auto, torch or triton; got {name!r}")
    return name


def select_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """`auto`: the Triton kernels on CUDA, the torch implementation elsewhere; or force one by name."""
    if validate_attention_backend(name) == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
