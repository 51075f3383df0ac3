"""What `loraplex serve` does with the flags of `vllm serve` that are not engine settings.

`--lora-modules` takes vLLM's forms: `name=path` or the JSON `{"name": ..., "path": ...}`, several after
one flag (`--lora-modules a=/p b=/q`) or the flag repeated. `--chat-template` is a file or the template
itself. `--tool-call-parser` names how tool calls are read from the model's text: loraplex reads one
form (see `api.tool_calls`), so only the names of that form are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.core import TyperCommand

LORA_MODULES_FLAG = "--lora-modules"
# The parsers whose format is the one loraplex reads: a whole reply that is the JSON object
# {"name": ..., "arguments": {...}} (any chat template), and forced calls constrained to it.
TOOL_CALL_PARSERS = ("json",)
MAX_TEMPLATE_CHARS = 1 << 20


class LoraModuleError(ValueError):
    """A `--lora-modules` adapter the registry refused (the message names the module)."""


class ServeCommand(TyperCommand):
    """`serve`, reading vLLM's variadic `--lora-modules a=/p b=/q` as `--lora-modules` repeated."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: click's Context
        return super().parse_args(ctx, expand_lora_modules(args))


def expand_lora_modules(args: Sequence[str]) -> list[str]:
    """`args` with each module after a `--lora-modules` (until the next option, or a word that is neither
    `name=path` nor JSON, such as the positional model) given its own `--lora-modules`."""
    out: list[str] = []
    taking = False
    for arg in args:
        if arg == "--":
            taking = False
        elif arg == LORA_MODULES_FLAG:
            taking = True
            out.append(arg)
            continue
        elif taking and not arg.startswith("-") and ("=" in arg or arg.lstrip().startswith("{")):
            if out[-1] != LORA_MODULES_FLAG:
                out.append(LORA_MODULES_FLAG)
        else:
            taking = False
        out.append(arg)
    return out


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: Path


def parse_lora_module(text: str) -> LoraModule:
    """One `--lora-modules` value: `name=path` or `{"name": ..., "path": ...}`; ValueError saying which
    forms exist for anything else."""
    forms = 'expected name=path or {"name": "...", "path": "..."}'
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {text!r}: not JSON ({exc}); {forms}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError(f"--lora-modules {text!r}: {forms}")
        name, path = value["name"], value.get("path")
        if not isinstance(path, str):
            raise ValueError(f"--lora-modules {text!r}: {forms}")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: {forms}")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora-modules {text!r}: {forms}")
    return LoraModule(name, Path(path).expanduser())


def parse_lora_modules(values: Sequence[str]) -> list[LoraModule]:
    """Every module given, each name once (ValueError for a name given twice)."""
    modules = [parse_lora_module(v) for v in values]
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(twice)} more than once")
    return modules


def read_chat_template(value: str) -> str:
    """The Jinja template `--chat-template` gives: the file's text when `value` names a file (vLLM's
    rule), else `value` itself when it looks like a template; ValueError otherwise."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            if path.stat().st_size > MAX_TEMPLATE_CHARS:
                raise ValueError(f"--chat-template {value}: larger than {MAX_TEMPLATE_CHARS} bytes")
            return path.read_text()
    except OSError as exc:  # a name too long for the file system is a template, not a file
        if "{" not in value:
            raise ValueError(f"--chat-template {value}: cannot read it ({exc.strerror})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")


def check_tool_call_parser(value: str) -> str:
    """`value` when loraplex reads tool calls the way that parser does; ValueError naming the ones it
    accepts otherwise."""
    if value in TOOL_CALL_PARSERS:
        return value
    raise ValueError(
        f"--tool-call-parser {value}: not supported; loraplex reads a tool call written as the JSON object "
        '{"name": ..., "arguments": {...}} (and constrains forced calls to it), which is parser '
        f"{' or '.join(TOOL_CALL_PARSERS)}"
    )


def register_lora_modules(registry_settings, modules: Sequence[LoraModule]) -> list[str]:
    """Register each module in the registry (a new version when its content is new) and activate it, so
    the server serves it under its name; lines describing what was done. Raises `LoraModuleError`
    (naming the module) for an adapter the registry refuses."""
    from lora_registry.errors import RegistryError
    from lora_registry.registry import open_registry  # lazy: alembic is slow to import

    lines: list[str] = []
    registry = open_registry(registry_settings)
    try:
        for m in modules:
            try:
                result = registry.adapters.register(
                    m.name, m.path, activate=True, actor="cli:serve --lora-modules"
                )
            except RegistryError as exc:
                raise LoraModuleError(f"--lora-modules {m.name}={m.path}: {exc}") from exc
            v = result.version
            state = "registered" if result.created else "already registered"
            lines.append(f"{m.name}: {state} as version {v.version} (digest {v.digest[:12]}), active")
    finally:
        registry.close()
    return lines
