"""`AdapterLoader`: which adapter a `LoRARequest` names (its content digest), and reading adapters from disk.

Identity: `resolve` maps a request to the content digest of its files, hashing again only when the files'
size or mtime changed, so a name re-pointed at new weights gets a new identity and never reuses old
weights or KV. `resolve_nowait` never reads weights on the caller's thread: files not seen before are
loaded in the background, where the digest is computed as part of the load.

Loading: every background load is keyed by the adapter's directory (`path_key`), in one futures map, and
a failed load is recorded under the same key until `take_failures` hands it out. The files of an adapter
that requests wait for can be held open (`hold_files`), so it loads even if they are deleted meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.lora.adapter_checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterCheckpoint,
    AdapterError,
    adapter_digest,
    adapter_files,
    inspect_adapter,
)
from engine.lora.held_files import HeldAdapterFiles
from engine.lora_request import LoRARequest
from engine.model_config import ModelConfig

FileStats = tuple[int, ...]  # (mtime_ns, size) of the config file, then of the weights file


@dataclass(slots=True)
class LoadStats:
    loads: int = 0
    failures: int = 0
    seconds_total: float = 0.0
    last_seconds: float = 0.0


class AdapterLoader:
    """Adapter identities (name -> digest -> files) and the background thread that reads them."""

    def __init__(
        self,
        model: ModelConfig,
        max_lora_rank: int,
        pin_memory: bool = False,
        check: Callable[[AdapterCheckpoint], None] | None = None,
    ) -> None:
        """`check(ckpt)`: raises `AdapterError` for an adapter the engine cannot hold (e.g. the pool's side
        budget), so it fails to load like an invalid one."""
        self.model = model
        self.check = check
        self.max_lora_rank = max_lora_rank
        self.pin_memory = pin_memory  # page-locked host copies (CUDA: faster, asynchronous uploads)
        self.stats = LoadStats()
        self._names: dict[str, str] = {}  # name -> digest last seen for it
        self._paths: dict[str, str] = {}  # digest -> path key of the files to (re)load it from
        self._stat: dict[str, tuple[FileStats, str]] = {}  # path key -> (file stats, digest)
        self._loads: dict[str, Future[tuple[FileStats, AdapterCheckpoint]]] = {}  # path key -> load
        self._failed: dict[str, str] = {}  # path key -> why its last background load failed
        self._held: dict[str, HeldAdapterFiles] = {}  # digest -> its files, opened for waiting requests
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # why this engine cannot serve a valid adapter, or None (a hook for engines with such limits)
        self.refuse: Callable[[AdapterCheckpoint], str | None] | None = None

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
        """Like `resolve`, but for files not seen before (or changed) returns None and starts loading
        them in the background; `poll_resolved(lr)` returns the digest once that load is done."""
        key, stats, digest = self._known_digest(lr)
        if digest is not None:
            return self._remember(lr.name, digest, key)
        if key not in self._loads:
            self._loads[key] = self._submit(self._read_with_stats, key, stats)
        return None

    def poll_resolved(self, lr: LoRARequest) -> tuple[str | None, AdapterCheckpoint | None]:
        """(digest, checkpoint) for a `resolve_nowait` that returned None: (None, None) while its load
        runs or after it failed; the checkpoint is the loaded adapter when this call saw the load end."""
        key = path_key(lr)
        fut = self._loads.get(key)
        if fut is not None:
            ckpt = self._collect(key)
            return (None, None) if ckpt is None else (self._remember(lr.name, ckpt.digest, key), ckpt)
        cached = self._stat.get(key)
        return (self._remember(lr.name, cached[1], key) if cached else None), None

    def _known_digest(self, lr: LoRARequest) -> tuple[str, FileStats, str | None]:
        """(path key, file stats, digest if known without hashing: given, or files unchanged). A given
        digest touches no file (the adapter may be served from memory after its files are gone)."""
        if lr.digest:
            return path_key(lr), (), lr.digest
        cfg_file, weights = adapter_files(lr.path)
        key = str(cfg_file.parent.resolve())
        stats = tuple(v for f in (cfg_file, weights) for v in (os.stat(f).st_mtime_ns, os.stat(f).st_size))
        cached = self._stat.get(key)
        return key, stats, cached[1] if cached is not None and cached[0] == stats else None

    def _remember(self, name: str, digest: str, key: str) -> str:
        self._names[name] = digest
        self._paths[digest] = key
        return digest

    def digest_of(self, name_or_digest: str) -> str:
        """The digest a name was last resolved to (a digest maps to itself)."""
        return self._names.get(name_or_digest, name_or_digest)

    def names_of(self, digest: str) -> list[str]:
        return sorted(n for n, d in self._names.items() if d == digest)

    def is_known(self, digest: str) -> bool:
        return digest in self._paths

    def known_digests(self) -> list[str]:
        return list(self._paths)

    def forget_name(self, name: str) -> None:
        """Stop mapping `name` to a digest (the digest itself stays known)."""
        self._names.pop(name, None)

    def forget(self, digest: str) -> None:
        """Drop every name of `digest`, where its files are, and their held descriptors."""
        self._paths.pop(digest, None)
        self._held.pop(digest, None)
        for name in [n for n, d in self._names.items() if d == digest]:
            del self._names[name]

    # ---- held files -------------------------------------------------------------------------------
    def hold_files(self, digest: str) -> None:
        """Open the files of the known adapter `digest` now (not reading them) so that later loads read
        them even if they are deleted or replaced meanwhile; raises `AdapterFilesGone` if they are gone."""
        if digest not in self._held:
            self._held[digest] = HeldAdapterFiles(self._paths[digest])

    def release_files(self, keep: set[str]) -> None:
        """Close the held files of every adapter not in `keep` (once no load uses them any more)."""
        for digest in [d for d in self._held if d not in keep]:
            del self._held[digest]

    def held_digests(self) -> list[str]:
        return list(self._held)

    # ---- loading ----------------------------------------------------------------------------------
    def load_now(self, digest: str) -> AdapterCheckpoint:
        """Validate and read the adapter's files on this thread (errors raise `AdapterError`)."""
        return _checked(self._read(self._paths[digest], self._held.get(digest)), digest)

    def clear_failure(self, digest: str) -> None:
        """Forget a reported-later failure of the adapter's files (they loaded fine since)."""
        self._failed.pop(self._paths.get(digest, ""), None)

    def fetch(self, digest: str) -> AdapterCheckpoint | None:
        """The adapter's checkpoint once a background load of its files has finished; until then None,
        starting that load if none is running (and no failure of it is waiting to be reported)."""
        key = self._paths[digest]
        ckpt = self._collect(key)
        if ckpt is not None:
            if ckpt.digest == digest:
                return ckpt
            self._fail(key, "adapter files changed while loading; retry")
            return None
        if key not in self._loads and key not in self._failed:
            self._loads[key] = self._submit(self._read_with_stats, key, None, self._held.get(digest))
        return None

    def wait_for_any(self, timeout: float) -> None:
        """Block until a background load finishes or `timeout` seconds pass (at once when none runs)."""
        if self._loads:
            wait(list(self._loads.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def is_loading(self, digest: str) -> bool:
        return self._paths.get(digest) in self._loads

    def take_failures(self) -> dict[str, str]:
        """Background loads that failed since the last call: `path_key` -> error message."""
        failed, self._failed = self._failed, {}
        return failed

    def _collect(self, key: str) -> AdapterCheckpoint | None:
        """The result of the finished background load of `key` (removing it), recording a failure."""
        fut = self._loads.get(key)
        if fut is None or not fut.done():
            return None
        del self._loads[key]
        try:
            stats, ckpt = fut.result()
        except Exception as exc:  # surfaced to the requests waiting on these files
            self._fail(key, str(exc))
            return None
        if stats is not None:
            self._stat[key] = (stats, ckpt.digest)
        return ckpt

    def _fail(self, key: str, message: str) -> None:
        self.stats.failures += 1
        self._failed[key] = message

    def _submit(self, fn: Any, *args: Any) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        return self._executor.submit(fn, *args)

    def _read_with_stats(
        self, key: str, stats: FileStats | None, held: HeldAdapterFiles | None = None
    ) -> tuple[FileStats | None, AdapterCheckpoint]:
        return stats, self._read(key, held)

    def _read(self, path: str, held: HeldAdapterFiles | None = None) -> AdapterCheckpoint:
        """Validate and load the adapter at `path` (through `held` when its files are held open) into
        host memory, timing the load."""
        t0 = time.perf_counter()
        contents = held.read() if held is not None else None
        ckpt = inspect_adapter(path, self.model, self.max_lora_rank, load_weights=True, contents=contents)
        problem = self.refuse(ckpt) if self.refuse is not None else None
        if problem:
            raise AdapterError(problem)
        if self.check is not None:
            self.check(ckpt)
        if self.pin_memory:
            ckpt = _pin_host_memory(ckpt)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.loads += 1
            self.stats.seconds_total += dt
            self.stats.last_seconds = dt
        return ckpt

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _checked(ckpt: AdapterCheckpoint, digest: str) -> AdapterCheckpoint:
    if ckpt.digest != digest:
        raise AdapterError("adapter files changed while loading; retry")
    return ckpt


def _pin_host_memory(ckpt: AdapterCheckpoint) -> AdapterCheckpoint:
    mods = tuple(
        replace(m, lora_a=m.lora_a.pin_memory(), lora_b=m.lora_b.pin_memory())
        for m in ckpt.modules
        if m.lora_a is not None and m.lora_b is not None  # loaded with weights: always both
    )
    return replace(ckpt, modules=mods)


def path_key(lr: LoRARequest) -> str:
    """The absolute directory of `lr`'s adapter files (how loads and their failures are keyed)."""
    path = Path(lr.path)
    if path.name in (CONFIG_FILE, WEIGHTS_FILE):
        path = path.parent
    return str(path.resolve())
