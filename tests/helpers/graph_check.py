"""`CheckedReplay`: the CPU stand-in for a CUDA graph that checks what would make a real graph stale.

A CUDA graph replays the kernel launches recorded at capture: the same kernels, grids and scalar
arguments, reading and writing the same addresses. On CPU `EagerReplay` re-runs the forward pass instead,
which would hide a pass whose launches depend on the step (a grid sized from this step's counts, a page
table copied to a new tensor, a kernel picked per step). `CheckedReplay` records every Triton launch
(interpreted: `InterpretedFunction.run`) of the capture and of each replay and fails the replay unless
they agree launch by launch: kernel, grid, every non-tensor argument, and for every tensor argument its
dtype, shape and strides, plus its address when it lived outside the pass (the `external` tensors: static
buffers, adapter pool, KV cache, weights, pointer tables). Tensors made inside the pass are a real
graph's own memory and may move.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from triton.runtime.interpreter import InterpretedFunction

Launch = tuple[str, object, tuple, tuple]  # (kernel name, grid, positional args, sorted kwargs)


@contextlib.contextmanager
def recording_launches() -> Iterator[list[Launch]]:
    """Record every interpreted Triton launch made inside the block (they still run)."""
    launches: list[Launch] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self.fn.__name__, grid, args, tuple(sorted(kwargs.items()))))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]


def _describe(value: object, external: set[int]) -> object:
    if isinstance(value, torch.Tensor):
        layout = (value.dtype, tuple(value.shape), value.stride())
        if value.untyped_storage().data_ptr() in external:
            return ("external", value.data_ptr(), *layout)
        return ("temporary", *layout)
    return value


def signature(launch: Launch, external: set[int]) -> tuple:
    """What a CUDA graph bakes in of one launch (module docstring)."""
    name, grid, args, kwargs = launch
    return (
        name,
        grid,
        tuple(_describe(a, external) for a in args),
        tuple((k, _describe(v, external)) for k, v in kwargs),
    )


@dataclass
class CheckedReplay:
    """A `GraphCapture` (engine/decode_graphs.py) that re-runs the pass and checks its launches."""

    external: Callable[[], Iterable[torch.Tensor]]  # tensors that live outside the forward pass
    captures: int = 0
    replays: int = 0
    launches_checked: int = 0
    kernels: list[str] = field(default_factory=list)  # kernel names of the last capture or replay

    def memory_bytes(self) -> int:
        return 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        with recording_launches() as launches:
            out = forward()
        self.captures += 1
        ext = {t.untyped_storage().data_ptr() for t in self.external() if t.layout == torch.strided}
        want = [signature(launch, ext) for launch in launches]
        self.kernels = [launch[0] for launch in launches]

        def replay() -> None:
            with recording_launches() as got:
                new = forward()
            have = [signature(launch, ext) for launch in got]
            assert len(have) == len(want), f"replay launched {len(have)} kernels, capture {len(want)}"
            for i, (h, w) in enumerate(zip(have, want, strict=True)):
                assert h == w, f"launch {i} ({w[0]}) differs from its capture:\n{h}\n!=\n{w}"
            self.replays += 1
            self.launches_checked += len(have)
            self.kernels = [launch[0] for launch in got]
            out.copy_(new)

        return replay, out


def engine_tensors(engine) -> Callable[[], list[torch.Tensor]]:
    """The tensors of an `LLMEngine` that live outside any forward pass: weights (oneDNN-packed ones are
    skipped: no Triton kernel reads them), KV cache, the decode graphs' static buffers, the adapter pool's
    tensors and the kernels' cached pointer tables."""
    from kernels._common import live_pointer_tables

    def tensors() -> list[torch.Tensor]:
        out = list(engine.model.parameters()) + list(engine.model.buffers()) + [engine.runner.kv_cache]
        graphs = engine.runner.graphs
        if graphs is not None:
            out += [v for v in vars(graphs).values() if isinstance(v, torch.Tensor)]
        if engine.lora is not None:
            pool = engine.lora.pool
            out += [*pool.a, *pool.b, pool.page_table, pool.ranks, pool.scalings]
        return out + live_pointer_tables()

    return tensors
