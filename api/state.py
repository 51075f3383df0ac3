"""`AppState`: what the server's lifespan creates and every route uses (reached through `api.deps`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from api.admission import ClientAdmission
from api.auth_throttle import AuthThrottle
from api.engine_client import EngineClient
from api.engine_protocol import Ready
from api.metrics import Metrics
from api.registry_lane import RegistryLane
from api.settings import ServerSettings
from api.traffic import TrafficLog
from lora_registry.follower import RegistryFollower
from lora_registry.key_cache import KeyCache
from lora_registry.registry import Registry

if TYPE_CHECKING:  # api.auth imports `app_state` from this module
    from api.auth import AdminAuth
    from api.schema_check import SchemaChecker
    from api.usage.service import UsageLimits


@dataclass(slots=True)
class AppState:
    settings: ServerSettings
    client: EngineClient
    tokenizer: Any
    registry: Registry
    follower: RegistryFollower
    admin_auth: AdminAuth
    admission: ClientAdmission
    key_cache: KeyCache  # API keys checked from memory (kept current like the follower's active set)
    # Blocking registry calls: request-path lookups (bounded wait, own threads) and admin changes.
    lookups: RegistryLane = field(default_factory=lambda: RegistryLane("lookup", threads=8, timeout=6.0))
    admin_calls: RegistryLane = field(default_factory=lambda: RegistryLane("admin", threads=4, timeout=None))
    auth_throttle: AuthThrottle = field(default_factory=AuthThrottle)  # admin-token guessing, per client
    metrics: Metrics = field(default_factory=Metrics)
    traffic: TrafficLog = field(default_factory=TrafficLog)
    started_at: float = field(default_factory=time.time)
    usage: UsageLimits | None = None  # usage accounting + rate limits (set by the lifespan)
    schemas: SchemaChecker | None = None  # compiles requests' schemas (made on first use)

    def __post_init__(self) -> None:
        self.metrics.name_model(self.settings.served_model_name)

    def engine_info(self) -> Ready:
        assert self.client.info is not None
        return self.client.info


def app_state(request: Request) -> AppState:
    """The server's state (set by the lifespan before the first request); routes ask for it as
    `api.deps.StateDep`."""
    return request.app.state.loraplex
