"""Without a working C compiler the CPU engine falls back to the torch LoRA path, or says why it cannot."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.lora.backend import select_lora_backend
from kernels import lora_bgmv_cpu

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No cached build and a compiler that does not exist; the real build is restored afterwards."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lora_bgmv_cpu.forget_library()
    yield
    lora_bgmv_cpu.forget_library()


def test_auto_picks_native_when_the_kernel_builds():
    assert select_lora_backend("auto", CPU, F32, F32) == "native"
    assert select_lora_backend("auto", CPU, torch.float16, F32) == "native"
    assert select_lora_backend("auto", CPU, torch.bfloat16, torch.bfloat16) == "native"  # bf16 activations
    assert select_lora_backend("auto", CPU, torch.float32, torch.bfloat16) == "native"  # wider pages


def test_auto_falls_back_to_torch_without_a_compiler(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.lora.backend"):
        assert select_lora_backend("auto", CPU, F32, F32) == "torch"
    assert "does not run" in caplog.text
    with pytest.raises(ValueError, match="lora backend 'native' is not available: C compiler"):
        select_lora_backend("native", CPU, F32, F32)
