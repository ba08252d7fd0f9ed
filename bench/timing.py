"""Timing shared by the benchmark scripts: CUDA events around single calls, median after warm-up."""
import statistics

import torch


def time_ms(fn, reps=20, warmup=3):
    """Median milliseconds of `reps` single calls of fn, each between two CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)
