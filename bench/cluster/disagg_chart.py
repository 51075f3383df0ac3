"""The docs' disaggregation chart from `loraplex bench disagg --json` files, one bar group per file.

    python -m bench.cluster.disagg_chart "wide, 0.3/s=docs/a.json" "wide, 0.6/s=docs/b.json" \
        --out docs/bench_disagg.png

Each group: the steady streams' ITL p99 and p99.9 (median over the file's interleaved runs, min–max
whiskers) for the colocated and the disaggregated setup (`bench.common.plots.plot_disagg`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench.cluster.disagg_chart", description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="+", help="LABEL=FILE: a bench disagg --json file and its label")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from bench.common.plots import plot_disagg

    points = []
    for group in args.groups:
        label, sep, file = group.partition("=")
        if not sep or not Path(file).is_file():
            ap.error(f"{group!r}: expected LABEL=FILE naming an existing file")
        points.append((label, json.loads(Path(file).read_text())["summary"]))
    plot_disagg(points, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
