"""The registry's API records survive a JSON round trip (`from_dict(to_dict(x)) == x`), as the CLI's
remote mode relies on; unknown keys are ignored and malformed values raise ValueError."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from lora_registry.schemas import (
    AdapterDetail,
    AdapterInfo,
    ApiKeyInfo,
    AuditRecord,
    CreatedKey,
    RegisterResult,
    VersionInfo,
)

NOW = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
V1 = VersionInfo(1, "ab" * 32, 8, 16.0, ("q_proj", "v_proj"), True, 1234, "tiny", "fp", "upload", NOW)
ADAPTER = AdapterInfo("support-bot", "desc", "active", None, ("a", "b"), NOW, NOW, V1, 1)
KEY = ApiKeyInfo("k", "lpx_abc", ("adapter:support-bot",), NOW, None)


@pytest.mark.parametrize(
    "record",
    [
        V1,
        ADAPTER,
        AdapterInfo("bare", "", "inactive", "me", (), NOW, NOW, None, 0),
        AdapterDetail(ADAPTER, (V1,)),
        RegisterResult(ADAPTER, V1, False),
        KEY,
        CreatedKey(KEY, "secret"),
        AuditRecord(NOW, "admin", "activate", "support-bot", {"version": 1}),
    ],
)
def test_round_trip_through_json(record):
    wire = json.loads(json.dumps(record.to_dict()))
    assert type(record).from_dict(wire) == record


def test_unknown_keys_ignored_and_bad_values_refused():
    wire = RegisterResult(ADAPTER, V1, True).to_dict()
    wire["new_field"] = 1
    wire["version"]["also_new"] = "x"
    assert RegisterResult.from_dict(wire).version == V1
    wire["version"]["rank"] = "eight"
    with pytest.raises(ValueError, match="rank"):
        RegisterResult.from_dict(wire)
    with pytest.raises(ValueError, match="digest"):
        VersionInfo.from_dict({k: v for k, v in V1.to_dict().items() if k != "digest"})
