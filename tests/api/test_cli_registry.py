"""The `loraplex` CLI's registry commands, locally on the data dir, with SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from tests.engine.lora.peft_factory import make_adapter, write_base_model
from tests.lora_registry.conftest import wipe
from tests.lora_registry.pg import postgres_database

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-assets")
    make_adapter(root / "a", seed=1)
    make_adapter(root / "b", seed=2, r=8, target_modules=["q_proj", "k_proj", "down_proj"])
    make_adapter(root / "dora", seed=4, use_dora=True)
    state = make_adapter(root / "pickled", seed=3)
    (root / "pickled" / "adapter_model.safetensors").unlink()
    import torch

    torch.save(state, root / "pickled" / "adapter_model.bin")
    with zipfile.ZipFile(root / "b.zip", "w") as zf:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(root / "b" / f, f"b/{f}")
    return {"base": write_base_model(root / "base"), **{p.name: p for p in root.iterdir()}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None: the data dir's default SQLite file; else the URL of a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield None
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture
def env(tmp_path: Path, assets: dict[str, Path], database: str | None) -> dict[str, str]:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(assets["base"])}
    if database is not None:
        env["LORAPLEX_DATABASE_URL"] = database
        invoke(env, "db", "upgrade")
        wipe(database)
    return env


def invoke(env: dict[str, str], *args: str, input: str | None = None, code: int = 0):
    result = CliRunner().invoke(app, list(args), env=env, input=input)
    assert result.exit_code == code, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    if code:
        assert "Traceback" not in result.output
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert (lines and lines[-1].startswith("error:")) or "aborted" in result.stderr, result.stderr
    return result


def test_adapter_lifecycle(env: dict[str, str], assets: dict[str, Path]) -> None:
    out = invoke(
        env,
        "adapters",
        "register",
        "support-bot",
        str(assets["a"]),
        "--description",
        "help desk",
        "--activate",
    )
    assert "Registered support-bot version 1" in out.stdout and "active" in out.stdout
    again = invoke(env, "adapters", "register", "support-bot", str(assets["a"]))
    assert "identical content is already version 1" in again.stdout
    invoke(env, "adapters", "register", "support-bot", str(assets["b.zip"]))
    listed = json.loads(invoke(env, "adapters", "list", "--json").stdout)
    assert [(a["name"], a["status"], a["current"]["version"], a["num_versions"]) for a in listed] == [
        ("support-bot", "active", 2, 2)
    ]
    assert listed[0]["current"]["target_modules"] == ["q_proj", "k_proj", "down_proj"]
    assert "support-bot" in invoke(env, "adapters", "list").stdout  # the Rich table
    shown = json.loads(invoke(env, "adapters", "show", "support-bot", "--json").stdout)
    assert [v["version"] for v in shown["versions"]] == [1, 2] and shown["adapter"][
        "description"
    ] == "help desk"
    assert "now points at version 1" in invoke(env, "adapters", "rollback", "support-bot", "1").stdout
    assert "inactive" in invoke(env, "adapters", "deactivate", "support-bot").stdout
    assert "active" in invoke(env, "adapters", "activate", "support-bot").stdout
    invoke(env, "adapters", "delete", "support-bot", input="n\n", code=1)
    assert len(json.loads(invoke(env, "adapters", "list", "--json").stdout)) == 1
    invoke(env, "adapters", "delete", "support-bot", "--yes")
    assert json.loads(invoke(env, "adapters", "list", "--json").stdout) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["adapters", "register", "../x", "{a}"], "adapter name '../x' is invalid"),
        (["adapters", "register", "bot", "{pickled}"], "pickle weights are refused"),
        (["adapters", "register", "bot", "{base}/nope"], "no such file or directory"),
        (["adapters", "show", "ghost"], "no adapter named 'ghost'"),
        (["adapters", "activate", "ghost"], "no adapter named 'ghost'"),
        (["adapters", "rollback", "ghost", "3"], "no adapter named 'ghost'"),
        (["keys", "create", "--name", "k"], "either --admin or one or more --adapter"),
        (["keys", "revoke", "ghost"], "no key named 'ghost'"),
    ],
)
def test_errors_are_one_line_and_exit_1(env, assets, args: list[str], message: str) -> None:
    result = invoke(env, *[a.format(**{k: str(v) for k, v in assets.items()}) for a in args], code=1)
    assert message in result.stderr
    assert json.loads(invoke(env, "adapters", "list", "--json").stdout) == []


def test_local_registration_checks_a_given_side_budget(env, assets) -> None:
    """With --lora-side-memory-bytes the local registration refuses what the engine could never hold,
    with the server's message; without it (the budget is the serving engine's, unknown here) it stores."""
    dora = str(assets["dora"])
    budget = ["--lora-side-memory-bytes", "64", "--lora-dtype", "bfloat16"]
    result = invoke(env, "adapters", "register", "dora-bot", dora, *budget, code=1)
    assert "side budget of 64 bytes" in result.stderr
    assert json.loads(invoke(env, "adapters", "list", "--json").stdout) == []
    bad = invoke(
        env,
        "adapters",
        "register",
        "dora-bot",
        dora,
        "--lora-side-memory-bytes",
        "64",
        "--lora-dtype",
        "int8",
        code=1,
    )
    assert "--lora-dtype: expected one of" in bad.stderr
    invoke(env, "adapters", "register", "dora-bot", dora, "--lora-side-memory-bytes", str(1 << 30))
    invoke(env, "adapters", "register", "dora-bot-2", dora)
    assert len(json.loads(invoke(env, "adapters", "list", "--json").stdout)) == 2


def test_keys(env: dict[str, str]) -> None:
    created = invoke(env, "keys", "create", "--name", "ops", "--admin")
    secret = created.stdout.strip()
    assert secret.startswith("lpx_") and "not shown again" in created.stderr
    invoke(env, "keys", "create", "--name", "team", "--adapter", "support-bot", "--adapter", "faq")
    listed = invoke(env, "keys", "list", "--json").stdout
    assert secret not in listed
    assert [(k["name"], k["scopes"]) for k in json.loads(listed)] == [
        ("ops", ["admin"]),
        ("team", ["adapter:support-bot", "adapter:faq"]),
    ]
    invoke(env, "keys", "revoke", "team")
    assert json.loads(invoke(env, "keys", "list", "--json").stdout)[1]["revoked_at"] is not None


def test_register_without_a_base_model(env: dict[str, str], assets) -> None:
    bare = {k: v for k, v in env.items() if k != "LORAPLEX_MODEL"}
    result = invoke(bare, "adapters", "register", "bot", str(assets["a"]), code=1)
    assert "set LORAPLEX_MODEL" in result.stderr


def test_unmigrated_postgres_and_unreachable_database(tmp_path: Path, database: str | None) -> None:
    if database is None:
        env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_DATABASE_URL": f"sqlite:///{tmp_path}/other.db"}
        assert "run `loraplex db upgrade`" in invoke(env, "adapters", "list", code=1).stderr
        return
    with postgres_database() as url:
        env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_DATABASE_URL": url}
        assert "run `loraplex db upgrade`" in invoke(env, "adapters", "list", code=1).stderr
        assert "is at revision" in invoke(env, "db", "upgrade").stdout
        assert json.loads(invoke(env, "adapters", "list", "--json").stdout) == []
    env["LORAPLEX_DATABASE_URL"] = "postgresql+psycopg://postgres@127.0.0.1:1/none"
    assert "registry database" in invoke(env, "adapters", "list", code=1).stderr


def test_console_script_entry_point(tmp_path: Path) -> None:
    """The installed entry point (`api.cli:app`) runs, and an error is one line with no traceback."""
    cmd = [sys.executable, "-c", "from api.cli import app; app()"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LORAPLEX_DATA_DIR": str(tmp_path)}
    help_ = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert (
        help_.returncode == 0
        and "adapters" in help_.stdout
        and "keys" in help_.stdout
        and "db" in help_.stdout
    )
    bad = subprocess.run(
        [*cmd, "adapters", "show", "ghost"], capture_output=True, text=True, env=env, timeout=60
    )
    assert bad.returncode == 1 and bad.stderr.strip() == "error: no adapter named 'ghost'"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--dtype", "foo"), "dtype 'foo' is not supported"),
        (("--lora-dtype", "float8"), "lora_dtype 'float8' is not supported"),
        (("--lora-backend", "gpu"), "lora backend must be one of auto, torch, native, triton"),
        (("--device", "tpu"), "device must be auto, cpu or cuda"),
    ],
)
def test_serve_refuses_bad_engine_options_before_starting(tmp_path: Path, assets, option, message) -> None:
    """A bad engine option is one line on stderr and exit 1, not a traceback from the engine process."""
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(assets["base"])}
    result = CliRunner().invoke(app, ["serve", "--port", "1", *option], env=env)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("option", "limit"), [((), 128), (("--max-seqs-per-client", "300"), 300)])
def test_serve_per_client_share(tmp_path: Path, assets, monkeypatch, option, limit) -> None:
    """`--max-seqs-per-client` reaches the server's settings (default: half of the engine's 256 sequences)."""
    started = []
    monkeypatch.setattr("api.server.serve", lambda settings, **_: started.append(settings))
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(assets["base"])}
    result = CliRunner().invoke(app, ["serve", "--port", "0", *option], env=env)
    assert result.exit_code == 0, result.output
    assert [s.client_seq_limit() for s in started] == [limit]
