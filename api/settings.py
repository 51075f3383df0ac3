"""Server settings: CLI flags over environment variables over defaults (built by a factory)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.engine_config import EngineConfig
from lora_registry.settings import RegistrySettings


@dataclass(slots=True)
class ServerSettings:
    model: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None  # None: generated at first start, stored hashed in the data dir
    require_api_key: bool = False
    max_upload_bytes: int = 512 * 1024**2
    registry_resync_seconds: float = 5.0  # also pick up changes made without the event bus
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="."))
    registry: RegistrySettings | None = None

    @classmethod
    def build(
        cls,
        model: str | None = None,
        env: Mapping[str, str] | None = None,
        **overrides,
    ) -> ServerSettings:
        """Settings from `LORAPLEX_*` variables, with explicit arguments taking precedence."""
        env = os.environ if env is None else env
        model = model or env.get("LORAPLEX_MODEL")
        if not model:
            raise ValueError("no base model: pass --model PATH or set LORAPLEX_MODEL")
        path = Path(model).expanduser().absolute()
        reg_env = dict(env) | {"LORAPLEX_MODEL": str(path)}
        registry = RegistrySettings.from_env(reg_env)
        engine_kw = overrides.pop("engine_kwargs", {}) or {}
        engine_cfg = EngineConfig(model=str(path), **engine_kw)
        engine_cfg.check_choices()
        return cls(
            model=path,
            served_model_name=overrides.pop("served_model_name", None) or path.name,
            admin_token=overrides.pop("admin_token", None) or env.get("LORAPLEX_ADMIN_TOKEN") or None,
            engine=engine_cfg,
            registry=registry,
            **overrides,
        )
