"""Two active names with the same content share one adapter pool entry (residency is per digest):
unloading, deactivating or deleting one name keeps the entry resident while the other name is active,
so the other name's next request loads nothing; the entry goes once no active name uses it."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import register
from tests.helpers.live_server import start_server, wait_until

pytestmark = pytest.mark.slow  # a live server

BASE_NAME = "rot13"


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("shared_digest_data")
    register(data, base, BASE_NAME, adapters["all7-r4"])
    srv = start_server(base, data)
    yield srv
    srv.stop()


def _complete(server, model: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text


def _pool(server) -> dict:
    r = server.admin().get("/admin/api/pool")
    assert r.status_code == 200, r.text
    return r.json()


def _entry(pool: dict, digest: str) -> dict | None:
    return next((a for a in pool["adapters"] if a["digest"] == digest), None)


def _complete_and_report(server, model: str) -> dict:
    """Serve one request for `model`, then the first pool report the engine sent after it finished."""
    before = _pool(server)["engine"]["generation_tokens_total"]
    _complete(server, model)
    seen: list[dict] = []
    ok = wait_until(
        lambda: seen.append(_pool(server)) or seen[-1]["engine"]["generation_tokens_total"] >= before + 3
    )
    assert ok
    return seen[-1]


def _names_known(server, digest: str) -> list[str]:
    entry = _entry(_pool(server), digest)
    return [] if entry is None else entry["names"]


def _share_then_drop(server, text_model, alias: str, drop) -> None:
    """Serve `rot13` (resident), add `alias` with the same files, `drop(admin)` the alias, then check that
    rot13's digest is still resident and a rot13 request loads nothing."""
    path = str(text_model[1]["all7-r4"])
    admin = server.admin()
    _complete(server, BASE_NAME)
    digest = server.state.follower.get(BASE_NAME).digest
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": alias, "lora_path": path})
    assert r.status_code == 200, r.text
    assert r.json()["digest"] == digest  # same content, same pool entry
    assert wait_until(lambda: alias in _names_known(server, digest))
    pool = _complete_and_report(server, alias)
    assert _entry(pool, digest)["tier"] == "device"
    loads = pool["lora"]["loads"]

    drop(admin)
    assert wait_until(lambda: alias not in server.state.follower.snapshot())
    # The engine has handled the alias's removal once it no longer lists the alias under the digest.
    assert wait_until(lambda: alias not in _names_known(server, digest))
    entry = _entry(_pool(server), digest)
    assert entry is not None and entry["tier"] == "device", entry
    assert BASE_NAME in entry["names"] and entry["active_name"] == BASE_NAME
    pool = _complete_and_report(server, BASE_NAME)
    assert pool["lora"]["loads"] == loads  # rot13 was served from the resident entry, no cold reload
    assert _entry(pool, digest)["tier"] == "device"


def test_unload_alias_keeps_shared_entry(server, text_model):
    def unload(admin: httpx.Client) -> None:
        admin.post("/v1/unload_lora_adapter", json={"lora_name": "rot13-alias"}).raise_for_status()

    _share_then_drop(server, text_model, "rot13-alias", unload)


def test_deactivate_alias_keeps_shared_entry(server, text_model):
    _share_then_drop(
        server,
        text_model,
        "rot13-copy",
        lambda admin: admin.post("/admin/api/adapters/rot13-copy/deactivate").raise_for_status(),
    )


def test_delete_alias_keeps_shared_entry(server, text_model):
    def delete(admin: httpx.Client) -> None:
        admin.post("/admin/api/adapters/rot13-twin/deactivate").raise_for_status()
        admin.delete("/admin/api/adapters/rot13-twin").raise_for_status()

    _share_then_drop(server, text_model, "rot13-twin", delete)


def test_entry_dropped_when_no_active_name_uses_it(server, text_model):
    """Both names gone: the shared digest leaves the pool."""
    path = str(text_model[1]["gud-r12"])
    admin = server.admin()
    for name in ("pair-a", "pair-b"):
        admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}).raise_for_status()
        assert wait_until(lambda n=name: n in server.state.follower.snapshot())
        _complete(server, name)
    digest = server.state.follower.get("pair-a").digest
    assert wait_until(lambda: set(_names_known(server, digest)) == {"pair-a", "pair-b"})
    admin.post("/v1/unload_lora_adapter", json={"lora_name": "pair-a"}).raise_for_status()
    assert wait_until(lambda: _names_known(server, digest) == ["pair-b"])
    admin.post("/v1/unload_lora_adapter", json={"lora_name": "pair-b"}).raise_for_status()
    assert wait_until(lambda: _entry(_pool(server), digest) is None)
