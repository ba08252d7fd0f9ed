#!/usr/bin/env python3
"""Development: the source lines of an ncu `--page source --csv --print-source cuda` export that hold the most
warp-stall samples (and their instructions), to see which phase of a kernel the time sits in.
usage: ncu_src_top.py FILE.csv [N]"""
import csv
import sys


def main():
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = list(csv.reader(open(path, errors="replace")))
    hi = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
    head = rows[hi]
    col = {c.strip(): i for i, c in enumerate(head)}
    src = col["Source"]
    line = col.get("#", col.get("Line", 0))
    samp = next(i for c, i in col.items() if c.startswith("Warp Stall Sampling (All"))
    inst = next((i for c, i in col.items() if c.startswith("Instructions Executed")), None)

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0
    data = [r for r in rows[hi + 1:] if len(r) == len(head)]
    tot = sum(num(r[samp]) for r in data) or 1.0
    print(f"{path}: {len(data)} lines, {tot:.0f} stall samples")
    for r in sorted(data, key=lambda r: -num(r[samp]))[:n]:
        print(f"{num(r[samp]) / tot * 100:5.1f}%  {r[line]:>5}  inst {num(r[inst]) if inst is not None else 0:>11.0f}  "
              f"{r[src].strip()[:110]}")


if __name__ == "__main__":
    main()
