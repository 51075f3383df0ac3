"""Server settings: CLI flags over environment variables over defaults (built by a factory)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from api.usage.settings import UsageSettings
from engine.engine_config import EngineConfig
from lora_registry.settings import RegistrySettings

ACCESS_LEVELS = ("auto", "public", "api_key", "admin")
MAX_SHUTDOWN_GRACE = 3600.0  # seconds; `shutdown_grace_seconds` is in [0, this]


def checkpoint_names(path: Path) -> list[str]:
    """Names the checkpoint goes by: its directory name and the `_name_or_path` in its config.json (the
    Hugging Face id it was saved from), so clients may use either as `model`; a GGUF file's name with
    and without `.gguf`."""
    names = [path.name]
    if path.suffix.lower() == ".gguf":  # a GGUF file: also its name without the suffix
        names.append(path.stem)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return names
    own = cfg.get("_name_or_path") if isinstance(cfg, dict) else None
    if isinstance(own, str) and own and own not in names and len(own) <= 256:
        names.append(own)
    return names


@dataclass(slots=True)
class ServerSettings:
    model: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None  # None: generated at first start, stored hashed in the data dir
    require_api_key: bool = False
    # `serve --api-key` (vLLM's): one static key that may use every model, beside the registry's keys;
    # setting it requires a key for inference.
    api_key: str | None = None
    chat_template: str | None = None  # Jinja text in place of the tokenizer's template (--chat-template)
    max_upload_bytes: int = 512 * 1024**2
    registry_resync_seconds: float = 5.0  # also pick up changes made without the event bus
    # Hostile-input limits (see README "Limits"): request bodies, prompt size, fan-out, fairness.
    max_request_bytes: int = 16 * 1024**2  # JSON body of an inference route (others: 1 MiB)
    max_prompt_chars: int | None = None  # None: 64 characters per token of the model's context
    max_choices_per_request: int = 64  # prompts × n of one request
    max_seqs_per_client: int | None = None  # engine sequences one API key (or client) runs; None: half
    # How long after its arrival a request may wait for its client's share before a 429
    # (LORAPLEX_CLIENT_WAIT_SECONDS).
    client_wait_seconds: float = 30.0
    # Who may read /metrics and /docs + /openapi.json: "public", "api_key" or "admin" ("auto": public
    # when API keys are not required, admin-only when they are). LORAPLEX_METRICS_ACCESS / _DOCS_ACCESS.
    metrics_access: str = "auto"
    docs_access: str = "auto"
    model_aliases: tuple[str, ...] = ()  # other ids of the base model (the checkpoint's own name)
    # Proxies whose X-Forwarded-For / -Proto are believed (comma-separated addresses, "*" for any);
    # None: none, the client is the connection's peer (per-client throttles cannot be dodged by
    # sending the header). LORAPLEX_FORWARDED_ALLOW_IPS.
    forwarded_allow_ips: str | None = None
    # On SIGTERM/SIGINT: requests in flight get this long to finish, then end with a retryable 503
    # (LORAPLEX_SHUTDOWN_GRACE; `serve --shutdown-grace`). See docs/operations.md.
    shutdown_grace_seconds: float = 30.0
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="."))
    registry: RegistrySettings | None = None
    usage: UsageSettings = field(default_factory=UsageSettings)  # accounting + rate limits (README)
    # `/v1/responses` kept in memory for `previous_response_id` and `GET /v1/responses/{id}`: the newest
    # this many, each at most this long (LORAPLEX_RESPONSES_MAX_STORED, LORAPLEX_RESPONSES_MAX_AGE_SECONDS)
    responses_max_stored: int = 1000
    responses_max_age_seconds: float = 3600.0
    responses_max_stored_chars: int = 64 * 1024**2  # of all kept conversations (..._MAX_STORED_CHARS)

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
        registry = _with_side_budget(registry, engine_cfg, path)
        for name in ("metrics_access", "docs_access"):
            value = overrides.get(name) or env.get(f"LORAPLEX_{name.upper()}") or "auto"
            if value not in ACCESS_LEVELS:
                raise ValueError(f"{name} must be one of {', '.join(ACCESS_LEVELS)}, got {value!r}")
            overrides[name] = value
        overrides["shutdown_grace_seconds"] = _grace(overrides.get("shutdown_grace_seconds"), env)
        overrides["client_wait_seconds"] = _client_wait(overrides.get("client_wait_seconds"), env)
        served = overrides.pop("served_model_name", None) or path.name
        if overrides.get("api_key"):
            overrides["require_api_key"] = True
        overrides.setdefault("forwarded_allow_ips", env.get("LORAPLEX_FORWARDED_ALLOW_IPS") or None)
        for name, kind in (
            ("responses_max_stored", int),
            ("responses_max_age_seconds", float),
            ("responses_max_stored_chars", int),
        ):
            raw = env.get(f"LORAPLEX_{name.upper()}")
            if name not in overrides and raw:
                overrides[name] = _non_negative(f"LORAPLEX_{name.upper()}", raw, kind)
        return cls(
            model=path,
            served_model_name=served,
            model_aliases=tuple(n for n in checkpoint_names(path) if n != served),
            admin_token=overrides.pop("admin_token", None) or env.get("LORAPLEX_ADMIN_TOKEN") or None,
            engine=engine_cfg,
            registry=registry,
            usage=overrides.pop("usage", None) or UsageSettings.from_env(env),
            **overrides,
        )

    def uvicorn_proxy_options(self) -> dict[str, object]:
        """uvicorn.Config keywords: trust forwarded headers only from the configured proxies."""
        if not self.forwarded_allow_ips:
            return {"proxy_headers": False}
        return {"proxy_headers": True, "forwarded_allow_ips": self.forwarded_allow_ips}

    def access(self, what: str) -> str:
        """The effective access level of `what` ("metrics" or "docs"): "auto" resolved."""
        level = self.metrics_access if what == "metrics" else self.docs_access
        if level == "auto":
            return "admin" if self.require_api_key else "public"
        return level

    def prompt_char_limit(self, max_model_len: int) -> int:
        """Most characters a prompt may have before it is tokenized."""
        return self.max_prompt_chars or 64 * max_model_len

    def client_seq_limit(self) -> int:
        """Most engine sequences one client may have in flight at once."""
        return self.max_seqs_per_client or max(1, self.engine.max_num_seqs // 2)


def _non_negative(name: str, raw: str, kind: type) -> float:
    """`raw` read as a non-negative `kind` (int or float); ValueError naming the variable otherwise."""
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a non-negative number, got {raw!r}")
    return value


def _grace(given: float | None, env: Mapping[str, str]) -> float:
    """The shutdown grace in seconds: `given`, else LORAPLEX_SHUTDOWN_GRACE, else 30; ValueError outside
    [0, MAX_SHUTDOWN_GRACE]."""
    raw: object = given if given is not None else env.get("LORAPLEX_SHUTDOWN_GRACE") or 30.0
    try:
        value = float(raw)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"shutdown grace must be a number of seconds, got {raw!r}") from None
    if not 0 <= value <= MAX_SHUTDOWN_GRACE:
        raise ValueError(f"shutdown grace must be in [0, {MAX_SHUTDOWN_GRACE:g}] seconds, got {value:g}")
    return value


def _client_wait(given: float | None, env: Mapping[str, str]) -> float:
    """How long a request may wait for its client's share: `given`, else LORAPLEX_CLIENT_WAIT_SECONDS,
    else 30; ValueError outside (0, 3600]."""
    raw: object = given if given is not None else env.get("LORAPLEX_CLIENT_WAIT_SECONDS") or 30.0
    try:
        value = float(raw)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"client wait must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= 3600:
        raise ValueError(f"client wait must be in (0, 3600] seconds, got {value:g}")
    return value


def _with_side_budget(registry: RegistrySettings, engine: EngineConfig, model: Path) -> RegistrySettings:
    """`registry` checking registrations against the engine's side budget (`engine/lora/side_memory.py`),
    when the model's config can be read here (otherwise the engine alone refuses at load)."""
    from engine.lora.side_memory import engine_side_budget
    from engine.model_config import ModelConfig

    try:
        budget = engine_side_budget(engine, ModelConfig.from_dir(model))
    except (OSError, ValueError):
        return registry
    return dataclasses.replace(registry, lora_side_budget=budget)
