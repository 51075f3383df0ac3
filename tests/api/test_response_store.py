"""`ResponseStore`: bounded by count (oldest first) and by age, and readable only by its owner or an admin."""

from __future__ import annotations

import pytest

from api.response_store import ResponseStore
from api.settings import ServerSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_oldest_goes_first_over_the_count():
    store = ResponseStore(2, 3600.0)
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, [], None)
    assert store.get("r0", None) is None
    assert [store.get(f"r{i}", None).body["id"] for i in (1, 2)] == ["r1", "r2"]
    assert len(store) == 2


def test_entries_expire_after_the_age_bound():
    clock = Clock()
    store = ResponseStore(10, 60.0, clock=clock)
    store.put("old", {}, [], None)
    clock.now += 30
    store.put("new", {}, [], None)
    clock.now += 31  # "old" is 61 s old, "new" 31 s
    assert store.get("old", None) is None and store.get("new", None) is not None
    clock.now += 30
    assert len(store) == 0


def test_only_the_owner_or_an_admin_reads_or_deletes():
    store = ResponseStore(10, 60.0)
    store.put("r", {}, [{"role": "user", "content": "x"}], "alice")
    assert store.get("r", "bob") is None and not store.delete("r", "bob")
    assert store.get("r", "alice").messages == [{"role": "user", "content": "x"}]
    assert store.get("r", "bob", admin=True) is not None
    assert store.delete("r", None, admin=True) and store.get("r", "alice") is None


def test_oldest_go_first_over_the_size_bound():
    store = ResponseStore(10, 60.0, max_chars=10)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    store.put("a", {}, [{"role": "user", "content": "xxxx"}], None)
    store.put("b", {}, [{"role": "assistant", "content": None, "tool_calls": [call]}], None)  # 3 chars
    assert store.get("a", None) is not None and store.get("b", None) is not None
    store.put("c", {}, [{"role": "user", "content": "yyyy"}], None)  # 11 in all: "a" goes
    assert store.get("a", None) is None and len(store) == 2
    store.put("huge", {}, [{"role": "user", "content": "z" * 11}], None)  # never fits: not kept
    store.put("told", {"instructions": "i" * 11}, [], None)  # instructions count too
    assert store.get("huge", None) is None and store.get("told", None) is None and len(store) == 2
    assert store.delete("b", None)
    store.put("d", {}, [{"role": "user", "content": "w" * 6}], None)  # 4 + 6: fits after the delete
    assert store.get("c", None) is not None and store.get("d", None) is not None


def test_a_zero_count_keeps_nothing():
    store = ResponseStore(0, 60.0)
    store.put("r", {}, [], None)
    assert store.get("r", None) is None


def test_retention_bounds_come_from_the_environment(tmp_path):
    (tmp_path / "m").mkdir()
    env = {
        "LORAPLEX_DATA_DIR": str(tmp_path),
        "LORAPLEX_RESPONSES_MAX_STORED": "7",
        "LORAPLEX_RESPONSES_MAX_AGE_SECONDS": "90.5",
        "LORAPLEX_RESPONSES_MAX_STORED_CHARS": "5000",
    }
    s = ServerSettings.build(str(tmp_path / "m"), env=env)
    assert (s.responses_max_stored, s.responses_max_age_seconds, s.responses_max_stored_chars) == (
        7,
        90.5,
        5000,
    )
    assert (
        ServerSettings.build(str(tmp_path / "m"), env=env, responses_max_stored=3).responses_max_stored == 3
    )
    with pytest.raises(ValueError, match="LORAPLEX_RESPONSES_MAX_STORED"):
        ServerSettings.build(str(tmp_path / "m"), env=env | {"LORAPLEX_RESPONSES_MAX_STORED": "-1"})
