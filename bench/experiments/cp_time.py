"""One bench_cp.py shape, libkda alone (auto plan): single calls and back-to-back GPU time, for A/Bs of two
builds on one card (KDA_LIBRARY picks the build; FLA's wheels only for bench_cp's imports).

    KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:bench:/tmp/site python3 bench/experiments/cp_time.py "single T65536 H8" [piece_len]

piece_len: None (auto, default), 0 (the split off) or a forced piece length in tokens.
"""
import os
import sys

import torch

import kda
from bench_cp import SHAPES
from bench_fla import call, make_inputs
from timing import back_to_back_ms, time_ms

name = sys.argv[1] if len(sys.argv) > 1 else "single T65536 H8"
cp = None if len(sys.argv) < 3 or sys.argv[2] == "None" else int(sys.argv[2])
lens, HQK, HV = next((l, a, b) for n, l, a, b in SHAPES if n == name)
with torch.inference_mode():
    x, flags, N, T = make_inputs(1, lens, HQK, HV, "lb")
    fn = lambda: call(kda.chunk_kda, x, dict(flags, cp_piece_len=cp))
    single = time_ms(fn, reps=30)
    b2b = back_to_back_ms(fn)
print(f"{name:28s} {os.environ.get('KDA_LIBRARY', '')} piece_len={cp}: single {single:.3f} ms, back to back {b2b:.3f} ms", flush=True)
