"""Registry settings, read from the environment by a factory (never at import time)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOB_STORES = ("local", "database")


@dataclass(slots=True, frozen=True)
class RegistrySettings:
    """Where the registry keeps its data and which services it talks to.

    `database_url` defaults to a SQLite file in `data_dir`; `redis_url` unset means the in-process event
    bus; `model_path` is the base model that registrations are validated against.
    """

    data_dir: Path
    database_url: str
    model_path: Path | None = None
    redis_url: str | None = None
    redis_channel: str = "loraplex:events"
    blob_store: str = "local"  # "local": files under data_dir/blobs; "database": in the registry database
    max_lora_rank: int = 64
    # the serving engine's budget for adapters' side stores (bytes, and bytes per element of its pool):
    # an adapter that could never be resident there is refused at registration (None: not checked)
    lora_side_budget: tuple[int, int] | None = None
    max_upload_bytes: int = 2 * 1024**3
    max_unpacked_bytes: int = 4 * 1024**3
    max_zip_entries: int = 64
    max_zip_ratio: float = 100.0  # unpacked : packed bytes of one zip entry over 1 MiB (zip bombs)
    # Every database call is bounded: connecting (PostgreSQL connect_timeout, also the wait for a pooled
    # connection) and each statement (PostgreSQL statement_timeout; SQLite's busy timeout).
    db_connect_timeout: float = 5.0
    db_statement_timeout: float = 15.0

    @property
    def uses_default_database(self) -> bool:
        """True when the database is the data dir's own SQLite file (safe to upgrade automatically)."""
        return self.database_url == default_database_url(self.data_dir)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RegistrySettings:
        """Settings from `LORAPLEX_DATA_DIR`, `LORAPLEX_DATABASE_URL`, `LORAPLEX_MODEL`, `LORAPLEX_REDIS_URL`,
        `LORAPLEX_MAX_LORA_RANK`, `LORAPLEX_MAX_UPLOAD_BYTES`, `LORAPLEX_BLOB_STORE`,
        `LORAPLEX_DB_CONNECT_TIMEOUT` and `LORAPLEX_DB_STATEMENT_TIMEOUT` (seconds)."""
        env = os.environ if env is None else env
        data_dir = Path(env.get("LORAPLEX_DATA_DIR") or "./data").expanduser().absolute()
        model = env.get("LORAPLEX_MODEL")
        kwargs: dict[str, Any] = {}
        ints = (
            ("LORAPLEX_MAX_LORA_RANK", "max_lora_rank"),
            ("LORAPLEX_MAX_UPLOAD_BYTES", "max_upload_bytes"),
        )
        for key, field in ints:
            if env.get(key):
                try:
                    kwargs[field] = int(env[key])
                except ValueError as exc:
                    raise ValueError(f"{key}: expected an integer, got {env[key]!r}") from exc
        seconds = (
            ("LORAPLEX_DB_CONNECT_TIMEOUT", "db_connect_timeout"),
            ("LORAPLEX_DB_STATEMENT_TIMEOUT", "db_statement_timeout"),
        )
        for key, field in seconds:
            if env.get(key):
                kwargs[field] = _seconds(key, env[key])
        blob_store = env.get("LORAPLEX_BLOB_STORE") or "local"
        if blob_store not in BLOB_STORES:
            raise ValueError(
                f"LORAPLEX_BLOB_STORE: expected one of {', '.join(BLOB_STORES)}, got {blob_store!r}"
            )
        return cls(
            data_dir=data_dir,
            blob_store=blob_store,
            database_url=env.get("LORAPLEX_DATABASE_URL") or default_database_url(data_dir),
            model_path=Path(model).expanduser().absolute() if model else None,
            redis_url=env.get("LORAPLEX_REDIS_URL") or None,
            **kwargs,
        )


def default_database_url(data_dir: Path) -> str:
    """The SQLite file `data_dir/registry.db` as an SQLAlchemy URL."""
    return f"sqlite:///{data_dir / 'registry.db'}"


def _seconds(key: str, text: str) -> float:
    """A positive number of seconds (at most a day) from environment variable `key`."""
    try:
        value = float(text)
    except ValueError as exc:
        raise ValueError(f"{key}: expected a number of seconds, got {text!r}") from exc
    if not 0 < value <= 86400:
        raise ValueError(f"{key}: expected seconds in (0, 86400], got {text!r}")
    return value
