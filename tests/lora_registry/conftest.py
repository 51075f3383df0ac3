"""Registry fixtures: a tiny base model, real PEFT adapters, and a registry on SQLite and PostgreSQL."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_registry.db import make_engine
from lora_registry.events import InProcessBus, RegistryEvent
from lora_registry.migrate import upgrade
from lora_registry.models import Base
from lora_registry.registry import Registry, open_registry
from lora_registry.settings import RegistrySettings
from tests.engine.lora.peft_factory import make_adapter, write_base_model
from tests.lora_registry.pg import postgres_database


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("base-model"))


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only PEFT adapters: `a` and `b` differ only in weights; `big` is all-linear with patterns."""
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "a", seed=1)
    make_adapter(root / "b", seed=2)
    make_adapter(root / "big", seed=3, r=8, target_modules="all-linear", rank_pattern={"down_proj": 4})
    return {p.name: p for p in root.iterdir()}


@pytest.fixture
def adapter_copy(adapter_dirs: dict[str, Path], tmp_path: Path):
    """`adapter_copy("a")` → a private, mutable copy of adapter `a`."""

    def copy(name: str) -> Path:
        dst = tmp_path / f"copy-{name}"
        shutil.copytree(adapter_dirs[name], dst)
        return dst

    return copy


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated registry database, one per backend per test session."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'registry.db'}"
        upgrade(url)
        yield url
    else:
        with postgres_database() as url:
            upgrade(url)
            yield url


def wipe(url: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(table.delete())
    finally:
        engine.dispose()


@pytest.fixture
def settings(db_url: str, tmp_path: Path, base_model: Path) -> RegistrySettings:
    return RegistrySettings(data_dir=tmp_path / "data", database_url=db_url, model_path=base_model)


@pytest.fixture
def events() -> list[RegistryEvent]:
    return []


@pytest.fixture
def registry(settings: RegistrySettings, events: list[RegistryEvent]) -> Iterator[Registry]:
    wipe(settings.database_url)
    bus = InProcessBus()
    bus.subscribe(events.append)
    reg = open_registry(settings, bus=bus, auto_upgrade=False)
    try:
        yield reg
    finally:
        reg.close()
