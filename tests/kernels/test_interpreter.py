"""The tests run the real @triton.jit kernels (interpreted), and the launchers are torch custom ops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.reference as reference
from kernels import lora_expand, lora_shrink, paged_attention
from kernels._common import is_interpreted
from tests.kernels.lora_case import make_case

REPO = Path(__file__).resolve().parents[2]


def test_kernels_are_interpreted_triton_functions() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for kernel in (
        lora_shrink._lora_shrink_kernel,
        lora_expand._lora_expand_kernel,
        paged_attention._write_kv_kernel,
        paged_attention._attention_kernel,
    ):
        assert is_interpreted(kernel), f"{kernel} was imported before TRITON_INTERPRET=1 was set"


def test_launchers_never_call_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in dir(reference):
        if name.endswith("_ref"):
            monkeypatch.setattr(reference, name, lambda *a, **k: pytest.fail("reference called"))
    case = make_case([[4, 16]], [1, 0, 1], 16, [16], 8, torch.float32)
    out = torch.zeros(1, 3, 16)
    lora_shrink.lora_shrink(case.x, case.a_pools, case.page_table, case.ranks, case.meta, out)
    assert out.abs().sum() > 0


def test_custom_ops_registered_and_compile() -> None:
    for name in ("lora_shrink", "lora_expand", "write_kv", "paged_attention"):
        assert hasattr(torch.ops.loraplex, name)
    case = make_case([[4, 16], [8, 0]], [1, 0, -1, 1], 16, [16, 8], 8, torch.float32)

    def lora(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = torch.empty(2, x.shape[0], 16)
        lora_shrink.lora_shrink(x, case.a_pools, case.page_table, case.ranks, case.meta, v)
        lora_expand.lora_expand(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, y)
        return y

    x = case.x.nan_to_num()
    expected = lora(x, torch.zeros(4, 24))
    compiled = torch.compile(lora, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, torch.zeros(4, 24)), expected)


def test_kernels_compile_for_cuda_sm90() -> None:
    """The real Triton compiler (not the interpreter) accepts every kernel; needs no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.cuda_compile_check", "bfloat16", "float32"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 16
