"""Runs one scheduled step: flat inputs -> model forward -> sampled tokens.

Per step it builds, with numpy on the host and one copy to the device:
- input ids and positions of every scheduled token (decodes first, then prefill chunks),
- the KV slot of every token (`block_ids[pos // block_size] * block_size + pos % block_size`),
- padded block tables, context lengths and query offsets for attention,
- the row of each sequence's last token, for the sequences that sample this step,
and, when any scheduled sequence uses an adapter, the per-step LoRA context from `lora_context`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.attention import AttentionMetadata, select_backend
from engine.model.linear import LoRAStepContext
from engine.model.llama import ForwardBatch, LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.sampler import Sampler
from engine.scheduler.output import RunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput

LoRAContextBuilder = Callable[[Sequence[ScheduledSequence]], LoRAStepContext | None]


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        attention_backend: str = "auto",
        lora_context: LoRAContextBuilder | None = None,
    ) -> None:
        """`lora_context(items)`: the step's LoRA context for the scheduled items in flat-batch order
        (None when LoRA is disabled)."""
        self.model, self.cfg, self.device, self.block_size = model, cfg, device, block_size
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_layers = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.backend = select_backend(device, attention_backend)
        self.sampler = Sampler(device, seed)
        self.lora_context = lora_context
        self.last_batch: tuple[int, int] = (0, 0)  # (tokens, decode tokens) of the last step, for benchmarks

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        """Compute the plan's tokens and return one sampled token (or None) per scheduled item."""
        # Decodes first (batched attention), each group ordered by adapter so its tokens are contiguous.
        order = sorted(
            range(len(plan.scheduled)),
            key=lambda i: (plan.scheduled[i].num_tokens != 1, plan.scheduled[i].seq.lora_key or ""),
        )
        items = [plan.scheduled[i] for i in order]
        batch = self._prepare(items)
        self.last_batch = (batch.input_ids.shape[0], batch.attn.num_decodes)
        logits = self.model(batch, self.kv_layers, self.backend)
        sample_items = [it for it in items if it.sample]
        tokens = self.sampler(logits, [it.seq for it in sample_items]) if sample_items else []
        by_item: dict[int, SampledToken] = {id(it): tok for it, tok in zip(sample_items, tokens, strict=True)}
        return RunnerOutput([by_item.get(id(it)) for it in plan.scheduled])

    def _prepare(self, items: list[ScheduledSequence]) -> ForwardBatch:
        bs = self.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        seq_lens, q_start, logits_rows = [], [0], []
        num_decodes = 0
        max_blocks = max(len(it.block_ids) for it in items)
        tables = np.zeros((len(items), max_blocks), dtype=np.int32)
        for row, it in enumerate(items):
            n, start = it.num_tokens, it.start
            if n == 1:
                num_decodes += 1
            ids.extend(it.seq.all_token_ids[start : start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            blocks = np.asarray(it.block_ids, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(blocks[pos // bs] * bs + pos % bs)
            tables[row, : len(blocks)] = blocks
            seq_lens.append(start + n)
            q_start.append(q_start[-1] + n)
            if it.sample:
                logits_rows.append(q_start[-1] - 1)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=dev),
            seq_lens_list=seq_lens,
            query_start_list=q_start,
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            max_query_len=max(it.num_tokens for it in items),
        )
        lora = self.lora_context(items) if self.lora_context is not None else None
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            attn=attn,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            lora=lora,
        )
