"""Which top-level fields of an OpenAI/vLLM generation request loraplex accepts; the rest are refused.

A field the request model declares is honoured. A field vLLM clients commonly send that changes nothing
here is accepted when it has the value loraplex behaves as (`TOLERATED`: e.g. `skip_special_tokens:
true`, `use_beam_search: false`) or any value when it never affects the output (`IGNORED`: `user`-like
bookkeeping). A null value means "not set" and is accepted for any field. Anything else is a 400 naming
the field, so a client never gets text produced without a setting it asked for.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic_core import PydanticCustomError

# Accepted with any value: bookkeeping that does not change what is generated.
IGNORED: frozenset[str] = frozenset({"store", "metadata", "service_tier", "request_id"})

# Accepted only with the value loraplex behaves as (vLLM's default); another value is refused.
TOLERATED: dict[str, object] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "add_generation_prompt": True,  # chat: the template's assistant turn is always opened
    "continue_final_message": False,
    "echo": False,  # chat (completions implements echo)
}


def check_fields(data: Any, known: frozenset[str]) -> None:
    """Raise a validation error naming the first field of the JSON object `data` that is neither in
    `known` (the model's fields and aliases) nor accepted by the rules above."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        if name in known or value is None or name in IGNORED:
            continue
        if name in TOLERATED:
            want = TOLERATED[name]
            if value == want and type(value) is type(want):
                continue
            raise PydanticCustomError(
                "unsupported_value",
                "loraplex implements only {field}={want}, got {got}",
                {"param": name, "field": name, "want": _json(want), "got": _json(value)},
            )
        raise PydanticCustomError(
            "unknown_field",
            "unknown or unsupported field '{field}': loraplex does not implement it (see the README's "
            "request-fields table)",
            {"param": name, "field": name},
        )


@lru_cache(maxsize=64)
def model_field_names(model: type) -> frozenset[str]:
    """The names and aliases a pydantic model class accepts at the top level."""
    names: set[str] = set()
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return frozenset(names)


def _json(value: object) -> str:
    return "true" if value is True else "false" if value is False else repr(value)[:80]
