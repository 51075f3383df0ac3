"""`WorkerGroup`: rank 0's side of tensor parallel — the N-1 worker processes and what each step sends them.

The engine process is rank 0: it keeps the one scheduler, KV block manager and adapter residency, and
its own shard of the model. The group starts ranks 1..N-1 (`engine/distributed/worker.py`, run as
`python -m engine.distributed`), each on its device (CUDA: `cuda:r`; CPU: `num_threads` cores' worth of
threads), and per step:

1. `flush_pool()` sends the adapter pool's journal (uploads at rank 0's slots and pages, evictions), so
   every rank holds its slice of the same digests in the same slots (an upload with DoRA on o/down then
   takes one all-reduce of partial norms, `engine/distributed/shard_adapters.py`);
2. `send_step(inputs, lora_runs)` sends the step's flat inputs (`engine/distributed/step_plan.py`);
3. rank 0 runs its forward; the row-parallel all-reduces meet the workers'; rank 0 samples.

Faults: a worker that dies makes rank 0's next collective fail at once, one that hangs makes it fail
after `timeout` seconds (the watchdog of every step), and either raises `WorkerGroupError`. The engine
then ends the in-flight requests and calls `restart()`: new workers, the pool's residents uploaded again
at their slots (the KV contents of the old workers are gone, so the caller drops its prefix cache).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.distributed import step_plan as sp
from engine.distributed.channel import Channel
from engine.distributed.group import CollectiveError, ProcessGroup, free_port
from engine.distributed.lora_runs import LoRARun, step_lora_runs
from engine.distributed.worker import WorkerSpec
from engine.engine_config import EngineConfig
from engine.lora.adapter_checkpoint import AdapterCheckpoint
from engine.lora.pool import AdapterPool
from engine.scheduler.output import ScheduledSequence
from engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.decode_graphs import DecodeGraphs

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0  # seconds a worker may take to load its shard


class WorkerGroupError(RuntimeError):
    """A rank died, hung, or failed; the group must be restarted before the next step."""


class WorkerGroup:
    """Ranks 1..world-1 of a tensor-parallel engine whose rank 0 is this process."""

    def __init__(
        self,
        config: EngineConfig,
        world: int,
        device: torch.device,
        num_threads: int,
        timeout: float = 30.0,
    ) -> None:
        self.config, self.world, self.device = config, world, device
        self.num_threads, self.timeout = num_threads, timeout
        # set by the engine before `start`, once it has sized the KV cache and made its adapter pool
        self.num_kv_blocks = 0
        self.lora_backend: str | None = None
        self.pool: AdapterPool | None = None  # rank 0's pool, whose journal the workers replay
        self.graphs: DecodeGraphs | None = None  # rank 0's decode graphs (`use_decode_graphs`)
        self._resident: dict[str, tuple[AdapterCheckpoint, int, list[list[int]]]] = {}
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Channel] = []
        self._group: ProcessGroup | None = None
        self._listener: socket.socket | None = None  # workers connect here while starting
        self._port = 0  # the process group's rendezvous
        self.restarts = 0

    # ---- life cycle -------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the worker processes, which import and load their shards while this process loads its
        own; `start` then hands them the KV and pool sizes and joins the group."""
        if self._listener is not None:
            return
        self._port = free_port()
        self._listener = socket.create_server(("127.0.0.1", 0))
        control = self._listener.getsockname()[1]
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for rank in range(1, self.world):
            device = f"cuda:{rank}" if self.device.type == "cuda" else "cpu"
            spec = WorkerSpec(
                self.config,
                rank,
                self.world,
                self._port,
                control,
                device,
                self.num_threads,
                self.config.lora_dtype,
                self.timeout,
            )
            cmd = [sys.executable, "-m", "engine.distributed"]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None, "stdin is a pipe"
            proc.stdin.write((spec.to_json() + "\n").encode())
            proc.stdin.close()
            self._procs.append(proc)

    def start(self) -> None:
        """Launch the workers (unless `launch` did), give them rank 0's KV cache size and LoRA backend,
        wait until each is ready and join the group with them; WorkerGroupError (one line) when a worker
        cannot start."""
        self.launch()
        assert self._listener is not None, "launch made it"
        sizes = json.dumps({"num_kv_blocks": self.num_kv_blocks, "lora_backend": self.lora_backend})
        try:
            self._conns = self._accept(self._listener)
            for conn in self._conns:
                conn.send_bytes(sizes.encode())
            for rank, conn in enumerate(self._conns, start=1):
                self._await_ready(rank, conn)
            self._group = ProcessGroup(0, self.world, self._port, self.device, self.timeout)
        except (WorkerGroupError, CollectiveError, OSError) as exc:
            self.close()
            raise WorkerGroupError(str(exc)) from None
        finally:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        for ckpt, slot, pages in self._resident.values():  # a restart: the pool as it was
            self._send_upload(ckpt, slot, pages)
        if self.graphs is not None:  # a restart: the new workers' decode graphs, with rank 0's again
            self._capture_graphs()

    def _send_upload(self, ckpt: AdapterCheckpoint, slot: int, pages: list[list[int]]) -> None:
        """Send one upload; then the all-reduce its DoRA norms may take, which every worker runs as it
        places the adapter (`AdapterPool.finish_upload`)."""
        self._send(sp.encode_upload(ckpt, slot, pages))
        if self.pool is not None:
            self.pool.finish_upload(ckpt)

    def _accept(self, listener: socket.socket) -> list[Channel]:
        """Each worker's channel, in rank order (it names its rank first)."""
        by_rank: dict[int, Channel] = {}
        deadline = time.monotonic() + START_TIMEOUT
        listener.settimeout(0.2)
        while len(by_rank) < self.world - 1:
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise WorkerGroupError(f"tensor-parallel workers did not connect in {START_TIMEOUT:.0f}s")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            conn = Channel(sock)
            by_rank[int(conn.recv_bytes())] = conn
        return [by_rank[r] for r in range(1, self.world)]

    def _await_ready(self, rank: int, conn: Channel) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not conn.poll(0.1):
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise WorkerGroupError(f"tensor-parallel rank {rank} did not start in {START_TIMEOUT:.0f}s")
        try:
            msg = conn.recv_bytes().decode()
        except EOFError:
            raise WorkerGroupError(f"tensor-parallel rank {rank} exited while starting") from None
        if msg != "ready":
            raise WorkerGroupError(f"tensor-parallel rank {rank}: {msg.removeprefix('error: ')}")

    def _check_alive(self, doing: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise WorkerGroupError(f"tensor-parallel rank {rank} exited (code {code}) while {doing}")

    def restart(self) -> None:
        """Replace every worker (after a `WorkerGroupError`); the pool's residents are uploaded again."""
        self.close()
        self._take_journal()  # changes made since the last step are part of the pool to restore
        self.restarts += 1
        log.warning("restarting the tensor-parallel worker group (restart %d)", self.restarts)
        self.start()

    def close(self) -> None:
        """Stop the workers (killing any that do not stop) and leave the group; idempotent."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(sp.encode(sp.STOP, []))
        if self._group is not None:
            self._group.close()
            self._group = None
        for proc in self._procs:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        for conn in self._conns:
            conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._procs, self._conns = [], []

    def worker_pids(self) -> list[int]:
        """The process ids of ranks 1..N-1 (for operators and fault tests)."""
        return [p.pid for p in self._procs]

    @property
    def collective_seconds(self) -> float:
        """Seconds rank 0 spent in collectives since the group (re)started."""
        return self._group.collective_seconds if self._group is not None else 0.0

    @property
    def fastest_collective(self) -> float:
        """Seconds of rank 0's quickest all-reduce: the collective's own cost, with no rank waited for."""
        return self._group.fastest_collective if self._group is not None else float("inf")

    @property
    def collective_calls(self) -> int:
        """All-reduces rank 0 ran since the group (re)started."""
        return self._group.collective_calls if self._group is not None else 0

    # ---- per step ---------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """The row-parallel layers' sum over ranks (rank 0's model is wired to this)."""
        if self._group is None:
            raise WorkerGroupError("the tensor-parallel group is not running")
        try:
            self._group.all_reduce(t)
        except CollectiveError as exc:
            raise WorkerGroupError(f"a tensor-parallel collective failed: {exc}") from None

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated in rank order (fully-sharded LoRA's shrink outputs)."""
        if self._group is None:
            raise WorkerGroupError("the tensor-parallel group is not running")
        try:
            return self._group.all_gather(t)
        except CollectiveError as exc:
            raise WorkerGroupError(f"a tensor-parallel collective failed: {exc}") from None

    def flush_pool(self) -> None:
        """Send the pool's uploads and evictions since the last step, in order."""
        for op in self._take_journal():
            if op[0] == "upload":
                self._send_upload(*op[1:])
            else:
                self._send(sp.encode_evict(op[1]))

    def _take_journal(self) -> list[tuple]:
        """The pool's journal since the last call (now noted in `_resident`, for restarts)."""
        pool = self.pool
        if pool is None or not pool.journal:
            return []
        ops, pool.journal = pool.journal, []
        for op in ops:
            if op[0] == "upload":
                self._resident[op[1].digest] = (op[1], op[2], op[3])
            else:
                self._resident.pop(op[1], None)
        return ops

    def lora_runs(self, items: Sequence[ScheduledSequence]) -> list[LoRARun]:
        """(first row, end row, pool slot, mix position, weight) of the flat batch's rows that use an
        adapter, for `items` in flat-batch order (`engine/distributed/lora_runs.py`)."""
        return step_lora_runs(self.pool, items) if self.pool is not None else []

    def collective_cost(self) -> float:
        """Seconds rank 0's collectives would have taken with no rank waited for (calls x the quickest):
        what its `ThreadGovernor` does not count as compute time, while a slow rank's wait it does."""
        calls = self.collective_calls
        return calls * self.fastest_collective if calls else 0.0

    def send_step(self, inputs: StepInputs, lora_runs: list[LoRARun], graph: bool = False) -> None:
        """Send one forward pass to every worker (after the pool's pending changes), with rank 0's CPU
        thread count (the workers follow its governor) and whether it replays a decode graph (`graph`)."""
        self.flush_pool()
        threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        self._send(sp.encode_step(inputs, lora_runs, threads, graph))

    def use_decode_graphs(self, graphs: DecodeGraphs) -> None:
        """Capture rank 0's decode `graphs` while every worker captures its own of the same buckets, in
        the same order (their warm-up passes meet rank 0's all-reduces); again after every restart."""
        self.graphs = graphs
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        assert self.graphs is not None, "use_decode_graphs set them"
        self.flush_pool()
        self._send(sp.encode(sp.GRAPHS, [np.asarray([self.graphs.buckets[-1]], dtype=np.int64)]))
        self.graphs.recapture()

    def _send(self, frame: bytes) -> None:
        if self._group is None:
            raise WorkerGroupError("the tensor-parallel group is not running")
        self._check_alive("serving")
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(frame)
            except OSError as exc:
                raise WorkerGroupError(f"tensor-parallel rank {rank} is gone: {exc}") from None
