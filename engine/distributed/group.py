"""The one owner of the torch.distributed process group: creation, rank facts and the collectives.

Every other module of the engine reaches collectives through a `ProcessGroup` (its `all_reduce`,
`all_gather`, `broadcast`), never through `torch.distributed`. The group is a private object (gloo on
CPU, NCCL on CUDA) over a TCP store on the loopback, not torch's global default group, so a process may
close one and open another (a restarted worker group) and tests may run several one after the other.

Each collective waits at most `timeout` seconds: a rank that hangs turns into a `CollectiveError` on the
others instead of a step that never ends; a rank that dies does so at once (its sockets close).
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group was closed."""


def free_port() -> int:
    """A TCP port on the loopback that is free now (for the group's rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessGroup:
    """Rank `rank` of a `world`-rank group meeting at 127.0.0.1:`port` (rank 0 hosts the store).

    Construction blocks until every rank has joined (at most `join_timeout` seconds)."""

    def __init__(
        self,
        rank: int,
        world: int,
        port: int,
        device: torch.device,
        timeout: float = 30.0,
        join_timeout: float = 300.0,
    ) -> None:
        self.rank, self.world, self.device = rank, world, device
        try:
            self._store: Any = dist.TCPStore(
                "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=join_timeout)
            )
            step = datetime.timedelta(seconds=timeout)
            if device.type == "cuda":
                nccl = dist.ProcessGroupNCCL.Options()
                nccl._timeout = step
                self._pg: Any = dist.ProcessGroupNCCL(self._store, rank, world, nccl)
            else:
                gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                gloo._timeout = step
                gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                self._pg = dist.ProcessGroupGloo(self._store, rank, world, gloo)
        except (RuntimeError, dist.DistStoreError) as exc:
            raise CollectiveError(f"rank {rank} could not join the {world}-rank group: {exc}") from exc
        self._closed = False
        self.collective_seconds = (
            0.0  # time spent in all-reduces and all-gathers (benchmarks split a step with it)
        )
        self.collective_calls = 0
        self.fastest_collective = float("inf")  # seconds of the quickest all-reduce: ~ its pure cost

    def _wait(self, work) -> None:
        if self._closed:
            raise CollectiveError("the process group is closed")
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveError(str(exc).splitlines()[0]) from exc

    def all_reduce(self, t: torch.Tensor) -> None:
        """t <- the sum of every rank's t, in place (gloo reduces half precision in float32)."""
        start = time.perf_counter()
        if t.device.type == "cpu" and t.dtype not in (torch.float32, torch.float64):
            wide = t.float()
            self._wait(self._pg.allreduce([wide]))
            t.copy_(wide)
        else:
            self._wait(self._pg.allreduce([t]))
        took = time.perf_counter() - start
        self.collective_seconds += took
        self.collective_calls += 1
        self.fastest_collective = min(self.fastest_collective, took)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape on all), concatenated along dim 0 in rank order (gloo moves
        half precision as float32; the result has `t`'s dtype)."""
        start = time.perf_counter()
        wide = t.float() if t.device.type == "cpu" and t.dtype not in (torch.float32, torch.float64) else t
        out = [torch.empty_like(wide) for _ in range(self.world)]
        self._wait(self._pg.allgather([out], [wide.contiguous()]))
        took = time.perf_counter() - start
        self.collective_seconds += took
        self.collective_calls += 1
        return torch.cat(out).to(t.dtype)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """t <- rank `src`'s t, in place."""
        self._wait(self._pg.broadcast([t], src))

    def close(self) -> None:
        """Give up the group (a collective after this raises); idempotent."""
        self._closed = True
        self._pg = None
        self._store = None
