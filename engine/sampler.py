"""Turn next-token logits into tokens for a batch of requests with different sampling settings.

First the per-request logits processing (`engine/logits_processing.py`: bad words, `min_tokens`,
`logit_bias`, repetition/frequency/presence penalties; only on rows that ask for it). Then for each row:
greedy rows take argmax of the processed logits. Other rows divide by temperature, drop tokens under
`min_p` × the top probability, keep the top-k logits and the smallest set of tokens whose probability mass
reaches top_p, and draw from the renormalized distribution with the Gumbel/exponential trick
`argmax(p / q), q ~ Exp(1)`. A request with a `seed` takes the `q` of each output position from a
counter-based stream (`engine/sampling_noise.py`): its token at position t depends only on (seed, t) and
that position's distribution, not on the rest of the batch, speculation, preemption or KV handoffs.
Log-probabilities are reported under the raw (unprocessed, untempered) distribution, as vLLM's default
`raw_logprobs` does.
"""

from __future__ import annotations

import torch

from engine.logits_processing import apply_min_p, process_logits
from engine.outputs import Logprob
from engine.sampling_noise import sample_rows
from engine.scheduler.output import SampledToken
from engine.sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.eos_token_ids: tuple[int, ...] = ()  # masked under `min_tokens` (set by the engine)

    def __call__(self, logits: torch.Tensor, reqs: list[Sequence]) -> list[SampledToken]:
        """logits [S, V] float32, one row per request -> one sampled token per request."""
        params = [r.params for r in reqs]
        greedy_rows = [p.greedy for p in params]
        # In place unless log-probabilities (of the raw logits) are wanted from this step.
        in_place = all(p.logprobs is None for p in params)
        processed = process_logits(logits, reqs, self.eos_token_ids, in_place=in_place)
        argmax = processed.argmax(dim=-1)
        if all(greedy_rows):
            tokens = argmax
        else:
            tokens = torch.where(
                torch.tensor(greedy_rows, device=logits.device), argmax, self._draw(processed, reqs)
            )
        token_list = tokens.tolist()
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out = [SampledToken(t) for t in token_list]
        if logprob_rows:
            rows = torch.tensor(logprob_rows, device=logits.device)
            logp = torch.log_softmax(logits[rows], dim=-1)
            chosen = tokens[rows]
            chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1)
            ranks = (logp > chosen_lp[:, None]).sum(-1) + 1
            max_k = max(params[i].logprobs or 0 for i in logprob_rows)  # not None in these rows
            top_lp, top_ids = logp.topk(max_k, dim=-1) if max_k else (None, None)
            chosen_l, ranks_l = chosen_lp.tolist(), ranks.tolist()
            for j, i in enumerate(logprob_rows):
                entry = {token_list[i]: Logprob(chosen_l[j], ranks_l[j])}
                k = params[i].logprobs
                if k:
                    assert top_ids is not None and top_lp is not None  # 0 < k <= max_k: topk ran
                    alts = zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist(), strict=True)
                    for r, (tid, lp) in enumerate(alts):
                        entry.setdefault(tid, Logprob(lp, r + 1))
                out[i].logprob = chosen_l[j]
                out[i].top_logprobs = entry
        return out

    def _draw(self, logits: torch.Tensor, reqs: list[Sequence]) -> torch.Tensor:
        params = [r.params for r in reqs]
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        scaled = logits / temps[:, None]
        min_p = [p.min_p if not p.greedy else 0.0 for p in params]
        if any(m > 0.0 for m in min_p):
            scaled = apply_min_p(scaled, min_p)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        seeds = [p.seed for p in params]
        return sample_rows(probs, seeds, [r.num_output_tokens for r in reqs], self.generator)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k and outside its row's top-p nucleus."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], device=logits.device)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop = mass_before >= p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
