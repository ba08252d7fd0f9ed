"""How much dA_log's relative error should exceed dg's if dg's errors were independent (issue 11's accuracy line).

    KDA_LIBRARY=build-c/libkda.so PYTHONPATH=python:bench python3 dev/experiments/dalog_amp.py [--cases a,b] [--seeds N]

dA_log (one scalar per value head) is Σ_{t,k} dλ_{t,k} λ_{t,k}, λ = −e^{A_log} softplus(g + dt_bias) the log decay
and dλ its gradient; dg (the raw gate's gradient) is dλ · (−e^{A_log} σ(g + dt_bias)). The sum cancels (Σ|dλ λ| is
tens of times |dA_log|), so dA_log's relative error is dλ's times an amplification that depends on the inputs. Here:
the fp64 oracle's dλ on bench/bwd_accuracy.py's inputs, perturbed by independent relative noise of size ε per
element (200 draws), and the ratio rel(dA_log) / rel(dg) — the amplification that independent errors would show.
A library whose measured ratio sits far above it has errors correlated along the sums (for instance one error
carried to every earlier token by the reverse cumulative sum of dγ). The measured dg of both libraries is also
rounded to bf16 on output (the g leaf is bf16), ~1.1e-3 of its error that dA_log (summed from fp32 inside) never sees.
"""
import argparse

import torch

import bwd_accuracy as ba
import kda
import kda._torch as kt
from kda._lib import BACKEND_REFERENCE


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="training_bf16,strong_decay_bf16,gva4_bf16")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args()
    kt._CPU_CONTEXT = (BACKEND_REFERENCE, 0)
    for name in args.cases.split(","):
        B, T, HQK, HV, K, dtype, gs = ba.CASES[name]
        for seed in range(args.seeds):
            x, w, cu = ba.make(B, T, HQK, HV, K, dtype, gs, seed)
            ref = ba.grads(kda.chunk_kda, x, w, cu, torch.float32, "cpu")
            g, A, db = x["g"].double(), x["A_log"].double(), x["dt_bias"].double().view(HV, K)
            xx = g + db
            lam = (-A.exp()[:, None] * torch.nn.functional.softplus(xx)).clamp(-80, 0)
            fac = -A.exp()[:, None] * torch.sigmoid(xx)
            dl = ref["g"] / fac
            dA = ref["A_log"]
            check = float(((dl * lam).sum((0, 1, 3)) - dA).norm() / dA.norm())
            amp = []
            for r in range(args.draws):
                eps = torch.randn(dl.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
                el = 1e-3 * dl * eps
                amp.append(float((el * lam).sum((0, 1, 3)).norm() / dA.norm()) / float((el * fac).norm() / ref["g"].norm()))
            amp = torch.tensor(amp)
            # the same with the independent errors put on dγ (dλ's reverse cumulative sum's terms, one sequence:
            # B = 1 and no cu_seqlens here), carried to every earlier token by the sum
            amp2 = []
            if cu is None and B == 1:
                dgam = dl.clone()
                dgam[:, :-1] -= dl[:, 1:]
                for r in range(args.draws):
                    eps = torch.randn(dl.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
                    el = (1e-3 * dgam * eps).flip(1).cumsum(1).flip(1)
                    amp2.append(float((el * lam).sum((0, 1, 3)).norm() / dA.norm()) / float((el * fac).norm() / ref["g"].norm()))
            amp2 = torch.tensor(amp2) if amp2 else torch.tensor([float("nan")])
            cancel = float(((dl * lam).abs().sum((0, 1, 3)) / dA.abs()).median())
            print(f"{name}/{seed}: Σ|dλ λ| / |dA_log| (median over heads) {cancel:6.1f}; independent errors: "
                  f"rel(dA_log) / rel(dg) median {amp.median():.2f}, 10-90 % {amp.quantile(0.1):.2f}-{amp.quantile(0.9):.2f}"
                  f"; on dγ: median {amp2.median():.2f}, 10-90 % {amp2.quantile(0.1):.2f}-{amp2.quantile(0.9):.2f}"
                  f" (oracle's sum check {check:.1e})", flush=True)


if __name__ == "__main__":
    main()
