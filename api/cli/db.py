"""`loraplex db …`: apply the registry's database migrations."""

from __future__ import annotations

import typer
from sqlalchemy.engine import make_url

from api.cli.output import CliError, handle_errors, stdout
from api.cli.state import state_of

app = typer.Typer(help="Registry database.", no_args_is_help=True)


@app.command("upgrade")
@handle_errors
def upgrade_cmd(ctx: typer.Context) -> None:
    """Migrate the registry database to the newest schema.

    The database is LORAPLEX_DATABASE_URL, by default the SQLite file in the data dir.
    """
    from lora_registry.db import make_engine  # lazy: alembic is slow to import
    from lora_registry.errors import first_line
    from lora_registry.migrate import current_revision, upgrade

    url = state_of(ctx).settings().database_url
    shown = make_url(url).render_as_string(hide_password=True)
    try:
        upgrade(url)
        engine = make_engine(url)
        try:
            rev = current_revision(engine)
        finally:
            engine.dispose()
    except Exception as exc:
        raise CliError(f"cannot migrate {shown}: {first_line(exc)}") from exc
    stdout().print(f"Database {shown} is at revision {rev}")
