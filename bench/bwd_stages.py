"""Per-stage GPU times of the CUDA backward (kda_backward), issue 11's training flags and shapes.

    KDA_LIBRARY=build-dev/libkda.so PYTHONPATH=python:bench python3 bench/bwd_stages.py [--shapes ...] [--reps N]
    ncu --profile-from-start off --section SpeedOfLight python3 bench/bwd_stages.py --profile "B2 T8192 H32"

A development build (cmake -DKDA_DEV=ON) exports kda_dev_bwd_timing / kda_dev_bwd_stage_ms: each kda_backward
then records a CUDA event before each of its stages (meta, prep, d_initial_state memset, states, dstate, chunk,
finish) and after the last; this prints the median of each stage's ms over --reps training steps (forward,
then torch.autograd.backward with do and dht, as bench/bench_bwd.py), and the whole backward. A shipped build
has no such symbols: then only the step time is printed. --profile runs one step of one shape between
cudaProfilerStart/Stop (for ncu, as above) and prints nothing.

Stage 1 is the forward's recurrence kernel (KDA_REC_STATES). To A/B two builds, run
one with --save-grads FILE and the other with --ref-grads FILE: the second prints each gradient's relative
difference to the first's ("vs ref"), same inputs (fixed seeds).
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

STAGES = ("meta", "prep", "dh0-memset", "states", "dstate", "inter", "chunk", "pairs", "finish")


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
    ap.add_argument("--k", type=int, default=128, help="the head sizes K = V (e.g. 256: the backward's class 256)")
    ap.add_argument("--profile", default=None, help="one step of this shape between cudaProfilerStart/Stop")
    ap.add_argument("--save-grads", default=None, help="save each shape's gradients to this file (torch.save)")
    ap.add_argument("--ref-grads", default=None, help="compare the gradients with those saved in this file")
    ap.add_argument("--dev-skip", type=int, default=0,
                    help="development builds: kda_dev_set_tuning's skip bits (parts of kernels left out, to time "
                         "the rest; the gradients are then wrong)")
    a = ap.parse_args()
    if a.dev_skip:
        ctypes.CDLL(os.environ.get("KDA_LIBRARY", "libkda.so")).kda_dev_set_tuning(a.dev_skip, 0, 0, 0)
    if a.profile:
        name, B, T, HQK, HV = next(s for s in SHAPES if s[0] == a.profile)
        x, w, flags = make_inputs(B, T, HQK, HV, K=a.k)
        for _ in range(2):
            step(kda.chunk_kda, x, w, flags)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step(kda.chunk_kda, x, w, flags)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    on, get = dev_timing()
    saved, refs = {}, (torch.load(a.ref_grads) if a.ref_grads else {})
    if on is None:
        print("no kda_dev_bwd_timing: a shipped build (cmake -DKDA_DEV=ON for the stage times)", file=sys.stderr)
    for s in a.shapes:
        name, B, T, HQK, HV = next(r for r in SHAPES if r[0] == s)
        x, w, flags = make_inputs(B, T, HQK, HV, K=a.k)
        if a.k != 128:
            name = "%s K%d" % (name, a.k)
        with torch.no_grad():
            fwd = time_ms(lambda: kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                initial_state=x["initial_state"], A_log=x["A_log"],
                                                dt_bias=x["dt_bias"], **flags), reps=a.reps)
        measure(a, name, x, w, flags, fwd, on, get, "", refs.get(name))
        if a.save_grads:
            saved[name] = {k: v.cpu() for k, v in grads(x, w, flags).items()}
        del x, w
        torch.cuda.empty_cache()
    if a.save_grads:
        torch.save(saved, a.save_grads)


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
    if ref is not None:
        g = grads(x, w, flags)
        line += "  | vs ref: " + " ".join("%s %.1e" % (k, rel(g[k].cpu(), ref[k])) for k in ref)
    print(line, flush=True)


if __name__ == "__main__":
    main()
