"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step (`schedule`):
1. Running requests first, in admission order: each gets `min(tokens left to compute, budget)` tokens;
   for a decode that is one token. If the KV pool has no room, the policy's victim among the running
   requests not yet scheduled this step (possibly the request itself) is preempted: its blocks are
   released and it returns to the front of the queue to be recomputed later.
2. If nothing was preempted, waiting requests are admitted in policy order while the token budget,
   `max_num_seqs`, `max_loras` and the KV pool allow, each starting after its cached prefix. A long
   prompt is split across steps (chunked prefill) by the token budget. A sequence whose adapter digest
   is not known yet (`lora_key` None) or whose adapter is not in the device pool (`is_resident` False)
   is passed over without holding up the others; with `resident_first` (default) such sequences also
   come after the resident ones of their priority, for a bounded number of steps (admission.py). A
   sequence passed over `lora_starvation_steps` times because `max_loras` adapters are already running
   stops admission behind it until its adapter gets a slot.
With speculative decoding, a running request in decode whose `spec_token_ids` were set by the proposer
(engine/spec/) is scheduled for 1 + k rows; the k proposed rows count against the token budget but only
from what is left after one row for each later running request, and they are dropped (before anyone is
preempted) when the KV pool has no room for them. `update` then appends the accepted tokens one at a
time, checking stop conditions after each, and releases the blocks of rejected rows.
The scheduler never touches tensors and never loads adapters: it asks `is_resident`, and tells the
engine which adapters it will want next (`adapters_wanted`); `update` applies the runner's sampled tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.scheduler.admission import count_bypasses, is_deferred, resident_first
from engine.scheduler.output import RunnerOutput, ScheduledSequence, SchedulerOutput
from engine.scheduler.policy import admission_order, pick_victim, validate_policy
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's share of `EngineConfig` (whose defaults apply; see `from_engine_config`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    max_loras: int
    # After this many steps passed over for lack of an adapter slot, a request blocks admission of
    # everything behind it, so the running adapters drain and its adapter gets a slot.
    lora_starvation_steps: int = 16
    # Resident-first admission (admission.py): a request whose adapter is not resident waits behind
    # resident ones for at most `max_bypass_steps` steps in which a later request was admitted.
    resident_first: bool = True
    max_bypass_steps: int = 32

    def __post_init__(self) -> None:
        validate_policy(self.policy)
        if self.max_bypass_steps < 0:
            raise ValueError(f"lora_max_bypass_steps must be >= 0, got {self.max_bypass_steps}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> SchedulerConfig:
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            max_loras=config.max_loras,
            resident_first=config.lora_resident_first,
            max_bypass_steps=config.lora_max_bypass_steps,
        )


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_batched_tokens: int = 0


class Scheduler:
    """Decides each step's batch; owns the waiting and running queues and the KV cache manager."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        eos_token_ids: tuple[int, ...] = (),
        is_resident: Callable[[str], bool] | None = None,
    ) -> None:
        """`is_resident(digest)`: whether an adapter is in the device pool now (a pure query; the engine
        loads adapters). None: every adapter counts as resident (no LoRA, or tests without a pool)."""
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.is_resident = is_resident or (lambda digest: True)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------------------------------
    def add_request(self, req: Sequence) -> None:
        self.seqs[req.seq_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_adapters(self) -> set[str]:
        """Digests of the adapters used by running sequences (they must stay resident; a weighted mix
        counts each of its members)."""
        return {k for s in self.running for k in s.adapter_keys}

    def adapters_wanted(self) -> list[str]:
        """Adapters of waiting sequences that admission could take next, in admission order (policy `lpm`
        in queue order): as many new ones as `max_loras` leaves beside the running adapters and, with
        `resident_first`, up to `max_loras` more, loaded ahead while the running batch computes. Resident
        ones come first (admission.py), so the engine's uploads for later ones never evict them."""
        running = self.running_adapters()
        limit = self.config.max_loras - len(running)
        if self.config.resident_first:
            limit += self.config.max_loras
        wanted: list[str] = []
        for seq in self._admission_order(lambda s: 0)[0]:
            if len(wanted) >= limit:
                break
            for key in seq.adapter_keys:
                if key not in running and key not in wanted:
                    wanted.append(key)
        return wanted

    def _admission_order(
        self, cached: Callable[[Sequence], int]
    ) -> tuple[list[Sequence], list[Sequence], set[int]]:
        """(admission order, policy order, id()s of the deferred sequences) of the waiting queue."""
        order = admission_order(self.config.policy, self.waiting, cached)
        if not self.config.resident_first:
            return order, order, set()
        bound = self.config.max_bypass_steps
        deferred = {id(s) for s in order if is_deferred(s, self.is_resident, bound)}
        return resident_first(self.config.policy, order, deferred), order, deferred

    def finish_request(self, req: Sequence, status: SequenceStatus) -> None:
        """End a request (stop, length or abort) and release everything it holds."""
        if req.is_finished:
            return
        if req.status == SequenceStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.seqs.pop(req.seq_id, None)

    def _preempt(self, req: Sequence) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = SequenceStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.insert(0, req)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        adapters: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.num_tokens - req.num_computed_tokens
            # proposed tokens only from budget left after one token for each later running request
            spec = self._take_spec(req, pending, budget - (len(self.running) - i - 1))
            n = min(pending + len(spec), budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                if spec:  # no room for the proposed tokens: drop them before preempting anyone
                    n -= len(spec)
                    spec = []
                    continue
                victim = pick_victim(self.config.policy, self.running[i:])
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req in preempted:
                continue
            scheduled.append(self._scheduled(req, n, spec))
            adapters.update(req.adapter_keys)
            budget -= n
            i += 1

        if not preempted:
            budget = self._admit(budget, scheduled, adapters)

        out = SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted)
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.num_batched_tokens = out.num_batched_tokens
        return out

    def _admit(self, budget: int, scheduled: list[ScheduledSequence], adapters: set[str]) -> int:
        running_adapters = self.running_adapters() | adapters
        hit_cache: dict[int, tuple[list, int]] = {}

        def cached(req: Sequence) -> int:
            if req.lora_request is not None and req.lora_key is None:
                return 0  # its adapter digest (part of every block key) is not known yet
            if id(req) not in hit_cache:
                hit_cache[id(req)] = self.kv.find_cached_prefix(req)
            return hit_cache[id(req)][1]

        order, policy_order, deferred = self._admission_order(cached)
        admitted: set[int] = set()
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.lora_request is not None and req.lora_key is None:
                continue  # its adapter's digest is still being computed by a background load
            keys = req.adapter_keys  # a weighted mix takes a slot for each member
            new = [k for k in keys if k not in running_adapters]
            if new and len(running_adapters) + len(new) > self.config.max_loras:
                req.num_lora_skips += 1
                if req.num_lora_skips >= self.config.lora_starvation_steps:
                    break
                continue
            if not all(self.is_resident(k) for k in keys):
                continue
            # Look up again: blocks cached earlier in this loop (e.g. by an n>1 sibling) may now hit.
            hit_cache.pop(id(req), None)
            cached(req)
            blocks, num_cached = hit_cache[id(req)]
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, n, blocks):
                if self.config.policy == "fcfs":
                    break
                continue
            self.kv.record_lookup(req, num_cached)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            self.waiting.remove(req)
            self.running.append(req)
            req.status = SequenceStatus.RUNNING
            running_adapters.update(keys)
            scheduled.append(self._scheduled(req, n))
            admitted.add(id(req))
            budget -= n
        if deferred and admitted:
            count_bypasses(policy_order, deferred, admitted)
        return budget

    def _take_spec(self, req: Sequence, pending: int, budget: int) -> list[int]:
        """The tokens proposed for `req` that this step verifies: only for a decode (one pending token),
        within `budget` rows in all, and never past the request's length limit (a step emits at most
        len + 1 tokens). The proposal is consumed either way."""
        spec, req.spec_token_ids = req.spec_token_ids, []
        if pending != 1 or not spec:
            return []
        left = min(req.params.max_tokens - req.num_output_tokens, req.max_total_tokens - req.num_tokens)
        return spec[: max(0, min(left - 1, budget - 1))]

    def _scheduled(self, req: Sequence, n: int, spec: list[int] | None = None) -> ScheduledSequence:
        start = req.num_computed_tokens
        spec = spec or []
        return ScheduledSequence(
            seq=req,
            start=start,
            num_tokens=n,
            block_ids=self.kv.block_ids(req),
            sample=start + n - len(spec) == req.num_tokens,
            spec_token_ids=spec,
        )

    def update(self, plan: SchedulerOutput, out: RunnerOutput) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, and finish requests that hit a stop condition.

        Returns the requests that received a new token this step (finished ones included).
        With speculative rows, an item emits several tokens: they are appended one at a time and the
        stop conditions are checked after each, so a stop token or the length limit cuts exactly; the KV
        blocks past the accepted tokens are released.
        """
        now = time.monotonic()
        progressed = []
        assert len(out.sampled) == len(plan.scheduled), "one runner output per scheduled item"
        for idx, item in enumerate(plan.scheduled):
            req = item.seq
            if req.is_finished:  # aborted while the step ran
                continue
            tokens = out.tokens(idx)
            num_spec = len(item.spec_token_ids)
            accepted = max(0, len(tokens) - 1) if num_spec else 0
            req.num_computed_tokens += item.num_tokens - num_spec + accepted
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            req.num_new_tokens = 0
            for sampled in tokens:
                req.append_token(sampled.token_id)
                req.num_new_tokens += 1
                if req.logprobs is not None and sampled.top_logprobs is not None:
                    req.logprobs.append(sampled.top_logprobs)
                if sampled.logprob is not None:
                    req.cumulative_logprob += sampled.logprob
                self._check_stop(req, sampled.token_id)
                if req.is_finished:
                    break
            if num_spec and not req.is_finished:
                self.kv.trim(req, req.num_tokens)
            progressed.append(req)
        return progressed

    def _check_stop(self, req: Sequence, token_id: int) -> None:
        params = req.params
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            self.finish_request(req, SequenceStatus.FINISHED_STOPPED)
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_request(req, SequenceStatus.FINISHED_STOPPED)
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= req.max_total_tokens:
            self.finish_request(req, SequenceStatus.FINISHED_LENGTH)
