"""Per-layer MoE routing metadata: the step's (token, choice) pairs sorted by expert, each expert's run
padded to the kernel's row block, so every row block of `kernels/fused_moe.py` reads one expert.

Built with device ops only (no host synchronization, no data-dependent shapes), so a CUDA graph can
capture it: the padded length is bounded on the host by `max_padded_pairs`, blocks past the real end
are marked and skipped by the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.intmath import cdiv


@dataclass(slots=True)
class MoEAlignment:
    """Pairs `p = t * top_k + j` (token t's j-th choice) grouped by expert, runs padded to `block_m`.

    Row block `b` covers `sorted_pair_ids[b * block_m : (b + 1) * block_m]`, all routed to expert
    `block_experts[b]`; padding entries hold the sentinel `num_pairs`; blocks at or past `num_padded`
    have `block_experts == num_experts` and do nothing.
    """

    sorted_pair_ids: Tensor  # [max_padded] int32: pair ids by expert (stable), sentinel num_pairs = padding
    block_experts: Tensor  # [max_padded // block_m] int32: each row block's expert; num_experts = unused
    num_padded: Tensor  # [1] int32 on the device: rows of sorted_pair_ids in use (a multiple of block_m)
    num_pairs: int  # T * top_k
    top_k: int
    num_experts: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        """Row blocks the kernel grid covers (an upper bound of the blocks in use)."""
        return self.block_experts.shape[0]


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: at most min(pairs, experts) runs, each padded by < block_m."""
    return cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m) * block_m


def align_pairs(topk_ids: Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs of `topk_ids` [T, k] by expert and pad each expert's run to `block_m`::

        counts[e] = #pairs routed to e;  padded[e] = ceil(counts[e] / block_m) * block_m
        pstart = exclusive_cumsum(padded)
        pairs of expert e, in pair order, fill sorted_pair_ids[pstart[e] : pstart[e] + counts[e]]
        block_experts[b] = e such that pstart[e] <= b * block_m < pstart[e] + padded[e]  (else E)

    Experts without pairs get no block. Ids must lie in [0, num_experts).
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"align_pairs: topk_ids must be a 2-D int32/int64 tensor, got {topk_ids.dtype} "
            f"of shape {tuple(topk_ids.shape)}"
        )
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"align_pairs: block_m and num_experts must be positive: {block_m}, {num_experts}")
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    # scatter_add_, not bincount: bincount reads the maximum on the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=dev) - run_start[expert_of]
    dest = (pend - padded)[expert_of] + rank
    total = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, total, block_m, device=dev)
    block_experts = torch.searchsorted(pend, block_starts, right=True).to(torch.int32)
    num_padded = pend[-1:].to(torch.int32)
    return MoEAlignment(
        sorted_pair_ids=sorted_ids,
        block_experts=block_experts,
        num_padded=num_padded,
        num_pairs=num_pairs,
        top_k=topk_ids.shape[1],
        num_experts=num_experts,
        block_m=block_m,
    )
