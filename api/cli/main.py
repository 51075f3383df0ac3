"""The root `loraplex` command: global options and the sub-command groups.

`bench` runs the benchmarks in `bench/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from api.cli import adapters, bench, db, keys, limits
from api.cli.serve import serve
from api.cli.state import CliState
from api.cli.usage import usage
from api.cli.vllm_flags import ServeCommand

app = typer.Typer(
    name="loraplex",
    help=(
        "Serve many LoRA fine-tunes from one base model. Registry commands work on the local data dir, "
        "or on a running server with --server URL --token T."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(adapters.app, name="adapters")
app.add_typer(keys.app, name="keys")
app.add_typer(db.app, name="db")
app.add_typer(bench.app, name="bench")
app.command("serve", cls=ServeCommand)(serve)
app.command("usage")(usage)
adapters.app.command("limit")(limits.adapter_limit)
keys.app.command("limit")(limits.key_limit)


@app.callback()
def main(
    ctx: typer.Context,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", envvar="LORAPLEX_DATA_DIR", help="Registry data directory.")
    ] = None,
    server: Annotated[
        str | None,
        typer.Option("--server", envvar="LORAPLEX_SERVER", help="URL of a running server to drive."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=["LORAPLEX_TOKEN", "LORAPLEX_ADMIN_TOKEN"],
            help="Admin token for --server (LORAPLEX_TOKEN, else LORAPLEX_ADMIN_TOKEN, the server's own).",
        ),
    ] = None,
) -> None:
    """loraplex: many LoRA fine-tunes, one resident base model."""
    state = CliState(data_dir, server, token)
    ctx.obj = state
    ctx.call_on_close(state.close)
