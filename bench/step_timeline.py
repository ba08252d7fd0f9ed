"""Where a training step's wall time goes outside the GPU's kernels: the host's time to enqueue the forward and
the backward (time.perf_counter around each call, no synchronisation between them; a single step's CUDA events
include the forward's, before its first kernel), a single step's CUDA-event time, then one step under
torch.profiler: every kernel with its start (µs after the step's first), duration and the idle gap before it
(the profiler slows the launches of kernels it meets for the first time: those gaps are its own, not the step's).
--cprofile: the Python functions with the most own time over 200 forward calls (no_grad) and 50 steps.

    KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:bench python3 bench/step_timeline.py [--shape "B2 T8192 H32"]
"""
import argparse
import statistics
import time

import torch

import kda
from bench_bwd import SHAPES, enqueue_times, make_inputs, forward, step as train_step
from timing import back_to_back_ms, time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B2 T8192 H32")
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()
    name, B, T, HQK, HV = next(s for s in SHAPES if s[0] == a.shape)
    x, w, flags = make_inputs(B, T, HQK, HV)

    def step():
        train_step(kda.chunk_kda, x, w, flags)

    for _ in range(3):
        step()
    torch.cuda.synchronize()

    # host time to enqueue (the GPU is idle at each start: the step's first kernel waits for this much)
    fh, bh, nh = [], [], []
    for _ in range(20):
        t0, t1, t2 = enqueue_times(kda.chunk_kda, x, w, flags)
        torch.cuda.synchronize()
        with torch.no_grad():
            t3 = time.perf_counter()
            forward(kda.chunk_kda, x, flags)
            t4 = time.perf_counter()
        torch.cuda.synchronize()
        fh.append((t1 - t0) * 1e6)
        bh.append((t2 - t1) * 1e6)
        nh.append((t4 - t3) * 1e6)
    print("%s: host µs to enqueue (medians of 20): forward with autograd %.0f, backward %.0f; forward under "
          "no_grad %.0f" % (name, statistics.median(fh), statistics.median(bh), statistics.median(nh)))
    print("single step (CUDA events, median of 10): %.3f ms" % time_ms(step, reps=10))
    print("steps back to back (GPU time per step, the host's hidden): %.3f ms" % back_to_back_ms(step, reps=5, group=4))

    if a.cprofile:
        import cProfile
        import pstats
        for what, fn, n in (("forward, no_grad", lambda: forward(kda.chunk_kda, x, flags), 200), ("step", step, 50)):
            pr = cProfile.Profile()
            with torch.no_grad() if what.endswith("no_grad") else torch.enable_grad():
                pr.enable()
                for _ in range(n):
                    fn()
                pr.disable()
            torch.cuda.synchronize()
            print("-- cProfile: %s, %d calls (own time)" % (what, n))
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    if not ev:
        print("no CUDA events recorded")
        return
    s0, end, idle = ev[0].time_range.start, ev[0].time_range.start, 0.0
    print("%10s %9s %8s  %s" % ("start µs", "dur µs", "gap µs", "kernel"))
    for e in ev:
        st, en = e.time_range.start, e.time_range.end
        gap = max(0.0, st - end)
        idle += gap
        print("%10.1f %9.1f %8.1f  %s" % (st - s0, en - st, gap, e.name[:90]))
        end = max(end, en)
    print("GPU span %.1f µs, idle between kernels %.1f µs" % (end - s0, idle))


if __name__ == "__main__":
    main()
