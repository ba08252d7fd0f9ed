"""A rounding budget of d_initial_state (dh0): which bf16-rounded forward panel costs how much of dh0's error.

    KDA_LIBRARY=build-c/libkda.so PYTHONPATH=python:bench python3 dev/experiments/dh0_budget.py [--cases a,b] [--seeds N]

dh0 does not depend on the forward's state: it is the state-gradient chain of bwd_dstate.cu alone,

    dS ← dht;  for each chunk, last first:  dΔ = Aqkᵀ dO + K̃ dS ;  dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ ;  dh0 ← dS

on the forward's chunk panels (docs/ALGORITHM.md §3: QΓ = s q̂ e^G, K̃ = k̂ e^{G_last − G}, γ = e^{G_last},
Aqk_ij = s Σ q̂_i k̂_j e^{G_i − G_j} (j ≤ i), A_ij = β_i Σ k̂_i k̂_j e^{G_i − G_j} (j < i), T = (I + A)⁻¹,
W = T Diag(β) KΓ). Here everything is float64 on the CPU; chosen panels are rounded to bf16 (RNE), the rest kept
exact, and dh0's relative error against the fp64 oracle is reported, ‖dh0 − ref‖ / ‖ref‖ over all sequences and
heads (bench/bwd_accuracy.py's rel()). Inputs: bench/bwd_accuracy.py's make(), the same cases and seeds.

Checks: the fp64 chunked chain against an fp64 token-by-token reverse recurrence (to ~1e-13) and against libkda's
reference backend (the oracle bwd_accuracy.py uses; its gradient comes back in float32, so ~1e-7).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # libkda's and torch's OpenMP threads otherwise spin against each other

import torch

torch.set_default_dtype(torch.float64)
C = 64
LOG2E = 1.4426950408889634


def bf(x):
    return x.to(torch.bfloat16).to(torch.float64)


def hilo(x):  # x as bf16 hi + bf16 lo (libkda's dS, dΔ operands): 16 significant bits
    hi = bf(x)
    return hi + bf(x - hi)


def softplus(x):
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))


class Problem:
    """One case/seed: per-token inputs laid out [N, HV, NC, C, ·] (sequences padded to whole chunks with neutral
    tokens: q = k = β = 0, gate 0, dO = 0, which leave every chain step the identity)."""

    def __init__(self, x, w, cu, K, HQK, HV):
        B, T = x["q"].shape[:2]
        if cu is None:
            seqs = [(b, 0, T) for b in range(B)]
        else:
            seqs = [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
        N, G = len(seqs), HV // HQK
        L = max(e - s for _, s, e in seqs)
        NC = (L + C - 1) // C
        P = NC * C
        z = lambda *s: torch.zeros(*s)
        self.q, self.k = z(N, P, HQK, K), z(N, P, HQK, K)
        self.g, self.beta, self.do = z(N, P, HV, K), z(N, P, HV), z(N, P, HV, K)
        self.valid = torch.zeros(N, P, dtype=torch.bool)
        for n, (b, s, e) in enumerate(seqs):
            ln = e - s
            self.q[n, :ln] = x["q"][b, s:e].double()
            self.k[n, :ln] = x["k"][b, s:e].double()
            self.g[n, :ln] = x["g"][b, s:e].double()
            self.beta[n, :ln] = x["beta"][b, s:e].double()
            self.do[n, :ln] = w["do"][b, s:e].double()
            self.valid[n, :ln] = True
        self.A_log, self.dt_bias = x["A_log"].double(), x["dt_bias"].double().view(HV, K)
        self.dht = w["dht"].double()  # [N, HV, K, V]
        self.N, self.NC, self.K, self.HV, self.G = N, NC, K, HV, G
        self.s = K ** -0.5

    # per-token quantities, [N, HV, NC, C, K] (β: [N, HV, NC, C])
    def tokens(self, qk_bf16="", g32=False):
        N, NC, K, HV = self.N, self.NC, self.K, self.HV
        rn = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        qs, kn = self.s * rn(self.q), rn(self.k)
        # libkda's normalize_qkv: s q / ‖q‖ and k / ‖k‖ rounded to bf16 tiles ("qk"; "q", "k": one of them)
        if "q" in qk_bf16:
            qs = bf(qs)
        if "k" in qk_bf16:
            kn = bf(kn)
        qs = qs.repeat_interleave(self.G, dim=2)
        kn = kn.repeat_interleave(self.G, dim=2)
        A = torch.exp(self.A_log)
        x = self.g + self.dt_bias
        gh = (-A[:, None] * softplus(x)).clamp(-80.0, 0.0)
        gh = torch.where(self.valid[:, :, None, None], gh, torch.zeros(()))
        lay = lambda t: t.reshape(N, NC, C, HV, -1).permute(0, 3, 1, 2, 4).contiguous()
        gh = lay(gh)
        if g32:  # libkda's gate_cumsum: fp32, log2 units, summed row by row
            g2 = (gh.float() * torch.tensor(LOG2E, dtype=torch.float32))
            run = torch.zeros_like(g2[..., 0, :])
            out = torch.empty_like(g2)
            for i in range(C):
                run = run + g2[..., i, :]
                out[..., i, :] = run
            Gc = out.double() / LOG2E  # e^G evaluated exactly from the fp32 log2 sum
        else:
            Gc = gh.cumsum(-2)
        beta = torch.sigmoid(self.beta)
        beta = torch.where(self.valid[:, :, None], beta, torch.zeros(()))
        beta = beta.reshape(N, NC, C, HV).permute(0, 3, 1, 2).contiguous()
        return lay(qs), lay(kn), Gc, beta, gh

    def panels(self, qk_bf16="", g32=False):
        qs, kn, Gc, beta, _ = self.tokens(qk_bf16, g32)
        GL = Gc[..., -1:, :]
        eG = torch.exp(Gc)
        QG, KG, Kt, gam = qs * eG, kn * eG, kn * torch.exp(GL - Gc), torch.exp(GL[..., 0, :])
        # pair products with e^{G_i − G_j}, j ≤ i, as matrix products of e^{G_i − R} and e^{R − G_j}, R = G at
        # the chunk's first row (fp64 keeps both factors exact to ~1e-16 while the chunk's range stays < 600 nats)
        R = Gc[..., :1, :]
        assert float((R - GL).max()) < 600.0, "decay range too large for the fp64 split"
        fi, fj = torch.exp(Gc - R), torch.exp(R - Gc)
        low = torch.tril(torch.ones(C, C))
        Aqk = ((qs * fi) @ (kn * fj).transpose(-1, -2)) * low
        Akk = ((kn * fi) @ (kn * fj).transpose(-1, -2)) * low
        Amat = beta[..., :, None] * torch.tril(Akk, -1)
        I = torch.eye(C)
        Tm = torch.linalg.solve_triangular(I + Amat, I.expand_as(Amat).contiguous(), upper=False, unitriangular=True)
        W = Tm @ (beta[..., None] * KG)
        dO = self.do.reshape(self.N, self.NC, C, self.HV, -1).permute(0, 3, 1, 2, 4).contiguous()
        return dict(QG=QG, Kt=Kt, W=W, Aqk=Aqk, gam=gam), dO

    def panels_gpu(self, q_hilo=False):
        """The panels as libkda's prep forms them (prep.cuh), fp32 arithmetic taken as exact: s q̂, k̂ rounded to bf16
        tiles; G in fp32 (log2 units); QΓ, K̃, KΓ the fp32 products of the bf16 rows, rounded once; γ fp32; A and Aqk
        by 16 × 16 blocks from bf16 factors bf16(x ⊙ bf16(e^{±(G − R)})) (intra_chunk_A's roles and references,
        the exact fallback for a diagonal block whose half-block range exceeds 64 nats), Aqk's diagonal
        s q·k / (‖q‖ ‖k‖) from the unrounded rows; W by solve_w_u's block substitution (A_IM, L_II = T_II − I and
        Y_I rounded to bf16 in the products, X_M the bf16 W rows). q_hilo: QΓ from the unrounded s q̂, kept as
        bf16 hi + lo."""
        qs, kn, Gc, beta, _ = self.tokens("", True)
        qb, kb = bf(qs), bf(kn)
        GL = Gc[..., -1:, :]
        eG = torch.exp(Gc)
        QG = hilo(qs * eG) if q_hilo else bf(qb * eG)
        Kt, KG = bf(kb * torch.exp(GL - Gc)), bf(kb * eG)
        gam = torch.exp(GL[..., 0, :]).float().double()
        sh = Gc.shape[:-1]
        Akk, Aqk = torch.zeros(*sh, C), torch.zeros(*sh, C)
        blk = lambda t, I: t[..., 16 * I:16 * I + 16, :]
        low_s, low = torch.tril(torch.ones(16, 16), -1), torch.tril(torch.ones(16, 16))
        for I in range(4):
            Gf, Gm, Gl = Gc[..., 16 * I, :], Gc[..., 16 * I + 7, :], Gc[..., 16 * I + 15, :]
            rng = torch.maximum(Gf - Gm, Gm - Gl).amax(-1)  # [N,HV,NC]
            split = (rng <= 64.0)[..., None, None]
            for J in range(I + 1):
                diag_role = J >= 2 * (I // 2) if I >= 2 else True  # roles (0,0) (1,0)(1,1) (2,2) (3,2)(3,3)
                Rs = Gc[..., 16 * I + 7:16 * I + 8, :] if diag_role else Gc[..., 16 * I:16 * I + 1, :]
                Rf = Gc[..., 16 * I:16 * I + 1, :]
                vals = []
                for R in (Rs, Rf):
                    er, ec = bf(torch.exp(blk(Gc, I) - R)), bf(torch.exp(R - blk(Gc, J)))
                    fk, fq, fb = bf(blk(kb, I) * er), bf(blk(qb, I) * er), bf(blk(kb, J) * ec)
                    vals.append((fk @ fb.transpose(-1, -2), fq @ fb.transpose(-1, -2)))
                a, q = [torch.where(split, vs, vf) for vs, vf in zip(*vals)] if diag_role else vals[1]
                if I == J:  # the exact fallback where the range rule fails
                    D = (blk(Gc, I)[..., :, None, :] - blk(Gc, I)[..., None, :, :]).clamp(max=0.0)
                    E = torch.exp(D)
                    ax = torch.einsum("...id,...jd,...ijd->...ij", blk(kb, I), blk(kb, I), E)
                    qx = torch.einsum("...id,...jd,...ijd->...ij", blk(qb, I), blk(kb, I), E)
                    a, q = torch.where(split, a, ax) * low_s, torch.where(split, q, qx) * low
                Akk[..., 16 * I:16 * I + 16, 16 * J:16 * J + 16] = a
                Aqk[..., 16 * I:16 * I + 16, 16 * J:16 * J + 16] = q
        idx = torch.arange(C)
        Aqk[..., idx, idx] = (qs * kn).sum(-1)  # aqk_diagonal: from the unrounded rows
        Aqk = bf(Aqk)
        Amat = beta[..., :, None] * Akk
        X = torch.zeros_like(KG)
        eye = torch.eye(16)
        for I in range(4):
            AII = Amat[..., 16 * I:16 * I + 16, 16 * I:16 * I + 16]
            L = torch.linalg.solve_triangular(eye + AII, eye.expand_as(AII).contiguous(), upper=False,
                                              unitriangular=True) - eye
            Y = blk(beta[..., None] * KG, I)
            for M in range(I):
                Y = Y - bf(Amat[..., 16 * I:16 * I + 16, 16 * M:16 * M + 16]) @ blk(X, M)
            X[..., 16 * I:16 * I + 16, :] = bf(Y + bf(L) @ bf(Y))
        dO = self.do.reshape(self.N, self.NC, C, self.HV, -1).permute(0, 3, 1, 2, 4).contiguous()
        return dict(QG=QG, Kt=Kt, W=X, Aqk=Aqk, gam=gam), dO

    def chain(self, P, dO, mode="exact"):
        """dh0 from panels P. mode: exact (fp64 arithmetic); libkda (dS, dΔ as hi+lo bf16 operands); fla (FLA's
        chunk_gated_delta_rule_bwd_dhu: Aqkᵀ dO stored bf16, dS rounded to bf16 for K̃ dS, dΔ rounded to bf16)"""
        dS = self.dht.clone()
        tr = lambda t: t.transpose(-1, -2)
        for c in range(self.NC - 1, -1, -1):
            Wc, QGc, Ktc, Ac, gc, dOc = (P["W"][:, :, c], P["QG"][:, :, c], P["Kt"][:, :, c], P["Aqk"][:, :, c],
                                         P["gam"][:, :, c], dO[:, :, c])
            if mode == "exact":
                dD = tr(Ac) @ dOc + Ktc @ dS
                dS = gc[..., None] * dS + tr(QGc) @ dOc - tr(Wc) @ dD
            elif mode == "libkda":
                dD = tr(Ac) @ dOc + Ktc @ hilo(dS)
                dS = gc[..., None] * dS + tr(QGc) @ dOc - tr(Wc) @ hilo(dD)
            elif mode == "fla":
                dD = bf(tr(Ac) @ dOc) + Ktc @ bf(dS)
                dS = gc[..., None] * dS + tr(QGc) @ dOc - tr(Wc) @ bf(dD)
        return dS

    def token_ref(self):
        """dh0 by the oracle's token-by-token reverse recurrence (ALGORITHM.md §6), fp64"""
        qs, kn, Gc, beta, gh = self.tokens()
        f = lambda t: t.reshape(*t.shape[:2], self.NC * C, *t.shape[4:])
        qs, kn, gh, dO = f(qs), f(kn), f(gh), f(self.do.reshape(self.N, self.NC, C, self.HV, -1).permute(0, 3, 1, 2, 4))
        b = beta.reshape(self.N, self.HV, -1)
        dS = self.dht.clone()
        for t in range(self.NC * C - 1, -1, -1):
            dS = dS + qs[:, :, t, :, None] * dO[:, :, t, None, :]
            dd = torch.einsum("nhkv,nhk->nhv", dS, kn[:, :, t])
            dS = dS - b[:, :, t, None, None] * kn[:, :, t, :, None] * dd[:, :, None, :]
            dS = torch.exp(gh[:, :, t])[..., None] * dS
        return dS


def rel(a, b):
    return float((a - b).norm() / b.norm())


PANELS = ("QG", "Kt", "W", "Aqk", "gam")


def variants():
    """(label, q̂/k̂ rounded before the panels ("", "q", "k", "qk"), G in fp32, panels rounded to bf16, chain mode
    [, panels kept as bf16 hi + lo instead])"""
    allp = set(PANELS) - {"gam"}  # γ is fp32 in libkda's block (prep.cuh decay_factors); bf16 listed separately
    v = [("none", "", 0, set(), "exact")]
    v += [(f"{p} only", "", 0, {p}, "exact") for p in PANELS]
    v += [("all 4 (QG Kt W Aqk)", "", 0, allp, "exact")]
    v += [(f"all 4 but {p}", "", 0, allp - {p}, "exact") for p in ("QG", "W", "Kt", "Aqk")]
    v += [("q,k bf16 only", "qk", 0, set(), "exact"), ("q bf16 only", "q", 0, set(), "exact"),
          ("k bf16 only", "k", 0, set(), "exact"), ("G fp32 only", "", 1, set(), "exact"),
          ("all4 + qk bf16", "qk", 0, allp, "exact"),
          ("GPU model: all4+qk+G32", "qk", 1, allp, "exact"),
          ("GPU, libkda chain (hi+lo)", "qk", 1, allp, "libkda"),
          ("GPU, FLA chain (bf16 dS,dD)", "qk", 1, allp, "fla"),
          ("GPU but QG exact", "qk", 1, allp - {"QG"}, "exact"),
          ("GPU but W exact", "qk", 1, allp - {"W"}, "exact"),
          ("GPU but Kt exact", "qk", 1, allp - {"Kt"}, "exact"),
          ("GPU but Aqk exact", "qk", 1, allp - {"Aqk"}, "exact"),
          ("GPU but QG hi+lo", "qk", 1, allp, "exact", {"QG"}),
          ("GPU but q fp32 (QG,Aqk bf16)", "k", 1, allp, "exact"),
          ("GPU but q fp32, QG exact", "k", 1, allp - {"QG"}, "exact"),
          ("GPU but q fp32, QG hi+lo", "k", 1, allp, "libkda", {"QG"}),
          ("GPU but q fp32, QG,Aqk hi+lo", "k", 1, allp, "libkda", {"QG", "Aqk"}),
          ("GPU but q fp32, QG,W hi+lo", "k", 1, allp, "libkda", {"QG", "W"})]
    return v


def main():
    sys.path[:0] = ["python", "bench"]
    import bwd_accuracy as ba
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="training_bf16,varlen6_bf16,varlen_bf16")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--no-oracle", action="store_true", help="skip libkda's reference backend (checks vs tokens only)")
    args = ap.parse_args()
    if not args.no_oracle:
        import kda
        import kda._torch as kt
        from kda._lib import BACKEND_REFERENCE
        kt._CPU_CONTEXT = (BACKEND_REFERENCE, 0)
    vs = variants()
    results = {}
    for name in args.cases.split(","):
        B, T, HQK, HV, K, dtype, gs = ba.CASES[name]
        for seed in range(args.seeds):
            t0 = time.time()
            x, w, cu = ba.make(B, T, HQK, HV, K, dtype, gs, seed=seed)
            pr = Problem(x, w, cu, K, HQK, HV)
            cache = {}
            def get(qk, g32):
                if (qk, g32) not in cache:
                    cache[(qk, g32)] = pr.panels(qk, bool(g32))
                return cache[(qk, g32)]
            P, dO = get("", 0)
            chunked = pr.chain(P, dO)
            ref = pr.token_ref()
            line = f"{name}/{seed}: chunked fp64 vs token fp64 {rel(chunked, ref):.1e}"
            if not args.no_oracle:
                g = ba.grads(kda.chunk_kda, x, w, cu, torch.float32, "cpu")
                oracle = g["initial_state"]
                line += f", vs libkda oracle (fp32 out) {rel(chunked, oracle):.1e}, token vs oracle {rel(ref, oracle):.1e}"
            print(line, flush=True)
            row = {}
            for label, qk, g32, rset, mode, *hl in vs:
                hl = hl[0] if hl else set()
                P, dO = get(qk, g32)
                Pr = {k: (hilo(v) if k in hl else bf(v) if k in rset else v) for k, v in P.items()}
                row[label] = rel(pr.chain(Pr, dO, mode), ref)
            Pg, dO = pr.panels_gpu()
            Pe, _ = get("qk", 1)
            row["prep as GPU"] = rel(pr.chain(Pg, dO, "libkda"), ref)
            row["prep as GPU, FLA chain"] = rel(pr.chain(Pg, dO, "fla"), ref)
            for p in ("QG", "W", "Aqk", "Kt"):
                row[f"prep as GPU but {p} exact(qk bf16)"] = rel(pr.chain({**Pg, p: Pe[p]}, dO, "libkda"), ref)
            Ph, _ = pr.panels_gpu(q_hilo=True)
            row["prep as GPU, QG hi+lo(fp32 q)"] = rel(pr.chain(Ph, dO, "libkda"), ref)
            Pf, _ = get("k", 1)
            row["prep as GPU, QG fp64(fp32 q)"] = rel(pr.chain({**Pg, "QG": Pf["QG"]}, dO, "libkda"), ref)
            row["  same + W exact(qk bf16)"] = rel(pr.chain({**Ph, "W": Pe["W"]}, dO, "libkda"), ref)
            results[(name, seed)] = row
            print(f"  ({time.time() - t0:.0f} s)", flush=True)
    keys = list(results)
    print()
    print(f"{'variant':28s} " + " ".join(f"{k[0][:-5][:10] + '/' + str(k[1]):>13s}" for k in keys) + f" {'sum':>10s}")
    for label in results[keys[0]]:
        vals = [results[k][label] for k in keys]
        print(f"{label:28s} " + " ".join(f"{v:13.3e}" for v in vals) + f" {sum(vals):10.3e}")


if __name__ == "__main__":
    main()
