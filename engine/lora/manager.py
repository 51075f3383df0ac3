"""`LoRAManager`: adapters by content digest across three tiers, and the per-step LoRA context.

Tiers: device pages (`AdapterPool`) <- host cache (`CpuAdapterCache`, LRU, `max_cpu_loras`) <- disk.
- `resolve` maps a `LoRARequest` to its content digest (re-hashing only when the files changed), so a
  name re-pointed at new weights gets a new identity and never reuses old weights or KV.
- `add_lora` loads and validates synchronously (errors raise `AdapterError`); `ready` is the scheduler's
  admission hook: it never blocks on disk — a missing adapter is loaded by a background thread while
  the running batch keeps stepping, and the request waits in the queue.
- Adapters used by a running request, or pinned with `pin_lora`, are never evicted from the pool; other
  residents are evicted least-recently-used first to make room.
"""

from __future__ import annotations

import os
import threading
import time
from collections import abc
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.adapter_checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterCheckpoint,
    AdapterError,
    adapter_digest,
    adapter_files,
    inspect_adapter,
)
from engine.lora.backend import select_lora_backend
from engine.lora.cpu_cache import CpuAdapterCache
from engine.lora.pool import AdapterPool, ResidentAdapter
from engine.lora.step_context import CpuLoRAContext, TritonLoRAContext, token_segments
from engine.lora_request import LoRARequest
from engine.model_config import ModelConfig
from engine.scheduler.output import ScheduledSequence
from kernels.intmath import cdiv


@dataclass(slots=True)
class LoRAInfo:
    """One known adapter as `list_loras` reports it."""

    digest: str
    names: list[str]
    tier: str  # "device" | "cpu" | "loading" | "disk"
    rank: int | None
    pinned: bool
    pages: int


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


class LoRAManager:
    def __init__(
        self,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        max_lora_rank: int = 64,
        max_cpu_loras: int | None = None,
        num_pages: int | None = None,
        page_rank: int = 16,
        max_loras: int = 8,
        backend: str = "auto",
    ) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.max_lora_rank = max_lora_rank
        pages_per_adapter = cdiv(max_lora_rank, page_rank)
        self.pool = AdapterPool(
            model, num_pages or 2 * max_loras * pages_per_adapter, page_rank, max_lora_rank, dtype, device
        )
        self.cpu = CpuAdapterCache(max_cpu_loras or max(64, 4 * max_loras))
        # dtype: the pool's (adapter weights); compute_dtype: the activations' (the model's)
        self.backend = select_lora_backend(backend, device, dtype, compute_dtype or dtype)
        self.in_use: Callable[[], set[str]] = lambda: set()
        self._pinned: set[str] = set()
        self._names: dict[str, str] = {}  # name -> digest last seen for it
        self._paths: dict[str, str] = {}  # digest -> path to (re)load from
        self._stat: dict[str, tuple[tuple[int, int, int, int], str]] = {}  # path -> (file stats, digest)
        self._loading: dict[str, Future] = {}  # digest -> load
        self._resolving: dict[str, Future] = {}  # path key -> load of files whose digest is not known yet
        self._failed: dict[str, str] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._clock = 0
        self._loads = self._uploads = self._evictions = self._failures = 0
        self._load_seconds = self._last_load = 0.0

    # ---- identity ---------------------------------------------------------------------------------
    def resolve(self, lr: LoRARequest) -> str:
        """Content digest of the adapter files behind `lr` (hashing again only if they changed).

        A digest given in `lr` is taken as is (checked against the files when they are loaded).
        """
        key, stats, digest = self._known_digest(lr)
        if digest is None:
            digest = adapter_digest(key)
            self._stat[key] = (stats, digest)
        return self._remember(lr.name, digest, key)

    def resolve_nowait(self, lr: LoRARequest) -> str | None:
        """Like `resolve`, but never reads the weights on the caller's thread: for files not seen before
        (or changed) it returns None and starts loading them in the background, where the digest is
        computed as part of the load; `poll_resolved(lr)` returns it once the load is done."""
        key, stats, digest = self._known_digest(lr)
        if digest is not None:
            return self._remember(lr.name, digest, key)
        if key not in self._resolving:
            self._resolving[key] = self._submit(self._load_path, key, stats)
        return None

    def poll_resolved(self, lr: LoRARequest) -> str | None:
        """The digest of a `resolve_nowait` that returned None, once its background load finished."""
        key = path_key(lr)
        fut = self._resolving.get(key)
        if fut is None:
            cached = self._stat.get(key)
            return self._remember(lr.name, cached[1], key) if cached else None
        if not fut.done():
            return None
        del self._resolving[key]
        try:
            stats, ckpt = fut.result()
        except Exception as exc:  # surfaced to the requests waiting on these files
            self._failures += 1
            self._failed[key] = str(exc)
            return None
        self._stat[key] = (stats, ckpt.digest)
        self.cpu.put(ckpt, keep=self._protected())
        return self._remember(lr.name, ckpt.digest, key)

    def _known_digest(self, lr: LoRARequest) -> tuple[str, tuple[int, ...], str | None]:
        """(path key, file stats, digest if known without hashing: given, or files unchanged)."""
        cfg_file, weights = adapter_files(lr.path)
        key = str(cfg_file.parent.resolve())
        stats = tuple(v for f in (cfg_file, weights) for v in (os.stat(f).st_mtime_ns, os.stat(f).st_size))
        if lr.digest:
            return key, stats, lr.digest
        cached = self._stat.get(key)
        return key, stats, cached[1] if cached is not None and cached[0] == stats else None

    def _remember(self, name: str, digest: str, key: str) -> str:
        self._names[name] = digest
        self._paths[digest] = key
        return digest

    # ---- explicit management ----------------------------------------------------------------------
    def add_lora(self, lr: LoRARequest) -> str:
        """Validate and load the adapter into the host cache now; returns its digest."""
        digest = self.resolve(lr)
        if digest not in self.cpu and digest not in self.pool.resident:
            try:
                ckpt = self._load(digest)
            except Exception:
                self._forget(digest)  # a refused adapter leaves nothing behind
                raise
            self.cpu.put(ckpt, keep=self._protected())
        self._failed.pop(digest, None)
        return digest

    def prefetch(self, lr: LoRARequest) -> None:
        """Start loading the adapter into host memory in the background (never blocks the caller on
        reading weights); a failure is reported like any background load's."""
        digest = self.resolve_nowait(lr)
        if digest is None or digest in self.cpu or digest in self.pool.resident or digest in self._loading:
            return
        self._loading[digest] = self._submit(self._load, digest)

    def remove_lora(self, name_or_digest: str) -> bool:
        """Forget an adapter (all tiers) unless a running request uses it. Returns whether it was known."""
        digest = self._names.get(name_or_digest, name_or_digest)
        if digest in self.in_use():
            raise ValueError(f"adapter {name_or_digest!r} is in use by running requests")
        known = digest in self.cpu or digest in self.pool.resident or digest in self._paths
        if digest in self.pool.resident:
            self.pool.evict(digest)
        self._forget(digest)
        return known

    def _forget(self, digest: str) -> None:
        self.cpu.drop(digest)
        self._pinned.discard(digest)
        self._paths.pop(digest, None)
        for name in [n for n, d in self._names.items() if d == digest]:
            del self._names[name]

    def pin_lora(self, name_or_digest: str, pinned: bool = True) -> bool:
        """Keep an adapter in the device pool regardless of LRU (loading it now). False if unknown."""
        digest = self._names.get(name_or_digest, name_or_digest)
        if digest not in self._paths:
            return False
        if pinned:
            if not self._make_resident(digest, blocking=True):
                raise ValueError(f"adapter {name_or_digest!r} does not fit in the adapter pool")
            self._pinned.add(digest)
        else:
            self._pinned.discard(digest)
        return True

    def list_loras(self) -> list[LoRAInfo]:
        out = []
        for digest in self._paths:
            names = sorted(n for n, d in self._names.items() if d == digest)
            res = self.pool.resident.get(digest)
            ckpt = self.cpu.get(digest) if res is None else None
            if res is not None:
                tier = "device"
            elif ckpt is not None:
                tier = "cpu"
            elif digest in self._loading:
                tier = "loading"
            else:
                tier = "disk"
            rank = max((max(r) for r in res.layer_ranks), default=0) if res else (ckpt.rank if ckpt else None)
            out.append(
                LoRAInfo(digest, names, tier, rank, digest in self._pinned, res.num_pages if res else 0)
            )
        return out

    # ---- scheduler hooks --------------------------------------------------------------------------
    def ready(self, digest: str) -> bool:
        """True when the adapter is in the device pool (uploading it from host memory if needed)."""
        return self._make_resident(digest, blocking=False)

    def take_failures(self) -> dict[str, str]:
        """Adapters whose background load failed since the last call: digest, or `path_key` for files
        loaded before their digest was known -> error message."""
        failed, self._failed = self._failed, {}
        return failed

    def step_context(self, items: abc.Sequence[ScheduledSequence]):
        """The LoRA context for a step's scheduled requests (in flat-batch order), or None if none has one."""
        adapters: list[ResidentAdapter | None] = []
        any_lora = False
        for it in items:
            key = it.seq.lora_key
            res = self.pool.resident.get(key) if key is not None else None
            assert key is None or res is not None, "scheduled adapter must be resident"
            if res is not None:
                self._clock += 1
                res.last_used = self._clock
                any_lora = True
            adapters.append(res)
        if not any_lora:
            return None
        counts = [it.num_tokens for it in items]
        if self.backend != "triton":
            native = self.backend == "native"
            return CpuLoRAContext(self.pool, token_segments(counts, adapters), native=native)
        slots = [
            (-1 if a is None else a.slot) for a, n in zip(adapters, counts, strict=True) for _ in range(n)
        ]
        return TritonLoRAContext(self.pool, torch.tensor(slots, dtype=torch.int32, device=self.device))

    # ---- internals --------------------------------------------------------------------------------
    def _protected(self) -> set[str]:
        return self.in_use() | self._pinned

    def _submit(self, fn, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        return self._executor.submit(fn, *args)

    def _load(self, digest: str) -> AdapterCheckpoint:
        ckpt = self._read(self._paths[digest])
        if ckpt.digest != digest:
            raise AdapterError("adapter files changed while loading; retry")
        return ckpt

    def _load_path(self, key: str, stats: tuple[int, ...]) -> tuple[tuple[int, ...], AdapterCheckpoint]:
        return stats, self._read(key)

    def _read(self, path: str) -> AdapterCheckpoint:
        """Validate and load the adapter at `path` into host memory (pinned on CUDA), timing the load."""
        t0 = time.perf_counter()
        ckpt = inspect_adapter(path, self.model, self.max_lora_rank, load_weights=True)
        if self.device.type == "cuda":
            ckpt = _pin_host_memory(ckpt)
        dt = time.perf_counter() - t0
        with self._lock:
            self._loads += 1
            self._load_seconds += dt
            self._last_load = dt
        return ckpt

    def _make_resident(self, digest: str, blocking: bool) -> bool:
        if digest in self.pool.resident:
            return True
        ckpt = self.cpu.get(digest)
        if ckpt is None:
            ckpt = self._poll_load(digest, blocking)
            if ckpt is None:
                return False
        if not self._make_room(ckpt):
            return False
        self.pool.upload(ckpt)
        self._uploads += 1
        return True

    def _poll_load(self, digest: str, blocking: bool) -> AdapterCheckpoint | None:
        if blocking:
            ckpt = self._load(digest)
        else:
            fut = self._loading.get(digest)
            if fut is None:
                self._loading[digest] = self._submit(self._load, digest)
                return None
            if not fut.done():
                return None
            del self._loading[digest]
            try:
                ckpt = fut.result()
            except Exception as exc:  # surfaced to the requests waiting on this adapter
                self._failures += 1
                self._failed[digest] = str(exc)
                return None
        self.cpu.put(ckpt, keep=self._protected())
        return ckpt

    def _make_room(self, ckpt: AdapterCheckpoint) -> bool:
        """Evict unprotected residents, least recently used first, until `ckpt` fits."""
        protected = self._protected()
        victims = sorted(
            (r for d, r in self.pool.resident.items() if d not in protected), key=lambda r: r.last_used
        )
        while not self.pool.fits(ckpt):
            if not victims:
                return False
            self.pool.evict(victims.pop(0).digest)
            self._evictions += 1
        return True

    def stats(self) -> LoRAPoolStats:
        used, total = self.pool.pages_used(), self.pool.pages_total()
        return LoRAPoolStats(
            pages_total=total,
            pages_used=used,
            pages_free=total - used,
            resident=len(self.pool.resident),
            cpu_cached=len(self.cpu),
            loads=self._loads,
            device_uploads=self._uploads,
            evictions=self._evictions,
            load_failures=self._failures,
            load_seconds_total=self._load_seconds,
            last_load_seconds=self._last_load,
        )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _pin_host_memory(ckpt: AdapterCheckpoint) -> AdapterCheckpoint:
    from dataclasses import replace

    mods = tuple(replace(m, lora_a=m.lora_a.pin_memory(), lora_b=m.lora_b.pin_memory()) for m in ckpt.modules)
    return replace(ckpt, modules=mods)


def path_key(lr: LoRARequest) -> str:
    """The absolute directory of `lr`'s adapter files (how loads of not-yet-hashed files are keyed)."""
    path = Path(lr.path)
    if path.name in (CONFIG_FILE, WEIGHTS_FILE):
        path = path.parent
    return str(path.resolve())
