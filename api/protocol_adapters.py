"""The loraplex `adapters` extension of a request body: a weighted mix of active adapters, each listed
once with a non-zero weight (api/mix.py resolves it; docs/endpoints.md documents it)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, field_validator

from api.protocol_fields import MAX_NAME_CHARS, RequestBody
from engine.lora_request import MAX_MIX_ADAPTERS, MAX_MIX_WEIGHT


class AdapterWeight(RequestBody):
    """One member of a weighted adapter mix (the loraplex `adapters` extension)."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    weight: float = Field(ge=-MAX_MIX_WEIGHT, le=MAX_MIX_WEIGHT, allow_inf_nan=False)

    @field_validator("weight")
    @classmethod
    def _nonzero(cls, v: float) -> float:
        if v == 0.0:
            raise ValueError("must be non-zero (leave the adapter out instead)")
        return v


AdapterMix = Annotated[list[AdapterWeight], Field(min_length=1, max_length=MAX_MIX_ADAPTERS)]


def distinct_adapters(v: list[AdapterWeight] | None) -> list[AdapterWeight] | None:
    """The `adapters` field unchanged, or `ValueError` naming the first adapter that is listed twice."""
    names = [a.name for a in v or []]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"adapter {dup!r} appears twice; list each adapter once with its weight")
    return v
