"""The vLLM side of the offline peer benchmark from loraplex's end: its environment and one long-lived
`vllm_runner.py` process (`VllmProcess`), plus the wait for it to go idle between legs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import deque
from pathlib import Path

from bench.common.settle import wait_quiet
from bench.peer.peer_result import root_cause

RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_env(vllm_python: Path, threads: int) -> dict[str, str]:
    """The environment vLLM CPU ran best with here: KV space, thread binding, its venv's libgomp."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    venv = Path(vllm_python).parent.parent
    gomp = sorted(venv.glob("lib/python3*/site-packages/torch/lib/libgomp*.so*"))
    if gomp:
        env["LD_PRELOAD"] = str(gomp[0])
    return env


class VllmProcess:
    """A `vllm_runner.py` process: one loaded `vllm.LLM`, one command at a time."""

    def __init__(self, vllm_python: Path, spec: Path, threads: int, log: Path) -> None:
        self._log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.lines: deque[str] = deque(maxlen=2000)  # its latest stdout lines other than answers (its log)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(vllm_python), str(RUNNER), str(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=vllm_env(vllm_python, threads),
        )
        self.ready = self._read()["ready"]
        self.start_s = time.perf_counter() - t0

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                return json.loads(line[5:])
            self.lines.append(line)
            self._log.write(line)
            self._log.flush()
        raise RuntimeError(f"the vLLM runner exited (code {self.proc.wait()}); see {self._log.name}")

    def run(self, cmd: str) -> dict:
        """The runner's answer to `cmd`; a refusal (`{"error": ...}`) carries the log's root cause and, with
        `dead`, whether the engine died of it (every later command would fail too)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            out |= {"dead": "EngineDead" in out["error"], "error": root_cause(self.lines, out["error"])}
        return out

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def settle(vllm: VllmProcess) -> None:
    """Wait until neither engine is still busy from its last leg (`bench/common/settle.py`)."""
    wait_quiet([vllm.proc.pid])
