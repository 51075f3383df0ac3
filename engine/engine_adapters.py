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

from collections.abc import Sequence as Seq
from collections.abc import Set

from engine.lora.loader import path_key
from engine.lora.manager import LoRAInfo, LoRAManager, LoRAPoolStats
from engine.lora.mix import capacity_problem, checkpoint_problem, member_need, member_problem, mix_key
from engine.lora_request import LoRARequest
from engine.scheduler import Scheduler
from engine.sequence import Sequence

SequenceError = tuple[Sequence, str]  # a sequence whose request must end, and why


class EngineAdapters:
    def __init__(self, lora: LoRAManager | None, scheduler: Scheduler) -> None:
        self.lora = lora
        self.scheduler = scheduler

    def key_for(self, lora_request: LoRARequest | None) -> tuple[str | None, tuple[str, ...]]:
        """(`lora_key`, `lora_keys`) of a new request: its adapter digest and the digests of every adapter
        it applies (a weighted mix: `mix_key` and its members'); (None, ()) for no adapter, or while a
        background load computes a digest. A mix with more members than `max_loras` is a ValueError."""
        if lora_request is None:
            return None, ()
        if self.lora is None:
            raise ValueError("a lora_request was given but the engine was created with enable_lora=False")
        self.check_mix_size(lora_request)
        digests = [self.lora.admit(lr) for lr, _ in lora_request.members()]
        if lora_request.mix:
            self._check_members(lora_request, digests)
        return self._keys(lora_request, digests)

    def _check_members(self, lr: LoRARequest, digests: list[str | None]) -> None:
        """ValueError for a mix member already in memory that a mix cannot combine (those not loaded
        yet are checked once resident, `refused_mixes`)."""
        assert self.lora is not None
        for (member, _), digest in zip(lr.mix, digests, strict=True):
            if digest is None:
                continue
            ckpt = self.lora.residency.host_copy(digest)
            res = self.lora.pool.resident.get(digest)
            why = checkpoint_problem(ckpt, member.name) if ckpt is not None else None
            why = why or (member_problem(res, member.name) if res is not None else None)
            if why:
                raise ValueError(why)
        why = self._capacity_problem(lr, digests)
        if why:
            raise ValueError(why)

    def _capacity_problem(self, lr: LoRARequest, digests: Seq[str | None]) -> str | None:
        """`mix.capacity_problem` of the mix `lr` once every member's size is known (resident or in host
        memory), else None (checked again each step while it waits, `refused_mixes`)."""
        assert self.lora is not None
        pool, needs = self.lora.pool, []
        for (member, _), digest in zip(lr.mix, digests, strict=True):
            if digest is None:
                return None
            need = member_need(
                pool, member.name, self.lora.residency.host_copy(digest), pool.resident.get(digest)
            )
            if need is None:
                return None
            needs.append(need)
        return capacity_problem(pool, needs)

    def check_mix_size(self, lr: LoRARequest) -> None:
        """ValueError when the mix `lr` has more members than `max_loras` (it could never be scheduled)."""
        limit = self.scheduler.config.max_loras
        if len(lr.members()) > limit:
            raise ValueError(
                f"the weighted mix has {len(lr.members())} adapters; this engine runs at most "
                f"max_loras={limit} adapters per step"
            )

    @staticmethod
    def _keys(lr: LoRARequest, digests: list[str | None]) -> tuple[str | None, tuple[str, ...]]:
        """(lora_key, lora_keys) once every member digest is known, else (None, ())."""
        known = [d for d in digests if d is not None]
        if len(known) < len(digests):
            return None, ()
        if not lr.mix:
            return known[0], (known[0],)
        return mix_key(known, [w for _, w in lr.mix]), tuple(known)

    def failed_loads(self) -> list[SequenceError]:
        """Unfinished sequences whose adapter could not be loaded (each failure is reported once)."""
        if self.lora is None:
            return []
        failed = self.lora.take_failures()
        if not failed:
            return []
        out = []
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            if seq.lora_request is None:
                continue
            for lr, _ in seq.lora_request.members():
                err = failed.get(path_key(lr))
                if err is not None:
                    out.append((seq, f"adapter {lr.name!r} could not be loaded: {err}"))
                    break
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
        lora = self.lora
        for seq in self.scheduler.waiting:
            req = seq.lora_request
            if req is None:
                continue
            members = [lr for lr, _ in req.members()]
            if seq.lora_key is None:
                # a member with a given digest was resolved by `key_for`; the others by their loads
                digests = [
                    lora.poll_resolved(lr, in_use) if lr.digest is None else lr.digest for lr in members
                ]
                seq.lora_key, seq.lora_keys = self._keys(req, digests)
                continue
            for lr, key in zip(members, seq.lora_keys, strict=True):
                if not lora.is_known(key) and self._resolve_or_none(lr) != key:
                    lost.append((seq, f"adapter {lr.name!r} was removed or changed while the request waited"))
                    break
        lora.prepare(self.scheduler.adapters_wanted(), in_use)
        return lost

    def refused_mixes(self) -> list[SequenceError]:
        """After `prepare` (and once its lost requests ended): the waiting mix requests that can never run,
        with a member a mix cannot combine (`mix.member_problem`) or members that cannot all be resident
        at once (`mix.capacity_problem`); their requests end as refused (the request's own fault)."""
        if self.lora is None:
            return []
        out: list[SequenceError] = []
        resident = self.lora.pool.resident
        for seq in self.scheduler.waiting:
            req = seq.lora_request
            if req is None or not req.mix:
                continue
            for (lr, _), key in zip(req.mix, seq.lora_keys, strict=False):
                res = resident.get(key)
                why = member_problem(res, lr.name) if res is not None else None
                if why is not None:
                    out.append((seq, why))
                    break
            else:
                why = self._capacity_problem(req, seq.lora_keys) if seq.lora_keys else None
                if why is not None:
                    out.append((seq, why))
        return out

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
        return {k for q in (sch.running, sch.waiting) for s in q for k in s.adapter_keys}

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
        """Validate and load the adapter (a mix: each member, refusing members a mix cannot combine with
        a ValueError) into host memory now; returns its digest (a mix: its `mix_key`)."""
        manager, in_use = self.manager(), self.scheduler.running_adapters()
        if not lora_request.mix:
            return manager.add_lora(lora_request, in_use)
        self.check_mix_size(lora_request)
        digests = [manager.add_lora(lr, in_use) for lr, _ in lora_request.mix]
        self._check_members(lora_request, list(digests))
        return mix_key(digests, [w for _, w in lora_request.mix])

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
