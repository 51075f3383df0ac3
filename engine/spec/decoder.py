"""Speculative decoding in the engine loop: propose after a step, account for what was accepted.

    plan = scheduler.schedule()          # a decode with proposals becomes 1 + k rows (budget counts them)
    out = runner.run(plan)               # the target verifies them in the same forward (verify.py)
    spec.observe(plan, out)              # acceptance per sequence (adaptive k) and per adapter (metrics)
    scheduler.update(plan, out)          # appends the emitted tokens, rolls back rejected KV blocks
    spec.end_step(rows, seconds, tokens) # what the step cost (the break-even acceptance, cost.py)
    spec.propose(scheduler.running)      # proposals for the next step, k chosen per sequence

The scheduler never calls a proposer: it only reads `seq.spec_token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler.output import RunnerOutput, SchedulerOutput
from engine.sequence import Sequence
from engine.spec.adaptive import AdapterPrior, SpecState
from engine.spec.config import SpeculativeConfig
from engine.spec.cost import StepCostModel
from engine.spec.proposer import Proposer


@dataclass(slots=True)
class AdapterSpecStats:
    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of which the target accepted
    verifications: int = 0  # sequence-steps that verified at least one proposed token

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted proposals + the target's own token."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0


@dataclass(slots=True)
class SpecStats:
    by_adapter: dict[str, AdapterSpecStats] = field(default_factory=dict)  # "" = the base model

    def total(self) -> AdapterSpecStats:
        out = AdapterSpecStats()
        for s in self.by_adapter.values():
            out.proposed += s.proposed
            out.accepted += s.accepted
            out.verifications += s.verifications
        return out


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats()
        self.cost = StepCostModel(prior=config.cost_prior)
        self.priors: dict[str | None, AdapterPrior] = {}  # by adapter digest (None: base model)

    def end_step(self, rows: int, seconds: float, tokens: int) -> None:
        """A finished step's size, duration and emitted tokens (for the break-even acceptance)."""
        self.cost.observe(rows, seconds, tokens)

    def observe(self, plan: SchedulerOutput, out: RunnerOutput) -> None:
        """Record, for every item that verified proposed tokens, how many the target accepted."""
        for idx, item in enumerate(plan.scheduled):
            proposed = len(item.spec_token_ids)
            if not proposed or item.seq.is_finished:
                continue
            accepted = max(0, len(out.tokens(idx)) - 1)
            seq = item.seq
            probe = seq.spec is not None and seq.spec.probing
            if seq.spec is not None:
                seq.spec.record(proposed, accepted)
            prior = self.priors.setdefault(seq.lora_key, AdapterPrior())
            prior.record(proposed, accepted, probe, self.config.max_backoff)
            name = seq.lora_request.name if seq.lora_request is not None else ""
            st = self.stats.by_adapter.setdefault(name, AdapterSpecStats())
            st.proposed += proposed
            st.accepted += accepted
            st.verifications += 1

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of each running sequence whose next step is a decode (sequences under a
        structured-output grammar do not speculate; penalties and the other logits processing do, the
        verifier applies them per row)."""
        self.proposer.retain({s.seq_id for s in running})
        seqs, ks = [], []
        cfg = self.config
        theta = self.cost.theta()
        for seq in running:
            seq.spec_token_ids = []
            if seq.is_finished or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if seq.structured is not None:  # grammar masks apply to one sampled row per sequence
                continue
            if seq.spec is None:
                prior = self.priors.get(seq.lora_key) or AdapterPrior()
                seq.spec = SpecState(
                    cfg.num_tokens, cfg.max_backoff, prior_alpha=prior.alpha(), backoff=prior.backoff
                )
            left = min(seq.params.max_tokens - seq.num_output_tokens, seq.max_total_tokens - seq.num_tokens)
            k = min(seq.spec.next_k(theta), left - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs, ks), strict=True):
            seq.spec_token_ids = draft
