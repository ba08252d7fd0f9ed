"""libkda vs FLA: KDA prefill forward on the GPU, same inputs, one process.

    KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:/tmp/site python3 bench/bench_fla.py [--out DIR] [--quick]

Flags of issue 4: l2norm + gate in kernel with lower_bound -5 (safe gate) + beta sigmoid + fp32 initial state +
final state, K = V = 128, bf16, V-first states (as FlashKDA was timed). Times are medians of CUDA-event timed
calls after warm-up (FLA autotunes on its first calls). Each shape also gets the floor: bytes every
implementation must move (inputs read once, outputs written once, states in and out) over the device-to-device
copy bandwidth measured here. Accuracy (ours and FLA's relative error against a float64 recurrence on the same
inputs) on moderate shapes. Writes results.json, results.md and ours_vs_fla.png to --out (every peer of the
run and the floor; `--replot DIR/results.json` redraws an earlier run's plot). bench/README.md: the columns.
"""
import argparse
import json
import math
import os
import sys
import time

from plotting import pyplot

if "--replot" not in sys.argv:  # the measurement needs them; redrawing a plot does not
    import torch

    import kda
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from timing import git_commit, rel, time_ms

# FlashKDA's speed-up over FLA 0.5.2 on an H200 (issue 4 / shared PERF-NOTES), same flags.
FLASHKDA = {
    "B1 T8192 H64": 1.62, "B2 T8192 H64": 2.36, "B8 T4096 H32": 2.15, "B1 T512 H64": 6.73,
    "B1 T32768 H32": 1.10, "varlen6 H64": 2.04, "varlen 8x1024 H64": 2.53,
}

SHAPES = [  # name, B, T (or lengths), HQK, HV, gate
    ("B1 T8192 H64", 1, 8192, 64, 64, "lb"),
    ("B2 T8192 H64", 2, 8192, 64, 64, "lb"),
    ("B8 T4096 H32", 8, 4096, 32, 32, "lb"),
    ("B1 T512 H64", 1, 512, 64, 64, "lb"),
    ("B1 T32768 H32", 1, 32768, 32, 32, "lb"),
    ("varlen6 H64", 1, [1300, 547, 2048, 963, 271, 3063], 64, 64, "lb"),
    ("varlen 8x1024 H64", 1, [1024] * 8, 64, 64, "lb"),
    ("GVA B2 T8192 HQK16 HV64", 2, 8192, 16, 64, "lb"),
    ("softplus B2 T8192 H64", 2, 8192, 64, 64, "softplus"),
]
# Other head sizes (issue 12): name, B, T, HQK, HV, gate, K = V. Not in the geomean of the eight.
HEAD_SHAPES = [
    ("K256 B2 T8192 H32", 2, 8192, 32, 32, "lb", 256),
    ("K100 B2 T8192 H32", 2, 8192, 32, 32, "lb", 100),
    ("K64 B4 T4096 H32", 4, 4096, 32, 32, "lb", 64),
]


def make_inputs(B, T, HQK, HV, gate, K=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    lens = None
    if isinstance(T, list):
        lens = T
        T = sum(lens)
    r = lambda *s, dt=bf: torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(dt)
    x = dict(
        q=r(B, T, HQK, K), k=r(B, T, HQK, K), v=r(B, T, HV, K), g=r(B, T, HV, K), beta=r(B, T, HV),
        A_log=(torch.rand(HV, generator=g, device=dev) * 2.0 - 1.0).float(),
        dt_bias=(0.5 * torch.randn(HV * K, generator=g, device=dev)).float(),
    )
    N = B if lens is None else len(lens)
    x["initial_state"] = (0.1 * torch.randn(N, HV, K, K, generator=g, device=dev)).float()  # [N,HV,V,K]
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=dev, dtype=torch.int64)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 output_final_state=True, state_v_first=True, cu_seqlens=cu)
    if gate == "lb":
        flags.update(safe_gate=True, lower_bound=-5.0)
    return x, flags, N, T


def call(fn, x, flags):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], **flags)


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=10)
    return 2 * n / (ms * 1e-3)  # bytes read + written per second


def floor_bytes(B, T, HQK, HV, N, K=128):
    tokens = B * T
    return (2 * tokens * HQK * K * 2 + tokens * HV * K * 2 * 2  # q, k; v, g
            + tokens * HV * 2 + tokens * HV * K * 2              # beta; o
            + 2 * N * HV * K * K * 4)                            # states in, out


def reference_fp64(x, flags):
    """Token-by-token float64 recurrence on the GPU (FLA's gate and flag semantics), for accuracy."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    B, T, HQK, K = q.shape
    HV = v.shape[2]
    G = HV // HQK
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(G, dim=2) * K ** -0.5
    k = k.repeat_interleave(G, dim=2)
    A = x["A_log"].double().exp().view(HV, 1)
    gg = g + x["dt_bias"].double().view(HV, K)
    gate = flags["lower_bound"] * torch.sigmoid(A * gg) if flags.get("lower_bound") else -A * torch.nn.functional.softplus(gg)
    b = torch.sigmoid(beta)
    cu = flags["cu_seqlens"]
    seqs = [(0, i) for i in range(B)] if cu is None else [(int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
    o = torch.zeros_like(v)
    hts = []
    for n, seq in enumerate(seqs):
        if cu is None:
            bb, lo, hi = seq[1], 0, T
        else:
            bb, lo, hi = 0, seq[0], seq[1]
        S = x["initial_state"][n].double().transpose(-1, -2).clone()  # [HV, K, V]
        for t in range(lo, hi):
            S = S * gate[bb, t].exp().unsqueeze(-1)
            kt = k[bb, t]
            d = b[bb, t].unsqueeze(-1) * (v[bb, t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt.unsqueeze(-1) * d.unsqueeze(-2)
            o[bb, t] = torch.einsum("hk,hkv->hv", q[bb, t], S)
        hts.append(S.transpose(-1, -2))
    return o, torch.stack(hts)


def plot(rows, meta, path):
    """Every peer of the run per shape (bars: FLA and libkda measured here; FlashKDA drawn from its published
    speed-up over FLA, times this run's FLA time, hatched: not measured here), the floor as a black line over
    each shape's bars, and libkda's speed-up over FLA above its bar. Log time axis: all shapes readable."""
    plt = pyplot()
    if plt is None:
        return
    peers = [("FLA 0.6.0 (Triton), measured", lambda r: r["fla_ms"], dict(color="tab:blue")),
             ("FlashKDA: its published speed-up over FLA 0.5.2 applied to this FLA time (not measured here)",
              lambda r: r["fla_ms"] / r["flashkda_ratio"] if r.get("flashkda_ratio") else None,
              dict(color="tab:green", hatch="//", alpha=0.55)),
             ("libkda (CUDA C), measured", lambda r: r["ours_ms"], dict(color="tab:orange"))]
    for key in sorted({k for r in rows for k in r if k.endswith("_ms") and k not in ("fla_ms", "ours_ms", "floor_ms")}):
        peers.insert(-1, (f"{key[:-3]}, measured", lambda r, key=key: r.get(key), {}))  # any other peer timed
    fig, ax = plt.subplots(figsize=(12, 6))
    width = 0.8 / len(peers)
    for p, (label, get, style) in enumerate(peers):
        xs = [i - 0.4 + width * (p + 0.5) for i, r in enumerate(rows) if get(r)]
        ys = [get(r) for r in rows if get(r)]
        if ys:
            ax.bar(xs, ys, width, label=label, **style)
    for i, r in enumerate(rows):
        ax.hlines(r["floor_ms"], i - 0.45, i + 0.45, colors="black", linewidth=1.6,
                  label="floor: bytes moved once / device copy bandwidth" if i == 0 else None)
        ax.text(i + 0.4 - width / 2, r["ours_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["shape"] for r in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("ms per call (log scale, lower is better)")
    ax.set_title(f"KDA prefill forward, {meta['card']}, commit {meta['commit']}  (label: libkda's speed-up over FLA)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("plot:", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, no accuracy runs")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--only", default=None, help="time only the shapes whose name contains this")
    ap.add_argument("--heads", action="store_true", help="also the other head sizes (HEAD_SHAPES)")
    ap.add_argument("--no-main", action="store_true", help="leave out the K = 128 shapes")
    ap.add_argument("--replot", metavar="RESULTS_JSON", help="only redraw the plot of an earlier run's results.json "
                                                             "(next to it; no GPU needed)")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            res = json.load(f)
        plot(res["rows"], res["meta"], os.path.join(os.path.dirname(args.replot), "ours_vs_fla.png"))
        return 0
    os.makedirs(args.out, exist_ok=True)
    reps = 10 if args.quick else 20
    card = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{card}: device copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)

    rows = []
    shapes = ([] if args.no_main else [s + (128,) for s in SHAPES]) + (HEAD_SHAPES if args.heads else [])
    for name, B, T, HQK, HV, gate, K in shapes:
        if args.only and args.only not in name:
            continue
        x, flags, N, Ttot = make_inputs(B, T, HQK, HV, gate, K=K)
        ours = lambda: call(kda.chunk_kda, x, flags)
        fla = lambda: call(fla_chunk_kda, x, flags)
        t_fla = time_ms(fla, reps=reps)
        t_ours = time_ms(ours, reps=reps)
        fl = floor_bytes(B, Ttot, HQK, HV, N, K=K) / bw * 1e3
        row = dict(shape=name, ours_ms=t_ours, fla_ms=t_fla, ratio=t_fla / t_ours, flashkda_ratio=FLASHKDA.get(name),
                   floor_ms=fl)
        rows.append(row)
        print(f"{name:26s} ours {t_ours:8.3f} ms  FLA {t_fla:8.3f} ms  ratio {t_fla / t_ours:5.2f}x  "
              f"FlashKDA {FLASHKDA.get(name) or float('nan'):5.2f}x  floor {fl:6.3f} ms", flush=True)
        del x

    acc = []
    if not args.quick:
        # head counts of the timed shapes, so that FLA's autotuning is already done for them
        cases = [("acc B1 T1024 H64", 1, 1024, 64, 64, "lb", 128),
                 ("acc varlen [300,1,0,700,65] H64", 1, [300, 1, 0, 700, 65], 64, 64, "lb", 128),
                 ("acc GVA B1 T512 HQK16 HV64", 1, 512, 16, 64, "lb", 128),
                 ("acc softplus B1 T1024 H64", 1, 1024, 64, 64, "softplus", 128)]
        if args.no_main:
            cases = []
        if args.heads:
            cases += [("acc K256 B1 T1024 H32", 1, 1024, 32, 32, "lb", 256),
                      ("acc K100 B1 T1024 H32", 1, 1024, 32, 32, "lb", 100),
                      ("acc K64 B1 T1024 H32", 1, 1024, 32, 32, "lb", 64)]
        for name, B, T, HQK, HV, gate, K in cases:
            x, flags, N, Ttot = make_inputs(B, T, HQK, HV, gate, K=K, seed=1)
            o_ref, ht_ref = reference_fp64(x, flags)
            o1, h1 = call(kda.chunk_kda, x, flags)
            o2, h2 = call(fla_chunk_kda, x, flags)
            a = dict(case=name, ours_o=rel(o1, o_ref), fla_o=rel(o2, o_ref), ours_ht=rel(h1, ht_ref),
                     fla_ht=rel(h2, ht_ref))
            acc.append(a)
            print(f"{name:26s} o: ours {a['ours_o']:.2e} FLA {a['fla_o']:.2e}   final state: ours {a['ours_ht']:.2e} "
                  f"FLA {a['fla_ht']:.2e}", flush=True)

    main8 = [r for r in rows if not r["shape"].startswith(("softplus", "K"))]
    geo = math.exp(sum(math.log(r["ratio"]) for r in main8) / len(main8)) if main8 else float("nan")
    meta = dict(date=time.strftime("%Y-%m-%d"), card=card, commit=args.commit or git_commit(), copy_tbps=bw / 1e12,
                torch=torch.__version__, fla="0.6.0", geomean_ratio_8=geo)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, accuracy=acc), f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"# libkda vs FLA 0.6.0 — {meta['date']}, {card}, commit {meta['commit']}\n\n")
        f.write(f"Device copy bandwidth {bw / 1e12:.2f} TB/s. Flags: l2norm + gate in kernel (lower_bound -5, safe) + "
                "beta sigmoid + fp32 V-first initial/final state, K = V = 128, bf16. Medians of CUDA events.\n\n")
        f.write("| shape | ours ms | FLA ms | ours / FLA speed-up | FlashKDA's speed-up | floor ms |\n|---|---:|---:|---:|---:|---:|\n")
        for r in rows:
            fk = f"{r['flashkda_ratio']:.2f}x" if r["flashkda_ratio"] else "—"
            f.write(f"| {r['shape']} | {r['ours_ms']:.3f} | {r['fla_ms']:.3f} | {r['ratio']:.2f}x | {fk} | {r['floor_ms']:.3f} |\n")
        f.write(f"\nGeomean speed-up over the eight (all but softplus): {geo:.2f}x\n")
        if acc:
            f.write("\n| accuracy case | ours o | FLA o | ours final state | FLA final state |\n|---|---:|---:|---:|---:|\n")
            for a in acc:
                f.write(f"| {a['case']} | {a['ours_o']:.2e} | {a['fla_o']:.2e} | {a['ours_ht']:.2e} | {a['fla_ht']:.2e} |\n")
    plot(rows, meta, os.path.join(args.out, "ours_vs_fla.png"))
    print(f"geomean speed-up over the eight: {geo:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
