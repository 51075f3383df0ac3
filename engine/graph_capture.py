"""How a decode step's forward pass is recorded for replay (`engine/decode_graphs.py`).

`CudaGraphCapture` records a `torch.cuda.CUDAGraph` (all its graphs share one memory pool: they replay
one at a time); `EagerReplay` re-runs the pass over the same static buffers where there is no CUDA, so the
padded static path is testable on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

Replay = Callable[[], None]


class GraphCapture(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Record `forward` (which reads only static buffers); return (replay, the static output)."""
        ...

    def memory_bytes(self) -> int:
        """Device memory held for graphs and their pool now (0 where nothing is recorded)."""
        ...


class CudaGraphCapture:
    """A `torch.cuda.CUDAGraph` per capture, after one warm-up pass on a side stream; all graphs of one
    `CudaGraphCapture` share one memory pool."""

    def __init__(self) -> None:
        self._pool: _POOL_HANDLE | None = None

    def memory_bytes(self) -> int:
        return int(torch.cuda.memory_reserved())

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # compiles the kernels and fills the launchers' caches outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter loader's thread may use CUDA meanwhile; only this thread must not
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = forward()
        return graph.replay, out


class EagerReplay:
    """No CUDA: a "replay" runs the forward pass again over the static buffers (tests, CPU)."""

    def memory_bytes(self) -> int:
        return 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        out = forward()

        def replay() -> None:
            out.copy_(forward())

        return replay, out
