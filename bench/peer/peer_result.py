"""What `bench.peer.offline.run_peer` measured: best seconds per leg, per-repeat ratios, token agreement,
and what vLLM refused, as a markdown summary."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class PeerResult:
    """Best-of-N seconds per leg and the tokens each engine produced."""

    requests: int
    adapters: int
    rank: int
    prompt_len: int
    new_tokens: int
    threads: int
    dtype: str
    hogs: int = 0  # busy processes beside the `*_hog` legs
    model: str = "random Llama"  # what both engines ran (`--arch`)
    expert_adapters: int = 0  # MoE: adapters with expert LoRA (legs `experts`, `vllm_experts`)
    seconds: dict[str, float] = field(default_factory=dict)  # leg -> best seconds
    all_s: dict[str, list[float]] = field(default_factory=dict)  # leg -> seconds of every run, in order
    start_s: dict[str, float] = field(default_factory=dict)  # engine -> start-up seconds
    agree: dict[str, float] = field(default_factory=dict)  # "mixed"/"base"/... -> fraction of equal requests
    load_avg: list[float] = field(default_factory=list)
    # comparison -> vLLM seconds / loraplex seconds of each repeat, the two legs run back to back
    pairs: dict[str, list[float]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # vLLM leg -> its error (root cause)

    def tok_s(self, leg: str) -> float:
        return self.requests * self.new_tokens / self.seconds[leg]

    def markdown(self) -> str:
        lines = ["| leg | seconds (best) | output tok/s |", "|---|---|---|"]
        lines += [f"| {leg} | {s:.2f} | {self.tok_s(leg):.0f} |" for leg, s in self.seconds.items()]
        s = self.seconds
        lines.append("")
        lines.append(f"- model: {self.model}")
        if "vllm_mixed" in s:
            lines.append(
                f"- mixed {self.adapters} adapters, loraplex / vLLM: **{s['vllm_mixed'] / s['mixed']:.2f}x**"
            )
        if "vllm_base" in s:
            lines.append(f"- base only, loraplex / vLLM (LoRA on): **{s['vllm_base'] / s['base']:.2f}x**")
        if "vllm_experts" in s:
            lines.append(
                f"- {self.expert_adapters} expert adapters mixed, loraplex / vLLM: "
                f"**{s['vllm_experts'] / s['experts']:.2f}x**"
            )
        if "vllm_base_compiled" in s:
            lines.append(
                f"- base only, loraplex / vLLM (LoRA off, compiled): "
                f"**{s['vllm_base_compiled'] / s['base']:.2f}x**"
            )
            if "vllm_mixed" not in s:  # vLLM ran no adapters: loraplex with them against its base
                lines.append(
                    f"- loraplex with {self.adapters} attention adapters mixed / vLLM base (LoRA off): "
                    f"{s['vllm_base_compiled'] / s['mixed']:.2f}x"
                    + (
                        f"; with {self.expert_adapters} expert adapters: "
                        f"{s['vllm_base_compiled'] / s['experts']:.2f}x"
                        if "experts" in s
                        else ""
                    )
                )
        lines.append(
            f"- LoRA overhead (mixed / base): loraplex {s['mixed'] / s['base']:.2f}x"
            + (f", expert adapters {s['experts'] / s['base']:.2f}x" if "experts" in s else "")
            + (f", vLLM {s['vllm_mixed'] / s['vllm_base']:.2f}x" if "vllm_mixed" in s else "")
        )
        if "mixed_hog" in s and "vllm_mixed_hog" in s:
            kept = {leg: s[leg] / s[f"{leg}_hog"] for leg in ("mixed", "base", "vllm_mixed", "vllm_base")}
            lines.append(
                f"- beside {self.hogs} busy processes, throughput kept (hog / quiet): loraplex mixed "
                f"{kept['mixed']:.2f}x, base {kept['base']:.2f}x; vLLM mixed {kept['vllm_mixed']:.2f}x, "
                f"base {kept['vllm_base']:.2f}x"
            )
            mixed, base = s["vllm_mixed_hog"] / s["mixed_hog"], s["vllm_base_hog"] / s["base_hog"]
            lines.append(
                f"- beside {self.hogs} busy processes, loraplex / vLLM: "
                f"mixed **{mixed:.2f}x**, base **{base:.2f}x**"
            )
        if self.pairs:
            lines.append(
                "- loraplex / vLLM per interleaved repeat, median (range): "
                + ", ".join(
                    f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
                    for k, v in self.pairs.items()
                )
            )
        if self.start_s:
            lines.append("- start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.start_s.items()))
        if self.agree:
            lines.append("- greedy tokens equal: " + ", ".join(f"{k} {v:.0%}" for k, v in self.agree.items()))
        lines += [f"- vLLM refused {leg}: `{why}`" for leg, why in self.refused.items()]
        lines.append(f"- {self.threads} threads, {self.dtype}; load average (1 min) start / end: "
                     + " / ".join(f"{x:.1f}" for x in self.load_avg))  # fmt: skip
        return "\n".join(lines)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of requests whose token lists are equal."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


_ERROR = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception): .*)$")


def root_cause(log_lines: Iterable[str], fallback: str) -> str:
    """The first exception a vLLM log's ERROR lines name (the worker's, which the `EngineDeadError` the
    caller gets hides), else `fallback`."""
    for line in log_lines:
        m = _ERROR.search(line.strip())
        if " ERROR " in line and m and not m.group(1).startswith(("EngineDeadError", "RuntimeError: Worker")):
            return m.group(1)
    return fallback
