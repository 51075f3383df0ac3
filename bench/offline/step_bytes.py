"""The byte floor of a whole run: per step, the bytes it must read, summed over the steps the engine ran.

    floor_s = sum over steps of (base weight bytes + page bytes of the step's distinct adapters) / read GB/s

(`bench/offline/byte_floor.py`: base bytes exclude the embedding table unless tied; an adapter's bytes are the
rank rows of A and the cache lines of B one decode row reads). It is a memory floor: a step that also
computes (a prefill chunk) can only be slower. Decode steps (every scheduled item one token: what a
decode-heavy workload's throughput follows) are also counted on their own, to set against the measured
decode time.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.offline.byte_floor import adapter_page_bytes, base_weight_bytes


@dataclass(slots=True)
class StepBytes:
    """What `StepBytesMeter` counted since its last `reset`."""

    steps: int = 0
    bytes: int = 0
    adapter_rows: int = 0  # sum over steps of the number of distinct adapters in the step
    decode_steps: int = 0
    decode_bytes: int = 0
    decode_tokens: int = 0

    def floor_s(self, read_gb_s: float) -> float:
        return self.bytes / (read_gb_s * 1e9)

    def decode_floor_s(self, read_gb_s: float) -> float:
        return self.decode_bytes / (read_gb_s * 1e9)

    @property
    def mean_distinct_adapters(self) -> float:
        return self.adapter_rows / self.steps if self.steps else 0.0


class StepBytesMeter:
    """Wraps an `LLMEngine`'s `scheduler.schedule` to count the bytes of every non-empty step it plans
    (an adapter's bytes are computed once per digest, so the timed loop pays a set and a dict lookup)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.base_bytes = base_weight_bytes(engine.model)
        self.counted = StepBytes()
        self._per_adapter: dict[str, int] = {}
        inner = engine.scheduler.schedule

        def schedule():
            plan = inner()
            if not plan.empty:
                keys = {it.seq.lora_key for it in plan.scheduled} - {None}
                decode = all(it.num_tokens == 1 for it in plan.scheduled)
                self._count(keys, len(plan.scheduled) if decode else 0)
            return plan

        engine.scheduler.schedule = schedule

    def _count(self, keys: set[str], decode_tokens: int) -> None:
        """One step reading the base weights and the pages of the adapters `keys` (`decode_tokens` > 0:
        a decode step of that many rows)."""
        c = self.counted
        step = self.base_bytes
        for key in keys:
            if key not in self._per_adapter:
                self._per_adapter[key] = adapter_page_bytes(self.engine.lora.pool, [key])
            step += self._per_adapter[key]
        c.steps += 1
        c.adapter_rows += len(keys)
        c.bytes += step
        if decode_tokens:
            c.decode_steps += 1
            c.decode_tokens += decode_tokens
            c.decode_bytes += step

    def reset(self) -> StepBytes:
        """The counts so far (then start again from zero)."""
        out, self.counted = self.counted, StepBytes()
        return out
