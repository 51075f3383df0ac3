"""The building blocks every OpenAI-compatible request schema shares: the strict `RequestBody` base,
bounded string and token-id types, the size limits, and `bounded`, a pydantic Field with the range
`engine.sampling_params.BOUNDS` declares for a sampling parameter (the engine's own contract)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import BOUNDS, MAX_STOP_CHARS, MAX_TOKEN_ID

_LOGPROBS_HI = BOUNDS["logprobs"].hi
assert _LOGPROBS_HI is not None
MAX_LOGPROBS = int(_LOGPROBS_HI)
MAX_PROMPTS = 64  # entries of a list `prompt` (prompts × n is bounded again by the server's settings)
MAX_MESSAGES = 1024
MAX_NAME_CHARS = 256
# A generous static cap on any one string; the server's `max_prompt_chars` is the real prompt limit.
MAX_TEXT_CHARS = 16 * 1024 * 1024
OPENAI_MAX_TEMPERATURE = 2.0


def bounded(name: str, default: Any, **extra: Any) -> Any:
    """A pydantic Field with the range `BOUNDS[name]` declares."""
    b = BOUNDS[name]
    lo: dict[str, Any] = {"gt": b.lo} if b.lo_open else {"ge": b.lo}
    return Field(default=default, le=b.hi, **lo, **extra)


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class RequestBody(BaseModel):
    """Base of every request body: JSON types are taken strictly, so `true` is not 1, `"10"` is not 10,
    `1` is not `true` and `2.0` is not the integer 2 (400 naming the field). An integer where a float is
    expected stays valid (`"temperature": 1` is how JSON writes 1.0)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(RequestBody):
    include_usage: bool = False
