"""libkda vs FLA: KDA training step (chunk_kda forward + backward) on the GPU, same inputs and loss weights.

    KDA_LIBRARY=build/libkda.so PYTHONPATH=python:/tmp/site python3 bench/bench_bwd.py [--out DIR] [--quick] [--rounds N]

Issue 11's shapes and flags: l2norm, softplus gate in kernel with A_log and dt_bias, beta sigmoid, fp32 initial
state, final state with its gradient (dht), bf16, K = V = 128; gradients of q, k, v, g, beta, initial_state,
A_log and dt_bias. Times: medians of CUDA-event timed steps (forward, then torch.autograd.backward with do and
dht) after warm-up; "bwd" is the step minus the forward alone. Peak memory: torch's high-water mark during one
step above what the inputs hold. Agreement: each gradient of libkda against FLA's (relative error), a quick sign
that both differentiate the same thing (the accuracy against the fp64 oracle is tests/gpu/test_bwd_cuda.c's).
Writes results.json, results.md and fwd_bwd.png to --out. FLA is optional: without it only libkda is timed.
"""
import argparse
import json
import os
import statistics
import time

import torch

import kda
from timing import git_commit, rel, time_ms

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except ImportError:  # libkda alone
    fla_chunk_kda = None

SHAPES = [  # name, B, T (or lengths), HQK, HV
    ("B2 T8192 H32", 2, 8192, 32, 32),
    ("B1 T32768 H16", 1, 32768, 16, 16),
    ("GVA B2 T8192 HQK16 HV64", 2, 8192, 16, 64),
    ("varlen6 H32", 1, [1300, 547, 2048, 963, 271, 3063], 32, 32),
]
FLA_MS = {"B2 T8192 H32": 8.85, "B1 T32768 H16": 10.5}  # issue 11: FLA's fwd+bwd on an H200


def make_inputs(B, T, HQK, HV, K=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    lens = None
    if isinstance(T, list):
        lens, T = T, sum(T)
    r = lambda *s, dt=bf: torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(dt)
    N = B if lens is None else len(lens)
    x = dict(q=r(B, T, HQK, K), k=r(B, T, HQK, K), v=r(B, T, HV, K), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=(torch.rand(HV, generator=g, device=dev) * 2.0 - 1.0).float(),
             dt_bias=(0.5 * torch.randn(HV * K, generator=g, device=dev)).float(),
             initial_state=(0.1 * torch.randn(N, HV, K, K, generator=g, device=dev)).float())
    for t in x.values():
        t.requires_grad_(True)
    w = dict(do=r(B, T, HV, K), dht=torch.randn(N, HV, K, K, generator=g, device=dev, dtype=torch.float32))
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.int64)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 output_final_state=True, cu_seqlens=cu)
    return x, w, flags


def forward(fn, x, flags):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], **flags)


def step(fn, x, w, flags):
    for t in x.values():
        t.grad = None
    o, ht = forward(fn, x, flags)
    torch.autograd.backward([o, ht], [w["do"], w["dht"]])


def enqueue_times(fn, x, w, flags):
    """One training step started on an idle GPU: (t0, t1, t2), perf_counter before the forward, between the
    forward and the backward, and after the backward's enqueue (the GPU not waited for)."""
    for t in x.values():
        t.grad = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o, ht = forward(fn, x, flags)
    t1 = time.perf_counter()
    torch.autograd.backward([o, ht], [w["do"], w["dht"]])
    return t0, t1, time.perf_counter()


def measure(fn, x, w, flags, reps):
    with torch.no_grad():
        fwd = time_ms(lambda: forward(fn, x, flags), reps=reps)
    total = time_ms(lambda: step(fn, x, w, flags), reps=reps)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(fn, x, w, flags)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {k: t.grad.detach().clone() for k, t in x.items()}
    return dict(fwd_ms=fwd, fwd_bwd_ms=total, bwd_ms=total - fwd, peak_mb=peak / 2**20), grads


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [r["shape"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["kda"]["fwd_bwd_ms"] for r in rows], 0.4, label="libkda fwd+bwd")
    if any(r.get("fla") for r in rows):
        ax.bar([i + 0.2 for i in xs], [r["fla"]["fwd_bwd_ms"] if r.get("fla") else 0 for r in rows], 0.4,
               label="FLA fwd+bwd")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=15, fontsize=8)
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/bwd"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--only", default=None, help="only the shapes whose name contains this (\"_\" for a space)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="training-step timings of libkda and FLA alternated this many times per shape; each side's "
                         "figure is the median of its rounds' medians (drift of the card's clocks hits both alike)")
    args = ap.parse_args()
    reps = 5 if args.quick else 20
    rows = []
    for name, B, T, HQK, HV in SHAPES:
        if args.only and args.only.replace("_", " ") not in name:
            continue
        x, w, flags = make_inputs(B, T, HQK, HV)
        row = dict(shape=name)
        row["kda"], g_kda = measure(kda.chunk_kda, x, w, flags, reps)
        if fla_chunk_kda is not None:
            row["fla"], g_fla = measure(fla_chunk_kda, x, w, flags, reps)
            if args.rounds > 1:
                rk, rf = [row["kda"]["fwd_bwd_ms"]], [row["fla"]["fwd_bwd_ms"]]
                for _ in range(args.rounds - 1):
                    rk.append(time_ms(lambda: step(kda.chunk_kda, x, w, flags), reps=reps))
                    rf.append(time_ms(lambda: step(fla_chunk_kda, x, w, flags), reps=reps))
                row["kda"]["rounds_ms"], row["fla"]["rounds_ms"] = rk, rf
                row["kda"]["fwd_bwd_ms"], row["fla"]["fwd_bwd_ms"] = statistics.median(rk), statistics.median(rf)
                row["kda"]["bwd_ms"] = row["kda"]["fwd_bwd_ms"] - row["kda"]["fwd_ms"]
                row["fla"]["bwd_ms"] = row["fla"]["fwd_bwd_ms"] - row["fla"]["fwd_ms"]
                row["round_speedups"] = [f / k for k, f in zip(rk, rf)]
            row["speedup"] = row["fla"]["fwd_bwd_ms"] / row["kda"]["fwd_bwd_ms"]
            row["grad_rel_vs_fla"] = {k: rel(g_kda[k], g_fla[k]) for k in g_kda}
        rows.append(row)
        line = f"{name:26s} libkda fwd {row['kda']['fwd_ms']:.3f} fwd+bwd {row['kda']['fwd_bwd_ms']:.3f} ms " \
               f"(peak +{row['kda']['peak_mb']:.0f} MB)"
        if "fla" in row:
            line += f" | FLA fwd+bwd {row['fla']['fwd_bwd_ms']:.3f} ms (peak +{row['fla']['peak_mb']:.0f} MB) " \
                    f"x{row['speedup']:.2f} | grads vs FLA " + \
                    " ".join(f"{k} {v:.1e}" for k, v in row["grad_rel_vs_fla"].items())
            if "round_speedups" in row:
                line += " | rounds x" + " ".join(f"{r:.2f}" for r in row["round_speedups"])
        print(line, flush=True)
        del x, w
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), commit=git_commit(), fla_issue_ms=FLA_MS, rounds=args.rounds)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"# fwd+bwd, {meta['device']}, libkda {meta['commit']}" +
                (f" (medians of {args.rounds} alternated rounds)" if args.rounds > 1 else "") + "\n\n")
        f.write("| shape | libkda fwd ms | libkda fwd+bwd ms | FLA fwd+bwd ms | speed-up | libkda peak MB | FLA peak MB |\n")
        f.write("|---|---|---|---|---|---|---|\n")
        for r in rows:
            fl = r.get("fla")
            f.write(f"| {r['shape']} | {r['kda']['fwd_ms']:.3f} | {r['kda']['fwd_bwd_ms']:.3f} | "
                    f"{fl['fwd_bwd_ms']:.3f} | {r['speedup']:.2f} | " if fl else
                    f"| {r['shape']} | {r['kda']['fwd_ms']:.3f} | {r['kda']['fwd_bwd_ms']:.3f} | — | — | ")
            f.write(f"{r['kda']['peak_mb']:.0f} | {fl['peak_mb']:.0f} |\n" if fl else f"{r['kda']['peak_mb']:.0f} | — |\n")
    plot(rows, os.path.join(args.out, "fwd_bwd.png"))


if __name__ == "__main__":
    main()
