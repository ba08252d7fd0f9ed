"""What the benchmark scripts share: CUDA events around single calls (time_ms) or around groups of calls
enqueued back to back (back_to_back_ms), medians after warm-up; the relative error they report (rel) and the
commit they stamp their results with (git_commit)."""
import statistics
import os
import subprocess

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


def back_to_back_ms(fn, reps=15, group=8):
    """GPU milliseconds per call: median over `reps` groups of `group` calls enqueued back to back between two
    CUDA events (the host time per call, below the GPU time, is hidden; time_ms's single calls include it)."""
    fn()
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(group):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / group)
    return sorted(ts)[len(ts) // 2]


def rel(a, b):
    """Relative error ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def git_commit():
    """The short commit of the working tree, "+dirty" when it has uncommitted changes ("unknown" without git);
    KDA_COMMIT, when set, names it instead (a copy of the tree whose git metadata is not its own, e.g. the device
    machine's, where the tree was copied without .git)."""
    if os.environ.get("KDA_COMMIT"):
        return os.environ["KDA_COMMIT"]
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet"]).returncode != 0
        return (c or "unknown") + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"
