"""`EngineAdapters`: the engine's adapter side, between the scheduler's queues and the `LoRAManager`.

Every step, before scheduling, the engine asks it for
- `failed_loads()`: the unfinished sequences whose adapter's background load failed, with the error;
- `prepare()`: learn the digests that background loads computed, make the adapters the scheduler wants
  next resident (uploading from host memory, or starting their loads), and name the waiting sequences
  whose adapter was lost meanwhile;
and after it, `retain()` holds the adapters of every unfinished request (the others may be evicted).
The engine ends the requests of the sequences named. `key_for` gives a new request its adapter digest,
and the rest is the engine's public adapter API (add, prefetch, remove, pin, list, stats).
"""

from __future__ import annotations

from collections.abc import Set

from engine.lora.loader import path_key
from engine.lora.manager import LoRAInfo, LoRAManager, LoRAPoolStats
from engine.lora_request import LoRARequest
from engine.scheduler import Scheduler
from engine.sequence import Sequence

SequenceError = tuple[Sequence, str]  # a sequence whose request must end, and why


class EngineAdapters:
    def __init__(self, lora: LoRAManager | None, scheduler: Scheduler) -> None:
        self.lora = lora
        self.scheduler = scheduler

    def key_for(self, lora_request: LoRARequest | None) -> str | None:
        """The adapter digest of a new request (None: no adapter, or its background load computes it)."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("a lora_request was given but the engine was created with enable_lora=False")
        return self.lora.admit(lora_request)

    def failed_loads(self) -> list[SequenceError]:
        """Unfinished sequences whose adapter could not be loaded (each failure is reported once)."""
        if self.lora is None:
            return []
        failed = self.lora.take_failures()
        if not failed:
            return []
        out = []
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            lr = seq.lora_request
            err = failed.get(path_key(lr)) if lr is not None else None
            if lr is not None and err is not None:
                out.append((seq, f"adapter {lr.name!r} could not be loaded: {err}"))
        return out

    def prepare(self) -> list[SequenceError]:
        """Before scheduling (module docstring); returns the waiting sequences whose adapter was lost.

        `remove` only retires an adapter that waiting requests use, so their digest stays known; should it
        be forgotten anyway (a failed `add` of the same digest), it is looked up again from their
        `LoRARequest`, and if its files changed or vanished meanwhile, their requests must end."""
        if self.lora is None or not self.scheduler.waiting:
            return []
        in_use = self.scheduler.running_adapters()
        lost: list[SequenceError] = []
        for seq in self.scheduler.waiting:
            lr = seq.lora_request
            if lr is None:
                continue
            if seq.lora_key is None:
                seq.lora_key = self.lora.poll_resolved(lr, in_use)
            elif not self.lora.is_known(seq.lora_key) and self._resolve_or_none(lr) != seq.lora_key:
                lost.append((seq, f"adapter {lr.name!r} was removed or changed while the request waited"))
        self.lora.prepare(self.scheduler.adapters_wanted(), in_use)
        return lost

    def _resolve_or_none(self, lr: LoRARequest) -> str | None:
        """`resolve_nowait`, with None for files that are gone or no longer an adapter."""
        assert self.lora is not None
        try:
            return self.lora.resolve_nowait(lr)
        except (OSError, ValueError):
            return None

    def in_use(self) -> set[str]:
        """Digests of the adapters of every unfinished request, running or waiting."""
        sch = self.scheduler
        return {s.lora_key for q in (sch.running, sch.waiting) for s in q if s.lora_key is not None}

    def retain(self) -> None:
        """Hold the adapters of every unfinished request; the others may be evicted."""
        if self.lora is not None:
            self.lora.retain(self.in_use())

    def wait_for_loads(self, seconds: float) -> None:
        """Block up to `seconds` for a background load to end (an empty step with requests waiting)."""
        if self.lora is not None and self.scheduler.waiting:
            self.lora.wait_for_loads(seconds)

    # ---- the engine's public adapter API ----------------------------------------------------------
    def manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is disabled (enable_lora=False)")
        return self.lora

    def add(self, lora_request: LoRARequest) -> str:
        return self.manager().add_lora(lora_request, self.scheduler.running_adapters())

    def prefetch(self, lora_request: LoRARequest) -> None:
        self.manager().prefetch(lora_request, self.scheduler.running_adapters())

    def remove(self, name_or_digest: str, keep: Set[str] = frozenset()) -> bool:
        return self.manager().remove_lora(name_or_digest, self.in_use(), keep)

    def pin(self, name_or_digest: str, pinned: bool = True) -> bool:
        return self.manager().pin_lora(name_or_digest, self.scheduler.running_adapters(), pinned)

    def infos(self) -> list[LoRAInfo]:
        return self.manager().list_loras()

    def stats(self) -> LoRAPoolStats:
        return self.manager().stats()
