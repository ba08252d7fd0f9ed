#!/usr/bin/env python3
"""Development: a gcov file of the emulated chunk kernel (dev/bwd_emu/run.sh profile) summed by device function and
by call site of the tensor-core products: executions per CUDA thread (a warp's lanes each count, so per thread =
per warp), a proxy for where the kernel's instructions go. usage: line_profile.py bwd_chunk.emu.h.gcov"""
import re
import sys

rows = []
for line in open(sys.argv[1]):
    parts = line.split(":", 2)
    if len(parts) < 3:
        continue
    c = parts[0].strip()
    try:
        n = int(parts[1].strip())
    except ValueError:
        continue
    rows.append((n, 0 if c in ("-", "#####", "=====") else int(c.replace("*", "")), parts[2].rstrip()))
ctas = threads = None
cur, agg = "?", {}
for n, c, src in rows:
    m = re.match(r"(?:DEV|__global__)\s.*?(\w+)\s*\(", src)
    if m:
        cur = "kernel body" if "kda_bwd_chunk_kernel" in src else m.group(1)
    agg[cur] = agg.get(cur, 0) + c
first = next((c for n, c, s in rows if "const int tid = threadIdx.x, lane" in s), 0)  # once per thread
threads = first or 1
tot = sum(agg.values())
print(f"{threads} CUDA threads; {tot / threads:.0f} line executions per thread")
for k, v in sorted(agg.items(), key=lambda x: -x[1]):
    if v:
        print(f"  {k:24s} {v / threads:8.0f} per thread  {100 * v / tot:5.1f}%")
mma = sum(c for n, c, s in rows if re.search(r"\bmma16\(", s) and not s.startswith("DEV"))
x3 = sum(c for n, c, s in rows if "mma16_x3(" in s and not s.startswith("DEV"))
glb = sum(c for n, c, s in rows if "__ldg" in s or "<GLB>(" in s)
print(f"mma16 calls (2 mma.m16n8k8 each) {mma / threads:.0f}, mma16_x3 calls {x3 / threads:.0f}, "
      f"global-operand load lines {glb / threads:.0f} per thread")
