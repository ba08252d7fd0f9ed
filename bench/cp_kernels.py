"""One libkda call of a bench_cp.py shape between cudaProfilerStart/Stop, for a per-kernel profile:

    ncu --profile-from-start off --section SpeedOfLight python3 bench/cp_kernels.py "single T65536 H8" [piece_len]

piece_len: None (auto, default), 0 (off) or a forced piece length in tokens.
"""
import sys

import torch

import kda
from bench_cp import SHAPES
from bench_fla import call, make_inputs

name = sys.argv[1] if len(sys.argv) > 1 else "single T65536 H8"
cp = None if len(sys.argv) < 3 or sys.argv[2] == "None" else int(sys.argv[2])
lens, HQK, HV = next((l, a, b) for n, l, a, b in SHAPES if n == name)
with torch.inference_mode():
    x, flags, N, T = make_inputs(1, lens, HQK, HV, "lb")
    for _ in range(3):
        call(kda.chunk_kda, x, dict(flags, cp_piece_len=cp))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(kda.chunk_kda, x, dict(flags, cp_piece_len=cp))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
