"""`LoRAManager`: the engine's adapter API, composed of an `AdapterLoader` and an `AdapterResidency`.

- The loader knows which adapter a `LoRARequest` names (its content digest) and reads adapters from disk,
  in a background thread when the engine must not wait.
- The residency part owns the tiers (device pages <- host cache), eviction and the per-step context.

The engine drives it; nothing here calls back into the scheduler. Whoever holds the running batch passes
`in_use` (digests used by running sequences), which are never evicted. Once per step, before scheduling,
the engine calls `poll_resolved` for sequences whose digest is not known yet and `prepare` with the
adapters the scheduler will want next; the scheduler then only asks `is_resident`.

Requests admitted for an adapter version finish on that version: `admit` holds the adapter for the
request (its host copy stays, and its files are held open until read), `remove_lora` of an adapter that
unfinished requests use only retires it, and `retain` (after every step) drops retired adapters as soon as
no request uses them any more. A removed digest is remembered (the last `REMOVED_MEMORY`): a request
admitted for it later (sent before the removal, delivered after) retires it again, so it does not stay
cached; `add_lora`/`prefetch`/`pin_lora` of it (activated again) end that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.lora.adapter_checkpoint import AdapterCheckpoint
from engine.lora.backend import select_lora_backend
from engine.lora.cpu_cache import CpuAdapterCache
from engine.lora.dora import BaseWeights
from engine.lora.held_files import AdapterFilesGone
from engine.lora.loader import AdapterLoader
from engine.lora.pool import AdapterPool, ResidentAdapter
from engine.lora.residency import AdapterResidency
from engine.lora_request import LoRARequest
from engine.model.linear import LoRAStepContext
from engine.model_config import ModelConfig
from engine.scheduler.output import ScheduledSequence

if TYPE_CHECKING:
    from engine.distributed.shard import TensorShard


@dataclass(slots=True)
class LoRAInfo:
    """One known adapter as `list_loras` reports it."""

    digest: str
    names: list[str]
    tier: str  # "device" | "cpu" | "loading" | "disk"
    rank: int | None
    pinned: bool
    pages: int
    memory_bytes: int = 0  # device bytes of its pages (projections and MoE experts); 0 when not resident


@dataclass(slots=True)
class LoRAPoolStats:
    pages_total: int
    pages_used: int
    pages_free: int
    resident: int
    cpu_cached: int
    loads: int
    device_uploads: int
    evictions: int
    load_failures: int
    load_seconds_total: float
    last_load_seconds: float
    side_bytes_used: int = 0  # device bytes resident adapters keep beside their pages
    side_bytes_budget: int = 0


def _device_rank(dev: ResidentAdapter) -> int:
    """The largest rank of a resident adapter, over its projections and its experts."""
    ranks = [r for layer in dev.layer_ranks for r in layer]
    if dev.experts is not None:
        ranks += [r for layer in dev.experts.ranks for r in layer.values()]
    return max(ranks, default=0)


REMOVED_MEMORY = 4096  # removed digests remembered, so late requests for them retire them again


class LoRAManager:
    """Adapters by content digest across device pages, host memory and disk."""

    def __init__(self, loader: AdapterLoader, residency: AdapterResidency) -> None:
        self.loader = loader
        self.residency = residency
        self.retiring: set[str] = set()  # removed while requests used them: dropped once they are done
        self.removed: OrderedDict[str, None] = OrderedDict()  # digests removed (not activated since)

    @classmethod
    def create(
        cls,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        num_pages: int,
        page_rank: int,
        max_loras: int,
        backend: str,
        base: BaseWeights | None = None,
        shard: TensorShard | None = None,
        side_budget: int | None = None,
    ) -> LoRAManager:
        """The engine's manager: a pool of `num_pages` pages per projection
        (`EngineConfig.adapter_pool_pages`), a host cache of `max_cpu_loras` adapters (default
        `max(64, 4 * max_loras)`). `dtype` is the pool's (adapter weights), `compute_dtype` the model's;
        `base`: the model's projection weights, which DoRA adapters need (`engine/lora/dora.py`); `shard`:
        tensor parallel rank 0's shard (its pool holds its part of every adapter); `side_budget`: bytes for
        what adapters keep beside their pages (`engine/lora/side_memory.py`; None: as much as the pages
        take); an adapter whose side stores exceed it is refused at load."""
        local = model if shard is None else shard.local_config()
        pool = AdapterPool(
            local, num_pages, page_rank, max_lora_rank, dtype, device, base, shard, side_budget
        )
        cpu = CpuAdapterCache(max_cpu_loras or max(64, 4 * max_loras))
        chosen = select_lora_backend(backend, device, dtype, compute_dtype)
        loader = AdapterLoader(
            model, max_lora_rank, pin_memory=device.type == "cuda", check=pool.check_side_budget
        )
        return cls(loader, AdapterResidency(pool, cpu, chosen, device))

    @property
    def pool(self) -> AdapterPool:
        return self.residency.pool

    @property
    def backend(self) -> str:
        return self.residency.backend

    # ---- identity ---------------------------------------------------------------------------------
    def resolve_nowait(self, lr: LoRARequest) -> str | None:
        """The adapter's digest if known without reading weights; else None (a background load starts)."""
        return self.loader.resolve_nowait(lr)

    def admit(self, lr: LoRARequest) -> str | None:
        """The digest of the adapter a new request uses (None until a background load computes it), held
        for the request: its host copy is kept and, when there is none, its files are opened now, so the
        version stays loadable if they are deleted or replaced while the request waits. Raises
        `AdapterFilesGone` when the adapter is not in memory and its files are gone."""
        digest = self.loader.resolve_nowait(lr)
        if digest is None:
            return None
        res = self.residency
        if not res.has_host_copy(digest):
            try:
                self.loader.hold_files(digest)
            except AdapterFilesGone:
                if digest not in res.held and not res.is_resident(digest):
                    self._forget(digest)  # a refused adapter leaves nothing behind
                raise
        res.held.add(digest)
        if digest in self.removed:
            self.retiring.add(digest)  # admitted after its removal: dropped again after its requests
        return digest

    def retain(self, in_use: set[str]) -> None:
        """After a step: `in_use` are the digests of every unfinished request (running or waiting). Keep
        their host copies, release other adapters' held files, and drop retired adapters no one uses."""
        self.residency.held = set(in_use)
        self.loader.release_files(in_use)
        for digest in [d for d in self.retiring if d not in in_use]:
            self._forget(digest)

    def poll_resolved(self, lr: LoRARequest, in_use: set[str]) -> str | None:
        """The digest of a `resolve_nowait` that returned None, once its background load finished (the
        loaded adapter goes to the host cache)."""
        digest, ckpt = self.loader.poll_resolved(lr)
        if digest is not None:
            self.residency.held.add(digest)
        if ckpt is not None:
            self.residency.keep_on_host(ckpt, in_use)
        return digest

    # ---- explicit management ----------------------------------------------------------------------
    def add_lora(self, lr: LoRARequest, in_use: set[str]) -> str:
        """Validate and load the adapter into the host cache now; returns its digest."""
        digest = self.loader.resolve(lr)
        self._reactivate(digest)
        res = self.residency
        if res.host_copy(digest) is None and not res.is_resident(digest):
            try:
                ckpt = self.loader.load_now(digest)
            except Exception:
                self._forget(digest)  # a refused adapter leaves nothing behind
                raise
            res.keep_on_host(ckpt, in_use)
        self.loader.clear_failure(digest)
        return digest

    def prefetch(self, lr: LoRARequest, in_use: set[str]) -> None:
        """Start loading the adapter into host memory in the background (never blocks the caller on
        reading weights); a failure is reported like any background load's."""
        digest = self.loader.resolve_nowait(lr)
        if digest is None:
            return
        self._reactivate(digest)
        if digest in self.residency.cpu or self.residency.is_resident(digest):
            return
        ckpt = self.loader.fetch(digest)
        if ckpt is not None:
            self.residency.keep_on_host(ckpt, in_use)

    def remove_lora(self, name_or_digest: str, in_use: set[str], keep: Set[str] = frozenset()) -> bool:
        """Forget an adapter (all tiers). If unfinished requests use it (`in_use`: digests of running and
        waiting requests) it is only retired: they finish on it and `retain` drops it after the last one.

        Residency is per digest: removing a *name* whose digest another name still maps to, or that is in
        `keep` (the digests the caller still serves under other names), only forgets that name; the
        adapter stays in every tier. Returns whether it was known."""
        digest = self.loader.digest_of(name_or_digest)
        res = self.residency
        known = digest in res.cpu or res.is_resident(digest) or self.loader.is_known(digest)
        if digest != name_or_digest and (
            digest in keep or any(n != name_or_digest for n in self.loader.names_of(digest))
        ):
            self.loader.forget_name(name_or_digest)  # shared content: only this name goes
            return known
        self.removed[digest] = None
        self.removed.move_to_end(digest)
        while len(self.removed) > REMOVED_MEMORY:
            self.removed.popitem(last=False)
        if digest in in_use:
            self.retiring.add(digest)
            res.pinned.discard(digest)
        else:
            self._forget(digest)
        return known

    def _reactivate(self, digest: str) -> None:
        """The adapter is wanted again (activated): no pending or remembered removal."""
        self.retiring.discard(digest)
        self.removed.pop(digest, None)

    def _forget(self, digest: str) -> None:
        self.retiring.discard(digest)
        self.residency.drop(digest)
        self.loader.forget(digest)

    def pin_lora(self, name_or_digest: str, in_use: set[str], pinned: bool = True) -> bool:
        """Keep an adapter in the device pool regardless of LRU (loading it now). False if unknown."""
        digest = self.loader.digest_of(name_or_digest)
        if not self.loader.is_known(digest):
            return False
        if pinned:
            self._reactivate(digest)
            if not self._make_resident(digest, in_use, blocking=True):
                raise ValueError(f"adapter {name_or_digest!r} does not fit in the adapter pool")
            self.residency.pinned.add(digest)
        else:
            self.residency.pinned.discard(digest)
        return True

    def list_loras(self) -> list[LoRAInfo]:
        out = []
        res = self.residency
        for digest in self.loader.known_digests():
            dev = res.pool.resident.get(digest)
            ckpt = res.host_copy(digest) if dev is None else None
            if dev is not None:
                tier = "device"
            elif ckpt is not None:
                tier = "cpu"
            elif self.loader.is_loading(digest):
                tier = "loading"
            else:
                tier = "disk"
            rank = _device_rank(dev) if dev else (ckpt.rank if ckpt else None)
            pinned = digest in res.pinned
            names = self.loader.names_of(digest)
            pages, memory = (dev.num_pages, dev.memory_bytes) if dev else (0, 0)
            out.append(LoRAInfo(digest, names, tier, rank, pinned, pages, memory))
        return out

    # ---- per step ---------------------------------------------------------------------------------
    def prepare(self, wanted: Sequence[str], in_use: set[str]) -> None:
        """Make the `wanted` adapters resident, in order, without blocking: upload those in host memory
        (evicting only adapters neither in use, pinned nor wanted earlier), start loading the others."""
        protected = set(in_use)
        for digest in wanted:
            if self.loader.is_known(digest) and self._make_resident(digest, protected, blocking=False):
                protected.add(digest)

    def is_resident(self, digest: str) -> bool:
        return self.residency.is_resident(digest)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a background adapter load finishes or `timeout` seconds pass."""
        self.loader.wait_for_any(timeout)

    def is_known(self, digest: str) -> bool:
        """Whether the loader knows the files behind `digest` (False once `remove_lora` forgot them)."""
        return self.loader.is_known(digest)

    def step_context(self, items: Sequence[ScheduledSequence]) -> LoRAStepContext | None:
        return self.residency.step_context(items)

    def take_failures(self) -> dict[str, str]:
        """Background loads that failed since the last call: `path_key` of the files -> error message."""
        return self.loader.take_failures()

    def _make_resident(self, digest: str, protected: set[str], blocking: bool) -> bool:
        res = self.residency
        if res.is_resident(digest):
            return True
        ckpt: AdapterCheckpoint | None = res.host_copy(digest)
        if ckpt is None:
            ckpt = self.loader.load_now(digest) if blocking else self.loader.fetch(digest)
            if ckpt is None:
                return False
            res.keep_on_host(ckpt, protected)
        return res.upload(ckpt, protected)

    def stats(self) -> LoRAPoolStats:
        pool, load, res = self.residency.pool, self.loader.stats, self.residency.stats
        used, total = pool.pages_used(), pool.pages_total()
        return LoRAPoolStats(
            pages_total=total,
            pages_used=used,
            pages_free=total - used,
            resident=len(pool.resident),
            cpu_cached=len(self.residency.cpu),
            loads=load.loads,
            device_uploads=res.device_uploads,
            evictions=res.evictions,
            load_failures=load.failures,
            load_seconds_total=load.seconds_total,
            last_load_seconds=load.last_seconds,
            side_bytes_used=pool.side_used,
            side_bytes_budget=pool.side_budget,
        )

    def shutdown(self) -> None:
        self.loader.shutdown()
