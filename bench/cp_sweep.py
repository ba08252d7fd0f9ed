"""The forward's time against the CP piece length, for tuning the auto plan (src/cp_plan.h):

    python3 bench/cp_sweep.py ["single T65536 H8[:chunks,chunks,...]" ...]

A shape is one of bench_cp.py's by name, or lengths and heads: "T8192 H8", "7000+40x30 H32" (K = V = 128).

Per shape of bench_cp.py: single calls (time_ms) and back-to-back GPU time (back_to_back_ms) with the split off,
auto, and forced pieces of the chunk counts given (default 8 to 128). No peers: it compares libkda with itself."""
import sys

import torch

import kda
from bench_cp import SHAPES
from bench_fla import call, make_inputs
from timing import back_to_back_ms, time_ms



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
