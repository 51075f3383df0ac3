"""Interleaved timing of several kinds of one batch (the offline benchmarks that compare adapter kinds).

Each round runs every kind's batch once, one after the other, so a slow spell of a loaded machine hits
all kinds alike; the first round warms up (adapter loads, CPU plans) and is not counted. Compare the kinds
by ratios of their best runs (`bench.common.workload.best`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bench.common.workload import RunTiming, timed_run


def interleaved_runs(
    engines: Mapping[str, object],
    loras: Mapping[str, Sequence],
    prompts: Sequence[list[int]],
    params,
    repeats: int,
) -> dict[str, list[RunTiming]]:
    """{kind: `repeats` timings} of the batch `prompts` on `engines[kind]` (an `LLMEngine`) with one
    `LoRARequest` (or None) per prompt from `loras[kind]`, kinds interleaved after one warm-up round;
    request ids are tagged with the kind and the round."""
    runs: dict[str, list[RunTiming]] = {kind: [] for kind in loras}
    for r in range(repeats + 1):  # the first round warms up (loads, plans) and is not counted
        for kind, reqs in loras.items():
            timing = timed_run(engines[kind], prompts, params, reqs, f"{kind}{r}")
            if r:
                runs[kind].append(timing)
    return runs
