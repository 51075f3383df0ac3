"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (the GPU path's host cost).

An eager decode step of a 1B Llama launches about a thousand small kernels, each from Python, and the
GPU idles most of the step (docs/benchmarks.md, GPU section). A plain decode step (every sequence
decodes one token and samples it) is instead run from a CUDA graph captured for its bucket: the
smallest of `BUCKETS` holding the batch, and for the step's LoRA kernel: none (no adapter row in the
step: no LoRA launch at all, the same graph as a LoRA-disabled engine's), the fused BGMV kernel or the SGMV
pair (`engine.lora.backend.lora_kernel_for`, by the step's longest run on one adapter). A replay is one
launch from the host.

Each bucket's inputs live in static device buffers. A step of B sequences in a bucket of S fills rows
0..B-1 and pads rows B..S-1 so that they do no harm:
- KV slot -1: `write_kv` skips the row, so it writes no KV;
- context length 1 over block 0: the row attends to one cached position; its output is discarded;
- adapter slot -1: the LoRA kernels skip the row;
- a MoE block routes the padded rows like any other (to whichever experts token 0 picks) and their
  output is discarded;
- the logits of padded rows are computed and ignored.
Launch shapes come from the bucket and kernel alone (LoRA segments = S, grids over `GRID_ROWS` rows of
a segment; the kernels read the real extent from the buffers and loop over longer segments), so every
replay matches its capture. Everything else a LoRA launch reads lives at fixed addresses that the adapter
pool updates in place (pages, page table, ranks, scalings: `engine/lora/pool.py`), so graphs stay valid
while adapters are loaded and evicted between steps.

`capture_all` records every (bucket, kernel) graph at engine start, largest bucket first, into one
shared memory pool (graphs replay one at a time, so they can share their intermediates' memory), and
reports the time and the memory that took (`GraphStats`: logged, and in the engine's ready info).
A graph missing then (e.g. `capture_all` not called) is captured on first use of its key (a warm-up pass
first compiles the Triton kernels). Prefill chunks, speculative verification steps (several query rows
per sequence), larger batches and steps with LoRA on a MoE model's experts run eagerly, over the same
pool tensors. A MoE model's routed experts run the Triton fused-MoE kernel on CUDA, whose routing
metadata is built on the device within bounds known from the bucket (`kernels/moe_align.py`), so its
decode steps replay too (base rows and attention adapters).

`capture` is how a forward pass is recorded (`engine/graph_capture.py`): `CudaGraphCapture` on a GPU,
`EagerReplay` (re-run the same pass over the same buffers) where there is no CUDA, so the padded static
path is testable on CPU.

Under tensor parallel (CPU ranks) every rank keeps its own `DecodeGraphs` over its shard: rank 0 sends the
workers its largest bucket (`WorkerGroup.use_decode_graphs`), all ranks capture the same keys in the same
order, and each step's plan says whether the step replays (every rank does) or runs eagerly. CUDA graphs
are not captured under tensor parallel on GPUs yet (`engine/distributed/shard_model.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.graph_capture import CudaGraphCapture, EagerReplay, GraphCapture, Replay
from engine.lora import backend as lora_backend
from engine.lora.pool import AdapterPool
from engine.lora.step_context import TritonLoRAContext
from engine.model.decoder import DecoderForCausalLM
from engine.model.layers import ForwardBatch
from engine.step_inputs import StepInputs
from kernels.intmath import cdiv
from kernels.lora_meta import LoRABatchMeta

__all__ = [
    "BUCKETS",
    "CudaGraphCapture",
    "DecodeGraphs",
    "EagerReplay",
    "GraphCapture",
    "GraphStats",
    "enable_decode_graphs",
    "padded_segments",
]

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager
    from engine.model_runner import ModelRunner

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# LoRA kernel grids of a graph cover this many rows of each adapter's segment and loop over more: decode
# batches spread over adapters, and a grid sized for the whole bucket would leave most programs idle.
# Per kernel: the BGMV graph serves steps of at most BGMV_MAX_ROWS rows per adapter, mostly 1-4 (32 adapters
# over a batch of 64-128), and a narrow row block lets its tiles take wide loads (kernels/lora_bgmv.py).
GRID_ROWS = {"sgmv": 16, "bgmv": 4}


@dataclass(slots=True)
class GraphStats:
    """What `DecodeGraphs.capture_all` recorded: graph count, wall time, device memory it added."""

    graphs: int = 0
    capture_s: float = 0.0
    memory_bytes: int = 0


@dataclass(slots=True)
class _Graph:
    replay: Replay
    logits: torch.Tensor  # [S, V] float32, rewritten by each replay
    keep: list[torch.Tensor]  # tensors the graph reads that nothing else keeps alive (pointer tables)


class DecodeGraphs:
    """Runs plain decode steps of up to `max(BUCKETS)` (or `max_batch`) sequences from captured graphs."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        capture: GraphCapture,
        pool: AdapterPool | None = None,
        max_batch: int = BUCKETS[-1],
    ) -> None:
        if backend.name != "triton":
            raise ValueError(f"decode graphs need the Triton attention backend, not {backend.name!r}")
        self.model, self.kv_layers, self.backend, self.pool = model, kv_layers, backend, pool
        self.capture_impl = capture
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (min(max_batch, BUCKETS[-1]),)
        s, dev = self.buckets[-1], device
        width = cdiv(model.config.max_model_len, block_size)
        self.input_ids = torch.zeros(s, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(s, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((s,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(s, width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(s, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(s + 1, dtype=torch.int32, device=dev)
        self.logits_rows = torch.arange(s, dtype=torch.int64, device=dev)
        # LoRA rows grouped by slot (kernels/lora_meta.py), padded to the bucket: segment slot -1, count 0
        self.lora_slots = torch.full((s,), -1, dtype=torch.int32, device=dev)
        self.lora_order = torch.arange(s, dtype=torch.int32, device=dev)
        self.lora_ids = torch.full((s,), -1, dtype=torch.int32, device=dev)
        self.lora_counts = torch.zeros(s, dtype=torch.int32, device=dev)
        self.lora_starts = torch.zeros(s, dtype=torch.int32, device=dev)
        self._graphs: dict[tuple[int, str | None], _Graph] = {}  # (bucket, LoRA kernel or None)
        self.stats = GraphStats()

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding `num_seqs` sequences (None: too many, run eagerly)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def handles(self, inp: StepInputs, lora: object | None) -> bool:
        """Whether this step can run from a graph: a plain decode step that fits a bucket, with no adapter
        or the Triton LoRA path."""
        if not inp.is_plain_decode or self.bucket(len(inp.seq_lens)) is None:
            return False
        # DoRA / lora_bias rows take a per-row epilogue, embedding / LM-head LoRA rows a per-run update,
        # a MoE model's expert-LoRA rows per-step (expert, adapter) groups and page tables, all indexed by
        # the step's rows: run eagerly
        return lora is None or (
            isinstance(lora, TritonLoRAContext)
            and self.pool is not None
            and not lora.epilogue
            and not lora.vocab
            and lora.experts is None
        )

    @property
    def captured(self) -> list[tuple[int, str | None]]:
        """(bucket, LoRA kernel: None, "bgmv" or "sgmv") of every graph captured so far."""
        return sorted(self._graphs, key=lambda k: (k[0], k[1] or ""))

    def graph_keys(self) -> list[tuple[int, str | None]]:
        """Every (bucket, LoRA kernel) a step can replay, largest bucket first: no LoRA, and with the
        adapter pool BGMV, and SGMV for buckets that can hold more than `BGMV_MAX_ROWS` rows of one
        adapter (`engine.lora.backend`; read at call time)."""
        keys: list[tuple[int, str | None]] = []
        for size in sorted(self.buckets, reverse=True):
            keys.append((size, None))
            if self.pool is not None:
                keys.append((size, "bgmv"))
                if size > lora_backend.BGMV_MAX_ROWS:
                    keys.append((size, "sgmv"))
        return keys

    def capture_all(self) -> GraphStats:
        """Capture every graph of `graph_keys` not captured yet; returns (and keeps in `stats`) how many,
        how long it took and the device memory it added, also logged."""
        start, mem0 = time.perf_counter(), self.capture_impl.memory_bytes()
        todo = [k for k in self.graph_keys() if k not in self._graphs]
        for size, kernel in todo:
            self._fill_padding(size)
            self._graphs[size, kernel] = self._capture(size, kernel)
        self.stats = GraphStats(
            graphs=len(self._graphs),
            capture_s=time.perf_counter() - start,
            memory_bytes=max(0, self.capture_impl.memory_bytes() - mem0),
        )
        log.info(
            "captured %d decode graphs (buckets %s; LoRA kernels: %s) in %.1f s, %.1f MiB of device memory",
            len(todo),
            ",".join(str(b) for b in self.buckets),
            "none" if self.pool is None else "none, bgmv, sgmv",
            self.stats.capture_s,
            self.stats.memory_bytes / (1 << 20),
        )
        return self.stats

    def recapture(self) -> GraphStats:
        """Drop every graph and capture them all again (a restarted tensor-parallel group's workers
        capture theirs meanwhile, their warm-up passes meeting these)."""
        self._graphs.clear()
        return self.capture_all()

    def run(self, inp: StepInputs, lora: TritonLoRAContext | None) -> torch.Tensor:
        """The step's logits `[B, V]` (float32), from the graph of its bucket (captured on first use).
        The tensor is a view of the graph's output: read it before the next step."""
        b = len(inp.seq_lens)
        size = self.bucket(b)
        assert size is not None, "the caller checked `handles` for this step"
        key = (size, lora.kernel if lora is not None else None)
        graph = self._graphs.get(key)
        if graph is None:
            self._fill_padding(size)
            graph = self._graphs[key] = self._capture(size, key[1])
        self._fill(inp, lora, size)
        graph.replay()
        return graph.logits[:b]

    def _fill_padding(self, size: int) -> None:
        """Every row of the bucket a padding row (module docstring): what a capture's warm-up pass sees."""
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        self.block_tables[:size].zero_()
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.lora_ids[:size].fill_(-1)
        self.lora_counts[:size].zero_()

    def _fill(self, inp: StepInputs, lora: TritonLoRAContext | None, size: int) -> None:
        """Copy the step's rows into the bucket's buffers and pad the rest."""
        b = len(inp.seq_lens)
        pad = size - b
        ids = np.zeros(size, dtype=np.int64)
        ids[:b] = inp.input_ids
        pos = np.zeros(size, dtype=np.int64)
        pos[:b] = inp.positions
        slots = np.full(size, -1, dtype=np.int64)
        slots[:b] = inp.slot_mapping
        tables = np.zeros((size, self.block_tables.shape[1]), dtype=np.int32)
        tables[:b, : inp.block_tables.shape[1]] = inp.block_tables
        lens = np.asarray(inp.seq_lens + [1] * pad, dtype=np.int32)
        self.input_ids[:size].copy_(torch.from_numpy(ids))
        self.positions[:size].copy_(torch.from_numpy(pos))
        self.slot_mapping[:size].copy_(torch.from_numpy(slots))
        self.block_tables[:size].copy_(torch.from_numpy(tables))
        self.seq_lens[:size].copy_(torch.from_numpy(lens))
        if lora is not None:
            order, seg_ids, counts, starts = padded_segments(lora.slots, size)
            row_slots = np.asarray(lora.slots + [-1] * pad, dtype=np.int32)
            self.lora_slots[:size].copy_(torch.from_numpy(row_slots))
            self.lora_order[:size].copy_(torch.from_numpy(order))
            self.lora_ids[:size].copy_(torch.from_numpy(seg_ids))
            self.lora_counts[:size].copy_(torch.from_numpy(counts))
            self.lora_starts[:size].copy_(torch.from_numpy(starts))

    def _capture(self, size: int, kernel: str | None) -> _Graph:
        """The graph of a `size`-row step with LoRA by `kernel` (None: no LoRA launch)."""
        from kernels._common import live_pointer_tables

        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start[: size + 1],
            seq_lens_list=[1] * size,  # read by no decode path of the Triton backend
            query_start_list=list(range(size + 1)),
            num_decodes=size,
            max_seq_len=1,
            max_query_len=1,
        )
        lora = None
        if kernel is not None:
            assert self.pool is not None, "a LoRA graph needs the adapter pool"
            meta = LoRABatchMeta(
                token_indices_sorted=self.lora_order[:size],
                slot_ids=self.lora_ids[:size],
                slot_token_counts=self.lora_counts[:size],
                slot_token_starts=self.lora_starts[:size],
                num_tokens=size,
                max_tokens_per_slot=size,
                token_slots=self.lora_slots[:size],
                grid_tokens_per_slot=min(size, GRID_ROWS[kernel]),
            )
            lora = TritonLoRAContext(self.pool, [-1] * size, meta, kernel=kernel)
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            attn=attn,
            logits_indices=self.logits_rows[:size],
            lora=lora,
        )
        replay, logits = self.capture_impl.capture(lambda: self.model(batch, self.kv_layers, self.backend))
        return _Graph(replay, logits, live_pointer_tables())


def enable_decode_graphs(runner: ModelRunner, lora: LoRAManager | None, max_batch: int) -> bool:
    """Let `runner` replay plain decode steps from CUDA graphs when its paths can be captured: Triton
    attention, LoRA off or on the Triton path, and a model that can be captured (`graph_problem`, logged).
    Captures every graph now (`DecodeGraphs.capture_all`: time and memory logged, kept in
    `runner.graphs.stats`). Returns whether decode steps run from graphs."""
    if runner.backend.name != "triton" or (lora is not None and lora.backend != "triton"):
        return False
    problem = getattr(runner.model, "graph_problem", None)
    if problem is not None:
        log.info("decode steps run eagerly, without CUDA graphs: %s", problem)
        return False
    # no CUDA (the Triton interpreter on CPU): the same static buffers, each "replay" re-runs the pass
    capture: GraphCapture = CudaGraphCapture() if runner.device.type == "cuda" else EagerReplay()
    runner.use_decode_graphs(capture, lora.pool if lora is not None else None, max_batch)
    assert runner.graphs is not None, "use_decode_graphs sets them"
    if runner.group is not None:  # tensor parallel: every rank captures its own, in step
        runner.group.use_decode_graphs(runner.graphs)
        return True
    try:
        runner.graphs.capture_all()
    except Exception:  # a capture that fails must not stop the engine: it serves eagerly instead
        log.exception("capturing decode graphs failed; decode steps run eagerly")
        runner.graphs = None
        return False
    return True


def padded_segments(slots: list[int], size: int) -> tuple[np.ndarray, ...]:
    """SGMV segments of `slots` padded with -1 to `size` rows (as `kernels.lora_meta` groups them):
    (row order by slot, segment slots, counts, starts), each `[size]` int32; unused segments are slot -1
    with count 0."""
    padded = np.full(size, -1, dtype=np.int32)
    padded[: len(slots)] = slots
    order = np.argsort(padded, kind="stable").astype(np.int32)
    ordered = padded[order]
    first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    n = len(first)
    seg_ids = np.full(size, -1, dtype=np.int32)
    counts = np.zeros(size, dtype=np.int32)
    starts = np.zeros(size, dtype=np.int32)
    seg_ids[:n] = ordered[first]
    counts[:n] = np.diff(np.r_[first, size])
    starts[:n] = first
    return order, seg_ids, counts, starts
