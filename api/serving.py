"""The parts every generation route shares: resolve the model (`api/targets.py`), bound and tokenize
prompts and map the body to `SamplingParams` (`api/prompt_bounds.py`), run under the client's fair share
and map engine failures to API errors (`api/request_run.py`); and the OpenAI answer's `usage` and
`finish_reason`. The routes import all of these from here."""

from __future__ import annotations

from typing import Any

from api.generation import Generation
from api.prompt_bounds import (
    check_choices,
    check_context,
    check_prompt_chars,
    sampling_params,
    tokenize_prompts,
)
from api.request_run import ClientDisconnected, RequestRun
from api.targets import (
    Target,
    adapter_target,
    is_base_model,
    model_not_found,
    registry_unavailable,
    resolve_target,
)

__all__ = [
    "ClientDisconnected",
    "RequestRun",
    "Target",
    "adapter_target",
    "check_choices",
    "check_context",
    "check_prompt_chars",
    "finish_reason",
    "is_base_model",
    "model_not_found",
    "registry_unavailable",
    "resolve_target",
    "sampling_params",
    "tokenize_prompts",
    "usage",
]


def usage(gen: Generation, num_prompt_tokens: int) -> dict[str, Any]:
    """OpenAI `usage`: completion tokens count every generated token (best_of candidates too, as OpenAI
    bills them)."""
    completion = gen.num_generated_tokens
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's `finish_reason` of an engine finish reason: "length", "stop" (any other end) or None."""
    return "length" if reason == "length" else ("stop" if reason is not None else None)
