"""Turn chat messages into a prompt: the tokenizer's own chat template, or a documented default.

Default template (for checkpoints without one)::

    <|system|>\n{content}\n ... <|user|>\n{content}\n ... <|assistant|>\n

i.e. each message as `<|{role}|>` on its own line followed by its content and a newline, then the
assistant header the model continues from. With tools, a `<|tools|>` message listing their definitions
(JSON) comes first, and an assistant turn's tool calls follow its content, one
`{"name": ..., "arguments": {...}}` per line (the shape the model is asked to write; see
`api.tool_calls`); tool results are `<|tool|>` messages.
"""

from __future__ import annotations

import json
from typing import Any


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for `messages` ([{"role", "content", optional "tool_calls"}]) and the tool
    definitions `tools`, ending where the assistant reply starts (without that header when
    `add_generation_prompt` is false, as `/tokenize` may ask)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        kwargs = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    parts = [f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
    for m in messages:
        text = m.get("content") or ""
        calls = [_call_text(c["function"]) for c in m.get("tool_calls") or []]
        parts.append(f"<|{m['role']}|>\n" + "\n".join([text, *calls] if text else calls) + "\n")
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


def _call_text(function: dict[str, Any]) -> str:
    return json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
