"""A training step's host time with torch CPU tensors, for a machine without a GPU: bench_bwd.py's step (the
bench flags: l2norm, gate and beta sigmoid in kernel, initial and final state, A_log, dt_bias; bf16 inputs) on
a tiny problem, so that the CPU backend's kernels take little time, with libkda's C entry points wrapped in
perf_counter timers. Per step (medians): the forward's host time and its part before kda_forward is entered
(what a single GPU step's CUDA events count before the first kernel), the backward's and its part before
kda_backward is entered, and the C calls' own times. With --breakdown, the kda package's functions are wrapped
too (inclusive µs per step, as bench/experiments/host_breakdown.py prints them on the GPU; the wrappers add
their own ~0.3 µs per call).

    KDA_NUM_THREADS=1 KDA_LIBRARY=build/libkda.so PYTHONPATH=python python3 bench/experiments/host_cpu.py
"""
import argparse
import collections
import statistics
import time

import torch

import kda
import kda._lib as kl
import kda._torch as kt

CLOCK = time.perf_counter  # --clock thread: time.thread_time (CPU time of this thread: robust on a loaded machine)
TOT = collections.defaultdict(float)
CNT = collections.defaultdict(int)
MARK = {}


def wrap(name, f, mark=None):
    def g(*a, **kw):
        t0 = CLOCK()
        if mark and mark not in MARK:
            MARK[mark] = t0
        try:
            return f(*a, **kw)
        finally:
            TOT[name] += CLOCK() - t0
            CNT[name] += 1
    return g


def make_inputs(B, T, H, K, lens=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    N = B if lens is None else len(lens)
    r = lambda *s, dt=bf: torch.randn(*s, generator=g, dtype=torch.float32).to(dt)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, K), g=r(B, T, H, K), beta=r(B, T, H),
             A_log=(torch.rand(H, generator=g) * 2.0 - 1.0).float(),
             dt_bias=(0.5 * torch.randn(H * K, generator=g)).float(),
             initial_state=(0.1 * torch.randn(N, H, K, K, generator=g)).float())
    for t in x.values():
        t.requires_grad_(True)
    w = dict(do=r(B, T, H, K), dht=torch.randn(N, H, K, K, generator=g, dtype=torch.float32))
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 output_final_state=True, cu_seqlens=cu)
    return x, w, flags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--H", type=int, default=1)
    ap.add_argument("--K", type=int, default=16)
    ap.add_argument("--varlen", action="store_true", help="B1 with cu_seqlens [T/2, T/2]")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5, help="medians per round, then the median of the rounds")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--stub", action="store_true", help="kda_forward and kda_backward replaced by a stub that returns "
                    "success after the warm-up round (results garbage): the host's time alone, without the CPU "
                    "backend's kernels or the C checks")
    ap.add_argument("--clock", choices=("wall", "thread"), default="thread",
                    help="thread (default): this thread's CPU time, which a loaded machine's waits do not inflate")
    a = ap.parse_args()
    global CLOCK
    if a.clock == "thread":
        CLOCK = time.thread_time
    lens = [a.T // 2, a.T - a.T // 2] if a.varlen else None
    x, w, flags = make_inputs(1 if a.varlen else 1, a.T, a.H, a.K, lens)
    L = kl.library()
    if a.stub:  # after the first calls (the signature cached and its backward remembered): no kernels at all
        fwd_c, bwd_c = L.forward, L.backward
        L.forward = lambda *args: 0 if stubbed else fwd_c(*args)
        L.backward = lambda *args: 0 if stubbed else bwd_c(*args)
    stubbed = False
    for n in ("forward", "backward", "forward_workspace_size", "backward_workspace_size", "forward_saved_size"):
        setattr(L, n, wrap("C " + n, getattr(L, n), mark={"forward": "fwd_c", "backward": "bwd_c"}.get(n)))
    # marks at the autograd Functions' entries (the signature's cached one from its second call on)
    for F in (kt._ChunkKDA, kt._ChunkKDACached):
        F.forward = staticmethod(wrap(F.__name__ + ".forward", F.forward, mark="fwd_py"))
        F.backward = staticmethod(wrap(F.__name__ + ".backward", F.backward, mark="bwd_py"))
    if a.breakdown:
        for mod, names in ((kt, ("_fill", "_launch", "_saved_tensor", "_run", "_chunk_kda_fwd_impl",
                                 "_chunk_kda_bwd_impl", "_chunk_grads", "_bwd_outputs", "_inputs", "_f32",
                                 "chunk_kda", "chunk_kda_cached", "_eager")),
                           (kl, ("run", "run_backward", "saved_size", "_call"))):
            for n in names:
                if hasattr(mod, n):
                    setattr(mod, n, wrap(mod.__name__.split(".")[-1] + "." + n, getattr(mod, n)))
        for n in ("_BwdCall", "_ChunkCall"):
            if hasattr(kt, n):
                cls = getattr(kt, n)
                for m in ("__call__", "launch", "_run"):
                    if m in cls.__dict__:
                        setattr(cls, m, wrap(n + "." + m, cls.__dict__[m]))
    fn = kda.chunk_kda

    def forward():
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
                  dt_bias=x["dt_bias"], **flags)

    cols = collections.defaultdict(list)
    for r in range(a.rounds + 1):
        per = collections.defaultdict(list)
        if r == 1:
            TOT.clear()
            CNT.clear()
            stubbed = a.stub
        for _ in range(a.steps):
            for t in x.values():
                t.grad = None
            MARK.clear()
            c0 = TOT["C forward"], TOT["C backward"]
            t0 = CLOCK()
            o, ht = forward()
            t1 = CLOCK()
            torch.autograd.backward([o, ht], [w["do"], w["dht"]])
            t2 = CLOCK()
            cf, cb = TOT["C forward"] - c0[0], TOT["C backward"] - c0[1]
            per["forward host (C forward excluded)"].append((t1 - t0 - cf) * 1e6)
            per["  to the autograd Function's forward"].append((MARK["fwd_py"] - t0) * 1e6)
            per["  to kda_forward's entry"].append((MARK["fwd_c"] - t0) * 1e6)
            per["backward host (C backward excluded)"].append((t2 - t1 - cb) * 1e6)
            per["  to the autograd Function's backward"].append((MARK["bwd_py"] - t1) * 1e6)
            per["  to kda_backward's entry"].append((MARK["bwd_c"] - t1) * 1e6)
            per["C kda_forward"].append(cf * 1e6)
            per["C kda_backward"].append(cb * 1e6)
            per["step host (both C calls excluded)"].append((t2 - t0 - cf - cb) * 1e6)
        if r >= 1:  # round 0 warms up (first calls, the fast path's signatures)
            for k, v in per.items():
                cols[k].append(statistics.median(v))
    med = statistics.median
    shape = f"B1 T{a.T} H{a.H} K=V={a.K}" + (" varlen [%d, %d]" % tuple(lens) if lens else "")
    print(f"{shape}, bf16, bench flags, {torch.get_num_threads()} torch threads, {a.clock} clock"
          f"{', C calls stubbed' if a.stub else ''}; µs per step, median of "
          f"{a.rounds} rounds of {a.steps} steps (each round's median; min-max of the rounds)")
    for k, v in cols.items():
        print("%-40s %8.1f   (%.1f-%.1f)" % (k, med(v), min(v), max(v)))
    if a.breakdown:
        n = a.steps * a.rounds
        print("%-40s %8s %6s" % ("function (inclusive)", "µs/step", "calls"))
        for k in sorted(TOT, key=lambda k: -TOT[k]):
            print("%-40s %8.1f %6.1f" % (k, TOT[k] / n * 1e6, CNT[k] / n))
        print("(means: a loaded machine's outliers are in them; the medians above are not)")


if __name__ == "__main__":
    main()
