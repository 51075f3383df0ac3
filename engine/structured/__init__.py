"""Structured output: grammar-constrained decoding with llguidance (JSON object / schema, regex, Lark).

`StructuredSpec` travels inside `SamplingParams.structured`; `StructuredOutput` (owned by `LLMEngine`)
compiles specs, keeps one matcher per constrained sequence, masks its logits before sampling and
advances it after.
"""

from engine.structured.spec import KINDS, MAX_SPEC_CHARS, StructuredSpec, StructuredSpecError

__all__ = ["KINDS", "MAX_SPEC_CHARS", "StructuredSpec", "StructuredSpecError"]
