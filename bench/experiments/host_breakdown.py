"""Where a training step's host time goes, function by function, without a profiler's own overhead: the kda
package's functions and libkda's C entry points wrapped with perf_counter timers (inclusive times, µs per step),
over single steps each started on an idle GPU as bench_bwd.py times them. Also: the host's time from the step's
start to kda_forward's entry (what a single step's CUDA events count before the first kernel) and from the
backward's start to kda_backward's entry.

    KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:bench python3 bench/experiments/host_breakdown.py [--shape ..]
"""
import argparse
import collections
import statistics
import time

import torch

import kda
import kda._lib as kl
import kda._torch as kt
from bench_bwd import SHAPES, enqueue_times, make_inputs

TOT = collections.defaultdict(float)
CNT = collections.defaultdict(int)
MARK = {}


def wrap(name, f, mark=None):
    def g(*a, **kw):
        t0 = time.perf_counter()
        if mark and mark not in MARK:
            MARK[mark] = t0
        try:
            return f(*a, **kw)
        finally:
            TOT[name] += time.perf_counter() - t0
            CNT[name] += 1
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B2 T8192 H32")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    name, B, T, HQK, HV = next(s for s in SHAPES if s[0] == a.shape)
    x, w, flags = make_inputs(B, T, HQK, HV)
    L = kl.library()
    for n in ("forward", "backward", "forward_workspace_size", "backward_workspace_size", "forward_saved_size"):
        setattr(L, n, wrap("C " + n, getattr(L, n), mark={"forward": "fwd_c", "backward": "bwd_c"}.get(n)))
    for mod, names in ((kt, ("_fill", "_launch", "_saved_tensor", "_run", "_chunk_kda_fwd_impl", "_chunk_kda_bwd_impl",
                             "_chunk_grads", "_bwd_outputs", "_inputs", "_f32", "_workspace", "_cuda_context",
                             "chunk_kda", "_eager", "chunk_kda_cached", "_run_backward")),
                       (kl, ("run", "run_backward", "saved_size", "_settle", "_call", "_call_backward"))):
        for n in names:
            if hasattr(mod, n):  # (an older package lacks some)
                setattr(mod, n, wrap(mod.__name__.split(".")[-1] + "." + n, getattr(mod, n)))
    kda.chunk_kda = wrap("kda.chunk_kda", kda.chunk_kda)
    # the autograd Functions (the checked one, and the fast path's from a signature's second call on), with marks
    # at their entries
    for F in (getattr(kt, "_ChunkKDA", None), getattr(kt, "_ChunkKDACached", None)):
        if F is not None:
            F.forward = staticmethod(wrap(F.__name__ + ".forward", F.forward, mark="fwd_py"))
            F.backward = staticmethod(wrap(F.__name__ + ".backward", F.backward, mark="bwd_py"))
    for n in ("_ChunkCall", "_BwdCall"):  # the fast path's forward launch and backward
        cls = getattr(kt, n, None)
        for m in ("_run", "__call__"):
            if cls is not None and m in cls.__dict__:
                setattr(cls, m, wrap(n + "." + m, cls.__dict__[m]))

    pre_f, pre_b, fw, bw, py_f, py_b = [], [], [], [], [], []
    for i in range(a.steps + 3):
        if i == 3:
            TOT.clear()
            CNT.clear()
        MARK.clear()
        t0, t1, t2 = enqueue_times(kda.chunk_kda, x, w, flags)
        torch.cuda.synchronize()
        if i >= 3:
            pre_f.append((MARK["fwd_c"] - t0) * 1e6)
            pre_b.append((MARK["bwd_c"] - t1) * 1e6)
            py_f.append((MARK["fwd_py"] - t0) * 1e6)
            py_b.append((MARK["bwd_py"] - t1) * 1e6)
            fw.append((t1 - t0) * 1e6)
            bw.append((t2 - t1) * 1e6)
    med = statistics.median
    print(f"{name}: host µs per step (medians of {a.steps}): forward {med(fw):.0f} (to kda_forward's entry "
          f"{med(pre_f):.0f}), backward {med(bw):.0f} (to kda_backward's entry {med(pre_b):.0f})")
    print(f"  to the autograd Function's forward {med(py_f):.0f}, to its backward {med(py_b):.0f}")
    print("%-34s %9s %6s" % ("function (inclusive)", "µs/step", "calls"))
    for n in sorted(TOT, key=lambda n: -TOT[n]):
        print("%-34s %9.1f %6.1f" % (n, TOT[n] / a.steps * 1e6, CNT[n] / a.steps))


if __name__ == "__main__":
    main()
