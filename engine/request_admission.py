"""Admitting a request to the engine: validate its prompt and parameters, bound its length, and build
its sequences (`n` or `best_of` of them, sharing the prompt's blocks through the prefix cache).

`LLMEngine.add_request` is `admit_request` here; KV imports (engine/engine_kv_transfer.py) reuse the
validation.
"""

from __future__ import annotations

import time
from collections import abc
from typing import TYPE_CHECKING, Any

from engine.kv_cache import KVCacheManager
from engine.lora_request import LoRARequest
from engine.output_processor import SequenceText
from engine.request_group import RequestGroup
from engine.request_tokens import resolve_request_tokens
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def tokenize(
    prompt: str | abc.Sequence[int], tokenizer: Any | None, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a text prompt or a list of token ids, validating both forms:
    ValueError for an empty prompt, text without a tokenizer, or ids outside [0, vocab_size)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer files; pass prompts as lists of token ids")
        return prompt, list(tokenizer.encode(prompt))
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return None, ids


def max_total(prompt_len: int, params: SamplingParams, max_model_len: int, kv: KVCacheManager) -> int:
    """The most tokens (prompt + output) a request may reach: `prompt_len + max_tokens`, capped by the
    model's context; ValueError when the prompt fills the context or the KV cache could never hold it."""
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens")
    total = min(prompt_len + params.max_tokens, max_model_len)
    if not kv.can_fit(kv.blocks_needed(total)):
        raise ValueError(
            f"request needs {kv.blocks_needed(total)} KV blocks for {total} tokens but the "
            f"cache has {kv.pool.num_blocks}; lower max_tokens or raise num_kv_blocks"
        )
    return total


def sequence_text(tokenizer: Any | None, detokenize: bool, params: SamplingParams) -> SequenceText | None:
    """The incremental detokenizer (with `params`' stop strings) of one sequence, or None when the
    engine does not detokenize (no tokenizer, or `detokenize=False`)."""
    if tokenizer is None or not detokenize:
        return None
    return SequenceText(tokenizer, params.stop, params.min_tokens)


def admit_request(
    engine: LLMEngine,
    request_id: str,
    prompt: str | abc.Sequence[int],
    params: SamplingParams | None,
    lora_request: LoRARequest | None,
    priority: int,
    arrival_time: float | None,
    prefill_only: bool,
) -> None:
    """Validate a request and queue its sequences on `engine`'s scheduler (`LLMEngine.add_request`)."""
    params = resolve_request_tokens(
        params or SamplingParams(), engine.tokenizer, engine.model_config.vocab_size
    )
    engine.structured.check(params)  # compiles the grammar (cached); refuses a spec that does not compile
    if request_id in engine.requests:
        raise ValueError(f"request id {request_id!r} is already in use")
    text, ids = engine.tokenize(prompt)
    limit = max_total(len(ids), params, engine.model_config.max_model_len, engine.kv)
    if prefill_only and len(params.choices()) != 1:
        raise ValueError("a prefill-only request has one sequence (n = 1, no best_of)")
    if prefill_only and engine.tp is not None:
        raise ValueError("KV transfer needs an engine of one rank (tensor_parallel_size 1)")
    lora_key, lora_keys = engine.adapters.key_for(lora_request)
    arrival = time.monotonic() if arrival_time is None else arrival_time
    seqs = []
    for i, choice in enumerate(params.choices()):
        seq_id = request_id if (params.best_of or params.n) == 1 else f"{request_id}#{i}"
        seqs.append(Sequence(seq_id, ids, choice, arrival, priority, lora_request, lora_key, limit))
        seqs[-1].lora_keys = lora_keys
        engine.structured.attach(seqs[-1])
    texts = [sequence_text(engine.tokenizer, engine.config.detokenize, params) for _ in seqs]
    engine.requests.add(RequestGroup(request_id, text, ids, seqs, texts, params.n), prefill_only)
    for s in seqs:
        engine.scheduler.add_request(s)
    engine.counters.prompt_tokens += len(ids)
