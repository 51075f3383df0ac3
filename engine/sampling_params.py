"""Per-request sampling settings: one typed contract with declared bounds, checked on construction.

`SamplingParams` is a msgspec Struct, so the same value is built by `LLM` users, mapped from an OpenAI
body by the API, sent over IPC to the engine process and decoded there; `__post_init__` runs in every
one of those cases and checks each field against `BOUNDS` (the only place the ranges are declared; the
OpenAI request models read them from here too).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine.structured.spec import StructuredSpec

_GREEDY_EPS = 1e-5
INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Bound:
    """Inclusive range of a numeric field (`lo`/`hi` None: unbounded on that side)."""

    lo: float | None
    hi: float | None
    lo_open: bool = False  # True: the value must be strictly greater than `lo`

    def holds(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        left = "(" if self.lo_open else "["
        return f"{left}{self.lo}, {self.hi}]"


MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_NEW_TOKENS = 1 << 20
MAX_TOP_K = 1 << 20
MAX_TEMPERATURE = 100.0
PRIORITY_BOUND = Bound(-(2**31), 2**31 - 1)
MAX_LOGIT_BIAS = 1024  # entries of `logit_bias`
MAX_BAD_WORDS = 64  # entries of `bad_words` (and of `bad_words_token_ids`)
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64  # tokens of one banned sequence

# The declared range of every numeric field (top_k additionally excludes 0: -1 means "disabled").
BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N),
    "max_tokens": Bound(1, MAX_NEW_TOKENS),
    "temperature": Bound(0.0, MAX_TEMPERATURE),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, MAX_TOP_K),
    "seed": Bound(0, INT64_MAX - MAX_N),  # seed + choice index stays a valid 64-bit seed
    "logprobs": Bound(0, MAX_LOGPROBS),
    "best_of": Bound(1, MAX_N),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 100.0, lo_open=True),
    "min_p": Bound(0.0, 1.0),
    "min_tokens": Bound(0, MAX_NEW_TOKENS),
    "logit_bias": Bound(-100.0, 100.0),  # each bias value
}
_INT_FIELDS = ("n", "max_tokens", "top_k", "seed", "logprobs", "best_of", "min_tokens")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)
_OPTIONAL = ("seed", "logprobs", "best_of")


class SamplingParamsError(ValueError):
    """A sampling field is out of its declared range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to pick tokens for one prompt and when to stop.

    `temperature == 0` means greedy. `top_k == -1` and `top_p == 1.0` disable those filters. `seed` makes the
    request's sampling reproducible regardless of what else is in the batch. `logprobs=k` returns, for each
    chosen token, its log-probability plus the `k` most likely tokens (`k = 0`: only the chosen one);
    with `structured` set they are those of the grammar-masked distribution.
    Every field has a declared range (`BOUNDS`); out of range raises `SamplingParamsError` naming it.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredSpec | None = None  # constrain the output (engine.structured); None: free text
    best_of: int | None = None  # generate this many, return the `n` of highest cumulative logprob
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM/HF: tokens in prompt or output: logit / p if > 0 else * p
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one (after temperature)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many output tokens
    bad_words: list[str] = msgspec.field(default_factory=list)  # tokenized by the engine (vLLM's way)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)  # banned token sequences

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first field that is out of range (cheap: no tensors)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            _check_number(name, value, integer=True)
        for name in _FLOAT_FIELDS:
            _check_number(name, getattr(self, name), integer=False)
        if self.best_of is not None and self.best_of < self.n:
            raise SamplingParamsError("best_of", f"must be at least n ({self.n}), got {self.best_of}")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_logit_bias(self.logit_bias)
        _check_bad_words(self.bad_words, self.bad_words_token_ids)
        if self.top_k == 0:
            raise SamplingParamsError("top_k", "must be -1 (disabled) or at least 1")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", "must be a boolean")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise SamplingParamsError("stop", f"stop strings must be 1..{MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
        for t in self.stop_token_ids:
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise SamplingParamsError(
                    "stop_token_ids", f"token ids must be integers in [0, {MAX_TOKEN_ID}]"
                )
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise SamplingParamsError("structured", "must be a StructuredSpec or None")

    def choices(self) -> list[SamplingParams]:
        """The single-choice params of this request, one per sequence it generates (`best_of` when set,
        else `n`): choice j samples with `n=1` and seed `seed + j` (no seed stays no seed). `LLMEngine`
        and the API server both fan out with this, so choice j draws the same tokens whichever of them
        runs it. With `best_of`, every choice tracks log-probabilities (`logprobs` at least 0) so the
        best `n` can be ranked."""
        logprobs = self.logprobs if self.best_of is None or self.logprobs is not None else 0
        return [
            msgspec.structs.replace(
                self, n=1, best_of=None, logprobs=logprobs, seed=None if self.seed is None else self.seed + j
            )
            for j in range(self.best_of or self.n)
        ]

    @property
    def penalized(self) -> bool:
        """Whether any of presence, frequency or repetition penalty is in effect."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before picking (penalties, logit_bias,
        min_tokens, bad words; min_p acts on the tempered distribution and counts too)."""
        return (
            self.penalized
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or bool(self.bad_words_token_ids)
            or self.min_p > 0.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check_logit_bias(bias: object) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", "must map token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    bound = BOUNDS["logit_bias"]
    for tok, value in bias.items():
        if type(tok) is not int or not 0 <= tok <= MAX_TOKEN_ID:
            raise SamplingParamsError("logit_bias", f"keys must be token ids in [0, {MAX_TOKEN_ID}]")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not bound.holds(value):
            raise SamplingParamsError(
                "logit_bias", f"values must be numbers in {bound.describe()}, got {value!r} for {tok}"
            )


def _check_bad_words(words: object, seqs: object) -> None:
    if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
        raise SamplingParamsError("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings")
    if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise SamplingParamsError("bad_words", f"each must be 1..{MAX_BAD_WORD_CHARS} non-blank characters")
    # Each word tokenizes to up to two sequences (with and without a leading space).
    if not isinstance(seqs, list) or len(seqs) > 2 * MAX_BAD_WORDS:
        raise SamplingParamsError(
            "bad_words_token_ids", f"must be a list of at most {2 * MAX_BAD_WORDS} token sequences"
        )
    for seq in seqs:
        if not isinstance(seq, list) or not 1 <= len(seq) <= MAX_BAD_WORD_TOKENS:
            raise SamplingParamsError(
                "bad_words_token_ids", f"each sequence must have 1..{MAX_BAD_WORD_TOKENS} tokens"
            )
        if any(type(t) is not int or not 0 <= t <= MAX_TOKEN_ID for t in seq):
            raise SamplingParamsError(
                "bad_words_token_ids", f"token ids must be integers in [0, {MAX_TOKEN_ID}]"
            )


def _check_number(name: str, value: object, integer: bool) -> None:
    bound = BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise SamplingParamsError(name, f"must be {kind}, got {value!r}")
    if value != value or not bound.holds(value):  # NaN fails every range
        raise SamplingParamsError(name, f"must be in {bound.describe()}, got {value!r}")
