"""Tensor parallel at TP=2 for what the family tests leave out: a GGUF checkpoint (llama's permuted q/k,
dequantized, then cut per rank) equal to transformers + PEFT on the same file; the CPU thread governor
deciding for every rank (its thread count travels in each step's plan) with unchanged tokens; and decode
graphs per rank (`EagerReplay` on CPU: each rank's static buffers, padded buckets, LoRA kernels) equal to
PEFT with mixed adapters, also after a worker is killed and the group restarts. Two TP=2 engines (one per
checkpoint) shared by the module."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.distributed import step_plan as sp
from tests.helpers.gguf_files import build_gguf_pair, hf_gguf_model
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

ADAPTERS = ("all7-r4", "qv-r8-rslora", "pattern-r16")
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3], [7, 8, 40, 2, 11, 19, 23], [33, 4], [61, 62, 63, 9, 17], [12, 13, 14]]
NAMES = ["all7-r4", None, "qv-r8-rslora", "pattern-r16", "all7-r4"]


def _loras(dirs, names):
    return [LoRARequest(n, str(dirs[n])) if n else None for n in names]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def gguf_setup(tmp_path_factory):
    """A Q8_0 llama GGUF, adapters trained against its source checkpoint, the HF(gguf) + PEFT tokens of
    `PROMPTS` on `NAMES`, and a TP=2 engine on the file with two threads per rank and the governor on."""
    from peft import PeftModel

    root = tmp_path_factory.mktemp("tp-gguf")
    hf, gguf = build_gguf_pair(root, "llama", "Q8_0")
    dirs = {n: build_adapter(hf, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(ADAPTERS)}
    want = []
    for prompt, name in zip(PROMPTS, NAMES, strict=True):
        model = hf_gguf_model(gguf)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(dirs[name])).eval()
        want.append(_hf_greedy(model, prompt))
    llm = LLM(
        str(gguf),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_lora_rank=32,
        tensor_parallel_size=2,
        num_threads=4,
        adaptive_threads=True,
    )
    yield llm, dirs, want
    llm.engine.shutdown()


def test_gguf_mixed_adapters_equal_transformers_on_the_file(gguf_setup):
    llm, dirs, want = gguf_setup
    outs = llm.generate(PROMPTS, GREEDY, lora_request=_loras(dirs, NAMES))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_thread_governor_sets_every_ranks_threads(gguf_setup):
    """Rank 0's governor runs under TP (2 threads per rank); a drop to one thread and the retry back to
    two reach the workers in the step plans that follow, and the tokens stay HF's."""
    llm, dirs, want = gguf_setup
    eng = llm.engine
    gov = eng.thread_governor
    assert gov is not None and gov.max_threads == 2 and gov.overhead is not None
    sent: list[int] = []
    group = eng.tp.group
    send = group._send

    def spy(frame: bytes) -> None:
        kind, arrays = sp.decode(frame)
        if kind == sp.STEP:
            sent.append(sp.decode_step(arrays).num_threads)
        send(frame)

    group._send = spy  # type: ignore[method-assign]
    try:
        gov.window_s = math.inf  # no decision from this test's own timings (the machine is shared)
        now = time.monotonic() + 100.0  # later than any drop the first test's timings made
        gov.decide(0.1, now=now)  # contention: one thread, for every rank
        assert torch.get_num_threads() == 1
        outs = llm.generate(PROMPTS, GREEDY, lora_request=_loras(dirs, NAMES))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sent and set(sent) == {1}
        sent.clear()
        gov.decide(1.0, now=now + gov.wait_s + 1.0)  # a whole core again, after the wait: back to two
        assert torch.get_num_threads() == 2
        outs = llm.generate(PROMPTS[:2], GREEDY, lora_request=_loras(dirs, NAMES[:2]))
        assert [o.outputs[0].token_ids for o in outs] == want[:2]
        assert sent and set(sent) == {2}
    finally:
        group._send = send  # type: ignore[method-assign]
        gov.window_s = 0.25


@pytest.fixture(scope="module")
def graphs_setup(tmp_path_factory):
    """A llama, its adapters, the PEFT oracle and a TP=2 engine on the Triton paths (interpreted on CPU)
    whose ranks each captured their decode graphs for batches of up to 4."""
    from engine.decode_graphs import enable_decode_graphs

    root = tmp_path_factory.mktemp("tp-graphs")
    base = build_checkpoint(root / "base", "llama")
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(ADAPTERS)}
    llm = LLM(
        str(base),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_lora_rank=32,
        tensor_parallel_size=2,
        attention_backend="triton",
        lora_backend="triton",
        distributed_timeout=10.0,
    )
    eng = llm.engine
    assert eng.runner.graphs is None
    assert enable_decode_graphs(eng.runner, eng.lora, 4)
    yield llm, dirs, PeftGreedyOracle(base)
    eng.shutdown()


def _counting_replays(graphs) -> list[int]:
    """Count `graphs.run` calls (each a replay on every rank) into the returned list's one element."""
    count = [0]
    run = graphs.run

    def counted(inp, lora):
        count[0] += 1
        return run(inp, lora)

    graphs.run = counted
    return count


def test_decode_graphs_per_rank_equal_peft(graphs_setup):
    llm, dirs, oracle = graphs_setup
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (4, "bgmv") in graphs.captured and (4, None) in graphs.captured
    replays = _counting_replays(graphs)
    # three rows in the bucket of 4: every rank's replay pads a row (a rank running eagerly instead would
    # all-reduce 3 rows against 4)
    prompts, names = PROMPTS[:3], NAMES[:3]
    outs = llm.generate(prompts, GREEDY, lora_request=_loras(dirs, names))
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW, dirs[name] if name else None), name
    assert replays[0] >= NEW - 1  # the decode steps replayed (the prefills ran eagerly)


def test_decode_graphs_captured_again_after_a_restart(graphs_setup):
    """A killed worker ends the in-flight requests; the new workers capture their graphs with rank 0's
    capture again, and the next batch replays and equals PEFT."""
    llm, dirs, oracle = graphs_setup
    eng = llm.engine
    restarts = eng.tp.group.restarts
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    ended = [o for _ in range(3) for o in eng.step() if o.finished]  # prefill, then replayed decodes
    os.kill(eng.tp.group.worker_pids()[0], signal.SIGKILL)
    while eng.has_unfinished_requests():
        ended += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in ended] == ["a"] and ended[0].error and "retry" in ended[0].error
    assert eng.tp.group.restarts == restarts + 1
    replays = _counting_replays(eng.runner.graphs)
    prompts, names = PROMPTS[1:4], NAMES[1:4]
    outs = llm.generate(prompts, GREEDY, lora_request=_loras(dirs, names))
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW, dirs[name] if name else None), name
    assert replays[0] >= NEW - 1
