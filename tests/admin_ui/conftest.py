"""Fixtures for the admin UI tests: a tiny model with adapters, adapter zips, a logged-in HTTP client."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.helpers.live_server import ADMIN_TOKEN, LiveServer, start_server
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer

PRELOADED = ("all7-r4", "qv-r8-rslora")  # registered and active before the server starts
UPLOADED = "gud-r12"  # uploaded through the UI
LONG_MODULE = "q_proj_" + "x" * 240  # no such module: its refusal is one long unbroken word


def register(data_dir: Path, model: Path, name: str, path: Path, activate: bool = True) -> None:
    """Register an adapter straight into the registry in `data_dir` (as `loraplex adapters register`)."""
    from lora_registry import RegistrySettings, open_registry

    env = {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_MODEL": str(model)}
    reg = open_registry(RegistrySettings.from_env(env))
    try:
        reg.adapters.register(name, path, activate=activate)
    finally:
        reg.close()


def zip_dir(src: Path, dest: Path) -> Path:
    """`dest`: a zip of the files of directory `src` at its top level."""
    with zipfile.ZipFile(dest, "w") as zf:
        for f in sorted(src.iterdir()):
            if f.is_file():
                zf.write(f, f.name)
    return dest


@pytest.fixture(scope="session")
def ui_model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A tiny llama with a character tokenizer and three PEFT adapters for it."""
    root = tmp_path_factory.mktemp("ui-model")
    base = build_checkpoint(root / "model", "llama", vocab_size=100)
    save_char_tokenizer(base)
    names = (*PRELOADED, UPLOADED)
    adapters = {
        n: build_adapter(base, root / "adapters" / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(names)
    }
    return base, adapters


@pytest.fixture(scope="session")
def adapter_zips(ui_model, tmp_path_factory) -> dict[str, Path]:
    """`good`: a zip of a valid adapter; `refused`: a zip without the weights file; `long_message`: a
    zip whose config targets an unknown 247-character module name (a long, unbroken refusal message)."""
    _, adapters = ui_model
    root = tmp_path_factory.mktemp("zips")
    good = zip_dir(adapters[UPLOADED], root / f"{UPLOADED}.zip")
    refused = root / "broken.zip"
    with zipfile.ZipFile(refused, "w") as zf:
        zf.write(adapters[UPLOADED] / "adapter_config.json", "adapter_config.json")
    long_message = root / "long-module.zip"
    config = json.loads((adapters[UPLOADED] / "adapter_config.json").read_text())
    config["target_modules"] = [LONG_MODULE]
    with zipfile.ZipFile(long_message, "w") as zf:
        zf.writestr("adapter_config.json", json.dumps(config))
        zf.write(adapters[UPLOADED] / "adapter_model.safetensors", "adapter_model.safetensors")
    return {"good": good, "refused": refused, "long_message": long_message}


def start_ui_server(ui_model, tmp_path_factory) -> LiveServer:
    """A live server whose registry already holds the `PRELOADED` adapters, active."""
    base, adapters = ui_model
    data = tmp_path_factory.mktemp("ui-data")
    for name in PRELOADED:
        register(data, base, name, adapters[name])
    return start_server(base, data)


_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_from(html: str) -> str:
    """The first CSRF token in a rendered page."""
    match = _CSRF.search(html)
    assert match, "no csrf_token field on the page"
    return match.group(1)


def logged_in_client(server: LiveServer) -> tuple[httpx.Client, str]:
    """An httpx client with an admin session, and the session's CSRF token."""
    client = httpx.Client(base_url=server.url, timeout=60)
    page = client.get("/admin/login")
    r = client.post("/admin/login", data={"token": ADMIN_TOKEN, "csrf_token": csrf_from(page.text)})
    assert r.status_code == 303, r.text
    dash = client.get("/admin")
    assert dash.status_code == 200
    return client, csrf_from(dash.text)
