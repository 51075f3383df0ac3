"""The background usage writer: batches, retries a failing database, drops (and counts) past a full queue,
and writes everything still queued when it is closed."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from api.usage.recorder import UsageRecorder
from lora_registry import RegistrySettings, open_registry
from lora_registry.usage import UsageEntry


def entry(i: int) -> UsageEntry:
    return UsageEntry(datetime.now(UTC), "k", "a", None, i, 1, 0, 5, "ok")


def test_close_writes_everything_queued_to_the_database(tmp_path) -> None:
    reg = open_registry(RegistrySettings.from_env({"LORAPLEX_DATA_DIR": str(tmp_path)}))
    try:
        rec = UsageRecorder(reg.usage.insert_many, flush_seconds=3600, batch_size=7).start()
        for i in range(50):
            assert rec.record(entry(i))
        assert rec.close(timeout=30)
        now = datetime.now(UTC)
        (row,) = reg.usage.summary("key", now - timedelta(hours=1), now + timedelta(minutes=1)).rows
        assert (row.requests, row.prompt_tokens) == (50, sum(range(50)))
        assert rec.written == 50 and rec.dropped == 0
    finally:
        reg.close()


def test_failing_writes_are_retried_and_a_full_queue_drops_and_counts() -> None:
    stored: list[UsageEntry] = []
    failures = [2]  # the first two writes fail
    gate = threading.Event()

    def write(batch) -> None:
        gate.wait(10)
        if failures[0]:
            failures[0] -= 1
            raise OSError("database down")
        stored.extend(batch)

    dropped: list[int] = []
    rec = UsageRecorder(write, queue_size=5, flush_seconds=0.01, batch_size=1, on_dropped=dropped.append)
    rec.start()
    accepted = [rec.record(entry(i)) for i in range(20)]  # the writer holds at most one batch meanwhile
    assert accepted.count(False) >= 14 and sum(dropped) == accepted.count(False)
    gate.set()
    assert rec.flush(timeout=20)
    assert len(stored) == accepted.count(True) and rec.written == len(stored)
    assert rec.close(timeout=10)
