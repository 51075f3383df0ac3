"""Draft-model proposer: a smaller checkpoint with the target's tokenizer proposes by greedy decoding.

The draft is run by the engine's own code (`load_model`, `ModelRunner`, `KVCacheManager`) with its own
paged KV cache, **without adapters**: every request, whatever its adapter, is drafted by the base draft
model (adapters are trained for the target's shapes, which a smaller draft does not have). Requests
whose adapter changes the output a lot therefore see fewer accepted tokens; the adaptive `k` then stops
drafting for them.

Each target sequence has a shadow sequence in the draft's cache. At each proposal the shadow's tokens
are brought up to the target's (tokens the target rejected are rolled back: the draft's KV stays valid
only for the common prefix), the missing tokens are computed in one draft forward, then the draft decodes
greedily `k` tokens, batched over all sequences. Greedy proposals are deterministic, so the target's
rejection sampling treats them as point masses (verify.py).
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCacheManager
from engine.model.loader import load_model
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.spec.config import SpeculativeConfig

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "auto",
    ) -> None:
        """Load the draft checkpoint at `config.draft_path`; ValueError if it cannot draft for `target`."""
        assert config.draft_path is not None, "a draft config names its checkpoint"
        try:
            cfg = ModelConfig.from_dir(config.draft_path)
        except Exception as exc:
            raise ValueError(f"speculative draft model {config.draft_path!r}: {exc}") from exc
        if cfg.vocab_size > target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({cfg.vocab_size}) is larger than the target's "
                f"({target.vocab_size}); a draft must share the target's tokenizer"
            )
        self.cfg = cfg
        self.model = load_model(cfg, dtype, device)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            self.model, cfg, num_blocks, block_size, dtype, device, 0, attention_backend
        )
        self.max_len = cfg.max_model_len
        self.shadows: dict[str, Sequence] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        shadows = [self._sync(s) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        # one forward computes every shadow's missing tokens and yields its first proposal
        active = [i for i, sh in enumerate(shadows) if sh is not None]
        for step in range(max(ks, default=0)):
            active = [i for i in active if len(drafts[i]) == step and ks[i] > step]
            active = [i for i in active if self._allocate(seqs[i], shadows[i])]
            if not active:
                break
            items = []
            for i in active:
                sh = shadows[i]
                assert sh is not None, "active shadows exist"
                n = sh.num_tokens - sh.num_computed_tokens
                items.append(ScheduledSequence(sh, sh.num_computed_tokens, n, self.kv.block_ids(sh), True))
            out = self.runner.run(SchedulerOutput(items, sum(it.num_tokens for it in items)))
            for i, it, tok in zip(active, items, out.sampled, strict=True):
                assert tok is not None, "every draft item samples"
                it.seq.num_computed_tokens += it.num_tokens
                it.seq.all_token_ids.append(tok.token_id)
                drafts[i].append(tok.token_id)
        return drafts

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The sequence's shadow with the target's tokens; its KV kept for the prefix both agree on."""
        tokens = seq.all_token_ids
        if seq.num_tokens >= self.max_len:
            return None
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            if max(tokens) >= self.cfg.vocab_size:
                return None  # a token the draft cannot embed
            sh = Sequence(seq.seq_id, list(tokens), _GREEDY, 0.0, max_total_tokens=self.max_len)
            self.shadows[seq.seq_id] = sh
            return sh
        old = sh.all_token_ids
        common = 0
        limit = min(len(old), len(tokens), sh.num_computed_tokens)
        while common < limit and old[common] == tokens[common]:
            common += 1
        if max(tokens[common:]) >= self.cfg.vocab_size:
            self.release(seq)
            return None
        sh.all_token_ids = list(tokens)
        sh.num_computed_tokens = min(common, len(tokens) - 1)
        self.kv.trim(sh, sh.num_computed_tokens)
        return sh

    def _allocate(self, seq: Sequence, sh: Sequence | None) -> bool:
        """Room in the draft's cache for the shadow's missing tokens (else the sequence is not drafted)."""
        if sh is None or sh.num_tokens >= self.max_len:
            return False
        if self.kv.allocate_slots(sh, sh.num_tokens - sh.num_computed_tokens):
            return True
        self.release(seq)
        return False

    def release(self, seq: Sequence) -> None:
        """Free the shadow of `seq` (its draft KV blocks)."""
        sh = self.shadows.pop(seq.seq_id, None)
        if sh is not None:
            self.kv.free(sh)

    def retain(self, alive: set[str]) -> None:
        """Free the shadows of sequences that are no longer running (finished, aborted, preempted)."""
        for seq_id in [s for s in self.shadows if s not in alive]:
            sh = self.shadows.pop(seq_id)
            self.kv.free(sh)
