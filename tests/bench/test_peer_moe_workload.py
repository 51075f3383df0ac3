"""The peer benchmark's MoE workload (`bench peer --arch qwen3_moe`): a checkpoint transformers loads as
Qwen3MoeForCausalLM, attention and expert adapters PEFT loads (the expert ones through its per-expert ->
fused conversion), on which loraplex's greedy tokens are PEFT's; and the harness's report when vLLM refuses
a leg (as vLLM CPU does any LoRA on a MoE model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.offline.moe import MoEShape
from bench.peer.moe_workload import build_moe_workload
from bench.peer.offline import main
from bench.peer.peer_result import PeerResult, root_cause
from tests.helpers.tiny_adapters import PeftGreedyOracle

TINY = MoEShape(layers=2, experts=4, top_k=2, hidden=64, expert_inter=32, heads=4, kv_heads=2, vocab=128)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return build_moe_workload(tmp_path_factory.mktemp("peer_moe"), adapters=2, requests=3, rank=4,
                              prompt_len=6, new_tokens=4, shape=TINY, expert_adapters=1)  # fmt: skip


def test_checkpoint_and_adapters_load_in_transformers_and_peft(workload):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    assert len(workload.adapters) == 2 and len(workload.expert_adapters) == 1
    assert all(len(p) == 6 and max(p) < TINY.vocab for p in workload.prompts) and len(workload.prompts) == 3
    base = AutoModelForCausalLM.from_pretrained(workload.model, dtype=torch.float32)
    assert isinstance(base, Qwen3MoeForCausalLM)
    assert base.config.num_experts == TINY.experts and base.config.num_experts_per_tok == TINY.top_k
    cfg = json.loads(Path(workload.adapters[0], "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    peft = PeftModel.from_pretrained(base, workload.expert_adapters[0])
    names = dict(peft.named_parameters())
    # PEFT read every expert's LoRA into its fused expert parameters: trained B, not its zero init
    expert_b = [p for n, p in names.items() if ".mlp.experts" in n and "lora_B" in n]
    assert len(expert_b) == 2 * TINY.layers and all(p.abs().sum() > 0 for p in expert_b)
    attn_b = [p for n, p in names.items() if ".self_attn." in n and "lora_B" in n]
    assert len(attn_b) == 4 * TINY.layers and all(p.abs().sum() > 0 for p in attn_b)


@pytest.mark.slow
def test_loraplex_tokens_equal_peft_on_the_workload(workload):
    """What the benchmark's token agreement stands on: base, an attention adapter and an expert adapter."""
    from engine import LLM, LoRARequest, SamplingParams

    oracle = PeftGreedyOracle(workload.model)
    llm = LLM(workload.model, device="cpu", dtype="float32", max_loras=3, max_lora_rank=16)
    params = SamplingParams(max_tokens=workload.new_tokens, temperature=0.0, ignore_eos=True)
    for adapter in (None, workload.adapters[1], workload.expert_adapters[0]):
        lr = LoRARequest(adapter.rsplit("/", 1)[-1], adapter) if adapter else None
        outs = llm.generate(workload.prompts, params, lora_request=lr)
        got = [list(o.outputs[0].token_ids) for o in outs]
        want = [oracle.greedy(p, workload.new_tokens, adapter) for p in workload.prompts]
        assert got == want, adapter


def test_root_cause_names_the_workers_exception():
    log = [
        "(MainProcess pid=1) WARNING 12-01 [base.py:380] ValueError: Tokenizer not available\n",
        "(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063]     compute_type = tl.float32\n",
        "(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063] AttributeError: module 'triton.language' "
        "has no attribute 'float32'\n",
        "(EngineCore pid=3) ERROR 12-01 [core.py:1512] RuntimeError: Worker failed with error 'x'\n",
    ]
    assert (
        root_cause(log, "EngineDeadError")
        == "AttributeError: module 'triton.language' has no attribute 'float32'"
    )
    assert root_cause(log[:1], "EngineDeadError: see above") == "EngineDeadError: see above"


def test_report_without_vllm_lora_legs():
    """vLLM ran only its LoRA-off base: the report compares that, says what was refused, and does not fail."""
    r = PeerResult(32, 4, 16, 8, 8, 2, "float32", model="random Qwen3-MoE", expert_adapters=2)
    r.seconds = {"mixed": 2.0, "base": 1.0, "experts": 2.5, "vllm_base_compiled": 3.0}
    r.refused = {"vllm (LoRA enabled)": "AttributeError: no triton"}
    r.agree = {"base vs compiled": 1.0}
    r.load_avg = [1.0, 2.0]
    md = r.markdown()
    assert "LoRA off, compiled): **3.00x**" in md and "expert adapters: 1.20x" in md
    assert "vLLM refused vllm (LoRA enabled): `AttributeError: no triton`" in md
    assert "base vs compiled 100%" in md and "model: random Qwen3-MoE" in md


def test_cli_refuses_expert_adapters_without_moe(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--vllm-python", "/bin/sh", "--expert-adapters", "2", "--workdir", str(tmp_path)])
    assert "--expert-adapters needs --arch qwen3_moe" in capsys.readouterr().err
