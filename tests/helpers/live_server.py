"""A real loraplex server (uvicorn on a free loopback port, engine in its own process) for tests."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from api.app import create_app
from api.settings import ServerSettings

ADMIN_TOKEN = "test-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread
    data_dir: Path

    @property
    def state(self):
        return self.app.state.loraplex

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def start_server(
    model: Path,
    data_dir: Path,
    startup_timeout: float = 180.0,
    settings_overrides: dict | None = None,
    env: dict[str, str] | None = None,
    **engine_kwargs,
) -> LiveServer:
    """Start a server for `model` with its registry in `data_dir`; returns once /health answers 200.
    `settings_overrides` sets `ServerSettings` fields (e.g. require_api_key); `env` adds `LORAPLEX_*`
    variables (e.g. `LORAPLEX_DATABASE_URL`, `LORAPLEX_REDIS_URL`)."""
    env = {"LORAPLEX_DATA_DIR": str(data_dir)} | (env or {})
    kwargs = dict(device="cpu", dtype="float32", max_lora_rank=32, num_kv_blocks=256) | engine_kwargs
    settings = ServerSettings.build(
        str(model), env=env, admin_token=ADMIN_TOKEN, engine_kwargs=kwargs, **(settings_overrides or {})
    )
    settings.port = free_port()
    app = create_app(settings)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=settings.port, log_level="warning", **settings.uvicorn_proxy_options()
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("server thread exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return LiveServer(url, app, server, thread, data_dir)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.should_exit = True
    raise RuntimeError("server did not become healthy in time")


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
