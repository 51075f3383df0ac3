"""Adapters as durable records: database, blob store, validation, events (see docs/architecture.md).

Entry point: `open_registry(RegistrySettings.from_env())` → `Registry` with `.adapters`
(`RegistryService`: register, activate, deactivate, delete, list, show, rollback) and `.keys`
(`KeyService`). Nothing is created at import time.
"""

from lora_registry.errors import (
    BlobCorrupt,
    Conflict,
    InvalidAdapter,
    InvalidName,
    NotFound,
    RegistryError,
    RegistryUnavailable,
)
from lora_registry.events import EventBus, InProcessBus, RegistryEvent
from lora_registry.keys import KeyService
from lora_registry.registry import Registry, open_registry
from lora_registry.schemas import (
    ActiveAdapter,
    AdapterDetail,
    AdapterInfo,
    ApiKeyInfo,
    CreatedKey,
    RegisterResult,
)
from lora_registry.service import RegistryService
from lora_registry.settings import RegistrySettings

__all__ = [
    "ActiveAdapter",
    "AdapterDetail",
    "AdapterInfo",
    "ApiKeyInfo",
    "BlobCorrupt",
    "Conflict",
    "CreatedKey",
    "EventBus",
    "InProcessBus",
    "InvalidAdapter",
    "InvalidName",
    "KeyService",
    "NotFound",
    "RegisterResult",
    "Registry",
    "RegistryError",
    "RegistryEvent",
    "RegistryService",
    "RegistrySettings",
    "RegistryUnavailable",
    "open_registry",
]
