"""The two servers of the online peer benchmark (`bench.peer.online`), each on a free loopback port.

`loraplex serve` gets a fresh data dir with the adapters registered and active under their names;
vLLM's OpenAI server (run by its virtualenv's Python) gets them as `--lora-modules NAME=DIR` and the
offline peer benchmark's CPU environment (`bench.peer.offline.vllm_env`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


def vllm_server_cmd(
    vllm_python: Path, model: str, adapters: dict[str, str], port: int, max_lora_rank: int, dtype: str
) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port` serving `adapters` (name -> PEFT dir) as LoRA modules."""
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--seed", "0"]
    cmd += ["--skip-tokenizer-init", "--enable-lora", "--lora-modules"]
    cmd += [f"{name}={path}" for name, path in adapters.items()]
    cmd += ["--max-loras", str(len(adapters)), "--max-lora-rank", str(max_lora_rank)]
    return cmd


def vllm_server_env(vllm_python: Path, threads: int, bind: str) -> dict[str, str]:
    """The offline peer benchmark's vLLM environment with VLLM_CPU_OMP_THREADS_BIND=`bind`; with "auto"
    OMP_NUM_THREADS is left unset, so vLLM sizes its worker's threads to the cores it binds."""
    from bench.peer.offline import vllm_env

    env = vllm_env(vllm_python, threads)
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if bind == "auto":
        env.pop("OMP_NUM_THREADS", None)
    return env


@contextlib.contextmanager
def peer_server(
    system: str,
    workdir: Path,
    model: str,
    named: dict[str, str],
    threads: int,
    max_lora_rank: int,
    dtype: str,
    vllm_python: Path | None,
    vllm_bind: str,
) -> Iterator[str]:
    """`system`'s server on a free loopback port serving `model` + the `named` adapters; yields its URL."""
    from bench.serving.server_process import free_port, loraplex_cmd, loraplex_env, serving

    port = free_port()
    if system == "loraplex":
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            env = loraplex_env(Path(tmp), Path(model), {k: Path(v) for k, v in named.items()})
            cmd = loraplex_cmd(Path(model), port, threads, len(named), max_lora_rank, dtype)
            with serving(cmd, env, port, "`loraplex serve`", workdir / "loraplex-serve.log") as url:
                yield url
        return
    assert vllm_python is not None
    env = vllm_server_env(vllm_python, threads, vllm_bind)
    cmd = vllm_server_cmd(vllm_python, model, named, port, max_lora_rank, dtype)
    with serving(cmd, env, port, "vLLM's OpenAI server", workdir / "vllm-serve.log", 900) as url:
        yield url
