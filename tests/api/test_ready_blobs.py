"""Readiness says when blobs are not shared: a replica on a shared PostgreSQL registry with its own data
dir and the local blob store is not ready while an adapter another replica registered (blobs in that
replica's own store) is active, and ready again once no active adapter's weights are missing."""

from __future__ import annotations

import httpx
import pytest

from lora_registry import RegistrySettings, open_registry
from lora_registry.migrate import upgrade
from tests.helpers.live_server import start_server, wait_until
from tests.lora_registry.pg import postgres_database

pytestmark = pytest.mark.slow  # a live server


def test_ready_is_503_while_an_active_adapters_blobs_are_on_another_replica(text_model, tmp_path):
    base, adapters, _ = text_model
    here, there = tmp_path / "replica-a", tmp_path / "replica-b"
    with postgres_database() as url:
        upgrade(url)
        own = open_registry(RegistrySettings(here, url, model_path=base), auto_upgrade=False)
        other = open_registry(RegistrySettings(there, url, model_path=base), auto_upgrade=False)
        try:
            own.adapters.register("mine", adapters["all7-r4"], activate=True)
            env = {"LORAPLEX_DATABASE_URL": url}
            srv = start_server(base, here, env=env, settings_overrides={"registry_resync_seconds": 0.3})
            try:
                assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200
                # Another replica, its own data dir and local blob store, registers and activates one.
                other.adapters.register("elsewhere", adapters["gud-r12"], activate=True)
                assert wait_until(lambda: "elsewhere" in srv.state.follower.snapshot(), timeout=10)
                ready = httpx.get(f"{srv.url}/ready", timeout=10)
                assert ready.status_code == 503, ready.text
                body = ready.json()
                assert body["engine"] == "ok" and body["registry"] == "ok"
                assert body["blobs"].startswith("not shared:") and "'elsewhere'" in body["blobs"]
                assert "'mine'" not in body["blobs"] and "LORAPLEX_BLOB_STORE=database" in body["blobs"]
                other.adapters.deactivate("elsewhere")
                assert wait_until(lambda: "elsewhere" not in srv.state.follower.snapshot(), timeout=10)
                ready = httpx.get(f"{srv.url}/ready", timeout=10)
                assert ready.status_code == 200 and ready.json()["blobs"] == "ok", ready.text
            finally:
                srv.stop()
        finally:
            own.close()
            other.close()
