"""`loraplex keys …`: create (the key is printed once), list, revoke."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from api.cli.output import CliError, handle_errors, print_json, stderr, stdout
from api.cli.state import state_of

app = typer.Typer(
    help="Manage API keys (stored hashed; scoped to all or to named adapters).", no_args_is_help=True
)


@app.command()
@handle_errors
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="A name for the key.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="Full access: every adapter and admin actions.")
    ] = False,
    adapter: Annotated[
        list[str] | None, typer.Option("--adapter", help="Allow this adapter (repeat for several).")
    ] = None,
) -> None:
    """Create an API key and print it once (it cannot be shown again)."""
    if admin == bool(adapter):
        raise CliError("give either --admin or one or more --adapter NAME")
    created = state_of(ctx).backend().create_key(name, admin, adapter or [])
    stderr().print(
        f"Created key [bold]{name}[/] ({', '.join(created.info.scopes)}). "
        "Store it now; it is not shown again:"
    )
    typer.echo(created.secret)


@app.command("list")
@handle_errors
def list_(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """List API keys (names, prefixes and scopes; never the keys)."""
    keys = state_of(ctx).backend().list_keys()
    if as_json:
        print_json([k.to_dict() for k in keys])
        return
    table = Table("name", "prefix", "scopes", "created", "revoked")
    for k in keys:
        revoked = k.revoked_at.strftime("%Y-%m-%d %H:%M") if k.revoked_at else ""
        table.add_row(k.name, k.prefix, ", ".join(k.scopes), k.created_at.strftime("%Y-%m-%d %H:%M"), revoked)
    stdout().print(table)


@app.command()
@handle_errors
def revoke(ctx: typer.Context, name: str) -> None:
    """Revoke the key NAME; it stops working at once."""
    state_of(ctx).backend().revoke_key(name)
    stdout().print(f"Revoked key [bold]{name}[/]")
