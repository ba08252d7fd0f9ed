"""Where a single inference call of an intra-card CP shape spends its time outside the GPU's kernels (issue 9's
bar is a single call between CUDA events, which includes the host's time before the first kernel starts).

For each shape (bench_cp.py's flags and inputs, varlen offsets, torch.inference_mode): the host's µs to enqueue
one call (time.perf_counter around it, no synchronisation; median of 50), the single call's CUDA-event ms (as
bench_cp.py), the back-to-back GPU ms per call, then one call under torch.profiler with the CPU side too: every
CUDA runtime call and kernel with its start in µs after the call's first host event, its duration and, for the
kernels, the GPU's idle gap before it. --cprofile: the Python functions with the most own time over 500 calls.

    KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:bench python3 bench/experiments/cp_call_timeline.py \
        [--only "T65536 H8"] [--cprofile]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kda  # noqa: E402
from bench_cp import SHAPES  # noqa: E402
from bench_fla import call, make_inputs  # noqa: E402
from timing import back_to_back_ms, time_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="T65536 H8")
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()
    with torch.inference_mode():
        for name, lens, HQK, HV in SHAPES:
            if a.only not in name:
                continue
            x, flags, _, _ = make_inputs(1, lens, HQK, HV, "lb")
            fn = lambda: call(kda.chunk_kda, x, flags)  # noqa: E731
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            hs = []
            for _ in range(50):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                hs.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            single, b2b = time_ms(fn, reps=30), back_to_back_ms(fn)
            print(f"{name}: host µs to enqueue {statistics.median(hs):.1f} (min {min(hs):.1f}); single call "
                  f"{single:.3f} ms; back to back {b2b:.3f} ms; difference {1e3 * (single - b2b):.1f} µs", flush=True)
            if a.cprofile:
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(500):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
                pstats.Stats(pr).sort_stats("tottime").print_stats(16)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                fn()  # the profiler's first-sight costs fall on this one
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
            ev = sorted(prof.events(), key=lambda e: e.time_range.start)
            # the second call: events after the last synchronize of the first
            syncs = [e for e in ev if "Synchronize" in e.name]
            t_cut = syncs[0].time_range.end if syncs else ev[0].time_range.start
            ev = [e for e in ev if e.time_range.start >= t_cut and "Synchronize" not in e.name]
            if not ev:
                print("no events recorded")
                continue
            s0, gpu_end = ev[0].time_range.start, None
            print("%10s %9s %8s  %s" % ("start µs", "dur µs", "gap µs", "event"))
            for e in ev:
                st, en = e.time_range.start, e.time_range.end
                gpu = e.device_type == torch.autograd.DeviceType.CUDA
                gap = "" if not gpu or gpu_end is None else "%8.1f" % max(0.0, st - gpu_end)
                if gpu:
                    gpu_end = en if gpu_end is None else max(gpu_end, en)
                print("%10.1f %9.1f %8s  %s%s" % (st - s0, en - st, gap, "GPU " if gpu else "", e.name[:90]))
            del x


if __name__ == "__main__":
    main()
