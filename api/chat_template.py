"""Turn chat messages into a prompt: the tokenizer's own chat template, or a documented default.

Default template (for checkpoints without one)::

    <|system|>\n{content}\n ... <|user|>\n{content}\n ... <|assistant|>\n

i.e. each message as `<|{role}|>` on its own line followed by its content and a newline, then the
assistant header the model continues from.
"""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text for `messages` ([{"role", "content"}]) ending where the assistant reply starts."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"
