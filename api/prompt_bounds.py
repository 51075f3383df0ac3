"""The bounds every generation request is held to before it reaches the engine: prompts × n, prompt length
(in characters before tokenizing, in tokens after), the token ids' vocabulary, and prompt + max_tokens
within the context and the KV cache; and the body mapped to the engine's `SamplingParams`."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from api.errors import APIError
from api.openai_protocol import SamplingFields
from engine.request_tokens import resolve_request_tokens
from engine.sampling_params import SamplingParams, SamplingParamsError
from kernels.intmath import cdiv


def check_choices(state, num_prompts: int, n: int) -> None:
    """400 when prompts × n exceeds what one request may fan out to."""
    limit = state.settings.max_choices_per_request
    if num_prompts * n > limit:
        raise APIError(
            400,
            f"{num_prompts} prompts × n={n} = {num_prompts * n} choices; at most {limit} per request",
            param="n",
        )


def check_prompt_chars(state, texts: list[str], param: str = "prompt") -> None:
    """400 `context_length_exceeded` when a prompt text is too long to be worth tokenizing."""
    info = state.client.info
    limit = state.settings.prompt_char_limit(info.max_model_len)
    longest = max((len(t) for t in texts), default=0)
    if longest > limit:
        raise APIError(
            400,
            f"prompt has {longest} characters; at most {limit} are accepted "
            f"(this model's context is {info.max_model_len} tokens)",
            param=param,
            code="context_length_exceeded",
        )


async def tokenize_prompts(state, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of every prompt (text or ids): text is length-checked first and tokenized off the event
    loop; 400 for text without a tokenizer, ids out of the vocabulary, empty or over-long prompts."""
    info = state.client.info
    texts = [p for p in prompts if isinstance(p, str)]
    check_prompt_chars(state, texts)
    if texts and state.tokenizer is None:
        raise APIError(
            400, "this model has no tokenizer; send the prompt as a list of token ids", param="prompt"
        )
    for p in prompts:
        if not isinstance(p, str):
            check_context(state, len(p))
            if any(t >= info.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {info.vocab_size})", param="prompt")
    encoded: list[list[int]] = []
    if texts:
        encoded = await run_in_threadpool(lambda: [list(state.tokenizer.encode(t)) for t in texts])
    it = iter(encoded)
    ids: list[list[int]] = [next(it) if isinstance(p, str) else list(p) for p in prompts]
    for p in ids:
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        check_context(state, len(p))
    return ids


def check_context(state, num_tokens: int) -> None:
    """400 `context_length_exceeded` when a prompt of `num_tokens` leaves no room in the context."""
    info = state.client.info
    if num_tokens >= info.max_model_len:
        raise APIError(
            400,
            f"prompt has {num_tokens} tokens; this model's context is {info.max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )


def sampling_params(
    state, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The engine's `SamplingParams` for each choice: 400 if a prompt or prompt + max_tokens cannot fit."""
    info = state.client.info
    longest = max(len(p) for p in prompts)
    check_context(state, longest)
    if max_tokens is None:
        max_tokens = info.max_model_len - longest
    total = min(longest + max_tokens, info.max_model_len)
    if cdiv(total, info.block_size) > info.num_kv_blocks:
        raise APIError(
            400,
            f"prompt + max_tokens ({total} tokens) exceed the KV cache "
            f"({info.num_kv_blocks * info.block_size} tokens)",
            param="max_tokens",
        )
    try:
        params = body.to_sampling_params(max_tokens, logprobs)
        # bad_words tokenized here (small: bounded words) so a bad one is a 400 naming it; token ids
        # checked against the vocabulary. The engine checks the result again.
        params = resolve_request_tokens(params, state.tokenizer, info.vocab_size)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
    if body.stream and params.best_of is not None and params.best_of > params.n:
        raise APIError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")
    return params
