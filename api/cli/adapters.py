"""`loraplex adapters …`: register, list, show, activate, deactivate, delete, rollback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Column, Table

from api.cli.output import CliError, RichProgress, handle_errors, print_json, stderr, stdout
from api.cli.state import state_of
from lora_registry.schemas import AdapterInfo, VersionInfo

app = typer.Typer(help="Register and manage LoRA adapters.", no_args_is_help=True)


def _element_bytes(dtype: str) -> int:
    """Bytes per element of the pool dtype `dtype` (CliError for another name)."""
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    if dtype not in sizes:
        raise CliError(f"--lora-dtype: expected one of {', '.join(sizes)}, got {dtype!r}")
    return sizes[dtype]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _version_line(v: VersionInfo) -> str:
    targets = ",".join(v.target_modules)
    return f"version {v.version} (digest {v.digest[:12]}, rank {v.rank}, alpha {v.alpha:g}, {targets})"


def _status(info: AdapterInfo) -> str:
    return "[green]active[/]" if info.is_active else "[dim]inactive[/]"


@app.command()
@handle_errors
def register(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Adapter name (a-z, 0-9, '.', '_', '-').")],
    path: Annotated[Path, typer.Argument(help="PEFT adapter directory, or a zip of one.")],
    description: Annotated[str | None, typer.Option(help="What this adapter is for.")] = None,
    activate: Annotated[bool, typer.Option("--activate", help="Serve it right away.")] = False,
    lora_side_memory_bytes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="The serving engine's lora_side_memory_bytes (as given to `loraplex serve`): refuse an "
            "adapter whose side stores (modules_to_save copies, token rows, embedding/LM-head LoRA, DoRA "
            "vectors) exceed it, as the server's registration does. Local registry only.",
        ),
    ] = None,
    lora_dtype: Annotated[
        str,
        typer.Option(help="The serving engine's adapter pool dtype, for --lora-side-memory-bytes."),
    ] = "float32",
) -> None:
    """Validate an adapter against the base model (LORAPLEX_MODEL) and store it as a new version.

    A server checks an adapter's side stores against its engine's budget at registration; a local
    registration cannot know that budget (it comes from the flags of whichever `loraplex serve` uses the
    registry, not from settings), so it checks it only when given --lora-side-memory-bytes; otherwise the
    engine refuses an oversized adapter when it loads it, with both numbers."""
    state = state_of(ctx)
    if lora_side_memory_bytes is not None:
        if state.server:
            raise CliError("--lora-side-memory-bytes is for a local registry; a server checks its own budget")
        state.side_budget = (lora_side_memory_bytes, _element_bytes(lora_dtype))
    backend = state.backend()
    with RichProgress(enabled=sys.stderr.isatty()) as progress:
        result = backend.register(name, path, description, activate, progress)
    out = stdout()
    if result.created:
        out.print(f"Registered [bold]{name}[/] {_version_line(result.version)}; {_status(result.adapter)}")
    else:
        out.print(
            f"[bold]{name}[/]: identical content is already version {result.version.version}; "
            f"nothing new stored ({_status(result.adapter)})"
        )


@app.command("list")
@handle_errors
def list_(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """List registered adapters."""
    infos = state_of(ctx).backend().list()
    if as_json:
        print_json([i.to_dict() for i in infos])
        return
    if not infos:
        stdout().print("No adapters registered yet. Add one with `loraplex adapters register NAME PATH`.")
        return
    table = Table("status", "version", "rank", "targets", "size", "digest", "updated")
    table.columns.insert(0, Column("name", no_wrap=True))
    for i in infos:
        cur = i.current
        table.add_row(
            i.name,
            _status(i),
            f"{cur.version}/{i.num_versions}" if cur else "-",
            str(cur.rank) if cur else "-",
            ",".join(cur.target_modules) if cur else "-",
            _size(cur.size_bytes) if cur else "-",
            cur.digest[:12] if cur else "-",
            i.updated_at.strftime("%Y-%m-%d %H:%M"),
        )
    stdout().print(table)


@app.command()
@handle_errors
def show(
    ctx: typer.Context,
    name: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one adapter and all its versions."""
    detail = state_of(ctx).backend().show(name)
    if as_json:
        print_json(detail.to_dict())
        return
    a, out = detail.adapter, stdout()
    out.print(f"[bold]{a.name}[/]  {_status(a)}  {a.description}")
    table = Table("", "version", "digest", "rank", "alpha", "rsLoRA", "targets", "size", "source", "created")
    for v in detail.versions:
        current = a.current is not None and v.version == a.current.version
        table.add_row(
            "→" if current else "",
            str(v.version),
            v.digest[:16],
            str(v.rank),
            f"{v.alpha:g}",
            "yes" if v.use_rslora else "no",
            ",".join(v.target_modules),
            _size(v.size_bytes),
            v.source,
            v.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    out.print(table)


@app.command()
@handle_errors
def activate(ctx: typer.Context, name: str) -> None:
    """Serve NAME (its current version)."""
    info = state_of(ctx).backend().activate(name)
    stdout().print(
        f"[bold]{name}[/] is {_status(info)} (version {info.current.version if info.current else '-'})"
    )


@app.command()
@handle_errors
def deactivate(ctx: typer.Context, name: str) -> None:
    """Stop serving NAME; its versions stay registered."""
    info = state_of(ctx).backend().deactivate(name)
    stdout().print(f"[bold]{name}[/] is {_status(info)}")


@app.command()
@handle_errors
def rollback(ctx: typer.Context, name: str, version: int) -> None:
    """Point NAME at an earlier VERSION."""
    info = state_of(ctx).backend().rollback(name, version)
    assert info.current is not None
    stdout().print(f"[bold]{name}[/] now points at {_version_line(info.current)}; {_status(info)}")


@app.command()
@handle_errors
def delete(
    ctx: typer.Context,
    name: str,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete NAME with all its versions and their weight files."""
    backend = state_of(ctx).backend()
    if not yes:
        detail = backend.show(name)
        n = len(detail.versions)
        if not typer.confirm(f"Delete adapter {name!r} and its {n} version(s)?", err=True):
            stderr().print("aborted; nothing deleted")
            raise typer.Exit(1)
    backend.delete(name)
    stdout().print(f"Deleted [bold]{name}[/]")
