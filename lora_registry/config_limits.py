"""Bounds on `adapter_config.json`, checked before the adapter reader parses it: size, nesting, and the
type and size of every field. A config outside them is refused (`InvalidAdapter`, 422) naming the field.

Known PEFT fields get their own type and size; any other field (PEFT adds new ones over time) is
accepted if it is small: strings up to `MAX_STRING` characters, lists up to `MAX_ITEMS` items, objects
up to `MAX_KEYS` keys, nested at most `MAX_DEPTH` deep. User regexes (`target_modules`,
`exclude_modules`, `rank_pattern`/`alpha_pattern` keys) must be in the restricted language of
`lora_registry.safe_regex`, so no pattern can stall the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lora_registry.errors import InvalidAdapter
from lora_registry.safe_regex import UnsafePattern, check_pattern

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 256 * 1024
MAX_DEPTH = 8
MAX_STRING = 1024
MAX_ITEMS = 1024
MAX_KEYS = 1024
MAX_NAME = 512  # base_model_name_or_path (the registry stores it in a 512-character column)
MAX_MODULE_NAME = 256
MAX_PATTERN_KEYS_WITH_QUANTIFIERS = 16


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and abs(v) < 1e12


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "null" if v is None else "a number"
    )


def _fail(field: str, message: str) -> InvalidAdapter:
    return InvalidAdapter(f"{CONFIG_FILE}: field {field!r}: {message}")


def _string(field: str, v: Any, limit: int = MAX_STRING, nullable: bool = True) -> None:
    if v is None and nullable:
        return
    if not isinstance(v, str):
        raise _fail(field, f"expected a string{' or null' if nullable else ''}, got {_kind(v)}")
    if len(v) > limit:
        raise _fail(field, f"{len(v)} characters (at most {limit})")


def _pattern(field: str, v: str) -> None:
    try:
        check_pattern(v)
    except UnsafePattern as exc:
        raise _fail(field, f"pattern {v[:80]!r} refused: {exc}") from exc


def _modules(field: str, v: Any) -> None:
    """A list of module names, a regex (restricted), "all-linear", or null."""
    if v is None or v == "all-linear":
        return
    if isinstance(v, str):
        _pattern(field, v)
        return
    if not isinstance(v, list):
        raise _fail(field, f"expected a list of module names, a regex or null, got {_kind(v)}")
    if len(v) > MAX_ITEMS:
        raise _fail(field, f"{len(v)} entries (at most {MAX_ITEMS})")
    for i, name in enumerate(v):
        _string(f"{field}[{i}]", name, MAX_MODULE_NAME, nullable=False)


def _patterns(field: str, v: Any) -> None:
    """An object {module regex: number}."""
    if v is None:
        return
    if not isinstance(v, dict):
        raise _fail(field, f"expected an object, got {_kind(v)}")
    if len(v) > MAX_KEYS:
        raise _fail(field, f"{len(v)} entries (at most {MAX_KEYS})")
    with_quantifiers = 0
    for key, value in v.items():
        if len(key) > MAX_MODULE_NAME:
            raise _fail(field, f"key of {len(key)} characters (at most {MAX_MODULE_NAME})")
        _pattern(f"{field}[{key[:40]!r}]", key)
        with_quantifiers += any(c in key for c in "*+?{")
        if not _is_number(value):
            raise _fail(f"{field}[{key[:40]!r}]", f"expected a number, got {_kind(value)}")
    if with_quantifiers > MAX_PATTERN_KEYS_WITH_QUANTIFIERS:
        raise _fail(
            field, f"{with_quantifiers} keys with quantifiers (at most {MAX_PATTERN_KEYS_WITH_QUANTIFIERS})"
        )


def _layers(field: str, v: Any) -> None:
    if v is None or _is_int(v):
        return
    if not isinstance(v, list) or len(v) > MAX_ITEMS or not all(_is_int(x) for x in v):
        raise _fail(field, f"expected an integer or a list of at most {MAX_ITEMS} integers")


def _number(field: str, v: Any) -> None:
    if v is not None and not _is_number(v):
        raise _fail(field, f"expected a number, got {_kind(v)}")


def _boolean(field: str, v: Any) -> None:
    if v is not None and not isinstance(v, bool):
        raise _fail(field, f"expected true or false, got {_kind(v)}")


def _bool_or_string(field: str, v: Any) -> None:
    if not isinstance(v, bool):
        _string(field, v, 64)


KNOWN: dict[str, Callable[[str, Any], None]] = {
    "base_model_name_or_path": lambda f, v: _string(f, v, MAX_NAME),
    "revision": lambda f, v: _string(f, v, 128),
    "peft_type": lambda f, v: _string(f, v, 64),
    "task_type": lambda f, v: _string(f, v, 64),
    "bias": lambda f, v: _string(f, v, 64),
    "r": _number,
    "lora_alpha": _number,
    "lora_dropout": _number,
    "target_modules": _modules,
    "exclude_modules": _modules,
    "rank_pattern": _patterns,
    "alpha_pattern": _patterns,
    "layers_to_transform": _layers,
    "layers_pattern": lambda f, v: _modules(f, v) if isinstance(v, list) else _string(f, v, MAX_MODULE_NAME),
    "use_rslora": _boolean,
    "use_dora": _boolean,
    "lora_bias": _boolean,
    "fan_in_fan_out": _boolean,
    "inference_mode": _boolean,
    "init_lora_weights": _bool_or_string,
}


def check_config_file(path: Path) -> dict[str, Any]:
    """The parsed config at `path` if it is within every bound, else `InvalidAdapter` naming what is not."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise InvalidAdapter(
            f"{CONFIG_FILE}: {size} bytes (at most {MAX_CONFIG_BYTES}); a config holds small fields only"
        )
    try:
        config = json.loads(path.read_bytes())
    except RecursionError:
        raise InvalidAdapter(f"{CONFIG_FILE}: nested more than {MAX_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidAdapter(f"{CONFIG_FILE}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{CONFIG_FILE}: expected a JSON object, got {_kind(config)}")
    check_config(config)
    return config


def check_config(config: dict[str, Any]) -> None:
    """Check every field of a parsed config (see the module docstring)."""
    if len(config) > MAX_KEYS:
        raise InvalidAdapter(f"{CONFIG_FILE}: {len(config)} fields (at most {MAX_KEYS})")
    for field, value in config.items():
        _generic(field, value)
        check = KNOWN.get(field)
        if check is not None:
            check(field, value)


def _generic(field: str, value: Any) -> None:
    """Size and nesting bounds for any field, walked without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _fail(field, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(v, str):
            if len(v) > max(MAX_STRING, MAX_NAME):
                raise _fail(field, f"a string of {len(v)} characters (at most {MAX_STRING})")
        elif isinstance(v, list):
            if len(v) > MAX_ITEMS:
                raise _fail(field, f"a list of {len(v)} items (at most {MAX_ITEMS})")
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            if len(v) > MAX_KEYS:
                raise _fail(field, f"an object of {len(v)} keys (at most {MAX_KEYS})")
            for k, x in v.items():
                if len(k) > MAX_STRING:
                    raise _fail(field, f"a key of {len(k)} characters (at most {MAX_STRING})")
                stack.append((x, depth + 1))
