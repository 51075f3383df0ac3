"""The engine's handle on a LoRA adapter: a name for humans and a path to its PEFT files."""

from __future__ import annotations

import re

import msgspec
from msgspec.structs import force_setattr

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class LoRARequest(msgspec.Struct, frozen=True):
    """Ask the engine to apply the PEFT adapter stored at `path` (a directory with `adapter_config.json`
    and `adapter_model.safetensors`). The engine identifies adapters by content digest, not by `name`.

    `digest`, when the caller already knows it (a registry stores adapters content-addressed), spares the
    engine hashing the files; it is still verified when the weights are loaded. Checked on construction
    and on decoding (the engine never trusts the wire): `ValueError` when a field is malformed. An empty
    `path` is left for the server holding the digest to fill in (a cluster replica does).

    vLLM's positional order `LoRARequest(name, int_id, path)` is accepted too: the integer is ignored
    (the engine's identity of an adapter is its content digest, not a number the caller picks). Any
    other shape (a name or path that is not a string) raises `TypeError` saying which forms exist.
    """

    name: str
    path: str
    digest: str | None = None

    def __post_init__(self) -> None:
        if _is_int_id(self.path) and isinstance(self.digest, str) and not _DIGEST.match(self.digest):
            force_setattr(self, "path", self.digest)  # vLLM's (name, int_id, path): the id is ignored
            force_setattr(self, "digest", None)
        if not isinstance(self.name, str) or not isinstance(self.path, str):
            raise TypeError(
                "LoRARequest takes (name: str, path: str) or vLLM's (name: str, int_id: int, path: str); "
                f"got name={type(self.name).__name__}, path={type(self.path).__name__}"
            )
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME_CHARS:
            raise ValueError(f"lora name must be 1..{MAX_NAME_CHARS} characters")
        if not isinstance(self.path, str) or len(self.path) > MAX_PATH_CHARS or "\0" in self.path:
            raise ValueError(f"lora path must be at most {MAX_PATH_CHARS} characters without NUL")
        if self.digest is not None and (not isinstance(self.digest, str) or not _DIGEST.match(self.digest)):
            raise ValueError("lora digest must be 64 lowercase hex characters")


def _is_int_id(value: object) -> bool:
    """Whether `value` is vLLM's `lora_int_id` (an int, not a bool) in the place of the path."""
    return isinstance(value, int) and not isinstance(value, bool)
