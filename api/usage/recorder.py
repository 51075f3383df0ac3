"""`UsageRecorder`: take usage records off the request path and write them in batches.

`record(entry)` only puts the entry on a bounded queue (never blocks, never touches the database). A
background thread writes what has queued up, at most `batch_size` rows per insert, at the latest
`flush_seconds` after the oldest waiting entry arrived. If the database fails, the batch is retried
with backoff while new entries keep queueing; a full queue drops new entries and counts them
(`loraplex_usage_records_dropped`). `close()` (the server's graceful shutdown, after the in-flight
requests have finished) writes everything still queued before it returns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from lora_registry.usage import UsageEntry

log = logging.getLogger("loraplex.usage")
CLOSE_ATTEMPTS = 3  # failed writes of one batch during close() before its records are given up


class UsageRecorder:
    def __init__(
        self,
        write: Callable[[Sequence[UsageEntry]], None],
        queue_size: int = 100_000,
        flush_seconds: float = 1.0,
        batch_size: int = 1000,
        on_written: Callable[[int], None] | None = None,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        self._write = write
        self.flush_seconds, self.batch_size = flush_seconds, batch_size
        self._queue: queue.Queue[UsageEntry] = queue.Queue(queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._on_written = on_written or (lambda n: None)
        self._on_dropped = on_dropped or (lambda n: None)
        self._done = threading.Condition()
        self.enqueued = self.written = self.dropped = 0
        self._last_drop_warning = 0.0

    def start(self) -> UsageRecorder:
        self._thread.start()
        return self

    def record(self, entry: UsageEntry) -> bool:
        """Queue `entry` for writing; False (and counted as dropped) when the queue is full."""
        with self._done:
            self.enqueued += 1
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self._count_dropped(1)
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every entry recorded so far is written (or dropped); False on timeout."""
        with self._done:
            target = self.enqueued
            return self._done.wait_for(lambda: self.written + self.dropped >= target, timeout)

    def close(self, timeout: float = 60.0) -> bool:
        """Write everything still queued, then stop the writer; False if it did not finish in time."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        batch: list[UsageEntry] = []
        oldest = 0.0
        while True:
            stopping = self._stop.is_set()
            try:
                entry = self._queue.get_nowait() if stopping else self._queue.get(timeout=0.05)
            except queue.Empty:
                if stopping:  # everything queued is in `batch` now
                    if batch:
                        self._write_batch(batch)
                    return
            else:
                if not batch:
                    oldest = time.monotonic()
                batch.append(entry)
            if batch and (len(batch) >= self.batch_size or time.monotonic() - oldest >= self.flush_seconds):
                self._write_batch(batch)
                batch = []

    def _write_batch(self, batch: list[UsageEntry]) -> None:
        """Insert `batch`, retrying with backoff; during close() give up after a few attempts."""
        delay, attempts = 0.2, 0
        while True:
            try:
                self._write(batch)
            except Exception as exc:
                attempts += 1
                if self._stop.is_set() and attempts >= CLOSE_ATTEMPTS:
                    log.error("usage: %d records lost, the database is unavailable: %s", len(batch), exc)
                    self._count_dropped(len(batch))
                    return
                log.warning("usage: writing %d records failed (retrying): %s", len(batch), exc)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            with self._done:
                self.written += len(batch)
                self._done.notify_all()
            self._on_written(len(batch))
            return

    def _count_dropped(self, n: int) -> None:
        with self._done:
            self.dropped += n
            self._done.notify_all()
        self._on_dropped(n)
        now = time.monotonic()
        if now - self._last_drop_warning > 30:
            self._last_drop_warning = now
            log.warning("usage: %d records dropped so far (queue full or database down)", self.dropped)
