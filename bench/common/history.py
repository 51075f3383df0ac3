"""Plot benchmark 1 across milestones (`docs/bench_history.json`) for `docs/benchmarks.md`.

    python -m bench.common.history docs/bench_history.json docs/bench_history.png

Each point is a recorded result (LoRA overhead, decode step times of one `bench.offline.throughput` run,
1 thread), added by hand with the run that produced it, so the chart shows where the numbers moved.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("history", type=Path, help="JSON file with a 'points' list")
    ap.add_argument("png", type=Path, help="where to write the chart")
    args = ap.parse_args(argv)
    points = json.loads(args.history.read_text())["points"]
    from bench.common.plots import plot_history

    plot_history(points, args.png)


if __name__ == "__main__":
    main()
