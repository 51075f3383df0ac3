"""The decoder's fused CPU small ops (engine/model/cpu_fused.py) in the engine: used on the CPU, greedy
tokens equal to HF transformers' and to the torch formulas' for every family, and the torch ops when the
native library cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import cpu_fused
from kernels import fused_cpu
from tests.helpers.broken_compiler import use_broken_compiler
from tests.helpers.tiny_models import ARCHS

pytestmark = pytest.mark.slow  # the HF oracle on tiny models

PROMPTS = [[5, 9, 14, 3, 77], [8] * 3, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
NEW = 8


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture
def calls(monkeypatch):
    """Counts of calls to each fused op (the real ops run)."""
    counts = dict.fromkeys(("add_rms_norm", "rope_", "silu_mul"), 0)
    for name in counts:
        real = getattr(fused_cpu.FusedStep, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(fused_cpu.FusedStep, name, spy)
    return counts


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_path_follows_hf_and_the_torch_formulas(arch, checkpoint, oracle, calls):
    ckpt = checkpoint(arch)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)
    fused = _greedy(llm)
    layers = llm.engine.model.config.num_layers
    assert calls["rope_"] >= layers and calls["silu_mul"] >= layers  # per layer of every step
    assert calls["add_rms_norm"] >= 2 * layers + 1
    assert fused == [oracle(ckpt).greedy(p, NEW) for p in PROMPTS]
    before = dict(calls)
    llm.engine.model.fused_cpu_ops = False
    assert _greedy(llm) == fused
    assert calls == before  # the switch takes the torch formulas


def test_only_cpu_tensors_of_a_supported_dtype_take_the_fused_path():
    assert cpu_fused.use_fused(torch.zeros(2, 4))
    assert not cpu_fused.use_fused(torch.zeros(2, 4), enabled=False)
    assert not cpu_fused.use_fused(torch.zeros(2, 4, device="meta"))  # as CUDA tensors: torch ops
    assert not cpu_fused.use_fused(torch.zeros(2, 4, dtype=torch.float64))


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A C compiler that fails and an empty build cache; the process's loaded library is dropped."""
    use_broken_compiler(monkeypatch, tmp_path)
    fused_cpu.forget_library()
    cpu_fused.native_dtypes.cache_clear()
    yield
    fused_cpu.forget_library()
    cpu_fused.native_dtypes.cache_clear()


def test_without_the_library_the_torch_ops_serve(no_compiler, checkpoint, oracle, calls, caplog):
    ckpt = checkpoint("qwen3")
    with caplog.at_level(logging.WARNING, logger="engine.model.cpu_fused"):
        llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, enable_lora=False)
        assert _greedy(llm) == [oracle(ckpt).greedy(p, NEW) for p in PROMPTS]
    assert all(n == 0 for n in calls.values())
    assert "fused CPU ops unavailable" in caplog.text and "not today" in caplog.text
