"""matplotlib PNGs of the benchmark results for `docs/` (matplotlib is imported only when plotting)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_offline(result, path: Path) -> None:
    """Bar chart of output tokens/s: mixed adapters, base only, HF PEFT, and the GEMM-limit decode rate."""
    plt = _pyplot()
    names = [f"loraplex\n{result.adapters} adapters", "loraplex\nbase only"]
    vals = [result.mixed.tokens_per_s, result.base.tokens_per_s]
    if result.hf_peft_s is not None:
        names.append("HF + PEFT\nmixed batch")
        vals.append(result.mixed.output_tokens / result.hf_peft_s)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, vals, color=["tab:blue", "tab:gray", "tab:red"][: len(vals)])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline: {result.requests} requests, {result.prompt_len}+{result.new_tokens} tokens (CPU)")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(result, path: Path) -> None:
    """Throughput and its byte floor, and pool hit rate, vs number of distinct adapters (log x)."""
    plt = _pyplot()
    xs = [p.adapters for p in result.points]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, [p.run.tokens_per_s for p in result.points], "o-", color="tab:blue", label="all steps")
    ax.plot(xs, [p.run.decode_tokens_per_s for p in result.points], "d-", color="tab:green", label="decode")
    floor = [p.run.decode_floor_tokens_per_s for p in result.points]
    ax.plot(xs, floor, "^:", color="tab:gray", label="decode byte floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters")
    ax.set_ylabel("output tokens / s", color="tab:blue")
    ax.legend(loc="lower left", fontsize=8)
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * p.run.pool_hit_rate for p in result.points], "s--", color="tab:orange")
    ax2.set_ylabel("pool hit rate (%)", color="tab:orange")
    ax2.set_ylim(0, 105)
    ax.set_title(f"Adapter scaling (ranks 8-64, pool {result.pool_pages} pages/projection)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cold_load(result, path: Path) -> None:
    """Step times of the running batch around the newcomer's arrival, resident vs cold adapter."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for cold, color in ((False, "tab:gray"), (True, "tab:red")):
        r = min((r for r in result.runs if r.cold == cold), key=lambda r: r.extra_s)
        xs = [i - r.inject_at for i in range(len(r.step_s))]
        label = "cold adapter" if cold else "resident adapter"
        ax.plot(xs[1:], [1e3 * s for s in r.step_s[1:]], ".-", color=color, label=label)
    ax.axvline(0, color="k", lw=0.8, ls=":")
    ax.set_xlabel("step (0 = newcomer arrives)")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"Cold load of a rank-{result.rank} adapter, batch {result.batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_history(points: list[dict], path: Path, goal: float = 1.15) -> None:
    """Benchmark 1 across milestones: LoRA overhead (with the goal) and decode step times, side by side."""
    plt = _pyplot()
    labels = [p["label"] for p in points]
    xs = range(len(points))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(xs, [p["lora_overhead"] for p in points], "o-", color="tab:blue")
    left.axhline(goal, color="tab:green", linestyle="--", label=f"goal {goal}x")
    left.set_ylabel("mixed 32 adapters / base time")
    left.set_title("LoRA overhead")
    left.legend()
    right.plot(xs, [p["mixed_decode_ms"] for p in points], "o-", color="tab:blue", label="32 adapters")
    right.plot(xs, [p["base_decode_ms"] for p in points], "o-", color="tab:gray", label="base only")
    right.set_ylabel("ms per decode step (batch 32)")
    right.set_title("Decode step")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(list(xs), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_online_peer(result, path: Path) -> None:
    """Online peer benchmark: output tok/s and p99 TTFT (log y, with the bound) vs offered rate per server."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"loraplex": "tab:blue", "vLLM": "tab:red"}
    for system, rates in result.rates.items():
        xs = [r.rate for r in rates]
        color = colors.get(system, "tab:gray")
        left.plot(xs, [r.output_tokens_per_s for r in rates], "o-", color=color, label=system)
        right.plot(xs, [max(r.ttft_p99, 1e-3) for r in rates], "o-", color=color, label=system)
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("output tokens / s")
    left.set_ylim(bottom=0)
    left.set_title("Throughput")
    right.axhline(
        result.ttft_bound, color="tab:green", linestyle="--", label=f"bound {result.ttft_bound:g} s"
    )
    right.set_yscale("log")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("p99 TTFT (s)")
    right.set_title("p99 time to first token")
    for ax in (left, right):
        ax.legend()
    fig.suptitle(f"Online, {result.adapters} adapters, {result.threads} threads, {result.dtype} (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_disagg(points: list[tuple[str, dict]], path: Path) -> None:
    """Grouped bars of the steady streams' ITL p99 and p99.9 (median, min–max whiskers), colocated vs
    disaggregated, one group per `(label, summary)` (`bench.cluster.disagg_report.summary`; log y)."""
    plt = _pyplot()
    bars = [
        ("colocated", "itl_p99_ms", "colocated p99", "tab:gray"),
        ("disaggregated", "itl_p99_ms", "disaggregated p99", "tab:blue"),
        ("colocated", "itl_p999_ms", "colocated p99.9", "silver"),
        ("disaggregated", "itl_p999_ms", "disaggregated p99.9", "lightsteelblue"),
    ]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for j, (setup, key, name, color) in enumerate(bars):
        xs, med, lo, hi = [], [], [], []
        for i, (_, summ) in enumerate(points):
            cell = summ.get(setup, {}).get(key)
            if cell is None:
                continue
            xs.append(i + (j - (len(bars) - 1) / 2) * width)
            med.append(cell["median"])
            lo.append(cell["median"] - cell["min"])
            hi.append(cell["max"] - cell["median"])
        if xs:
            ax.bar(xs, med, width, yerr=[lo, hi], color=color, label=name, capsize=2)
    ax.set_xticks(range(len(points)), [label for label, _ in points], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("inter-token latency (ms)")
    title = "Decode streams' ITL tail, colocated vs prefill/decode disaggregated (same cores)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
