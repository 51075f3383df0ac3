"""Alembic environment: the URL comes from the caller (`lora_registry.migrate`) or from the settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from lora_registry.db import make_engine
from lora_registry.models import Base
from lora_registry.settings import RegistrySettings


def _url() -> str:
    """The URL given by `lora_registry.migrate`, else alembic.ini's `sqlalchemy.url`, else the settings'."""
    cfg = context.config
    return (
        cfg.attributes.get("url")
        or cfg.get_main_option("sqlalchemy.url")
        or RegistrySettings.from_env().database_url
    )


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=Base.metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode rebuilds tables there
        compare_type=True,
        **kwargs,
    )


def run_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection: Connection | None = context.config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url(), statement_timeout=None)  # migrations may run long
    try:
        with engine.connect() as conn:
            _configure(connection=conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
