"""libkda's decode (kda.fused_recurrent_kda -> kda_decode -> src/cuda/decode/) vs FLA's fused_recurrent_kda_fwd,
in one process, on a vLLM-style state pool updated in place (issue 10).

    KDA_LIBRARY=build/libkda.so PYTHONPATH=python:$FLA python3 bench/bench_decode.py --out DIR [--quick]

Shapes (K = V = 128, bf16 q/k/v/g, beta logits, l2norm + in-kernel gate with lower_bound -5 + beta sigmoid):
N1 / N32 / N256 H32 one token per sequence; GVA N64 HQK8 HV32; MTP N64 H32 4 tokens per sequence (states
[N, ...] in place, no indices); spec decode N64 H32 T_max 4 (2-D ssm_state_indices, num_accepted_tokens in
[1, 4], the state after every token to its slot). Each with fp32 and bf16 states, V-first (FLA's vLLM layout);
N256 also K-first. Pool slots are a random permutation (some sequences with slot -1 in the 1-D cases are not
used: vLLM's padding is a separate case the tests cover).

Times: GPU microseconds per call, from CUDA events around replays of a CUDA graph of `group` captured calls
(what vLLM runs; the host time of the Python wrappers is not in it), and eager back-to-back calls (host time
included where it exceeds the GPU time). Medians of `reps` after warm-up. State TB/s = bytes of the touched
states read + written (spec: 1 read + T writes per sequence) / graph time. Accuracy: relative error of o and of
the written states of one call of each implementation against a float64 recurrence on the same inputs.
Writes results.json, results.md and decode.png to --out; `--replot DIR/results.json --out DIR2` redraws only
the plot (matplotlib; no GPU).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda  # noqa: E402
from plotting import pyplot  # noqa: E402
from timing import back_to_back_ms, git_commit, rel  # noqa: E402

try:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd  # noqa: E402
except Exception as e:  # pragma: no cover
    fla_fwd = None
    FLA_ERR = repr(e)

K = V = 128
LOWER_BOUND = -5.0

# name, N, HQK, HV, tokens per sequence, mode ("pool": 1-D indices, "mtp": [N] states in place, "spec": 2-D)
SHAPES = [
    ("N1 H32", 1, 32, 32, 1, "pool"),
    ("N32 H32", 32, 32, 32, 1, "pool"),
    ("N256 H32", 256, 32, 32, 1, "pool"),
    ("GVA N64 HQK8 HV32", 64, 8, 32, 1, "pool"),
    ("MTP N64 H32 T4", 64, 32, 32, 4, "mtp"),
    ("spec N64 H32 Tmax4", 64, 32, 32, 4, "spec"),
]


def make_problem(N, HQK, HV, T, mode, state_dtype, vfirst, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float32)
    x = dict(q=r(N, T, HQK, K).to(bf), k=r(N, T, HQK, K).to(bf), v=r(N, T, HV, V).to(bf),
             g=r(N, T, HV, K).to(bf), beta=r(N, T, HV).to(bf),
             A_log=(torch.rand(HV, generator=g, device=dev) * 2.0 - 1.0).float(),
             dt_bias=(0.5 * r(HV * K)).float())
    shape = (HV, V, K) if vfirst else (HV, K, V)
    if mode == "mtp":
        slots, idx, nat = N, None, None
    elif mode == "pool":
        slots = 2 * N + 3
        idx = torch.randperm(slots, generator=g, device=dev)[:N].to(torch.int32)
        nat = None
    else:  # spec
        slots = N * T + 7
        idx = torch.randperm(slots, generator=g, device=dev)[:N * T].to(torch.int32).view(N, T)
        nat = torch.randint(1, T + 1, (N,), generator=g, device=dev, dtype=torch.int32)
    x["pool"] = (0.1 * r(slots, *shape)).to(state_dtype)
    x["idx"], x["nat"] = idx, nat
    return x


def flags():
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=LOWER_BOUND)


def call_ours(x, pool, vfirst):
    kw = dict(num_accepted_tokens=x["nat"]) if x["nat"] is not None else {}
    if x["idx"] is not None:
        kw["ssm_state_indices"] = x["idx"]
    return kda.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                   initial_state=pool, inplace_final_state=True, state_v_first=vfirst,
                                   **flags(), **kw)


def call_fla(x, pool, vfirst):
    return fla_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                   initial_state=pool, inplace_final_state=True, state_v_first=vfirst,
                   ssm_state_indices=x["idx"], num_accepted_tokens=x["nat"], **flags())


def graph_us(fn, group=20, reps=15):
    """GPU µs per call: replays of a CUDA graph of `group` calls between two events (median of reps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(group):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / group)
    return statistics.median(ts)


def eager_us(fn, group=20, reps=15):
    """GPU µs per call of eager calls enqueued back to back (bench/timing.py)."""
    return back_to_back_ms(fn, reps=reps, group=group) * 1e3


def reference(x, pool0, mode, vfirst, HQK, HV, T):
    """float64: (o [N, T, HV, V], pool after the call as float64 in the stored layout)."""
    G = HV // HQK
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    N = q.shape[0]
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    A = x["A_log"].double().exp().view(HV, 1)
    gate = LOWER_BOUND * torch.sigmoid(A * (g + x["dt_bias"].double().view(HV, K)))
    b = torch.sigmoid(beta)
    pool = pool0.double()
    kv = lambda s: s.transpose(-1, -2) if vfirst else s  # stored <-> [.., K, V]
    if mode == "mtp":
        rs = torch.arange(N, device=q.device)
    elif mode == "pool":
        rs = x["idx"].long()
    else:
        rs = x["idx"].long().gather(1, (x["nat"].long() - 1).view(N, 1)).view(N)
    S = kv(pool[rs.clamp(min=0)]).clone()
    S[rs < 0] = 0
    o = torch.empty(N, T, HV, V, dtype=torch.float64, device=q.device)
    for t in range(T):
        S = S * gate[:, t].exp().unsqueeze(-1)
        kS = torch.einsum("nhk,nhkv->nhv", k[:, t], S)
        S = S + k[:, t].unsqueeze(-1) * (b[:, t].unsqueeze(-1) * (v[:, t] - kS)).unsqueeze(-2)
        o[:, t] = torch.einsum("nhk,nhkv->nhv", q[:, t], S)
        if mode == "spec":
            w = x["idx"][:, t].long()
            pool[w[w >= 0]] = kv(S[w >= 0])
    if mode != "spec":
        pool[rs[rs >= 0]] = kv(S[rs >= 0])
    return o, pool


def written_slots(x, mode, N):
    if mode == "mtp":
        return torch.arange(N, device="cuda")
    if mode == "pool":
        return x["idx"].long()
    return x["idx"].long().flatten()


def crossover(reps):
    """kda_decode's choice between its two kernels for bf16 inputs (KDA_DECODE_MAX_TOKENS_PER_SEQ): the
    recurrent kernel (fused_recurrent_kda on fp32 copies of the inputs, which always takes it) against the
    chunked kernels (chunk_kda, bf16) on the same problem, T tokens per sequence, fp32 V-first states, N
    sequences of H32. Rows: (N, T, recurrent µs, chunked µs)."""
    out = []
    for N in (1, 32):
        for T in (1, 4, 8, 16, 32, 64, 128, 256):
            x = make_problem(N, 32, 32, T, "mtp", torch.float32, True, seed=1)
            g = torch.nn.functional.logsigmoid(x["g"].float()).to(torch.bfloat16)
            b = torch.sigmoid(x["beta"].float()).to(torch.bfloat16)
            f32 = lambda t: t.float()
            pool = x["pool"].clone()
            q32, k32, v32, g32, b32 = f32(x["q"]), f32(x["k"]), f32(x["v"]), f32(g), f32(b)
            rec = lambda: kda.fused_recurrent_kda(q32, k32, v32, g32, b32, initial_state=pool,
                                                  inplace_final_state=True, state_v_first=True,
                                                  use_qk_l2norm_in_kernel=True)
            chk = lambda: kda.chunk_kda(x["q"], x["k"], x["v"], g, b, initial_state=pool, output_final_state=True,
                                        state_v_first=True, use_qk_l2norm_in_kernel=True)
            t_rec, t_chk = graph_us(rec, reps=reps), graph_us(chk, reps=reps)
            out.append((N, T, t_rec, t_chk))
            print(f"crossover N{N} H32 T{T}: recurrent {t_rec:.1f} us, chunked {t_chk:.1f} us", flush=True)
            del x, pool
    return out


def plot(rows, meta, path):
    """Bars of GPU µs per call (graph), ours and FLA, per shape, with the ratio FLA / ours above ours."""
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if isinstance(r.get("ours_graph_us"), (int, float))]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.get("fla_graph_us") or 0 for r in rows], 0.4, label="FLA fused_recurrent_kda",
           color="tab:blue")
    ax.bar([i + 0.2 for i in x], [r["ours_graph_us"] for r in rows], 0.4, label="libkda kda_decode",
           color="tab:orange")
    for i, r in enumerate(rows):
        if isinstance(r.get("ratio"), (int, float)):
            ax.text(i + 0.2, r["ours_graph_us"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["shape"] for r in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("GPU µs per call (CUDA graph)")
    ax.set_title(f"decode step, vLLM pool in place, K = V = 128 — {meta.get('card')}, {meta.get('date')}, "
                 f"commit {meta.get('commit')} (label: FLA / libkda)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-crossover", action="store_true")
    ap.add_argument("--replot", default=None, help="results.json to redraw decode.png from (into --out)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        with open(args.replot) as fh:
            res = json.load(fh)
        plot(res["rows"], res["meta"], os.path.join(args.out, "decode.png"))
        return 0
    reps = 7 if args.quick else 15
    card = torch.cuda.get_device_name()
    print(f"{card}; FLA {'found' if fla_fwd else 'NOT importable: ' + FLA_ERR}", flush=True)

    cases = []
    for name, N, HQK, HV, T, mode in SHAPES:
        for sdt in (torch.float32, torch.bfloat16):
            for vfirst in ((True, False) if name.startswith("N256") else (True,)):
                cases.append((name, N, HQK, HV, T, mode, sdt, vfirst))
    rows = []
    for name, N, HQK, HV, T, mode, sdt, vfirst in cases:
        label = f"{name} {'fp32' if sdt == torch.float32 else 'bf16'} {'V-first' if vfirst else 'K-first'}"
        if args.only and args.only not in label:
            continue
        x = make_problem(N, HQK, HV, T, mode, sdt, vfirst)
        touched = N * HV * K * V * x["pool"].element_size() * ((1 + T) if mode == "spec" else 2)
        row = dict(shape=label, N=N, HQK=HQK, HV=HV, T=T, mode=mode, state_bytes=touched)
        for who, fn in (("ours", call_ours), ("fla", call_fla)):
            if who == "fla" and fla_fwd is None:
                continue
            pool = x["pool"].clone()
            try:
                row[f"{who}_graph_us"] = graph_us(lambda: fn(x, pool, vfirst), reps=reps)
            except Exception as e:  # a capture failure is a result too
                row[f"{who}_graph_us"] = None
                row[f"{who}_graph_error"] = repr(e)[:200]
            row[f"{who}_eager_us"] = eager_us(lambda: fn(x, pool, vfirst), reps=reps)
            # accuracy of one call from the original pool
            pool = x["pool"].clone()
            o, _ = fn(x, pool, vfirst)
            torch.cuda.synchronize()
            o_ref, pool_ref = reference(x, x["pool"], mode, vfirst, HQK, HV, T)
            ws = written_slots(x, mode, N)
            ws = ws[ws >= 0]
            row[f"{who}_o_err"] = rel(o, o_ref)
            row[f"{who}_state_err"] = rel(pool[ws], pool_ref[ws])
            del pool, o_ref, pool_ref
        t_ours = row.get("ours_graph_us") or row["ours_eager_us"]
        row["ours_tbps"] = touched / (t_ours * 1e-6) / 1e12
        if row.get("fla_graph_us") or row.get("fla_eager_us"):
            t_fla = row.get("fla_graph_us") or row["fla_eager_us"]
            row["fla_tbps"] = touched / (t_fla * 1e-6) / 1e12
            row["ratio"] = t_fla / t_ours
        rows.append(row)
        f = lambda v, fmt: (fmt % v) if isinstance(v, (int, float)) else "—"
        print(f"{label:34s} ours {f(row.get('ours_graph_us'), '%7.1f')} us ({f(row['ours_tbps'], '%.2f')} TB/s, "
              f"eager {row['ours_eager_us']:.1f})  FLA {f(row.get('fla_graph_us'), '%7.1f')} us "
              f"({f(row.get('fla_tbps'), '%.2f')} TB/s, eager {f(row.get('fla_eager_us'), '%.1f')})  "
              f"ratio {f(row.get('ratio'), '%.2f')}x  o err ours {row['ours_o_err']:.1e} FLA "
              f"{f(row.get('fla_o_err'), '%.1e')}  state err ours {row['ours_state_err']:.1e} FLA "
              f"{f(row.get('fla_state_err'), '%.1e')}", flush=True)
        del x
        torch.cuda.empty_cache()

    cross = [] if args.no_crossover else crossover(reps)
    meta = dict(date=time.strftime("%Y-%m-%d"), card=card, commit=git_commit(), torch=torch.__version__,
                fla=getattr(sys.modules.get("fla"), "__version__", "unknown"))
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows, crossover=cross), fh, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(f"# libkda decode vs FLA fused_recurrent_kda_fwd — {meta['date']}, {card}, commit {meta['commit']}\n\n")
        fh.write("K = V = 128, bf16 inputs, l2norm + gate in kernel (lower_bound -5) + beta sigmoid, vLLM pool in "
                 "place. µs: GPU time per call from CUDA-graph replays (eager: back-to-back Python calls). TB/s: "
                 "touched states read + written. Errors: relative to a float64 recurrence.\n\n")
        fh.write("| shape | ours µs | FLA µs | FLA / ours | ours TB/s | FLA TB/s | ours eager µs | FLA eager µs | "
                 "o err ours | o err FLA | state err ours | state err FLA |\n")
        fh.write("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        g = lambda r, k, fmt: (fmt % r[k]) if isinstance(r.get(k), (int, float)) else "—"
        for r in rows:
            fh.write(f"| {r['shape']} | {g(r, 'ours_graph_us', '%.1f')} | {g(r, 'fla_graph_us', '%.1f')} | "
                     f"{g(r, 'ratio', '%.2fx')} | {g(r, 'ours_tbps', '%.2f')} | {g(r, 'fla_tbps', '%.2f')} | "
                     f"{g(r, 'ours_eager_us', '%.1f')} | {g(r, 'fla_eager_us', '%.1f')} | "
                     f"{g(r, 'ours_o_err', '%.1e')} | {g(r, 'fla_o_err', '%.1e')} | "
                     f"{g(r, 'ours_state_err', '%.1e')} | {g(r, 'fla_state_err', '%.1e')} |\n")
        errs = [f"{r['shape']}: {who} graph capture failed: {r[who + '_graph_error']}" for r in rows
                for who in ("ours", "fla") if r.get(who + "_graph_error")]
        if errs:
            fh.write("\n" + "\n".join(errs) + "\n")
        if cross:
            fh.write("\n## kda_decode's crossover (bf16 inputs): recurrent vs chunked kernels, fp32 V-first states, "
                     "H32, T tokens per sequence, l2norm, GPU µs per call (graph)\n\n| N | T | recurrent µs | "
                     "chunked µs |\n|---:|---:|---:|---:|\n")
            for N, T, a, b in cross:
                fh.write(f"| {N} | {T} | {a:.1f} | {b:.1f} |\n")
    print(f"wrote {args.out}/results.md", flush=True)
    plot(rows, meta, os.path.join(args.out, "decode.png"))


if __name__ == "__main__":
    main()
