"""The forward's time against the CP piece length, for tuning the auto plan (src/cp_plan.h):

    python3 bench/cp_sweep.py ["single T65536 H8[:chunks,chunks,...]" ...]

A shape is one of bench_cp.py's by name, or lengths and heads: "T8192 H8", "7000+40x30 H32" (K = V = 128).
`--plot OUT.png LOG...` draws the back-to-back times of earlier runs' output (no GPU needed).

Per shape of bench_cp.py: single calls (time_ms) and back-to-back GPU time (back_to_back_ms) with the split off,
auto, and forced pieces of the chunk counts given (default 8 to 128). No peers: it compares libkda with itself."""
import collections
import re
import sys


def plot(out, logs):
    """ms per call (back to back, the best of the runs) against the piece length, per shape; dotted: no split"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = collections.defaultdict(lambda: collections.defaultdict(list))
    for log in logs:
        shape = None
        for line in open(log):
            if line.endswith(":\n") and not line.startswith(" "):
                shape = line[:-2]
            m = re.match(r"\s+(off|auto|\d+ chunks)\s+single [\d.]+ ms\s+back-to-back ([\d.]+)", line)
            if m and m[1] != "auto":
                data[shape][0 if m[1] == "off" else int(m[1].split()[0])].append(float(m[2]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for shape, pts in data.items():
        xs = sorted(k for k in pts if k > 0)
        line, = ax.plot(xs, [min(pts[k]) for k in xs], "o-", label=shape)
        if pts[0]:
            ax.axhline(min(pts[0]), color=line.get_color(), ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("piece length (chunks of 64 tokens)")
    ax.set_ylabel("ms per call (back to back)")
    ax.set_title("libkda forward with CP forced to a piece length (dotted: no split)", fontsize=9)
    ax.legend(fontsize=7)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if len(sys.argv) > 2 and sys.argv[1] == "--plot":
    plot(sys.argv[2], sys.argv[3:])
    sys.exit(0)

import torch  # noqa: E402

import kda  # noqa: E402
from bench_cp import SHAPES  # noqa: E402
from bench_fla import call, make_inputs  # noqa: E402
from timing import back_to_back_ms, time_ms  # noqa: E402



def parse(name):
    """bench_cp.py's shape of that name, else "T<len> H<h>" or "<len>+<n>x<len>... H<h>": (lengths, HQK, HV)"""
    for n, l, a, b in SHAPES:
        if n == name:
            return l, a, b
    seqs, heads = name.split()
    lens = []
    for part in seqs.lstrip("T").split("+"):
        n, _, l = part.rpartition("x")
        lens += [int(l)] * (int(n) if n else 1)
    h = int(heads.lstrip("H"))
    return lens, h, h


names = sys.argv[1:] or ["single T65536 H8", "B1 T32768 H32"]
with torch.inference_mode():
    for arg in names:
        name, _, counts = arg.partition(":")
        counts = [int(c) for c in counts.split(",")] if counts else [8, 16, 24, 32, 48, 64, 96, 128]
        lens, HQK, HV = parse(name)
        x, flags, N, T = make_inputs(1, lens, HQK, HV, "lb")
        print(f"{name}:", flush=True)
        for cp in [0, None] + [64 * c for c in counts]:
            f = lambda: call(kda.chunk_kda, x, dict(flags, cp_piece_len=cp))
            single, b2b = time_ms(f), back_to_back_ms(f)
            label = "auto" if cp is None else "off" if cp == 0 else f"{cp // 64} chunks"
            print(f"  {label:>10}  single {single:.3f} ms  back-to-back {b2b:.3f} ms", flush=True)
