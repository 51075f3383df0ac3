"""A tensor-parallel worker process (ranks 1..N-1): its model shard, KV cache (its heads) and adapter pool.

It loads its shard, reports ready on its pipe, joins the process group, and then runs what rank 0 sends
(`engine/distributed/step_plan.py`): pool uploads (with DoRA, lora_bias and embedding-side tensors) and
evictions at the slots and pages rank 0 chose, and forward passes (plain, DoRA and mixed adapter rows;
a plain decode step replays this rank's decode graph of its bucket where rank 0 replays its own), whose
all-reduces meet rank 0's, at rank 0's CPU thread count. It computes no logits and samples nothing. Any
failure ends the process, which closes its sockets, so rank 0's next collective fails at once; a closed
pipe (rank 0 gone) ends it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.distributed.channel import Channel
from engine.engine_config import EngineConfig

if TYPE_CHECKING:
    from engine.decode_graphs import DecodeGraphs
    from engine.distributed.group import ProcessGroup
    from engine.lora.pool import AdapterPool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its rank (one JSON line on its stdin, at start)."""

    config: EngineConfig
    rank: int
    world: int
    port: int  # the process group's rendezvous
    control_port: int  # rank 0's socket for this worker's channel
    device: str  # e.g. "cpu", "cuda:1"
    num_threads: int
    lora_dtype: str  # the pool's dtype name
    timeout: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        return cls(**(raw | {"config": EngineConfig(**raw["config"])}))


def worker_main(spec: WorkerSpec) -> None:
    """The worker process's life (module docstring): connect, load the shard, take rank 0's sizes
    (`{"num_kv_blocks": n, "lora_backend": name or null}`, JSON), report ready, join, serve, exit."""
    conn = Channel.connect(spec.control_port)
    conn.send_bytes(str(spec.rank).encode())
    try:
        worker = _Worker(spec)
        sizes = json.loads(conn.recv_bytes())
        worker.allocate(int(sizes["num_kv_blocks"]), sizes["lora_backend"])
    except BaseException as exc:  # reported to rank 0, which raises it at start
        with contextlib.suppress(OSError):
            conn.send_bytes(f"error: {exc}".encode())
        os._exit(1)
    conn.send_bytes(b"ready")
    try:
        worker.join()
        worker.serve(conn)
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        os._exit(1)
    os._exit(0)


class _Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        from engine.attention import select_backend
        from engine.distributed.setup import rank_shard
        from engine.distributed.shard_model import load_shard
        from engine.model_config import ModelConfig, resolve_dtype

        torch.set_num_threads(spec.num_threads)
        cfg = spec.config
        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        checkpoint = ModelConfig.from_dir(cfg.model)
        dtype = resolve_dtype(cfg.dtype, checkpoint, self.device)
        self.shard = rank_shard(spec.rank, spec.world, checkpoint, cfg)
        self.group: ProcessGroup | None = None
        self.model = load_shard(
            checkpoint, self.shard, dtype, self.device, self._all_reduce, cfg.packed_cpu_gemms
        )
        self.dtype = dtype
        self.backend = select_backend(self.device, cfg.attention_backend)
        self.lora_backend: str | None = None
        self.pool: AdapterPool | None = None
        self.graphs: DecodeGraphs | None = None  # rank 0's `GRAPHS` frame captures them

    def allocate(self, num_kv_blocks: int, lora_backend: str | None) -> None:
        """This rank's KV cache (its heads, rank 0's block count) and adapter pool (rank 0's layout;
        `lora_backend` None: LoRA disabled)."""
        from engine.lora.dora import ProjectionBaseWeights
        from engine.lora.pool import AdapterPool
        from engine.model_config import resolve_lora_dtype

        cfg, local = self.spec.config, self.shard.local_config()
        shape = (local.num_layers, 2, num_kv_blocks, cfg.block_size, local.num_kv_heads, local.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_layers = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(local.num_layers)]
        self.lora_backend = lora_backend
        if lora_backend is not None:
            self.pool = AdapterPool(
                local,
                cfg.adapter_pool_pages(),
                cfg.lora_page_rank,
                cfg.max_lora_rank,
                resolve_lora_dtype(self.spec.lora_dtype, self.dtype),
                self.device,
                ProjectionBaseWeights(self.model),  # this shard's weights, for DoRA norms
                self.shard,
            )
            self.pool.all_reduce = self._all_reduce
            if self.shard.fully_sharded:
                self.pool.all_gather = self._all_gather

    def _all_reduce(self, t: torch.Tensor) -> None:
        assert self.group is not None, "the group is joined before the first forward"
        self.group.all_reduce(t)

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        assert self.group is not None, "the group is joined before the first forward"
        return self.group.all_gather(t)

    def join(self) -> None:
        from engine.distributed.group import ProcessGroup

        s = self.spec
        self.group = ProcessGroup(s.rank, s.world, s.port, self.device, s.timeout)

    def serve(self, conn: Channel) -> None:
        from engine.distributed import step_plan as sp

        while True:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 is gone
            kind, arrays = sp.decode(frame)
            if kind == sp.STEP:
                self._step(sp.decode_step(arrays))
            elif kind == sp.UPLOAD:
                assert self.pool is not None, "uploads only come with LoRA enabled"
                ckpt, slot, pages = sp.decode_upload(arrays)
                self.pool.place(ckpt, slot, pages)
                self.pool.finish_upload(ckpt)  # with rank 0's (`WorkerGroup._send_upload`)
            elif kind == sp.EVICT:
                assert self.pool is not None, "evictions only come with LoRA enabled"
                self.pool.evict(sp.decode_evict(arrays))
            elif kind == sp.GRAPHS:
                self._capture_graphs(int(arrays[0][0]))
            elif kind == sp.STOP:
                return

    def _capture_graphs(self, max_batch: int) -> None:
        """This rank's decode graphs: the buckets and keys rank 0 captures, in its order."""
        from engine.decode_graphs import DecodeGraphs
        from engine.graph_capture import CudaGraphCapture, EagerReplay, GraphCapture

        capture: GraphCapture = CudaGraphCapture() if self.device.type == "cuda" else EagerReplay()
        pool = self.pool if self.lora_backend == "triton" else None
        block_size = self.spec.config.block_size
        self.graphs = DecodeGraphs(
            self.model, self.kv_layers, self.backend, block_size, self.device, capture, pool, max_batch
        )
        with torch.inference_mode():
            self.graphs.capture_all()

    @torch.inference_mode()
    def _step(self, step) -> None:
        from engine.distributed.lora_runs import worker_lora_context
        from engine.step_inputs import to_forward_batch

        lora = None
        if len(step.lora_runs):
            assert self.pool is not None, "LoRA runs only come with LoRA enabled"
            assert self.lora_backend is not None, "set with the pool"
            n = step.inputs.num_tokens
            lora = worker_lora_context(
                self.pool, self.lora_backend, step.lora_runs, step.lora_weights, n, self.device
            )
        if step.num_threads and step.num_threads != torch.get_num_threads():
            torch.set_num_threads(step.num_threads)  # rank 0's governor changed them
        if step.graph:
            assert self.graphs is not None, "rank 0 sent GRAPHS first"
            self.graphs.run(step.inputs, lora)  # type: ignore[arg-type]  # handles() checked the type
            return
        batch = to_forward_batch(step.inputs, lora, self.device)
        self.model(batch, self.kv_layers, self.backend)
