"""A benchmarked server as a subprocess: a free loopback port, start, wait until it answers, stop.

Used by the online benchmarks for `loraplex serve` (`loraplex_env` + `loraplex_cmd`) and, in
`bench.peer.online`, for vLLM's OpenAI server. The server runs in its own process group so that stopping
it also stops the processes it started (vLLM's engine core); only that group is signalled.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loraplex_env(root: Path, base: Path, adapters: Mapping[str, Path]) -> dict[str, str]:
    """A fresh data dir under `root` with every adapter in `adapters` (name -> PEFT dir) registered and
    active; returns the environment `loraplex serve` reads it with."""
    from lora_registry import RegistrySettings, open_registry

    env = os.environ | {
        "LORAPLEX_DATA_DIR": str(root / "data"),
        "LORAPLEX_MODEL": str(base),
        "LORAPLEX_ADMIN_TOKEN": secrets.token_urlsafe(24),  # the server refuses tokens under 16 characters
    }
    reg = open_registry(RegistrySettings.from_env(env))
    try:
        for name, path in adapters.items():
            reg.adapters.register(name, path, activate=True)
    finally:
        reg.close()
    return env


def loraplex_cmd(
    base: Path,
    port: int,
    threads: int,
    max_loras: int,
    max_lora_rank: int | None = None,
    dtype: str | None = None,
) -> list[str]:
    """The `loraplex serve` command line (CPU, quiet logs) next to this Python's `loraplex` script."""
    exe = str(Path(sys.executable).parent / "loraplex")
    cmd = [exe, "serve", "--model", str(base), "--port", str(port), "--device", "cpu"]
    cmd += ["--max-loras", str(max_loras), "--threads", str(threads), "--log-level", "warning"]
    if max_lora_rank is not None:
        cmd += ["--max-lora-rank", str(max_lora_rank)]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    return cmd


@contextlib.contextmanager
def serving(
    cmd: list[str],
    env: Mapping[str, str],
    port: int,
    name: str,
    log: Path | None = None,
    ready_timeout: float = 300.0,
) -> Iterator[str]:
    """Run `cmd` (a server listening on 127.0.0.1:`port`) until the block ends; yields its URL once
    `GET /health` answers 200. Its output goes to `log` (appended) or to this process's streams."""
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=dict(env), stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                where = f"; see {log}" if log is not None else ""
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready{where}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{name} was not ready after {ready_timeout:.0f} s")
        yield url
    finally:
        _stop(proc)
        if out is not None:
            out.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it has not exited within 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    # children still alive after the leader exited (e.g. an engine core) share its group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
