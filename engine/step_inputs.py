"""One step's flat model inputs as host arrays, built from the scheduled sequences.

For the scheduled items in flat-batch order (decodes first, see `ModelRunner.run`):
- the token ids and positions of every row (a sequence's new tokens, then its proposed tokens),
- the KV slot of every row (`block_ids[pos // block_size] * block_size + pos % block_size`),
- each sequence's block table (padded with 0), context length after the step and first row,
- the rows whose next-token logits are needed (a sampling sequence's last row; with `k` proposed tokens,
  its last `k + 1` rows).

The eager path turns these into device tensors (`to_forward_batch`); the CUDA-graph decode path copies
them into its static buffers (`engine/decode_graphs.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.model.layers import ForwardBatch
from engine.model.linear import LoRAStepContext
from engine.scheduler.output import ScheduledSequence


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int]  # [T]
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: list[int]  # [B]
    query_starts: list[int]  # [B + 1]
    logits_rows: list[int]
    num_decodes: int  # the first num_decodes sequences have one row each

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_plain_decode(self) -> bool:
        """Every sequence decodes one token (no prefill chunk, no proposed tokens) and samples it."""
        b = len(self.seq_lens)
        return self.num_decodes == b == self.num_tokens and len(self.logits_rows) == b


def step_inputs(items: Sequence[ScheduledSequence], block_size: int) -> StepInputs:
    """The host arrays of one step (module docstring) for `items` in flat-batch order.

    The leading decode rows (one token each) are computed with plain integers, the other rows with
    numpy: a decode step of 32 sequences costs about half the time of numpy for every row."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    pos_parts: list[np.ndarray] = []  # the rows after the leading decodes' `positions` / `slots`
    slot_parts: list[np.ndarray] = []
    seq_lens, q_start = [], [0]
    logits_rows: list[int] = []
    num_decodes = 0
    max_blocks = max(len(it.block_ids) for it in items)
    tables = np.zeros((len(items), max_blocks), dtype=np.int32)
    for row, it in enumerate(items):
        n, start, spec, blocks = it.num_tokens, it.start, it.spec_token_ids, it.block_ids
        tables[row, : len(blocks)] = blocks
        seq_lens.append(start + n)
        q_start.append(q_start[-1] + n)
        num_decodes += n == 1
        if n == 1 and not pos_parts:  # a decode row before any other row: plain integers
            ids.append(it.seq.all_token_ids[start])
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            ids.extend(it.seq.all_token_ids[start : start + n - len(spec)])
            ids.extend(spec)
            pos = np.arange(start, start + n, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs)
        if it.sample:  # the last row; with proposed tokens, every row from the last known token on
            logits_rows.extend(range(q_start[-1] - 1 - len(spec), q_start[-1]))
    return StepInputs(
        input_ids=ids,
        positions=np.concatenate([np.asarray(positions, dtype=np.int64), *pos_parts]),
        slot_mapping=np.concatenate([np.asarray(slots, dtype=np.int64), *slot_parts]),
        block_tables=tables,
        seq_lens=seq_lens,
        query_starts=q_start,
        logits_rows=logits_rows,
        num_decodes=num_decodes,
    )


def to_forward_batch(inp: StepInputs, lora: LoRAStepContext | None, device: torch.device) -> ForwardBatch:
    """The step's inputs as device tensors (one copy each), for an eager forward pass."""
    attn = AttentionMetadata(
        slot_mapping=torch.from_numpy(inp.slot_mapping).to(device),
        block_tables=torch.from_numpy(inp.block_tables).to(device),
        seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(inp.query_starts, dtype=torch.int32, device=device),
        seq_lens_list=inp.seq_lens,
        query_start_list=inp.query_starts,
        num_decodes=inp.num_decodes,
        max_seq_len=max(inp.seq_lens),
        max_query_len=max(b - a for a, b in pairwise(inp.query_starts)),
    )
    return ForwardBatch(
        input_ids=torch.tensor(inp.input_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(inp.positions).to(device),
        attn=attn,
        logits_indices=torch.tensor(inp.logits_rows, dtype=torch.int64, device=device),
        lora=lora,
    )
