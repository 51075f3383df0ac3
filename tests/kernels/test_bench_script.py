"""bench/kernels/triton_gpu.py imports and answers --help on CPU, and its benchmark loop runs interpreted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "triton_gpu.py"


def test_help_without_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "--decode-batches" in proc.stdout


def test_cpu_smoke_run_prints_table() -> None:
    args = ["--device", "cpu", "--dtype", "float32", "--skip-check", "--hidden", "64", "--slices", "64,32"]
    args += ["--adapters", "4", "--decode-batches", "2", "--prefill-tokens", "12"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| prefill | 12 | expand |" in proc.stdout


def test_cpu_smoke_correctness_checks_pass() -> None:
    """The script's correctness part (every kernel vs the reference, the fused BGMV kernel included) on
    small problems, interpreted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["--device", "cpu", "--dtype", "float32", "--tiny", "--skip-bench"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| lora_bgmv few rows |" in proc.stdout and "FAIL" not in proc.stdout
    assert proc.stdout.count("| ok |") == 10
