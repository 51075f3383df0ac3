"""The engine's handle on a LoRA adapter: a name for humans and a path to its PEFT files, or a weighted
mix of several such adapters."""

from __future__ import annotations

import math
import re

import msgspec
from msgspec.structs import force_setattr

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_MIX_ADAPTERS = 8  # members of one weighted mix (the engine's max_loras may bound it lower)
MAX_MIX_WEIGHT = 100.0  # |weight| of a mix member


class LoRARequest(msgspec.Struct, frozen=True, repr_omit_defaults=True, omit_defaults=True):
    """Ask the engine to apply the PEFT adapter stored at `path` (a directory with `adapter_config.json`
    and `adapter_model.safetensors`). The engine identifies adapters by content digest, not by `name`.

    `digest`, when the caller already knows it (a registry stores adapters content-addressed), spares the
    engine hashing the files; it is still verified when the weights are loaded. Checked on construction
    and on decoding (the engine never trusts the wire): `ValueError` when a field is malformed. An empty
    `path` is left for the server holding the digest to fill in (a cluster replica does).

    vLLM's positional order `LoRARequest(name, int_id, path)` is accepted too: the integer is ignored
    (the engine's identity of an adapter is its content digest, not a number the caller picks). Any
    other shape (a name or path that is not a string) raises `TypeError` saying which forms exist.

    A **weighted mix** (`LoRARequest.weighted([(a, 0.7), (b, 0.3)])`, or `mix=` with an empty `path`)
    applies several adapters at once: every token's delta on a projection is `Σ_i w_i · s_i · B_i A_i x`,
    PEFT's `add_weighted_adapter(..., combination_type="cat")` computed without merging
    (`engine/lora/mix.py`). Members are plain adapters (not mixes) with distinct names, 1 to
    `MAX_MIX_ADAPTERS` of them, weights finite, non-zero and at most `MAX_MIX_WEIGHT` in magnitude.
    """

    name: str
    path: str
    digest: str | None = None
    mix: tuple[tuple[LoRARequest, float], ...] = ()

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
        if self.mix:
            force_setattr(self, "mix", _checked_mix(self.mix, self.path, self.digest))

    @classmethod
    def weighted(cls, members: list[tuple[LoRARequest, float]], name: str | None = None) -> LoRARequest:
        """A weighted mix of `members` ((adapter, weight) pairs); `name` defaults to `a*0.7+b*0.3`."""
        if not members:
            raise ValueError(f"a weighted mix takes 1 to {MAX_MIX_ADAPTERS} adapters, got 0")
        if name is None:
            name = "+".join(f"{lr.name}*{w:g}" for lr, w in members)[:MAX_NAME_CHARS] or "mix"
        return cls(name, "", None, tuple((lr, w) for lr, w in members))

    @property
    def is_mix(self) -> bool:
        return bool(self.mix)

    def members(self) -> tuple[tuple[LoRARequest, float], ...]:
        """The adapters this request applies with their weights: the mix, or the adapter itself at 1."""
        return self.mix or ((self, 1.0),)


def _checked_mix(mix: object, path: str, digest: str | None) -> tuple[tuple[LoRARequest, float], ...]:
    """`mix` as a tuple of (LoRARequest, float), or ValueError / TypeError naming what is wrong."""
    if path or digest is not None:
        raise ValueError("a weighted mix has no path or digest of its own (its members have them)")
    if not isinstance(mix, tuple | list):
        raise TypeError("lora mix must be a sequence of (LoRARequest, weight) pairs")
    if not 0 < len(mix) <= MAX_MIX_ADAPTERS:
        raise ValueError(f"a weighted mix takes 1 to {MAX_MIX_ADAPTERS} adapters, got {len(mix)}")
    out: list[tuple[LoRARequest, float]] = []
    for pair in mix:
        if not isinstance(pair, tuple | list) or len(pair) != 2 or not isinstance(pair[0], LoRARequest):
            raise TypeError("lora mix must be a sequence of (LoRARequest, weight) pairs")
        lr, weight = pair
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise TypeError(f"the weight of adapter {lr.name!r} in the mix must be a number")
        weight = float(weight)
        if lr.mix:
            raise ValueError(f"adapter {lr.name!r} in a mix is itself a mix; mixes do not nest")
        if not math.isfinite(weight) or weight == 0.0 or abs(weight) > MAX_MIX_WEIGHT:
            raise ValueError(
                f"the weight of adapter {lr.name!r} in the mix must be finite, non-zero and at most "
                f"{MAX_MIX_WEIGHT:g} in magnitude; got {weight}"
            )
        if any(o.name == lr.name for o, _ in out):
            raise ValueError(f"adapter {lr.name!r} appears twice in the mix")
        out.append((lr, weight))
    return tuple(out)


def _is_int_id(value: object) -> bool:
    """Whether `value` is vLLM's `lora_int_id` (an int, not a bool) in the place of the path."""
    return isinstance(value, int) and not isinstance(value, bool)
