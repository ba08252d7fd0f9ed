"""Gradient accuracy of libkda's CUDA backward and of FLA's chunk_kda against the fp64 oracle, same inputs.

    KDA_LIBRARY=build/libkda.so PYTHONPATH=python:bench:/tmp/site python3 bench/bwd_accuracy.py [--cases a,b]

Issue 11's accuracy line: "each gradient's relative error against the fp64 oracle ≤ FLA's on the same inputs
(measure both)". Inputs are drawn in float32 and rounded to the case's dtype; the oracle is libkda's reference
backend (float64 inside) on CPU float32 copies of exactly those rounded inputs, with the same do and dht. Each
gradient's error is ‖x − ref‖ / ‖ref‖ over the whole tensor. FLA is optional (without it only libkda is measured).
"""
import argparse

import torch

import kda
from kda import _lib

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except ImportError:
    fla_chunk_kda = None

# name: (B, T or lengths, HQK, HV, K, dtype, gate scale)
CASES = {
    "training_bf16": (1, 300, 4, 4, 128, torch.bfloat16, 1.0),
    "training_fp32": (1, 300, 4, 4, 128, torch.float32, 1.0),
    "gva4_bf16": (1, 300, 2, 8, 128, torch.bfloat16, 1.0),
    "strong_decay_bf16": (1, 300, 4, 4, 128, torch.bfloat16, 8.0),
    "varlen_bf16": (1, [70, 130, 1, 99], 4, 4, 128, torch.bfloat16, 1.0),
    "varlen6_bf16": (1, [1300, 547, 2048, 963, 271, 3063], 4, 4, 128, torch.bfloat16, 1.0),  # the benchmark's lengths
    "k64_bf16": (2, 200, 4, 4, 64, torch.bfloat16, 1.0),
}
GRADS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def make(B, T, HQK, HV, K, dtype, gscale, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = None
    if isinstance(T, list):
        lens, T = T, sum(T)
    N = B if lens is None else len(lens)
    r = lambda *s: torch.randn(*s, generator=gen)
    x = dict(q=r(B, T, HQK, K), k=r(B, T, HQK, K), v=r(B, T, HV, K), g=gscale * r(B, T, HV, K), beta=r(B, T, HV),
             A_log=torch.rand(HV, generator=gen) * 2.0 - 1.0, dt_bias=0.5 * r(HV * K),
             initial_state=0.1 * r(N, HV, K, K))
    for n in ("q", "k", "v", "g", "beta"):
        x[n] = x[n].to(dtype).float()  # the case's rounding, kept as exact float32 values for the oracle
    w = dict(do=r(B, T, HV, K).to(dtype).float(), dht=r(N, HV, K, K))
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    return x, w, cu


def grads(fn, x, w, cu, dtype, device):
    leaves = {}
    for n, t in x.items():
        dt = dtype if n in ("q", "k", "v", "g", "beta") else torch.float32
        leaves[n] = t.to(device=device, dtype=dt).clone().requires_grad_(True)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 output_final_state=True, cu_seqlens=None if cu is None else cu.to(device))
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves["initial_state"], A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], **flags)
    torch.autograd.backward([o, ht], [w["do"].to(device=device, dtype=o.dtype), w["dht"].to(device)])
    return {n: leaves[n].grad.detach().double().cpu() for n in GRADS}


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--fla-cases", default=None, help="the cases FLA runs too (default: all; each compiles its kernels)")
    ap.add_argument("--seeds", type=int, default=1, help="inputs drawn from seeds 0 .. N-1 (a row per seed)")
    args = ap.parse_args()
    _lib.CPU_CONTEXT = (_lib.BACKEND_REFERENCE, 0)  # CPU tensors: the fp64 oracle
    print("case                 impl   " + " ".join(f"{n[:8]:>9s}" for n in GRADS))
    for name in args.cases.split(","):
        B, T, HQK, HV, K, dtype, gs = CASES[name]
        with_fla = fla_chunk_kda is not None and (args.fla_cases is None or name in args.fla_cases.split(","))
        impls = [("kda", kda.chunk_kda)] + ([("fla", fla_chunk_kda)] if with_fla else [])
        for seed in range(args.seeds):
            x, w, cu = make(B, T, HQK, HV, K, dtype, gs, seed=seed)
            ref = grads(kda.chunk_kda, x, w, cu, torch.float32, "cpu")
            label = name if args.seeds == 1 else f"{name}/{seed}"
            for iname, fn in impls:
                try:
                    g = grads(fn, x, w, cu, dtype, "cuda")
                    print(f"{label:20s} {iname:5s} " + " ".join(f"{rel(g[n], ref[n]):9.2e}" for n in GRADS), flush=True)
                except Exception as e:  # noqa: BLE001 (a peer's failure is reported, not fatal)
                    print(f"{label:20s} {iname:5s} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)


if __name__ == "__main__":
    main()
