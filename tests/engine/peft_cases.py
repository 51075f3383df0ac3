"""The setup and checks the adapter engine tests share (plain LoRA per family, DoRA / lora_bias, LoRA on
embed_tokens and lm_head, modules_to_save, trainable tokens): per model family a tiny random checkpoint,
PEFT adapters built on it and the HF + PEFT greedy oracle; greedy batches checked against the oracle
(with `tests.helpers.peft_batch.check_requests`), the Triton path with decode graphs on."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.peft_batch import check_requests, cpu_llm
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter

# A plain LoRA on every projection: the reference rows of every mixed batch
PLAIN_R4: dict[str, Any] = dict(r=4, lora_alpha=8, target_modules="all-linear")

Case = tuple[Path, dict[str, Path], PeftGreedyOracle]  # (base checkpoint, {adapter name: dir}, oracle)


def build_cases(
    checkpoint, tmp_path_factory, specs: Mapping[str, Mapping[str, dict[str, Any]]], tag: str, seed: int
) -> dict[str, Case]:
    """Per family `arch` of `specs` ({arch: {adapter name: PEFT `LoraConfig` kwargs}}): its tiny checkpoint
    (the `checkpoint` fixture), the adapters built on it in a fresh `{tag}_{arch}` directory (the i-th
    with random weights of seed `seed + i`), and the PEFT oracle on it."""
    out = {}
    for arch, arch_specs in specs.items():
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"{tag}_{arch}")
        dirs = {
            n: build_adapter(base, root / n, seed=seed + i, **s)
            for i, (n, s) in enumerate(arch_specs.items())
        }
        out[arch] = (base, dirs, PeftGreedyOracle(base))
    return out


def check_greedy(
    llm: LLM,
    dirs: Mapping[str, Path],
    oracle: PeftGreedyOracle,
    prompts: list[list[int]],
    names: list[str | None],
    new: int,
) -> None:
    """`prompts[i]` on adapter `names[i]` (None: the base model), all in one batch: `new` greedy tokens
    each, equal to the oracle's (`check_requests`)."""
    check_requests(llm, dirs, oracle, list(zip(prompts, names, strict=True)), new)


def triton_llm_replaying_plain_lora(base: Path, dirs: Mapping[str, Path], oracle: PeftGreedyOracle) -> LLM:
    """An engine on the CUDA path (Triton attention and SGMV, interpreted on CPU) with decode graphs on
    (`EagerReplay`), after checking that a plain-LoRA request (`dirs["plain-r4"]`) captures graphs with
    LoRA and equals PEFT."""
    from engine.decode_graphs import EagerReplay

    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton")
    eng = llm.engine
    eng.runner.use_decode_graphs(EagerReplay(), eng.lora.pool, max_batch=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params, lora_request=[LoRARequest("plain-r4", str(dirs["plain-r4"]))])
    assert eng.runner.graphs is not None and any(lo for _, lo in eng.runner.graphs.captured)
    assert plain[0].outputs[0].token_ids == oracle.greedy([5, 6, 7], 4, dirs["plain-r4"])
    return llm
