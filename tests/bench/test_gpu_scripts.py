"""`bench/gpu/check.sh` and the Python pieces it calls work before a GPU shows up: the script stops at
once with a clear message without CUDA, every command line in it parses, and each piece's CPU-checkable
part runs (`bench.gpu.e2e` and `bench.gpu.step_profile` are run in test_cpu_benchmarks.py, the kernel
script in tests/kernels/test_bench_script.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu" / "check.sh"


def _step_commands() -> dict[str, list[str]]:
    """NAME -> argv (after the interpreter) of every `step NAME LIMIT "$PY" ...` line of check.sh."""
    text = CHECK.read_text().replace("\\\n", " ")
    steps = {}
    for line in text.splitlines():
        m = re.match(r'step (\w+) \d+ "\$PY" (.*)$', line.strip())
        if m:
            steps[m.group(1)] = [a.replace('"$DIR', '"/tmp') for a in shlex.split(m.group(2))]
    return steps


def test_check_script_stops_at_once_without_cuda(tmp_path) -> None:
    assert subprocess.run(["bash", "-n", str(CHECK)], capture_output=True).returncode == 0
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(CHECK), str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs a CUDA GPU" in proc.stderr
    assert not list((tmp_path / "out").glob("*.log"))  # no step ran


def test_every_command_line_of_the_check_script_parses() -> None:
    from bench.gpu import e2e, features, lora_overhead, moe_graphs, step_profile

    sys.path.insert(0, str(ROOT / "bench" / "kernels"))
    import triton_gpu

    steps = _step_commands()
    assert set(steps) == {"kernels", "parity", "moe", "overhead", "profile", "features"}
    parsers = {
        "bench.gpu.e2e": e2e.parse_args,
        "bench.gpu.lora_overhead": lora_overhead.parse_args,
        "bench.gpu.step_profile": step_profile.parse_args,
        "bench.gpu.features": features.parse_args,
        "bench.gpu.moe_graphs": moe_graphs.parse_args,
    }
    for argv in steps.values():
        if argv[0] == "-m":
            parsers[argv[1]](argv[2:])
        else:
            assert argv[0] == "bench/kernels/triton_gpu.py"
            triton_gpu.parse_args(argv[1:])
    overhead = lora_overhead.parse_args(steps["overhead"][2:])
    assert overhead.batches == [1, 64, 256] and overhead.adapters == 32 and overhead.rank == 16
    assert overhead.compare_sgmv
    assert (overhead.prefill_prompts, overhead.prefill_len, overhead.prefill_adapters) == (4, 1024, 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batches", "0,4"], "positive integers"),
        (["--batches", "a"], "comma-separated integers"),
        (["--prefill-adapters", "5"], "--prefill-adapters must be between"),
        (["--repeats", "0"], "--repeats must be at least 1"),
    ],
)
def test_overhead_script_refuses_bad_arguments(argv, message, capsys) -> None:
    from bench.gpu import lora_overhead

    with pytest.raises(SystemExit) as exc:
        lora_overhead.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("module", ["lora_overhead", "features", "moe_graphs"])
def test_scripts_say_they_need_cuda(module, capsys) -> None:
    import importlib

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert importlib.import_module(f"bench.gpu.{module}").main(["--device", "cuda"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_overhead_script_on_cpu(tmp_path, capsys) -> None:
    """Every leg of `bench.gpu.lora_overhead` at a tiny size: decode at two batches and one prefill, each
    timed for mixed adapters, base on the LoRA engine and the LoRA-disabled engine."""
    from bench.gpu import lora_overhead

    out = tmp_path / "overhead.json"
    argv = ["--device", "cpu", "--size", "tiny", "--dtype", "float32", "--adapters", "2", "--batches", "1,3"]
    argv += ["--prompt-len", "6", "--new-tokens", "3", "--prefill-prompts", "2", "--prefill-len", "12"]
    argv += ["--prefill-adapters", "2", "--repeats", "1", "--kv-gib", "0.05", "--workdir", str(tmp_path)]
    assert lora_overhead.main([*argv, "--compare-sgmv", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    legs = [(g["kind"], g["batch"], g["tokens"]) for g in result["legs"]]
    assert legs == [("decode", 1, 1), ("decode", 3, 3), ("prefill", 2, 24)]
    for g in result["legs"]:
        assert g["mixed_ms"] > 0 and g["base_ms"] > 0 and g["no_lora_ms"] > 0 and g["lora_overhead"] > 0
    assert [g["mixed_sgmv_ms"] > 0 for g in result["legs"]] == [True, True, False]  # decode legs only
    assert result["lora_engine"]["graphs"] == 0  # no CUDA graphs on CPU
    assert "| prefill | 2 | 24 |" in capsys.readouterr().out


def test_features_script_on_cpu(capsys) -> None:
    """`bench.gpu.features --device cpu --words 1`: every check on a fifth of the batch."""
    from bench.gpu import features

    assert features.main(["--device", "cpu", "--words", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("| yes |") == 4 and "5/5" in out


def test_moe_graphs_script_on_cpu(tmp_path, capsys) -> None:
    """`bench.gpu.moe_graphs --device cpu` at a tiny size: both legs' greedy tokens equal transformers',
    no graph captured (CPU), a timed run each; a bad size is refused."""
    from bench.gpu import moe_graphs

    out = tmp_path / "moe.json"
    argv = ["--device", "cpu", "--layers", "2", "--experts", "4", "--hidden", "64", "--prompts", "2"]
    argv += ["--new-tokens", "4", "--batch", "3", "--decode-tokens", "4", "--json", str(out)]
    assert moe_graphs.main(argv) == 0
    legs = json.loads(out.read_text())["legs"]
    assert [(leg["cuda_graphs"], leg["graphs_captured"], leg["tokens_equal_hf"]) for leg in legs] == [
        (True, 0, True),
        (False, 0, True),
    ]
    assert all(leg["decode_s"] > 0 for leg in legs)
    assert "| graphs / eager |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        moe_graphs.main(["--device", "cpu", "--hidden", "72"])
