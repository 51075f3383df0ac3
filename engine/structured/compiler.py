"""Grammar compilation with llguidance: spec text -> grammar -> a template matcher per spec (cached).

llguidance compiles lazily (an Earley parser over a lexer built on demand): a large schema takes up to
about a second, and its first masks may fail where compiling did not, so a new template is dry-run by
`engine.structured.probe` before it is cached. Compiling is thread-safe and runs off the engine's step
loop (`StructuredOutput.compile_later`) and off the API's event loop (`api.schema_check`). Wrapping the
tokenizer (about a second for a 128k vocabulary) is done once. Each sequence gets a `deep_copy` of the
spec's template matcher. JSON is emitted with fixed separators (`", "`, `": "`) and no free whitespace, so
the output cannot grow by whitespace alone and a tool call's text has a fixed shape.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf

from engine.structured.probe import probe
from engine.structured.spec import StructuredSpec, StructuredSpecError
from engine.tokenizer import token_bytes

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHE_SIZE = 256  # compiled specs kept (LRU)
# A fifth of llguidance's default lexer fuel: a regex such as `x{60000}` then fails its dry run (400)
# instead of costing ~150 ms of every decoding step of the batch it joins. No parser-state dumps in errors.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for `spec` (not yet checked)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec.spec), overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    return llguidance.LLMatcher.grammar_from_lark(spec.spec)


def check_spec(spec: StructuredSpec, tokenizer: Any = None) -> str:
    """The checked grammar of `spec`; `StructuredSpecError` with llguidance's reason if it does not
    compile (unsupported JSON-schema keywords, invalid regex, Lark syntax errors)."""
    try:
        grammar = grammar_text(spec)
    except (ValueError, TypeError, RecursionError) as exc:
        raise StructuredSpecError(f"invalid {spec.kind}: {exc!r}") from exc
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    is_error, messages = validate(grammar, tokenizer, limits=LIMITS)
    if is_error:
        raise StructuredSpecError(f"unsupported {spec.kind}: {messages[0] if messages else 'invalid'}")
    return grammar


class GrammarCompiler:
    """Compiles specs for one model's tokenizer and vocabulary; hands out fresh per-sequence matchers."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """`vocab_size`: the width of the model's logits (may exceed the tokenizer's own vocabulary; the
        extra ids are never allowed). `eos_token_ids`: every id that ends a sequence."""
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the tokenizer's first build (compiles run unlocked)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built on first use: about a second for a large vocabulary)."""
        with self._lock:
            return self._build_tokenizer()

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            n_vocab = max(self.vocab_size, len(self._hf))
            eos = [t for t in self.eos_token_ids if t < n_vocab] or None
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=n_vocab, eos_token=eos)
            except ValueError:  # not a fast tokenizer, or a decoder llguidance cannot read
                wrapper = llguidance.TokenizerWrapper(_ByteTokens(self._hf))
                self._tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)
        return self._tokenizer

    @property
    def mask_width(self) -> int:
        """Tokens covered by a bitmask row (a multiple of 32 at least the vocabulary size)."""
        return (self.tokenizer.vocab_size + 31) // 32 * 32

    def is_compiled(self, spec: StructuredSpec) -> bool:
        """Whether `spec`'s template is cached (a `matcher` call costs a copy, no compile)."""
        with self._lock:
            return spec.key in self._cache

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` at the start of the output; `StructuredSpecError` if it does not
        compile or fails its dry run (`probe`)."""
        with self._lock:
            template = self._cache.get(spec.key)
            if template is not None:
                self._cache.move_to_end(spec.key)
        if template is None:
            template = self.compile(spec)
            with self._lock:
                self._cache[spec.key] = template
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def compile(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """`spec`'s template matcher, compiled and dry-run (not cached); `StructuredSpecError` if it
        is refused."""
        tokenizer = self.tokenizer
        grammar = check_spec(spec, tokenizer)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if template.is_error():
            line = template.get_error().strip().splitlines()[0] if template.get_error() else "invalid"
            raise StructuredSpecError(f"unsupported {spec.kind}: {line}")
        probe(template, tokenizer.vocab_size, spec.kind)
        return template


class _ByteTokens:
    """Any HF tokenizer as llguidance's generic tokenizer interface: every token's bytes (via
    `engine.tokenizer.token_bytes`), the special ids, and encoding of text without special tokens."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = hf.bos_token_id
        self.special_token_ids = list(hf.all_special_ids)
        specials = set(self.special_token_ids)
        self.tokens = [
            hf.convert_ids_to_tokens(t).encode() if t in specials else token_bytes(hf, t)
            for t in range(len(hf))
        ]

    def __call__(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))
