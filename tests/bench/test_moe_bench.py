"""The MoE vs dense benchmark on a tiny shape: it runs, its parameter counts are the models' own, and the
candidate grouped-GEMM CPU formulation computes what the engine's MoE block computes."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from bench.offline.moe import MoEShape, build_models, grouped_experts, main, streamed_experts

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


def test_candidate_formulations_equal_the_block(tmp_path):
    from engine.model.loader import load_model
    from engine.model.moe import SparseMoE
    from engine.model_config import ModelConfig

    moe_dir, _ = build_models(tmp_path, TINY)
    model = load_model(ModelConfig.from_dir(moe_dir), torch.float32, torch.device("cpu"))
    block = next(m for m in model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(9, TINY.hidden)
    torch.testing.assert_close(grouped_experts(block, x), block(x), rtol=1e-5, atol=1e-6)
    for max_rows in (0, 4, 64):  # nothing, the small experts, every expert streamed
        torch.testing.assert_close(streamed_experts(block, x, max_rows), block(x), rtol=1e-5, atol=1e-6)


def test_cli_runs_both_models_per_batch(tmp_path, capsys):
    args = ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "64", "--expert-inter", "32",
            "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--batches", "1,3", "--new-tokens", "3",
            "--rounds", "1", "--moe-block", "--workdir", str(tmp_path)]  # fmt: skip
    args += ["--json", str(tmp_path / "r.json")]
    r = main(args)
    assert r.shape == asdict(TINY)
    assert [p.batch for p in r.points] == [1, 3] and [b.rows for b in r.blocks] == [1, 3]
    assert all(p.moe_step_ms > 0 and p.dense_step_ms > 0 for p in r.points)
    out = capsys.readouterr().out
    assert "| decode batch | MoE step | dense step | MoE / dense |" in out and "grouped_mm" in out
    assert TINY.step_bytes_ratio(1) == pytest.approx(TINY.active_params(True) / TINY.active_params(False))
    assert 1 < TINY.step_bytes_ratio(3) < TINY.step_bytes_ratio(64)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["points"][1]["ratio"] == pytest.approx(r.points[1].ratio)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_gpu_check_needs_cuda():
    from bench.kernels import fused_moe_gpu

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fused_moe_gpu.main(["--tokens", "1"])
