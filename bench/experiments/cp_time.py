"""bench_cp.py shapes, libkda alone: single calls and back-to-back GPU time, for A/Bs of two builds on one card
(KDA_LIBRARY picks the build; FLA's wheels only for bench_cp's imports).

    KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:bench:/tmp/site python3 bench/experiments/cp_time.py "single T65536 H8" [piece_len]
    ... cp_time.py "single T65536 H8" "varlen 7000 + 40x30 H32" "varlen 7000 + 40x30 H32=0"   (several in one process)

piece_len: None (auto, default), 0 (the split off) or a forced piece length in tokens; with several shapes, as
"name=piece_len".
"""
import os
import sys

import torch

import kda
from bench_cp import SHAPES
from bench_fla import call, make_inputs
from timing import back_to_back_ms, time_ms


def piece(s):
    return None if s in ("None", "") else int(s)


args = sys.argv[1:] or ["single T65536 H8"]
if len(args) == 2 and (args[1] == "None" or args[1].lstrip("-").isdigit()):
    runs = [(args[0], piece(args[1]))]
else:
    runs = [(a.rsplit("=", 1)[0], piece(a.rsplit("=", 1)[1])) if "=" in a else (a, None) for a in args]
with torch.inference_mode():
    for name, cp in runs:
        lens, HQK, HV = next((l, a, b) for n, l, a, b in SHAPES if n == name)
        x, flags, N, T = make_inputs(1, lens, HQK, HV, "lb")
        fn = lambda: call(kda.chunk_kda, x, dict(flags, cp_piece_len=cp))
        single = time_ms(fn, reps=30)
        b2b = back_to_back_ms(fn)
        print(f"{name:28s} {os.environ.get('KDA_LIBRARY', '')} piece_len={cp}: single {single:.3f} ms, back to back "
              f"{b2b:.3f} ms", flush=True)
        del x
