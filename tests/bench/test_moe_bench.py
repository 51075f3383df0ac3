"""The MoE vs dense benchmark on a tiny shape: it runs, its parameter counts are the models' own, and its
baseline leg (the CPU expert path without the native kernel) is another path computing the same block."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

import pytest
import torch

from bench.offline.moe import LEGS, MoEShape, build_models, main, op_by_op, torch_gemms

pytestmark = pytest.mark.slow  # builds and runs two engines

TINY = MoEShape(layers=2, experts=8, top_k=2, hidden=64, expert_inter=32, heads=4, kv_heads=2, vocab=128)


def test_parameter_counts_are_the_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM

    moe_dir, dense_dir = build_models(tmp_path, TINY)
    for moe, d in ((True, moe_dir), (False, dense_dir)):
        model = AutoModelForCausalLM.from_pretrained(d)
        assert sum(p.numel() for p in model.parameters()) == TINY.total_params(moe)
    # the same active parameters but for the router (experts x hidden per layer)
    assert TINY.active_params(True) - TINY.active_params(False) == TINY.layers * TINY.experts * TINY.hidden


def test_baseline_leg_takes_the_torch_gemms(tmp_path, monkeypatch):
    """Inside `torch_gemms(True)` the block never calls the native kernel, outside it does (op by op, and
    the fused decode call otherwise); same output."""
    from engine.model.loader import load_model
    from engine.model.moe import SparseMoE
    from engine.model_config import ModelConfig
    from kernels import moe_fused_cpu, moe_gemm_cpu

    moe_dir, _ = build_models(tmp_path, TINY)
    model = load_model(ModelConfig.from_dir(moe_dir), torch.float32, torch.device("cpu"))
    block = next(m for m in model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(3, TINY.hidden)
    with torch.no_grad():
        block(x)  # the kernel's one-time check
        calls: list[int] = []
        real = moe_gemm_cpu.grouped_small_gemm
        monkeypatch.setattr(
            moe_gemm_cpu, "grouped_small_gemm", lambda *a, **k: calls.append(1) or real(*a, **k)
        )
        with torch_gemms(True):
            base = block(x)
        assert calls == []
        with op_by_op(True):
            torch.testing.assert_close(block(x), base, rtol=1e-5, atol=1e-6)
        assert len(calls) == 2  # gate_up and down
        fused: list[int] = []
        real_fused = moe_fused_cpu.fused_moe_cpu
        monkeypatch.setattr(
            moe_fused_cpu, "fused_moe_cpu", lambda *a, **k: fused.append(1) or real_fused(*a, **k)
        )
        torch.testing.assert_close(block(x), base, rtol=1e-5, atol=1e-6)
        assert len(calls) == 2 and fused == [1]
        wide = torch.randn(20, TINY.hidden)  # past 16 tokens, still decode-sized by the rows-per-expert rule
        block(wide)
        assert fused == [1, 1]
        with torch_gemms(True):  # the baseline leg takes neither native path at any size
            block(wide)
        assert fused == [1, 1] and len(calls) == 2


def test_cli_runs_both_models_per_batch(tmp_path, capsys):
    args = ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "64", "--expert-inter", "32",
            "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--batches", "1,3", "--new-tokens", "3",
            "--runs", "2", "--moe-block", "--workdir", str(tmp_path)]  # fmt: skip
    args += ["--json", str(tmp_path / "r.json")]
    r = main(args)
    assert r.shape == asdict(TINY)
    assert [p.batch for p in r.points] == [1, 3] and [b.rows for b in r.blocks] == [1, 3]
    assert all(len(p.step_ms[leg]) == 2 and min(p.step_ms[leg]) > 0 for p in r.points for leg in LEGS)
    assert all(len(b.block_ms[leg]) == 2 for b in r.blocks for leg in LEGS)
    out = capsys.readouterr().out
    assert "| decode batch | MoE step | MoE step, op by op | MoE step, torch GEMMs | dense step |" in out
    assert "| rows | MoE block |" in out and "load " in out
    assert TINY.step_bytes_ratio(1) == pytest.approx(TINY.active_params(True) / TINY.active_params(False))
    assert 1 < TINY.step_bytes_ratio(3) < TINY.step_bytes_ratio(64)
    saved = json.loads((tmp_path / "r.json").read_text())
    ratios = r.points[1].ratios("moe")
    assert saved["points"][1]["ratio_moe_dense"]["median"] == pytest.approx(statistics.median(ratios))
    assert len(saved["load_before"]) == 3 and saved["runs"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_gpu_check_needs_cuda():
    from bench.kernels import fused_moe_gpu

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fused_moe_gpu.main(["--tokens", "1"])
