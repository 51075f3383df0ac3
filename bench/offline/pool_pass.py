"""One measured pass of a multi-adapter workload: throughput, the byte floor of its steps, and what the
adapter pool did (hits, uploads, host loads, evictions)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.common.workload import timed_run
from bench.offline.step_bytes import StepBytesMeter


@dataclass(slots=True)
class PoolPass:
    requests: int
    output_tokens: int
    total_s: float
    floor_s: float  # the steps' bytes over the run's read bandwidth (bench/offline/step_bytes.py)
    steps: int
    decode_s: float  # wall time of the decode steps (every item one token)
    decode_tokens: int
    decode_floor_s: float  # the decode steps' bytes over the read bandwidth
    mean_distinct_adapters: float  # per step
    pool_hit_rate: float  # 1 - device uploads / requests
    device_uploads: int
    host_loads: int  # adapters read from disk (host cache misses)
    evictions: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def floor_tokens_per_s(self) -> float:
        """The most output tokens per second the bytes of these steps allow."""
        return self.output_tokens / self.floor_s

    @property
    def of_floor(self) -> float:
        """Measured throughput as a fraction of the byte floor's (1.0: at the floor)."""
        return self.floor_s / self.total_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def decode_floor_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_floor_s if self.decode_floor_s else 0.0

    @property
    def decode_of_floor(self) -> float:
        """Decode steps' throughput as a fraction of their byte floor's."""
        return self.decode_floor_s / self.decode_s if self.decode_s else 0.0


def measure_pass(eng, meter: StepBytesMeter, prompts, params, loras, tag: str, read_gb_s: float) -> PoolPass:
    """Run `prompts` (one `LoRARequest` each in `loras`) to the end on `eng` and measure them."""
    before = eng.get_lora_stats()
    meter.reset()
    run = timed_run(eng, prompts, params, loras, tag)
    counted = meter.reset()
    after = eng.get_lora_stats()
    uploads = after.device_uploads - before.device_uploads
    return PoolPass(
        requests=len(prompts),
        output_tokens=run.output_tokens,
        total_s=run.total_s,
        floor_s=counted.floor_s(read_gb_s),
        steps=counted.steps,
        decode_s=run.decode_s,
        decode_tokens=counted.decode_tokens,
        decode_floor_s=counted.decode_floor_s(read_gb_s),
        mean_distinct_adapters=counted.mean_distinct_adapters,
        pool_hit_rate=1 - uploads / len(prompts),
        device_uploads=uploads,
        host_loads=after.loads - before.loads,
        evictions=after.evictions - before.evictions,
    )
