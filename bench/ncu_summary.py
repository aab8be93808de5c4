#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV of kernel times (`ncu --metrics gpu__time_duration.sum --csv --print-units
base`, as scripts/device/bench.sh's q30x12-profile writes it): one line per kernel and grid, with its launches,
the median and the sum of their times, the largest sum first. A decode step's kernels are the groups with a launch
per layer and step (a 12-layer model decoding 6 tokens: 72), so their medians are one layer's costs.

  python3 bench/ncu_summary.py /tmp/ferry-bench/q30x12-profile.csv [--min-launches 24]
"""

import argparse
import csv
import statistics
import sys
from collections import defaultdict


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu's CSV output (warnings before the header are skipped)")
    parser.add_argument("--min-launches", type=int, default=1, help="leave out kernels launched fewer times")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        lines = f.read().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        sys.exit(f"{args.csv}: no ncu CSV header (\"ID\", ...) found")
    rows = csv.DictReader(lines[header:])
    times = defaultdict(list)  # (kernel, grid, block) -> microseconds, in launch order
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        times[(row["Kernel Name"][:60], row["Grid Size"], row["Block Size"])].append(ns / 1000)
    groups = [(k, v) for k, v in times.items() if len(v) >= args.min_launches]
    groups.sort(key=lambda kv: -sum(kv[1]))
    print(f"{'kernel':60} {'grid':>16} {'block':>14} {'launches':>8} {'median us':>10} {'sum us':>10}")
    for (kernel, grid, block), us in groups:
        print(f"{kernel:60} {grid:>16} {block:>14} {len(us):>8} {statistics.median(us):>10.2f} {sum(us):>10.1f}")


if __name__ == "__main__":
    main()
