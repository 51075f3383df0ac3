"""The messages rank 0 sends the other tensor-parallel ranks: typed arrays in one byte frame, no pickle.

A frame is ``[kind, n, (dtype code, ndim, shape...) * n]`` as int64, then each array's raw bytes. Kinds:

- `STEP`: one forward pass. Arrays: input_ids [T], positions [T], slot_mapping [T] (int64),
  block_tables [B, M] (int32), seq_lens [B], query_starts [B+1], [num_decodes] (int64), the LoRA
  runs [S, 4] = (first row, end row, pool slot, mix position) of the rows that use an adapter (S = 0:
  none) and their weights [S] (float64; `engine/distributed/lora_runs.py`), then [threads, graph] (int64):
  the CPU threads every rank computes this step with (rank 0's count, which its `ThreadGovernor` may
  change; 0: leave them) and whether the step replays the decode graph of its bucket (1) or runs
  eagerly (0), as rank 0 does (`engine/decode_graphs.py`).
- `UPLOAD`: write an adapter into the pool. Arrays: digest (uint8, ASCII), [slot], pages per module
  [7] then the page ids, per adapted (layer, module) its [layer, module index, rank] (int64 [W, 3]) and
  scaling (float64 [W]); per adapted (layer, expert projection) of a MoE adapter its [layer, projection
  index, rank] (int64 [X, 3]) and scaling (float64 [X]); then A and B of each module, float32; then A
  [E, r, in] and B [E, out, r] of each expert projection, float32 (whole: every rank cuts its part); then
  the adapter's side tensors (DoRA magnitudes, lora_B biases, its embedding side:
  `engine/distributed/adapter_frames.py`).
- `EVICT`: digest. `STOP`: no arrays.
- `GRAPHS`: [max batch]: capture the decode graphs now, as rank 0 does (`DecodeGraphs.capture_all`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.distributed.adapter_frames import decode_side, encode_side
from engine.lora.adapter_checkpoint import PROJECTIONS, AdapterCheckpoint, LoRAModuleWeights
from engine.lora.expert_checkpoint import ExpertLoRAWeights
from engine.lora.expert_pages import EXPERT_PROJS
from engine.step_inputs import StepInputs

STEP, UPLOAD, EVICT, STOP, GRAPHS = 1, 2, 3, 4, 5
_DTYPES = [np.dtype(t) for t in (np.int64, np.int32, np.float32, np.float64, np.uint8)]


def encode(kind: int, arrays: list[np.ndarray]) -> bytes:
    """One frame of `kind` carrying `arrays` (each of a dtype in `_DTYPES`)."""
    head: list[int] = [kind, len(arrays)]
    for a in arrays:
        head += [_DTYPES.index(a.dtype), a.ndim, *a.shape]
    parts = [np.asarray([len(head), *head], dtype=np.int64).tobytes()]
    parts += [np.ascontiguousarray(a).tobytes() for a in arrays]
    return b"".join(parts)


def decode(frame: bytes) -> tuple[int, list[np.ndarray]]:
    """(kind, arrays) of a frame made by `encode`."""
    n_head = int(np.frombuffer(frame, dtype=np.int64, count=1)[0])
    head = np.frombuffer(frame, dtype=np.int64, count=n_head, offset=8).tolist()
    kind, count, i = head[0], head[1], 2
    offset = 8 * (n_head + 1)
    arrays = []
    for _ in range(count):
        dtype, ndim = _DTYPES[head[i]], head[i + 1]
        shape = tuple(head[i + 2 : i + 2 + ndim])
        i += 2 + ndim
        size = int(np.prod(shape)) if shape else 1
        arrays.append(np.frombuffer(frame, dtype=dtype, count=size, offset=offset).reshape(shape).copy())
        offset += size * dtype.itemsize
    return kind, arrays


@dataclass(slots=True)
class WorkerStep:
    """A decoded `STEP`: the forward inputs (no logits rows: only rank 0 samples) and the LoRA runs."""

    inputs: StepInputs
    lora_runs: np.ndarray  # [S, 4] (start, end, slot, mix position)
    lora_weights: np.ndarray  # [S] float64: each run's weight
    num_threads: int = 0  # the CPU threads to compute with (0: unchanged)
    graph: bool = False  # replay the bucket's decode graph (rank 0 does)


def encode_step(
    inp: StepInputs,
    lora_runs: Sequence[tuple[int, int, int, int, float]],
    num_threads: int = 0,
    graph: bool = False,
) -> bytes:
    """`lora_runs`: (start, end, slot, mix position, weight) per run (`lora_runs.step_lora_runs`);
    `num_threads`, `graph`: as in the module docstring."""
    runs = np.asarray([r[:4] for r in lora_runs], dtype=np.int64).reshape(-1, 4)
    weights = np.asarray([r[4] for r in lora_runs], dtype=np.float64)
    return encode(
        STEP,
        [
            np.asarray(inp.input_ids, dtype=np.int64),
            inp.positions.astype(np.int64, copy=False),
            inp.slot_mapping.astype(np.int64, copy=False),
            inp.block_tables.astype(np.int32, copy=False),
            np.asarray(inp.seq_lens, dtype=np.int64),
            np.asarray(inp.query_starts, dtype=np.int64),
            np.asarray([inp.num_decodes], dtype=np.int64),
            runs,
            weights,
            np.asarray([num_threads, int(graph)], dtype=np.int64),
        ],
    )


def decode_step(arrays: list[np.ndarray]) -> WorkerStep:
    ids, pos, slots, tables, seq_lens, starts, nd, runs, weights, flags = arrays
    inp = StepInputs(
        input_ids=ids.tolist(),
        positions=pos,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=seq_lens.tolist(),
        query_starts=starts.tolist(),
        logits_rows=[],
        num_decodes=int(nd[0]),
    )
    return WorkerStep(inp, runs, weights, int(flags[0]), bool(flags[1]))


def _digest(d: str) -> np.ndarray:
    return np.frombuffer(d.encode("ascii"), dtype=np.uint8)


def encode_upload(ckpt: AdapterCheckpoint, slot: int, pages: list[list[int]]) -> bytes:
    mods = [w for w in ckpt.modules if w.lora_a is not None and w.lora_b is not None]
    index = {m: i for i, m in enumerate(PROJECTIONS)}
    meta = np.asarray([[w.layer, index[w.module], w.rank] for w in mods], dtype=np.int64).reshape(-1, 3)
    weights = []
    for w in mods:
        assert w.lora_a is not None and w.lora_b is not None, "filtered above"
        weights += [w.lora_a.float().numpy(), w.lora_b.float().numpy()]
    expert_meta, expert_scalings, expert_weights = _expert_arrays(ckpt)
    return encode(
        UPLOAD,
        [
            _digest(ckpt.digest),
            np.asarray([slot], dtype=np.int64),
            np.asarray([len(p) for p in pages], dtype=np.int64),
            np.asarray([p for plist in pages for p in plist], dtype=np.int64),
            meta,
            np.asarray([w.scaling for w in mods], dtype=np.float64),
            expert_meta,
            expert_scalings,
            *weights,
            *expert_weights,
            *encode_side(ckpt, mods),
        ],
    )


def _expert_arrays(ckpt: AdapterCheckpoint) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """An adapter's expert LoRA (`engine/lora/expert_checkpoint.py`) as `UPLOAD` arrays: [X, 3] of (layer,
    projection index, rank), [X] scalings, and each one's A and B (float32)."""
    ws = [w for w in ckpt.experts if w.lora_a is not None and w.lora_b is not None]
    meta = [[w.layer, EXPERT_PROJS.index(w.proj), w.rank] for w in ws]
    arrays: list[np.ndarray] = []
    for w in ws:
        assert w.lora_a is not None and w.lora_b is not None, "filtered above"
        arrays += [w.lora_a.float().numpy(), w.lora_b.float().numpy()]
    scalings = np.asarray([w.scaling for w in ws], dtype=np.float64)
    return np.asarray(meta, dtype=np.int64).reshape(-1, 3), scalings, arrays


def decode_upload(arrays: list[np.ndarray]) -> tuple[AdapterCheckpoint, int, list[list[int]]]:
    """(the adapter, with the weights it had on rank 0, as float32; its slot; its pages per module)."""
    digest, slot, counts, flat, meta, scalings, expert_meta, expert_scalings, *rest = arrays
    n_mod, n_exp = 2 * len(meta), 2 * len(expert_meta)
    weights, expert_weights = rest[:n_mod], rest[n_mod : n_mod + n_exp]
    side = rest[n_mod + n_exp :]
    pages, at = [], 0
    for n in counts.tolist():
        pages.append(flat[at : at + n].tolist())
        at += n
    modules = []
    for i, (layer, m, rank) in enumerate(meta.tolist()):
        a, b = torch.from_numpy(weights[2 * i]), torch.from_numpy(weights[2 * i + 1])
        modules.append(LoRAModuleWeights(layer, PROJECTIONS[m], rank, 0.0, float(scalings[i]), a, b))
    experts = []
    for i, (layer, p, rank) in enumerate(expert_meta.tolist()):
        a, b = torch.from_numpy(expert_weights[2 * i]), torch.from_numpy(expert_weights[2 * i + 1])
        experts.append(ExpertLoRAWeights(layer, EXPERT_PROJS[p], rank, float(expert_scalings[i]), a, b))
    ckpt = AdapterCheckpoint(
        digest=bytes(digest).decode("ascii"),
        rank=max((w.rank for w in modules), default=0),
        alpha=0.0,
        target_modules=(),
        use_rslora=False,
        size_bytes=0,
        base_model_name=None,
        modules=tuple(modules),
        experts=tuple(experts),
    )
    return decode_side(side, ckpt), int(slot[0]), pages


def encode_evict(digest: str) -> bytes:
    return encode(EVICT, [_digest(digest)])


def decode_evict(arrays: list[np.ndarray]) -> str:
    return bytes(arrays[0]).decode("ascii")
