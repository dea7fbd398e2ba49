#!/usr/bin/env python3
"""Sums Nsight Compute's kernel times by kernel: where one profiled step's GPU time goes.

Reads the CSV that `ncu --csv --metrics gpu__time_duration.sum --log-file FILE` writes (one row
per kernel launch and metric; lines before the header, such as ncu's ==PROF== messages, are
skipped) and prints the total GPU time, the number of launches and a table of the kernels that
took the most time, each kernel named without its parameter list and namespaces and with its
template arguments shortened, as scripts/gpu_check.sh's gptprofile step records a training
step of mixtape-charlm and of its PyTorch twin:

    python3 scripts/ncu_summary.py FILE [--top N] [--label TEXT]

Times in any unit ncu writes (nsecond, usecond, msecond, second; `--print-units base` gives
nanoseconds) are read as such. Exits 1 when the file holds no kernel time.
"""
import argparse
import csv
import re
import sys

UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}


def short_name(name, width=80):
    """The kernel's name without 'void', its parameter list and its namespaces; template
    arguments kept but cut to fit `width`."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    # The parameter list: the parenthesis group that ends the name.
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    # Namespaces (the qualifiers before the last '::' outside template arguments).
    depth, cut = 0, 0
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif depth == 0 and name.startswith("::", i):
            cut = i + 2
    name = name[cut:]
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def read_times(path):
    """(kernel name, microseconds) for each row of gpu__time_duration.sum in the file."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = []
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNITS.get((row.get("Metric Unit") or "").strip())
        value = (row.get("Metric Value") or "").replace(",", "").strip()
        if unit is None or not value:
            continue
        rows.append((row.get("Kernel Name") or "?", float(value) * unit))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--label", default="")
    a = p.parse_args()
    rows = read_times(a.file)
    if not rows:
        print(f"{a.label or a.file}: no kernel times in {a.file}")
        return 1
    total = sum(t for _, t in rows)
    by_kernel = {}
    for name, t in rows:
        key = short_name(name)
        n, s = by_kernel.get(key, (0, 0.0))
        by_kernel[key] = (n + 1, s + t)
    print(f"{a.label or a.file}: {len(rows)} kernel launches, {total / 1e3:.3f} ms of GPU time, "
          f"{len(by_kernel)} kernels")
    print(f"{'share':>6} {'us':>10} {'launches':>8} {'us each':>9}  kernel")
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])
    for key, (n, s) in ranked[:a.top]:
        print(f"{100 * s / total:5.1f}% {s:10.1f} {n:8d} {s / n:9.2f}  {key}")
    rest = ranked[a.top:]
    if rest:
        s = sum(v[1] for _, v in rest)
        n = sum(v[0] for _, v in rest)
        print(f"{100 * s / total:5.1f}% {s:10.1f} {n:8d} {'':>9}  ({len(rest)} other kernels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
