#!/usr/bin/env python3
"""Development: where a kernel's warp-stall samples are, from ncu's source page exports.

usage: ncu_src_top.py FILE.csv [N]          the CUDA source lines with the most samples (--print-source cuda)
       ncu_src_top.py --phases FILE.csv[.gz] the SASS (--print-source sass) cut at the CTA barriers: per phase its
                                             share of the samples, warp instructions per CTA (CTAS, default 8192),
                                             top opcodes and top stall reasons
nvcc 13's line tables did not always reach ncu's CUDA view (a source export without metric columns): then use
--phases on the SASS export, which always has them."""
import collections
import csv
import gzip
import os
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def top_lines(path, n):
    rows = list(csv.reader(open(path, errors="replace")))
    hi = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
    head = rows[hi]
    col = {c.strip(): i for i, c in enumerate(head)}
    samp = next((i for c, i in col.items() if c.startswith("Warp Stall Sampling (All")), None)
    if samp is None:
        print(f"{path}: no stall-sampling column (no line table in the export); use --phases on the SASS export")
        return
    src = col["Source"]
    line = col.get("#", col.get("Line", 0))
    inst = next((i for c, i in col.items() if c.startswith("Instructions Executed")), None)
    data = [r for r in rows[hi + 1:] if len(r) == len(head)]
    tot = sum(num(r[samp]) for r in data) or 1.0
    print(f"{path}: {len(data)} lines, {tot:.0f} stall samples")
    for r in sorted(data, key=lambda r: -num(r[samp]))[:n]:
        print(f"{num(r[samp]) / tot * 100:5.1f}%  {r[line]:>5}  inst {num(r[inst]) if inst is not None else 0:>11.0f}  "
              f"{r[src].strip()[:110]}")


def phases(path):
    f = gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")
    rows = list(csv.reader(f))
    hi = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    head = rows[hi]
    col = {c: i for i, c in enumerate(head)}
    samp, inst, src = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"], col["Source"]
    reasons = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
    data = [r for r in rows[hi + 1:] if len(r) == len(head)]
    tot = sum(num(r[samp]) for r in data) or 1.0
    warps = num(data[0][inst]) or 1.0  # the kernel's first instruction runs once per warp
    print(f"{path}: {len(data)} SASS instructions, {sum(num(r[inst]) for r in data) / warps:.0f} instructions per "
          f"warp ({warps:.0f} warps), {tot:.0f} stall samples")
    start = 0
    for idx, r in enumerate(data):
        if "BAR.SYNC" not in r[src] and "BAR.RED" not in r[src] and idx != len(data) - 1:
            continue
        seg, start = data[start:idx + 1], idx + 1
        st = sum(num(x[samp]) for x in seg)
        if st / tot < 0.004:
            continue
        n = sum(num(x[inst]) for x in seg) or 1.0
        ops, why = collections.Counter(), collections.Counter()
        for x in seg:
            t = x[src].split()
            ops[(t[1] if t[0].startswith("@") else t[0]).split(".")[0]] += num(x[inst])
            for c in reasons:
                why[c[6:]] += num(x[col[c]])
        print(f"[{idx - len(seg) + 1:5d}-{idx:5d}] stall {st / tot * 100:5.1f}%  inst/warp {n / warps:6.0f}  "
              + " ".join(f"{o}:{v / n * 100:.0f}" for o, v in ops.most_common(5)) + " | "
              + " ".join(f"{o}:{v / max(st, 1) * 100:.0f}" for o, v in why.most_common(3)))


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phases":
        phases(sys.argv[2])
    else:
        top_lines(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)


if __name__ == "__main__":
    main()
