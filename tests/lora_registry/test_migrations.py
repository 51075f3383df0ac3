"""Alembic migrations: upgrade/downgrade on empty SQLite and PostgreSQL; models match the migrations."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from lora_registry.db import make_engine
from lora_registry.errors import RegistryUnavailable
from lora_registry.migrate import current_revision, downgrade, head_revision, upgrade
from lora_registry.models import Base
from lora_registry.registry import open_registry
from lora_registry.settings import RegistrySettings
from tests.lora_registry.pg import postgres_database

TABLES = {
    "adapters",
    "adapter_versions",
    "api_keys",
    "audit_log",
    "registry_meta",
    "blobs",
    "blob_chunks",
    "usage_records",
    "rate_limits",
    "event_outbox",
    "admin_sessions",
}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        with postgres_database() as url:
            yield url


def test_upgrade_matches_models_and_downgrade_drops_everything(empty_db: str) -> None:
    engine = make_engine(empty_db)
    try:
        assert current_revision(engine) is None
        upgrade(empty_db)
        assert current_revision(engine) == head_revision() is not None
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == [], f"models and migrations differ: {diff}"
        downgrade(empty_db, "base")
        assert set(inspect(engine).get_table_names()) & TABLES == set()
        upgrade(empty_db)  # and back up again
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()


def test_default_sqlite_is_upgraded_automatically_other_urls_are_not(tmp_path: Path) -> None:
    settings = RegistrySettings.from_env({"LORAPLEX_DATA_DIR": str(tmp_path / "data")})
    assert settings.uses_default_database and settings.database_url.endswith("data/registry.db")
    reg = open_registry(settings)
    try:
        assert reg.adapters.list() == []
    finally:
        reg.close()
    other = RegistrySettings.from_env(
        {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"}
    )
    with pytest.raises(RegistryUnavailable, match="run `loraplex db upgrade`"):
        open_registry(other)
