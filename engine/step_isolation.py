"""When a batched forward raises: rerun its sequences one at a time so the failure ends only the request
that caused it (`LLMEngine.step`)."""

from __future__ import annotations

from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.request_table import RequestTable
from engine.scheduler.output import RunnerOutput, SchedulerOutput
from engine.sequence import SequenceStatus


def run_isolated(
    runner: ModelRunner, plan: SchedulerOutput, requests: RequestTable
) -> tuple[SchedulerOutput, RunnerOutput, list[RequestOutput]]:
    """The batch of `plan` raised: run each scheduled sequence alone, end those that raise again with an
    error, and return the plan and output of the ones that ran, with the error outputs."""
    kept, sampled, spec_tokens, failed = [], [], [], []
    for item in plan.scheduled:
        seq = item.seq
        if seq.is_finished:
            continue
        try:
            one = runner.run(SchedulerOutput([item], item.num_tokens))
        except Exception as exc:
            gid = requests.seq_to_group.get(seq.seq_id)
            if gid is not None:
                failed.append(requests.end_with_error(gid, f"request failed in the engine: {exc!r}"))
            else:
                requests.finish(seq, SequenceStatus.FINISHED_ABORTED)
            continue
        kept.append(item)
        sampled.append(one.sampled[0])
        spec_tokens.append(one.spec_tokens[0] if one.spec_tokens is not None else None)
    # a sequence that ran may belong to a request (n > 1) that a later failure of its sibling ended
    alive = [i for i, it in enumerate(kept) if not it.seq.is_finished]
    kept, sampled = [kept[i] for i in alive], [sampled[i] for i in alive]
    spec_tokens = [spec_tokens[i] for i in alive]
    tokens = sum(it.num_tokens for it in kept)
    return SchedulerOutput(kept, tokens, plan.preempted), RunnerOutput(sampled, spec_tokens), failed
