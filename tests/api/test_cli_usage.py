"""`loraplex usage`, `loraplex adapters limit` and `loraplex keys limit`, locally on a data dir and with
`--server` against a real server on the same data dir (remote mode must print what local mode prints)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from api.cli import app
from lora_registry import RegistrySettings, open_registry
from lora_registry.events import InProcessBus
from lora_registry.usage import UsageEntry
from tests.helpers.live_server import ADMIN_TOKEN, start_server
from tests.helpers.served import SERVED_ADAPTERS, register

pytestmark = pytest.mark.slow  # a live server

CLEAN = {"LORAPLEX_SERVER": None, "LORAPLEX_TOKEN": None, "LORAPLEX_DEBUG": None}
ADAPTER = SERVED_ADAPTERS[0]


@pytest.fixture(scope="module")
def served(text_model, tmp_path_factory):
    """A data dir with usage from two keys on two adapters (two hours ago and just now), and a server."""
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("cli-usage")
    for name in SERVED_ADAPTERS[:2]:
        register(data, base, name, adapters[name])
    env = {"LORAPLEX_DATA_DIR": str(data), "LORAPLEX_MODEL": str(base)}
    reg = open_registry(RegistrySettings.from_env(env), bus=InProcessBus())
    now = datetime.now(UTC)
    try:
        reg.keys.create("team-a", admin=True)
        reg.usage.insert_many(
            [
                UsageEntry(now - timedelta(hours=2), "team-a", ADAPTER, "a" * 64, 10, 5, 0, 30, "ok"),
                UsageEntry(now - timedelta(minutes=1), "team-a", ADAPTER, "a" * 64, 7, 3, 4, 20, "ok"),
                UsageEntry(
                    now - timedelta(minutes=1), None, SERVED_ADAPTERS[1], "b" * 64, 2, 0, 0, 5, "error"
                ),
                UsageEntry(now - timedelta(days=3), "team-a", ADAPTER, "a" * 64, 100, 100, 0, 5, "ok"),
            ]
        )
    finally:
        reg.close()
    server = start_server(base, data)
    yield server
    server.stop()


def local(server) -> dict:
    return CLEAN | {"LORAPLEX_DATA_DIR": str(server.data_dir)}


def remote(server) -> dict:
    return CLEAN | {
        "LORAPLEX_SERVER": server.url,
        "LORAPLEX_TOKEN": ADMIN_TOKEN,
        "LORAPLEX_DATA_DIR": "/nowhere",
    }


def invoke(env: dict, *args: str, code: int = 0):
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == code, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result


@pytest.mark.parametrize("mode", [local, remote])
def test_usage_by_adapter_and_key(served, mode) -> None:
    env = mode(served)
    report = json.loads(invoke(env, "usage", "--json").stdout)  # the last 24 hours
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {ADAPTER, SERVED_ADAPTERS[1]}
    assert (rows[ADAPTER]["requests"], rows[ADAPTER]["total_tokens"], rows[ADAPTER]["cached_tokens"]) == (
        2,
        25,
        4,
    )
    assert rows[SERVED_ADAPTERS[1]]["failed"] == 1
    by_key = json.loads(invoke(env, "usage", "--by", "key", "--since", "7d", "--json").stdout)
    assert {r["name"]: r["total_tokens"] for r in by_key["rows"]} == {"team-a": 225, None: 2}
    recent = json.loads(invoke(env, "usage", "--since", "30m", "--bucket", "hour", "--json").stdout)
    assert sum(r["total_tokens"] for r in recent["rows"]) == 12 and all(r["bucket"] for r in recent["rows"])
    table = invoke(env, "usage", "--by", "key", "--adapter", ADAPTER).stdout
    assert "team-a" in table and "2 requests, 25 tokens" in table


def test_local_and_remote_print_the_same(served) -> None:
    for args in (("usage", "--by", "key"), ("usage", "--bucket", "day", "--since", "7d")):
        assert invoke(local(served), *args).stdout == invoke(remote(served), *args).stdout


@pytest.mark.parametrize("mode", [local, remote])
def test_limits_set_show_and_clear(served, mode) -> None:
    env = mode(served)
    out = invoke(env, "adapters", "limit", ADAPTER, "--requests-per-minute", "60", "--max-concurrent", "2")
    assert f"{ADAPTER} (adapter): 60 requests/min, no token limit, at most 2 concurrent" in out.stdout
    shown = json.loads(invoke(env, "adapters", "limit", ADAPTER, "--json").stdout)
    assert (shown["requests_per_minute"], shown["tokens_per_minute"], shown["max_concurrent"]) == (
        60,
        None,
        2,
    )
    invoke(env, "adapters", "limit", ADAPTER, "--requests-per-minute", "0", "--max-concurrent", "0")
    assert (
        "no request limit, no token limit, no concurrency limit"
        in invoke(env, "adapters", "limit", ADAPTER).stdout
    )
    out = invoke(env, "keys", "limit", "team-a", "--tokens-per-minute", "5000")
    assert "team-a (key): no request limit, 5000 tokens/min" in out.stdout
    invoke(env, "keys", "limit", "team-a", "--tokens-per-minute", "0")


@pytest.mark.parametrize("mode", [local, remote])
def test_bad_input_is_one_line_and_exit_1(served, mode) -> None:
    env = mode(served)
    missing = invoke(env, "adapters", "limit", "nope", "--max-concurrent", "1", code=1)
    assert "no adapter named 'nope'" in missing.output and "Traceback" not in missing.output
    assert (
        "no key named 'nope'" in invoke(env, "keys", "limit", "nope", "--max-concurrent", "1", code=1).output
    )
    assert "give a span like 24h" in invoke(env, "usage", "--since", "yesterday", code=1).output
    assert invoke(env, "adapters", "limit", ADAPTER, "--max-concurrent", "-1", code=2).exit_code == 2
