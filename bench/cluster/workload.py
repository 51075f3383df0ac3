"""The cluster benchmark's arrival trace: built once from a seed, replayed identically for every router.

Three kinds of request, all token-id prompts for a random-weight model (no tokenizer):

* **adapter requests** (`--adapter-share` of the steady phase): adapter k of `adapters` drawn with
  probability ∝ 1/(k+1)^alpha, system prompt s of `system_prompts` drawn the same way, independently;
  prompt = system prompt s + a fresh user turn. Each (adapter, system prompt) pair is its own cached
  prefix in the engines (the KV cache is keyed by the adapter's content digest).
* **base-model multi-turn chats** (the rest): `chats` conversations of up to `turns` turns, each
  starting on one of the system prompts; turn t+1 arrives an exponential think time after turn t's
  arrival, its prompt the previous prompt + a fixed (synthetic) assistant answer + a new user turn, so
  each turn's prefix is the conversation so far.
* a **hot-adapter burst** (`burst_s` seconds after the steady phase, at `burst_rate`): `hot_share` of
  the requests go to one adapter, `hot_adapter` (by default a mid-popularity one, cold when the burst
  starts); the rest follow the steady mix.

Arrivals of the steady phase and of the burst are Poisson processes; `Arrival.at` is seconds from the
start of the run.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What the trace is made of (the CLI's flags)."""

    adapters: int = 16
    system_prompts: int = 8
    alpha: float = 1.0  # power-law exponent of adapter and system-prompt popularity
    steady_s: float = 30.0
    rate: float = 36.0  # steady arrivals per second
    adapter_share: float = 0.7  # of the steady arrivals (the rest: chat turns)
    chats: int = 24
    turns: int = 4
    think_s: float = 3.0  # mean gap between a chat's turn arrivals
    burst_s: float = 10.0
    burst_rate: float = 54.0
    hot_share: float = 0.8
    hot_adapter: int | None = None  # None: adapters // 2
    system_tokens: int = 128
    user_tokens: tuple[int, int] = (8, 24)  # a user turn's length, uniform in [lo, hi]
    answer_tokens: int = 16  # the synthetic assistant answer between chat turns
    max_tokens: int = 16  # generated per request (ignore_eos: always this many)
    vocab_size: int = 512
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError for a trace that cannot be built."""
        if self.adapters < 1 or self.system_prompts < 1 or self.turns < 1 or self.chats < 0:
            raise ValueError("--adapters, --system-prompts and --turns must be at least 1")
        if min(self.rate, self.burst_rate) <= 0 or min(self.steady_s, self.burst_s) < 0:
            raise ValueError("rates must be positive and phase lengths not negative")
        if not 0 <= self.adapter_share <= 1 or not 0 <= self.hot_share <= 1:
            raise ValueError("--adapter-share and --hot-share are fractions in [0, 1]")
        if self.hot_adapter is not None and not 0 <= self.hot_adapter < self.adapters:
            raise ValueError(f"--hot-adapter must be in [0, {self.adapters})")

    @property
    def hot(self) -> int:
        return self.hot_adapter if self.hot_adapter is not None else self.adapters // 2

    def longest_prompt(self) -> int:
        """Tokens of the longest prompt the trace can hold (a chat's last turn)."""
        turn = self.user_tokens[1]
        return self.system_tokens + self.turns * turn + (self.turns - 1) * self.answer_tokens


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the trace."""

    at: float  # seconds from the start
    phase: str  # "steady" or "burst"
    kind: str  # "adapter", "chat" or "hot"
    adapter: int | None  # index into the adapters; None: the base model
    system: int  # which system prompt the prompt starts with
    prompt: tuple[int, ...] = field(repr=False)


def popularity(count: int, alpha: float) -> list[float]:
    """P(k) ∝ 1/(k+1)^alpha for k in [0, count)."""
    w = [1.0 / (k + 1) ** alpha for k in range(count)]
    return [x / sum(w) for x in w]


def build_trace(spec: WorkloadSpec) -> list[Arrival]:
    """The whole run's arrivals, sorted by time (deterministic in `spec.seed`)."""
    spec.validate()
    rng = random.Random(spec.seed)
    systems = [_tokens(rng, spec.system_tokens, spec.vocab_size) for _ in range(spec.system_prompts)]
    p_adapter = popularity(spec.adapters, spec.alpha)
    p_system = popularity(spec.system_prompts, spec.alpha)
    out: list[Arrival] = []

    def adapter_request(at: float, phase: str, adapter: int, kind: str) -> Arrival:
        s = rng.choices(range(spec.system_prompts), p_system)[0]
        prompt = systems[s] + _user_turn(rng, spec)
        return Arrival(at, phase, kind, adapter, s, tuple(prompt))

    t = 0.0
    chat_starts: list[float] = []
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.steady_s:
            break
        if rng.random() < spec.adapter_share or spec.chats == 0:
            k = rng.choices(range(spec.adapters), p_adapter)[0]
            out.append(adapter_request(t, "steady", k, "adapter"))
        elif len(chat_starts) < spec.chats:
            chat_starts.append(t)  # a chat begins here; its later turns are laid out below
        else:  # every chat has begun: one more adapter request keeps the arrival rate
            k = rng.choices(range(spec.adapters), p_adapter)[0]
            out.append(adapter_request(t, "steady", k, "adapter"))
    for start in chat_starts:
        out.extend(_chat(rng, spec, systems, start))
    end = spec.steady_s + spec.burst_s
    t = spec.steady_s
    while True:
        t += rng.expovariate(spec.burst_rate)
        if t >= end:
            break
        if rng.random() < spec.hot_share:
            out.append(adapter_request(t, "burst", spec.hot, "hot"))
        else:
            k = rng.choices(range(spec.adapters), p_adapter)[0]
            out.append(adapter_request(t, "burst", k, "adapter"))
    return sorted(out, key=lambda a: a.at)


def _chat(rng: random.Random, spec: WorkloadSpec, systems: list[list[int]], start: float) -> list[Arrival]:
    """One base-model conversation: its turns' arrivals, each prompt extending the one before."""
    s = rng.choices(range(spec.system_prompts), popularity(spec.system_prompts, spec.alpha))[0]
    history = list(systems[s])
    turns, t = [], start
    for i in range(spec.turns):
        if i:
            history += _tokens(rng, spec.answer_tokens, spec.vocab_size)  # the previous turn's "answer"
            t += rng.expovariate(1.0 / spec.think_s)
        history += _user_turn(rng, spec)
        phase = "steady" if t < spec.steady_s else "burst"
        turns.append(Arrival(t, phase, "chat", None, s, tuple(history)))
    return turns


def _user_turn(rng: random.Random, spec: WorkloadSpec) -> list[int]:
    return _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab_size)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """`n` random token ids in [3, vocab) (0-2: pad, bos, eos)."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def attainable_hit_rate(trace: list[Arrival], block_size: int, cache_blocks: int | None = None) -> float:
    """The prefix-hit rate one engine would reach on `trace` (served in arrival order): the share of prompt
    tokens in full blocks whose chained prefix (under the same adapter) is still cached from an earlier
    prompt. `cache_blocks` None: an unbounded cache, the ceiling any routing can reach; else a cache of
    that many blocks evicting the least recently used (a single replica's cache, not counting the blocks
    its running requests hold, so still an upper bound for that replica)."""
    cache: OrderedDict[tuple, None] = OrderedDict()
    hit = total = 0
    for a in trace:
        total += len(a.prompt)
        key: tuple = (a.adapter,)
        cached = True
        for start in range(0, len(a.prompt) - block_size + 1, block_size):
            key = (key, a.prompt[start : start + block_size])
            if cached and key in cache:
                hit += block_size
            else:
                cached = False
                cache[key] = None
            cache.move_to_end(key)
            if cache_blocks is not None and len(cache) > cache_blocks:
                cache.popitem(last=False)
    return hit / total if total else 0.0
