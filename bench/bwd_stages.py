"""Per-stage GPU times of the CUDA backward (kda_backward), issue 11's training flags and shapes.

    KDA_LIBRARY=build-dev/libkda.so PYTHONPATH=python:bench python3 bench/bwd_stages.py [--shapes ...] [--reps N]
    ncu --profile-from-start off --section SpeedOfLight python3 bench/bwd_stages.py --profile "B2 T8192 H32"

A development build (cmake -DKDA_DEV=ON) exports kda_dev_bwd_timing / kda_dev_bwd_stage_ms: each kda_backward
then records a CUDA event before each of its stages (meta, prep, d_initial_state memset, states, dstate, chunk,
finish) and after the last; this prints the median of each stage's ms over --reps training steps (forward,
then torch.autograd.backward with do and dht, as bench/bench_bwd.py), and the whole backward. A shipped build
has no such symbols: then only the step time is printed. --profile runs one step of one shape between
cudaProfilerStart/Stop (for ncu, scripts/gpu-check.sh bwdprof) and prints nothing.

Stage 1 is the forward's recurrence kernel (KDA_REC_STATES; the CUDA-core bwd_states.cu and its --v2-states
switch are gone). --v1-chunk also times the backward with its stage 3 by the v1 CUDA-core kernel (dev_skip bit 13,
bwd_chunk_v1.cuh); the reference of the "vs v1" columns is then the all-v1 backward (v1 chunk kernel), and the
default variant ("v3", the tensor-core chunk kernel) is compared with it too (expect ~1e-3 from its tf32
operands).
"""
import argparse
import ctypes
import os
import statistics
import sys

import torch

import kda
from bench_bwd import SHAPES, make_inputs, step
from timing import time_ms

STAGES = ("meta", "prep", "dh0-memset", "states", "dstate", "chunk", "finish")


V1_CHUNK = 8192  # dev_skip bit: backward stage 3 by the v1 CUDA-core kernel (bwd_chunk_v1.cuh)


def dev_tuning():
    lib = ctypes.CDLL(os.environ.get("KDA_LIBRARY", "libkda.so"))
    try:
        f = lib.kda_dev_set_tuning
    except AttributeError:
        return None
    f.argtypes = [ctypes.c_int] * 4
    return f


def grads(x, w, flags):
    step(kda.chunk_kda, x, w, flags)
    torch.cuda.synchronize()
    return {k: t.grad.detach().float().clone() for k, t in x.items()}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def dev_timing():
    lib = ctypes.CDLL(os.environ.get("KDA_LIBRARY", "libkda.so"))
    try:
        on, get = lib.kda_dev_bwd_timing, lib.kda_dev_bwd_stage_ms
    except AttributeError:
        return None, None
    on.argtypes = [ctypes.c_int]
    get.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int]
    return on, get


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["B2 T8192 H32", "B1 T32768 H16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", default=None, help="one step of this shape between cudaProfilerStart/Stop")
    ap.add_argument("--v1-chunk", action="store_true", help="also stage 3 by the v1 kernel (dev build)")
    a = ap.parse_args()
    if a.profile:
        name, B, T, HQK, HV = next(s for s in SHAPES if s[0] == a.profile)
        x, w, flags = make_inputs(B, T, HQK, HV)
        for _ in range(2):
            step(kda.chunk_kda, x, w, flags)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step(kda.chunk_kda, x, w, flags)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    on, get = dev_timing()
    tune = dev_tuning()
    variants = [("v3", 0)] + ([("v1-chunk", V1_CHUNK)] if a.v1_chunk and tune else [])
    if on is None:
        print("no kda_dev_bwd_timing: a shipped build (cmake -DKDA_DEV=ON for the stage times)", file=sys.stderr)
    for s in a.shapes:
        name, B, T, HQK, HV = next(r for r in SHAPES if r[0] == s)
        x, w, flags = make_inputs(B, T, HQK, HV)
        with torch.no_grad():
            fwd = time_ms(lambda: kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                initial_state=x["initial_state"], A_log=x["A_log"],
                                                dt_bias=x["dt_bias"], **flags), reps=a.reps)
        ref = None
        if len(variants) > 1:  # the reference: the backward with the v1 chunk kernel
            tune(V1_CHUNK, 0, 0, 0)
            ref = grads(x, w, flags)
        for vname, bits in variants:
            if tune:
                tune(bits, 0, 0, 0)
            measure(a, name, x, w, flags, fwd, on, get, vname, ref)
        if tune:
            tune(0, 0, 0, 0)
        del x, w
        torch.cuda.empty_cache()


def measure(a, name, x, w, flags, fwd, on, get, vname, ref):
    total = time_ms(lambda: step(kda.chunk_kda, x, w, flags), reps=a.reps)
    line = "%-14s %-9s fwd %.3f  fwd+bwd %.3f ms" % (name, vname, fwd, total)
    if on is not None:
        if on(1) != 0:
            raise SystemExit("kda_dev_bwd_timing failed")
        per = [[] for _ in STAGES]
        buf = (ctypes.c_float * len(STAGES))()
        for _ in range(a.reps):
            step(kda.chunk_kda, x, w, flags)
            torch.cuda.synchronize()
            if get(buf, len(STAGES)) != 0:
                raise SystemExit("kda_dev_bwd_stage_ms failed")
            for i in range(len(STAGES)):
                per[i].append(buf[i])
        on(0)
        med = [statistics.median(p) for p in per]
        line += "  | bwd %.3f: " % sum(med) + "  ".join("%s %.3f" % (n, m) for n, m in zip(STAGES, med))
    if ref is not None and vname != "v1-chunk":
        g = grads(x, w, flags)
        line += "  | vs v1: " + " ".join("%s %.1e" % (k, rel(g[k], ref[k])) for k in ref)
    print(line, flush=True)


if __name__ == "__main__":
    main()
