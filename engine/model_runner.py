"""Runs one scheduled step: flat inputs -> model forward -> sampled tokens.

Per step it builds, with numpy on the host and one copy to the device:
- input ids and positions of every scheduled token (decodes first, then prefill chunks),
- the KV slot of every token (`block_ids[pos // block_size] * block_size + pos % block_size`),
- padded block tables, context lengths and query offsets for attention,
- the row of each sequence's last token, for the sequences that sample this step (with speculative
  decoding, the rows of its last known token and of each proposed token after it: `k` proposed tokens
  are `k + 1` query rows of the sequence, each row carrying the sequence's adapter),
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
        if not any(it.spec_token_ids for it in sample_items):
            tokens = self.sampler(logits, [it.seq for it in sample_items]) if sample_items else []
            by_item = {id(it): tok for it, tok in zip(sample_items, tokens, strict=True)}
            return RunnerOutput([by_item.get(id(it)) for it in plan.scheduled])
        return self._sample_with_spec(plan, sample_items, logits)

    def _sample_with_spec(
        self, plan: SchedulerOutput, sample_items: list[ScheduledSequence], logits: torch.Tensor
    ) -> RunnerOutput:
        """Sample the plain rows; verify the proposed tokens of speculative items (engine/spec/verify.py).

        logits [R, V]: one row per plain item, len(spec) + 1 rows per speculative item, in item order."""
        from engine.spec.verify import verify

        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for it in sample_items:
            n = len(it.spec_token_ids) + 1
            (spec_rows if n > 1 else plain_rows).extend(range(row, row + n))
            row += n
        plain = [it for it in sample_items if not it.spec_token_ids]
        spec = [it for it in sample_items if it.spec_token_ids]
        dev = logits.device
        by_item: dict[int, SampledToken] = {}
        spec_by_item: dict[int, list[SampledToken]] = {}
        if plain:
            tokens = self.sampler(logits[torch.tensor(plain_rows, device=dev)], [it.seq for it in plain])
            by_item = {id(it): tok for it, tok in zip(plain, tokens, strict=True)}
        spec_logits = logits[torch.tensor(spec_rows, device=dev)]
        drafts = [it.spec_token_ids for it in spec]
        emitted = verify(spec_logits, [it.seq for it in spec], drafts, self.sampler.generator)
        for it, toks in zip(spec, emitted, strict=True):
            by_item[id(it)] = toks[0]
            spec_by_item[id(it)] = toks
        return RunnerOutput(
            [by_item.get(id(it)) for it in plan.scheduled],
            [spec_by_item.get(id(it)) for it in plan.scheduled],
        )

    def _prepare(self, items: list[ScheduledSequence]) -> ForwardBatch:
        bs = self.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        seq_lens, q_start = [], [0]
        logits_rows: list[int] = []
        num_decodes = 0
        max_blocks = max(len(it.block_ids) for it in items)
        tables = np.zeros((len(items), max_blocks), dtype=np.int32)
        for row, it in enumerate(items):
            n, start = it.num_tokens, it.start
            if n == 1:
                num_decodes += 1
            spec = it.spec_token_ids
            ids.extend(it.seq.all_token_ids[start : start + n - len(spec)])
            ids.extend(spec)
            pos = np.arange(start, start + n, dtype=np.int64)
            blocks = np.asarray(it.block_ids, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(blocks[pos // bs] * bs + pos % bs)
            tables[row, : len(blocks)] = blocks
            seq_lens.append(start + n)
            q_start.append(q_start[-1] + n)
            if it.sample:  # the last row; with proposed tokens, every row from the last known token on
                logits_rows.extend(range(q_start[-1] - 1 - len(spec), q_start[-1]))
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
