"""Runs one scheduled step: flat inputs -> model forward -> sampled tokens.

Per step it builds the flat inputs on the host (`engine/step_inputs.py`: token ids, positions, KV slots,
block tables, the rows to sample; decodes first, then prefill chunks) and, when any scheduled sequence
uses an adapter, the per-step LoRA context from `lora_context`. A plain decode step replays a CUDA graph
when `use_decode_graphs` was called (`engine/decode_graphs.py`); every other step runs eagerly, with its
inputs copied to the device once.

Under tensor parallel (`group`, `engine/distributed/worker_group.py`) the runner is rank 0: it sends the
step's inputs and LoRA runs to the other ranks, runs its own shard's forward (whose all-reduces meet
theirs) and samples alone. A forward that fails there leaves the group out of step, so it is raised as
`WorkerGroupError` (the engine restarts the group) rather than as one request's failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import select_backend
from engine.decode_graphs import BUCKETS, DecodeGraphs, GraphCapture
from engine.lora.pool import AdapterPool
from engine.model.decoder import DecoderForCausalLM
from engine.model.linear import LoRAStepContext
from engine.model_config import ModelConfig
from engine.sampler import Sampler
from engine.scheduler.output import RunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput
from engine.step_inputs import StepInputs, step_inputs, to_forward_batch

if TYPE_CHECKING:
    from engine.distributed.worker_group import WorkerGroup

LoRAContextBuilder = Callable[[Sequence[ScheduledSequence]], LoRAStepContext | None]


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        attention_backend: str = "auto",
        lora_context: LoRAContextBuilder | None = None,
        group: WorkerGroup | None = None,
    ) -> None:
        """`lora_context(items)`: the step's LoRA context for the scheduled items in flat-batch order
        (None when LoRA is disabled); `group`: the other tensor-parallel ranks (`cfg` is then this
        rank's shard's config, so the KV cache holds its heads only)."""
        self.model, self.cfg, self.device, self.block_size = model, cfg, device, block_size
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_layers = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.backend = select_backend(device, attention_backend)
        self.sampler = Sampler(device, seed)
        self.lora_context = lora_context
        self.group = group
        self.last_batch: tuple[int, int] = (0, 0)  # (tokens, decode tokens) of the last step, for benchmarks
        self.graphs: DecodeGraphs | None = None  # plain decode steps from CUDA graphs (`use_decode_graphs`)

    def use_decode_graphs(
        self, capture: GraphCapture, pool: AdapterPool | None = None, max_batch: int = BUCKETS[-1]
    ) -> None:
        """Run plain decode steps of up to `max_batch` sequences from graphs recorded by `capture`
        (`engine/decode_graphs.py`); `pool`: the adapter pool, when LoRA runs on the Triton path."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_layers, self.backend, self.block_size, self.device, capture, pool, max_batch
        )

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        """Compute the plan's tokens and return one sampled token (or None) per scheduled item."""
        # Decodes first (batched attention), each group ordered by adapter so its tokens are contiguous.
        order = sorted(
            range(len(plan.scheduled)),
            key=lambda i: (plan.scheduled[i].num_tokens != 1, plan.scheduled[i].seq.lora_key or ""),
        )
        items = [plan.scheduled[i] for i in order]
        inp = step_inputs(items, self.block_size)
        rope = self.model.rope
        if rope.long_from is not None:  # LongRoPE: each token's row of the short or long tables
            prompt_lens = np.repeat(
                [it.seq.num_prompt_tokens for it in items], [it.num_tokens for it in items]
            )
            inp.positions = rope.long_rope_positions(inp.positions, prompt_lens)
        self.last_batch = (inp.num_tokens, inp.num_decodes)
        lora = self.lora_context(items) if self.lora_context is not None else None
        if self.group is not None:
            logits = self._forward_parallel(items, inp, lora)
        elif self.graphs is not None and self.graphs.handles(inp, lora):
            logits = self.graphs.run(inp, lora)  # type: ignore[arg-type]  # handles() checked the type
        else:
            logits = self.model(to_forward_batch(inp, lora, self.device), self.kv_layers, self.backend)
        sample_items = [it for it in items if it.sample]
        if not any(it.spec_token_ids for it in sample_items):
            tokens = self.sampler(logits, [it.seq for it in sample_items]) if sample_items else []
            by_item = {id(it): tok for it, tok in zip(sample_items, tokens, strict=True)}
            return RunnerOutput([by_item.get(id(it)) for it in plan.scheduled])
        return self._sample_with_spec(plan, sample_items, logits)

    def _forward_parallel(
        self, items: list[ScheduledSequence], inp: StepInputs, lora: LoRAStepContext | None
    ) -> torch.Tensor:
        """Rank 0's forward under tensor parallel: the plan to the other ranks, then our shard's pass."""
        from engine.distributed.worker_group import WorkerGroupError

        assert self.group is not None, "called under tensor parallel only"
        # every rank replays its own decode graph of the step's bucket, or every rank runs eagerly
        graph = self.graphs is not None and self.graphs.handles(inp, lora)
        self.group.send_step(inp, self.group.lora_runs(items) if lora is not None else [], graph)
        try:
            if graph:
                assert self.graphs is not None, "checked above"
                return self.graphs.run(inp, lora)  # type: ignore[arg-type]  # handles() checked the type
            return self.model(to_forward_batch(inp, lora, self.device), self.kv_layers, self.backend)
        except WorkerGroupError:
            raise
        except Exception as exc:
            raise WorkerGroupError(f"rank 0's forward failed: {exc!r}") from exc

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
        emitted = verify(
            spec_logits, [it.seq for it in spec], drafts, self.sampler.generator, self.sampler.eos_token_ids
        )
        for it, toks in zip(spec, emitted, strict=True):
            by_item[id(it)] = toks[0]
            spec_by_item[id(it)] = toks
        return RunnerOutput(
            [by_item.get(id(it)) for it in plan.scheduled],
            [spec_by_item.get(id(it)) for it in plan.scheduled],
        )
