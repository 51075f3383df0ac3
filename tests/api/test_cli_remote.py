"""The `loraplex` registry commands with `--server URL --token T`, against a real running server.

Remote mode must print exactly what local mode prints: the tests compare each remote command's output
with the same command run locally on the server's own data dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from api.cli import app
from api.cli.output import CliError
from api.cli.remote import RemoteBackend
from lora_registry.schemas import AdapterDetail, RegisterResult
from tests.helpers.live_server import ADMIN_TOKEN, LiveServer, free_port, start_server

pytestmark = pytest.mark.slow  # a live server

REPO = Path(__file__).resolve().parents[2]
# Never let the developer's own settings leak into either mode.
CLEAN = {
    "LORAPLEX_SERVER": None,
    "LORAPLEX_TOKEN": None,
    "LORAPLEX_ADMIN_TOKEN": None,
    "LORAPLEX_DEBUG": None,
}


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(text_model[0], tmp_path_factory.mktemp("remote-data"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def assets(text_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter dirs from `text_model`, a zip of one (in a top-level folder), and refused uploads."""
    adapters: dict[str, Path] = text_model[1]
    root = tmp_path_factory.mktemp("remote-assets")
    zipped = root / "qv.zip"
    with zipfile.ZipFile(zipped, "w") as zf:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(adapters["qv-r8-rslora"] / f, f"qv/{f}")
    truncated = root / "truncated"
    truncated.mkdir()
    shutil.copy(adapters["all7-r4"] / "adapter_config.json", truncated)
    weights = (adapters["all7-r4"] / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    evil = root / "evil.zip"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../adapter_config.json", "{}")
    (root / "empty").mkdir()
    return {**adapters, "zip": zipped, "truncated": truncated, "evil": evil, "empty": root / "empty"}


def remote(server: LiveServer) -> dict[str, str | None]:
    """Environment for remote mode; the data dir points nowhere useful, so local mode would fail."""
    return CLEAN | {
        "LORAPLEX_SERVER": server.url,
        "LORAPLEX_TOKEN": ADMIN_TOKEN,
        "LORAPLEX_DATA_DIR": "/nonexistent",
    }


def local(server: LiveServer) -> dict[str, str | None]:
    """Environment for local mode on the server's own registry (its default SQLite file)."""
    return CLEAN | {"LORAPLEX_DATA_DIR": str(server.data_dir)}


def invoke(env: dict[str, str | None], *args: str, input: str | None = None, code: int = 0) -> Result:
    result = CliRunner().invoke(app, list(args), env=env, input=input)
    assert result.exit_code == code, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    if code:
        assert "Traceback" not in result.output
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert (lines and lines[-1].startswith("error:")) or "aborted" in result.stderr, result.stderr
        assert sum(ln.startswith("error:") for ln in lines) <= 1, result.stderr
    return result


def same_as_local(server: LiveServer, *args: str) -> str:
    """Run a read-only command in both modes; they must print the same. Returns the output."""
    out = invoke(remote(server), *args).stdout
    assert out == invoke(local(server), *args).stdout, args
    return out


def names(server: LiveServer) -> list[str]:
    return [a["name"] for a in json.loads(invoke(remote(server), "adapters", "list", "--json").stdout)]


def test_adapter_lifecycle(server: LiveServer, assets: dict[str, Path]) -> None:
    env = remote(server)
    args = ["adapters", "register", "support-bot", str(assets["all7-r4"]), "--description", "help desk"]
    out = invoke(env, *args, "--activate").stdout
    assert "Registered support-bot version 1" in out and "active" in out
    again = invoke(env, "adapters", "register", "support-bot", str(assets["all7-r4"]))
    assert "identical content is already version 1" in again.stdout
    out = invoke(
        env, "--server", server.url, "adapters", "register", "support-bot", str(assets["zip"])
    ).stdout
    assert "Registered support-bot version 2" in out

    listed = json.loads(same_as_local(server, "adapters", "list", "--json"))
    bot = next(a for a in listed if a["name"] == "support-bot")
    assert (bot["status"], bot["current"]["version"], bot["num_versions"]) == ("active", 2, 2)
    assert bot["current"]["target_modules"] == ["q_proj", "v_proj"] and bot["current"]["use_rslora"]
    assert "support-bot" in same_as_local(server, "adapters", "list")  # the Rich table
    shown = json.loads(same_as_local(server, "adapters", "show", "support-bot", "--json"))
    assert [v["version"] for v in shown["versions"]] == [1, 2]
    assert shown["adapter"]["description"] == "help desk"
    same_as_local(server, "adapters", "show", "support-bot")

    assert "now points at version 1" in invoke(env, "adapters", "rollback", "support-bot", "1").stdout
    assert (
        json.loads(same_as_local(server, "adapters", "show", "support-bot", "--json"))["adapter"]["current"][
            "version"
        ]
        == 1
    )
    assert "inactive" in invoke(env, "adapters", "deactivate", "support-bot").stdout
    assert server.state.registry.adapters.show("support-bot").adapter.status == "inactive"
    assert "is active" in invoke(env, "adapters", "activate", "support-bot").stdout
    assert invoke(env, "adapters", "rollback", "support-bot", "7", code=1).stderr.startswith("error: ")

    assert "aborted" in invoke(env, "adapters", "delete", "support-bot", input="n\n", code=1).stderr
    assert "support-bot" in names(server)
    assert "Deleted support-bot" in invoke(env, "adapters", "delete", "support-bot", "--yes").stdout
    assert "support-bot" not in names(server)


def test_keys(server: LiveServer) -> None:
    env = remote(server)
    created = invoke(env, "keys", "create", "--name", "ops", "--admin")
    secret = created.stdout.strip()
    assert secret.startswith("lpx_") and "not shown again" in created.stderr
    invoke(env, "keys", "create", "--name", "team", "--adapter", "support-bot", "--adapter", "faq")
    listed = same_as_local(server, "keys", "list", "--json")
    assert secret not in listed
    assert [(k["name"], k["scopes"]) for k in json.loads(listed)] == [
        ("ops", ["admin"]),
        ("team", ["adapter:support-bot", "adapter:faq"]),
    ]
    same_as_local(server, "keys", "list")
    assert "Revoked key team" in invoke(env, "keys", "revoke", "team").stdout
    assert json.loads(same_as_local(server, "keys", "list", "--json"))[1]["revoked_at"] is not None
    assert "no key named 'ghost'" in invoke(env, "keys", "revoke", "ghost", code=1).stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The server's validator refuses these; its message comes through unchanged.
        (["adapters", "register", "bot", "{truncated}"], "adapter_model.safetensors truncated"),
        (["adapters", "register", "bot", "{evil}"], "'..' path components refused"),
        # Refused before anything is sent, with local mode's messages.
        (["adapters", "register", "../x", "{all7-r4}"], "adapter name '../x' is invalid"),
        (["adapters", "register", "bot", "{evil}.missing"], "no such file or directory"),
        (["adapters", "register", "bot", "{empty}"], "adapter_config.json: missing in"),
        (["adapters", "show", "ghost"], "error: no adapter named 'ghost'"),
        (["adapters", "activate", "ghost"], "no adapter named 'ghost'"),
        (["adapters", "rollback", "ghost", "3"], "no adapter named 'ghost'"),
        (["adapters", "delete", "ghost"], "no adapter named 'ghost'"),
        (["keys", "create", "--name", "k"], "either --admin or one or more --adapter"),
    ],
)
def test_errors_are_one_line_and_exit_1(
    server: LiveServer, assets: dict[str, Path], args: list[str], message: str
) -> None:
    formatted = [a.format(**{k: str(v) for k, v in assets.items()}) for a in args]
    result = invoke(remote(server), *formatted, code=1)
    assert message in result.stderr
    assert "bot" not in names(server)


def test_token_problems(server: LiveServer) -> None:
    env = remote(server)
    wrong = invoke(env | {"LORAPLEX_TOKEN": "nope"}, "adapters", "list", code=1).stderr
    assert f"the server at {server.url} refused the admin token (invalid admin token)" in wrong
    assert "--token" in wrong
    missing = invoke(env | {"LORAPLEX_TOKEN": None}, "adapters", "list", code=1).stderr
    assert "needs the server's admin token: pass --token or set LORAPLEX_TOKEN" in missing
    # The server's own variable works for the CLI too; LORAPLEX_TOKEN, when set, comes first.
    server_var = env | {"LORAPLEX_TOKEN": None, "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}
    assert invoke(server_var, "adapters", "list", "--json").stdout.startswith("[")
    both = invoke(
        env | {"LORAPLEX_TOKEN": "nope", "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}, "adapters", "list", code=1
    )
    assert "refused the admin token" in both.stderr
    assert "needs the server's admin token" in invoke(env, "--token", " ", "adapters", "list", code=1).stderr
    bad = invoke(env, "--token", "a\nb", "adapters", "list", code=1).stderr
    assert "cannot be sent in an HTTP header" in bad


def test_401_from_the_server(server: LiveServer) -> None:
    """Were the token lost on the way (a proxy, say), the server's 401 becomes advice, not a traceback."""

    def without_auth(request: httpx.Request) -> httpx.Response:
        response = httpx.request(request.method, str(request.url), timeout=10)
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    backend = RemoteBackend(server.url, ADMIN_TOKEN, transport=httpx.MockTransport(without_auth))
    try:
        with pytest.raises(CliError, match="wants an admin token: pass --token or set LORAPLEX_TOKEN"):
            backend.list()
    finally:
        backend.close()


def test_unreachable_and_wrong_servers(server: LiveServer) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    refused = invoke(remote(server), "--server", url, "adapters", "list", code=1).stderr
    assert f"error: cannot connect to the server at {url}: connection refused" in refused
    assert "loraplex serve" in refused
    bare = invoke(remote(server), "--server", server.url.removeprefix("http://"), "adapters", "list")
    assert bare.exit_code == 0  # host:port means http://host:port
    bad = invoke(remote(server), "--server", "ftp://example.org", "adapters", "list", code=1).stderr
    assert "is not an http:// or https:// URL" in bad
    not_api = invoke(remote(server), "--server", f"{server.url}/nowhere", "adapters", "list", code=1).stderr
    assert "HTTP 404" in not_api and "is --server a loraplex server" in not_api


def test_upload_progress_and_two_file_upload(server: LiveServer, assets: dict[str, Path]) -> None:
    """A directory goes up as its two PEFT files; the progress bar sees every byte."""

    class Recorder:
        def __init__(self) -> None:
            self.phases: dict[str, list[int]] = {}

        def phase(self, description: str, total: int):
            done = self.phases.setdefault(description, [total, 0])
            return lambda n: done.__setitem__(1, done[1] + n)

    backend = RemoteBackend(server.url, ADMIN_TOKEN)
    try:
        progress = Recorder()
        result = backend.register("gud", assets["gud-r12"], None, True, progress)
        assert isinstance(result, RegisterResult) and result.created and result.adapter.is_active
        size = sum(f.stat().st_size for f in assets["gud-r12"].iterdir() if f.name.startswith("adapter_"))
        assert progress.phases == {"uploading": [size, size]}
        detail = backend.show("gud")
        assert detail == AdapterDetail.from_dict(detail.to_dict())
        assert detail == server.state.registry.adapters.show("gud")
        backend.delete("gud")
    finally:
        backend.close()


def test_console_script(server: LiveServer, assets: dict[str, Path]) -> None:
    """The installed `loraplex` script in remote mode: a zip upload, and a one-line error."""
    exe = REPO / ".venv" / "bin" / "loraplex"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    cmd = [str(exe), "--server", server.url, "--token", ADMIN_TOKEN, "adapters"]
    run = subprocess.run(
        [*cmd, "register", "zipped", str(assets["zip"]), "--activate"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0 and "Registered zipped version 1" in run.stdout, run.stderr
    bad = subprocess.run([*cmd, "show", "ghost"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: no adapter named 'ghost'"
    invoke(remote(server), "adapters", "delete", "zipped", "--yes")
