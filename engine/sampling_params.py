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

# The declared range of every numeric field (top_k additionally excludes 0: -1 means "disabled").
BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N),
    "max_tokens": Bound(1, MAX_NEW_TOKENS),
    "temperature": Bound(0.0, MAX_TEMPERATURE),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, MAX_TOP_K),
    "seed": Bound(0, INT64_MAX - MAX_N),  # seed + choice index stays a valid 64-bit seed
    "logprobs": Bound(0, MAX_LOGPROBS),
}


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first field that is out of range (cheap: no tensors)."""
        for name in ("n", "max_tokens", "top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs"):
                continue
            _check_number(name, value, integer=True)
        for name in ("temperature", "top_p"):
            _check_number(name, getattr(self, name), integer=False)
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
        """The `n` single-choice params of this request: choice j samples with `n=1` and seed `seed + j`
        (no seed stays no seed). `LLMEngine` and the API server both fan out `n` with this, so choice j
        draws the same tokens whichever of them runs it."""
        return [
            msgspec.structs.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
            for j in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check_number(name: str, value: object, integer: bool) -> None:
    bound = BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise SamplingParamsError(name, f"must be {kind}, got {value!r}")
    if value != value or not bound.holds(value):  # NaN fails every range
        raise SamplingParamsError(name, f"must be in {bound.describe()}, got {value!r}")
