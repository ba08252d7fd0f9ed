#!/usr/bin/env python3
"""A numpy model of the rounding points of libkda's CUDA chunked forward and of FLA's chunk_kda (issue 12).

It runs both on the inputs of bench_fla.py's accuracy cases (randn q, k, v, g, β logits; l2norm, gate and β sigmoid
in kernel; fp32 initial state 0.1·randn), rounding exactly where each implementation rounds: bf16 = round to
nearest even to 8 significant bits, tf32 = 11 bits, products on the tensor cores exact with fp32 accumulation,
ex2 flushing results below 2^-126 to zero. It reports ||o − o_ref|| / ||o_ref|| against a float64 token-by-token
recurrence (o_ref unrounded, as bench_fla.py's oracle), and, with --attribute, the same with ONE rounding point at a
time of ours (or of FLA's) replaced by fp32.

    python3 bench/acc_model.py                      # ours vs FLA, default case (T 1024, 8 heads, K = V = 128)
    python3 bench/acc_model.py --attribute          # one rounding point at a time to fp32
    python3 bench/acc_model.py --ours-fix impl2    # ours as prep.cuh computes it now (FIXES: the candidates)

No torch needed. Where the kernels differ from this model: fp32 accumulation order (the model sums in numpy's
float32 GEMM order), approximate ex2/rcp (≈1e-7 relative), and tf32 operands are rounded to nearest here (the
tensor cores may truncate): none of these is within an order of magnitude of the bf16 roundings.
"""
import argparse

import numpy as np

LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------------------
# Rounding
# ------------------------------------------------------------------------------------------------------------
def _rne(x, drop):
    """fp32 x rounded to nearest even, dropping the `drop` low mantissa bits"""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    half = (1 << (drop - 1)) - 1
    u = (u + half + ((u >> drop) & 1)) & ~np.uint64((1 << drop) - 1)
    return u.astype(np.uint32).view(np.float32)


def bf16(x):
    return _rne(x, 16)


def tf32(x):
    return _rne(x, 13)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def ex2(x):
    """ex2.approx.ftz: results below 2^-126 flush to zero"""
    y = np.exp2(f32(x)).astype(np.float32)
    return np.where(y < np.float32(2.0 ** -126), np.float32(0), y).astype(np.float32)


def mm(a, b):
    """tensor-core product: operands as given (already rounded), fp32 accumulation"""
    return np.matmul(f32(a), f32(b))


def R(flags, name, fn):
    """the rounding `fn` at point `name`, or fp32 when `name` is in flags['off']"""
    return f32 if name in flags["off"] else fn


# ------------------------------------------------------------------------------------------------------------
# Inputs (bench_fla.py make_inputs, numpy generator) and the fp64 oracle
# ------------------------------------------------------------------------------------------------------------
def make_inputs(T, H, K, V, gate, seed=0):
    rng = np.random.default_rng(seed)
    b = lambda *s: bf16(rng.standard_normal(s, dtype=np.float32))
    x = dict(q=b(T, H, K), k=b(T, H, K), v=b(T, H, V), g=b(T, H, K), beta=b(T, H),
             A_log=(rng.random(H) * 2.0 - 1.0).astype(np.float32),
             dt_bias=(0.5 * rng.standard_normal((H, K))).astype(np.float32),
             h0=(0.1 * rng.standard_normal((H, K, V))).astype(np.float32), gate=gate)
    return x


def gate_nat(x, dtype):
    """per-token log decay in nat units (float64 for the oracle, fp32 for the kernels)"""
    A = np.exp(x["A_log"].astype(dtype))[None, :, None]
    gg = x["g"].astype(dtype) + x["dt_bias"].astype(dtype)[None]
    if x["gate"] == "lb":
        return (-5.0 / (1.0 + np.exp(-A * gg))).astype(dtype)
    sp = np.where(gg > 20, gg, np.log1p(np.exp(np.minimum(gg, 20))))
    return (-A * sp).astype(dtype)


def oracle(x):
    q, k, v = (x[n].astype(np.float64) for n in ("q", "k", "v"))
    K = q.shape[-1]
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * K ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    a = np.exp(gate_nat(x, np.float64))
    beta = 1.0 / (1.0 + np.exp(-x["beta"].astype(np.float64)))
    S = x["h0"].astype(np.float64).copy()
    o = np.zeros_like(v)
    for t in range(q.shape[0]):
        S *= a[t][:, :, None]
        d = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], S))
        S += k[t][:, :, None] * d[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t], S)
    return o, S


# ------------------------------------------------------------------------------------------------------------
# Shared preprocessing: l2norm (fp32, rounded to bf16 by both), β, G (fp32, log2 units, per chunk)
# ------------------------------------------------------------------------------------------------------------
C = 64


def chunked(x):
    """[T, H, ...] → [N = chunks·H, C, ...] (T a multiple of C)"""
    T, H = x.shape[:2]
    return np.ascontiguousarray(np.swapaxes(x.reshape(T // C, C, H, *x.shape[2:]), 1, 2)).reshape(
        T // C * H, C, *x.shape[2:])


def prep_common(x, scale_in_q):
    q, k, v = f32(x["q"]), f32(x["k"]), f32(x["v"])
    K = q.shape[-1]
    s = np.float32(K ** -0.5)
    nq = (1.0 / np.sqrt((q * q).sum(-1, keepdims=True) + np.float32(1e-6))).astype(np.float32)
    nk = (1.0 / np.sqrt((k * k).sum(-1, keepdims=True) + np.float32(1e-6))).astype(np.float32)
    qn = bf16(q * nq * (s if scale_in_q else np.float32(1)))
    kn = bf16(k * nk)
    beta = (1.0 / (1.0 + np.exp(-f32(x["beta"])))).astype(np.float32)
    g2 = (gate_nat(x, np.float32) * np.float32(LOG2E)).astype(np.float32)
    qc, kc, vc, gc = chunked(qn), chunked(kn), chunked(v), chunked(g2)
    G = np.cumsum(gc, axis=1, dtype=np.float32)
    bc = chunked(beta[..., None])[..., 0]
    return qc, kc, vc, G, bc, s


def blk(X, I):
    return X[:, 16 * I:16 * I + 16]


# ------------------------------------------------------------------------------------------------------------
# libkda (src/cuda/fwd/prep.cuh + recurrence.cuh)
# ------------------------------------------------------------------------------------------------------------
DIAG_RANGE2 = 64.0 * LOG2E

# the rounding points of ours (names for --attribute / flags['off'])
OURS_POINTS = [
    ("a_efac", "A/Aqk: exp factors e^{G_i−R}, e^{R−G_j} rounded to bf16"),
    ("a_fac", "A/Aqk: factor products k·e, q·e rounded to bf16"),
    ("aqk_st", "Aqk stored in bf16 (workspace)"),
    ("kg_e", "KΓ/QΓ: e^{G} rounded to bf16"),
    ("kg_p", "KΓ = k·e^G rounded to bf16"),
    ("qg_p", "QΓ = q·e^G rounded to bf16 (workspace)"),
    ("kt_e", "K̃: e^{G_last−G} rounded to bf16"),
    ("kt_p", "K̃ = k·e rounded to bf16 (workspace)"),
    ("wu_a", "solve: A_IM rounded to bf16 (mma operand)"),
    ("wu_t", "solve: T_II rounded to bf16 (mma operand)"),
    ("wu_y", "solve: Y = β B − Σ A X rounded to bf16"),
    ("wu_x", "solve: X_M (W, U rows) rounded to bf16 (operand of later blocks and workspace)"),
    ("rec_s", "recurrence: S rounded to bf16 (operand of W S, QΓ S)"),
    ("rec_d", "recurrence: Δ rounded to bf16 (operand of Aqk Δ, K̃ᵀ Δ)"),
    ("out", "o rounded to bf16"),
]

# candidate fixes of ours (flags['fix'])
FIXES = {
    "single_fac": "A/Aqk factors: k·e^x in fp32, rounded once to bf16 (no bf16 exp factor)",
    "single_gq": "KΓ, QΓ, K̃: k·e^x in fp32, rounded once",
    "wu_x_split": "solve: X_M as a hi + lo bf16 pair in the A X products (two mma), stored rounded once",
    "wu_a_split": "solve: A_IM as a hi + lo bf16 pair (two mma)",
    "wu_t_split": "solve: T_II as a hi + lo bf16 pair (two mma)",
    "wu_y_split": "solve: Y as a hi + lo bf16 pair (two mma)",
    "wu_full_t": "solve: FLA's way: all of T in fp32 then bf16(T) · bf16(β B) once",
    "a_split_col": "A/Aqk: column factor as hi + lo bf16 (two mma)",
    "a_split_row": "A/Aqk: row factors as hi + lo bf16 (two mma)",
    "near0": "Aqk's diagonal q_i·k_i by an fp32 dot product (no factors)",
    "near1": "near0, and A, Aqk at j = i − 1 by fp32 dot products (one exp per row and channel)",
    "near2": "near1, and j = i − 2",
    "near1a": "near0, and A (not Aqk) at j = i − 1 by fp32 dot products",
    "near1q": "near0, and Aqk (not A) at j = i − 1 by fp32 dot products",
    "diag_unr": "Aqk's diagonal from the fp32 rows before their bf16 rounding: s (q·k) / (‖q‖ ‖k‖)",
    "aqk_diag_f32": "Aqk's diagonal kept in fp32 (not rounded to bf16 in the workspace)",
    "exact_diag_blocks": "the diagonal blocks of A, Aqk in fp32 (as diag_block_exact)",
    "exact_off_blocks": "the off-diagonal blocks of A, Aqk in fp32",
    "single_fac_diag": "single_fac in the diagonal blocks only",
    "single_col_diag": "the diagonal blocks' column factors k·e rounded once (row factors as today)",
    "impl1": "prep.cuh's first step in issue 12: near0 (raw q·k products on the tensor cores) + single_fac_diag "
             "(the row factors of the warps with a diagonal block included) + wu_y_ident",
    "impl": "wip/12-acc's prep.cuh (measured +6-12% time): impl1 + split_col_diag",
    "cheap": "the plan after wip/12-acc: near0 (from normalize_qkv's bf16 rows) + wu_y_ident",
    "impl2": "what prep.cuh does since issue 12: diag_unr + wu_y_ident",
    "single_row_diag": "the diagonal blocks' row factors rounded once (column factors as before)",
    "split_col_diag": "a_split_col in the diagonal blocks only (single-rounded factors there)",
    "wu_y_ident": "solve: X_I = Y_I + (T_II − I) bf16(Y_I): the accumulator starts at Y in fp32, the mma applies "
                  "only the strictly lower part of T_II",
    "wu_y_trick": "solve: X_I = T'_II B_I − T'_II bf16(Σ A'_IM X_M), T' = T_II Diag(β), A' = A without β: "
                  "B (bf16 already) never rounded again, only the correction",
}


def split_mm(a, b, split_a, split_b, rnd=bf16):
    """a·b on the tensor cores with a (and/or b) as a hi + lo bf16 pair: one extra mma per split operand"""
    ah = rnd(a)
    bh = rnd(b)
    out = mm(ah, bh)
    if split_a:
        out = out + mm(rnd(f32(a) - ah), bh)
    if split_b:
        out = out + mm(ah, rnd(f32(b) - bh))
    return out.astype(np.float32)


def diag_unrounded(x):
    """Aqk's diagonal s q·k/(‖q‖‖k‖) from the fp32 rows before their bf16 rounding (normalize_qkv's registers)"""
    q, k = f32(x["q"]), f32(x["k"])
    s = np.float32(q.shape[-1] ** -0.5)
    nq = (1.0 / np.sqrt((q * q).sum(-1) + np.float32(1e-6))).astype(np.float32)
    nk = (1.0 / np.sqrt((k * k).sum(-1) + np.float32(1e-6))).astype(np.float32)
    d = ((q * k).sum(-1, dtype=np.float32) * (nq * s) * nk).astype(np.float32)
    return chunked(d[..., None])[..., 0]


def ours_prep(x, flags):
    off, fix = flags["off"], set(flags["fix"])
    if "impl" in fix:
        fix |= {"impl1", "split_col_diag"}
    if "cheap" in fix:
        fix |= {"near0", "wu_y_ident"}
    if "impl2" in fix:
        fix |= {"diag_unr", "wu_y_ident"}
    if "impl1" in fix:
        fix |= {"near0", "single_fac_diag", "wu_y_ident"}
    qc, kc, vc, G, bc, s = prep_common(x, scale_in_q=True)
    N, _, K = kc.shape
    r_e = R(flags, "a_efac", bf16)
    r_f = R(flags, "a_fac", bf16)
    # the factor k·e: mul.rn.bf16x2 of bf16 k and the bf16-rounded exp (one rounding of the exact product)
    if "single_fac" in fix:
        fac = lambda kv, e: r_f(kv * e)
    else:
        fac = lambda kv, e: r_f(kv * r_e(e))
    A = np.zeros((N, C, C), np.float32)
    Aqk = np.zeros((N, C, C), np.float32)
    tril_s = np.tril(np.ones((16, 16), bool), -1)
    tril = np.tril(np.ones((16, 16), bool), 0)

    def has(name, I):
        """fix `name` for the diagonal block I: `name` for all four, `name@02` for blocks 0 and 2 only"""
        return name in fix or any(f.startswith(name + "@") and str(I) in f.split("@")[1] for f in fix)

    def by_factors(I, J, Rv, rows_single=False):
        """the block (I, J) by split factors around reference R (N, K)"""
        if J < I and "exact_off_blocks" in fix:
            d = ex2(blk(G, I)[:, :, None, :] - blk(G, J)[:, None, :, :])
            e = (blk(kc, J)[:, None, :, :] * d).astype(np.float32)
            return ((blk(kc, I)[:, :, None, :] * e).sum(-1, dtype=np.float32),
                    (blk(qc, I)[:, :, None, :] * e).sum(-1, dtype=np.float32))
        e_row = ex2(blk(G, I) - Rv[:, None])
        e_col = ex2(Rv[:, None] - blk(G, J))
        f = fac
        if J == I and (has("single_fac_diag", I) or has("split_col_diag", I)):
            f = lambda kv, e: r_f(kv * e)
        fk, fq = f(blk(kc, I), e_row), f(blk(qc, I), e_row)
        if rows_single or (J == I and "single_row_diag" in fix):
            fk, fq = r_f(blk(kc, I) * e_row), r_f(blk(qc, I) * e_row)
        cb = f(blk(kc, J), e_col)
        if J == I and has("single_col_diag", I):
            cb = r_f(blk(kc, J) * e_col)
        sr, sc = "a_split_row" in fix, "a_split_col" in fix or (J == I and has("split_col_diag", I))
        if sr or sc:
            rf = lambda v, e: f32(v) * e  # unrounded factors for the split
            return (split_mm(rf(blk(kc, I), e_row), np.swapaxes(rf(blk(kc, J), e_col), 1, 2), sr, sc),
                    split_mm(rf(blk(qc, I), e_row), np.swapaxes(rf(blk(kc, J), e_col), 1, 2), sr, sc))
        return mm(fk, np.swapaxes(cb, 1, 2)), mm(fq, np.swapaxes(cb, 1, 2))

    def diag_exact(I):
        Gi, Gj = blk(G, I)[:, :, None, :], blk(G, I)[:, None, :, :]
        e = (blk(kc, I)[:, None, :, :] * ex2(np.where(tril[None, :, :, None], Gi - Gj, 0))).astype(np.float32)
        return ((blk(kc, I)[:, :, None, :] * e).sum(-1, dtype=np.float32),
                (blk(qc, I)[:, :, None, :] * e).sum(-1, dtype=np.float32))

    def put(I, J, a, aq):
        be = blk(bc, I)[:, :, None]
        a = a * be
        if I == J:
            a = np.where(tril_s, a, 0)
            aq = np.where(tril, aq, 0)
        A[:, 16 * I:16 * I + 16, 16 * J:16 * J + 16] = a
        Aqk[:, 16 * I:16 * I + 16, 16 * J:16 * J + 16] = R(flags, "aqk_st", bf16)(aq)

    # warp runs: (I, J0, nb) as intra_chunk_A assigns them
    for (I, J0, nb) in [(0, 0, 1), (1, 0, 2), (2, 0, 2), (2, 2, 1), (3, 0, 2), (3, 2, 2)]:
        has_diag = J0 + nb - 1 == I
        Rfirst = G[:, 16 * I]
        if not has_diag:
            for J in range(J0, J0 + nb):
                put(I, J, *by_factors(I, J, Rfirst))
            continue
        Gf, Gm, Gl = G[:, 16 * I], G[:, 16 * I + 7], G[:, 16 * I + 15]
        split = np.maximum(Gf - Gm, Gm - Gl).max(-1) <= DIAG_RANGE2  # (N,)
        sp = split[:, None, None]
        for J in range(J0, J0 + nb):
            a_s, q_s = by_factors(I, J, G[:, 16 * I + 7], rows_single=has("single_fac_diag", I))
            if J < I:
                a_f, q_f = by_factors(I, J, Rfirst)
            else:
                a_f, q_f = diag_exact(I)
            if J == I and has("exact_diag_blocks", I):
                a_s, q_s = a_f, q_f = diag_exact(I)
            put(I, J, np.where(sp, a_s, a_f), np.where(sp, q_s, q_f))

    # entries i − j <= m computed in fp32 (no factors)
    near1 = {"near1", "near1a", "near1q"} & fix
    m = 2 if "near2" in fix else 1 if near1 else 0 if {"near0", "aqk_diag_f32", "diag_unr"} & fix else -1
    for dlt in range(m + 1):
        i = np.arange(dlt, C)
        j = i - dlt
        e = ex2(G[:, i] - G[:, j])
        kj = (kc[:, j] * e).astype(np.float32)
        aq = (qc[:, i] * kj).sum(-1, dtype=np.float32)
        if dlt == 0 and "diag_unr" in fix:
            aq = diag_unrounded(x)
        if dlt != 1 or "near1a" not in fix:
            Aqk[:, i, j] = f32(aq) if dlt == 0 and "aqk_diag_f32" in fix else R(flags, "aqk_st", bf16)(aq)
        if dlt > 0 and (dlt != 1 or "near1q" not in fix):
            A[:, i, j] = (kc[:, i] * kj).sum(-1, dtype=np.float32) * bc[:, i]

    # decay factors
    GL = G[:, -1:, :]
    e_kt = ex2(GL - G)
    e_g = ex2(G)
    if "single_gq" in fix:
        KT = R(flags, "kt_p", bf16)(kc * e_kt)
        KG = R(flags, "kg_p", bf16)(kc * e_g)
        QG = R(flags, "qg_p", bf16)(qc * e_g)
    else:
        KT = R(flags, "kt_p", bf16)(kc * R(flags, "kt_e", bf16)(e_kt))
        eg = R(flags, "kg_e", bf16)(e_g)
        KG = R(flags, "kg_p", bf16)(kc * eg)
        QG = R(flags, "qg_p", bf16)(qc * eg)
    gam = ex2(GL[:, 0])

    # T_II (fp32 forward substitution: modelled by an fp64 inverse rounded to fp32)
    eye = np.eye(16)
    Tii = [f32(np.linalg.inv(eye + A[:, 16 * I:16 * I + 16, 16 * I:16 * I + 16].astype(np.float64))) for I in range(4)]

    if "wu_full_t" in fix:
        Tfull = f32(np.linalg.inv(np.eye(C) + A.astype(np.float64)))
        Tb = bf16(Tfull)
        W = bf16(mm(Tb, bf16(bc[:, :, None] * kc * e_g)))
        U = bf16(mm(Tb, bf16(bc[:, :, None] * vc)))
        return dict(W=W, U=U, QG=QG, KT=KT, Aqk=Aqk, gam=gam)

    def solve_trick(B):
        X = np.zeros(B.shape, np.float32)
        for I in range(4):
            bI = blk(bc, I)
            Tp = R(flags, "wu_t", bf16)(Tii[I] * bI[:, None, :])
            acc = mm(Tp, blk(B, I))
            if I > 0:
                c = np.zeros((N, 16, B.shape[-1]), np.float32)
                for M in range(I):
                    ap = A[:, 16 * I:16 * I + 16, 16 * M:16 * M + 16] / bI[:, :, None]  # A' (stored so)
                    c += mm(R(flags, "wu_a", bf16)(np.nan_to_num(ap)), X[:, 16 * M:16 * M + 16])
                acc = acc - mm(Tp, R(flags, "wu_y", bf16)(c))
            X[:, 16 * I:16 * I + 16] = R(flags, "wu_x", bf16)(acc)
        return X

    def solve(B):
        if "wu_y_trick" in fix:
            return solve_trick(B)
        X = np.zeros(B.shape, np.float32)
        rx = R(flags, "wu_x", bf16)
        for I in range(4):
            acc = np.zeros((N, 16, B.shape[-1]), np.float32)
            for M in range(I):
                aim = A[:, 16 * I:16 * I + 16, 16 * M:16 * M + 16]
                if "wu_a_split" in fix or "wu_x_split" in fix:
                    acc += split_mm(aim, Xf[M], "wu_a_split" in fix, "wu_x_split" in fix)
                else:
                    acc += mm(R(flags, "wu_a", bf16)(aim), X[:, 16 * M:16 * M + 16])
            y = (blk(bc, I)[:, :, None] * blk(B, I) - acc).astype(np.float32)
            if "wu_y_ident" in fix:
                L = Tii[I] - np.eye(16, dtype=np.float32)
                xi = (y + mm(R(flags, "wu_t", bf16)(L), R(flags, "wu_y", bf16)(y))).astype(np.float32)
            elif "wu_t_split" in fix or "wu_y_split" in fix:
                xi = split_mm(Tii[I], y, "wu_t_split" in fix, "wu_y_split" in fix)
            else:
                xi = mm(R(flags, "wu_t", bf16)(Tii[I]), R(flags, "wu_y", bf16)(y))
            Xf[I] = xi
            X[:, 16 * I:16 * I + 16] = rx(xi)
        return X

    Xf = [None] * 4
    W = solve(KG)
    Xf = [None] * 4
    U = solve(vc)
    return dict(W=W, U=U, QG=QG, KT=KT, Aqk=Aqk, gam=gam)


def recurrence(x, ws, flags, o_scale=1.0):
    """Δ = U − W S, O = QΓ S + Aqk Δ, S ← Diag(γ) S + K̃ᵀ Δ; S fp32, products on bf16 operands"""
    T, H, V = x["v"].shape
    nch = T // C
    S = f32(x["h0"]).copy()
    o = np.zeros((nch, H, C, V), np.float32)
    rs, rd = R(flags, "rec_s", bf16), R(flags, "rec_d", bf16)
    sh = lambda a: a.reshape(nch, H, *a.shape[1:])
    W, U, QG, KT, Aqk, gam = (sh(ws[n]) for n in ("W", "U", "QG", "KT", "Aqk", "gam"))
    for c in range(nch):
        Sb = rs(S)
        D = (U[c] - mm(W[c], Sb)).astype(np.float32)
        Db = rd(D)
        o[c] = (mm(QG[c], Sb) * np.float32(o_scale) + mm(Aqk[c], Db)).astype(np.float32)
        S = (S * gam[c][:, :, None] + mm(np.swapaxes(KT[c], 1, 2), Db)).astype(np.float32)
    o = R(flags, "out", bf16)(o)
    return np.swapaxes(o, 1, 2).reshape(T, H, V), S


# ------------------------------------------------------------------------------------------------------------
# FLA 0.6.0 chunk_kda (safe_gate): chunk_intra.py, wy_fast.py, common/chunk_delta_h.py, gla chunk_gla_fwd_o_gk
# ------------------------------------------------------------------------------------------------------------
FLA_POINTS = [
    ("f_a_tf32", "A/Aqk: factors as tf32 operands"),
    ("aqk_st", "Aqk stored in bf16"),
    ("f_inv_tf32", "T off-diagonal blocks: tf32 products"),
    ("f_t_st", "T stored in bf16"),
    ("f_b", "β k e^G, β v rounded to bf16"),
    ("f_wu_st", "W, U stored in bf16"),
    ("f_kg", "kg = k e^{G_last−G} rounded to bf16"),
    ("f_qg", "qg = q e^G rounded to bf16"),
    ("rec_s", "recurrence: h rounded to bf16"),
    ("rec_d", "recurrence: v_new rounded to bf16"),
    ("out", "o rounded to bf16"),
]


def fla_prep(x, flags):
    qc, kc, vc, G, bc, s = prep_common(x, scale_in_q=False)
    N, _, K = kc.shape
    rt = R(flags, "f_a_tf32", tf32)
    A = np.zeros((N, C, C), np.float32)
    Aqk = np.zeros((N, C, C), np.float32)
    tril_s = np.tril(np.ones((16, 16), bool), -1)
    tril = np.tril(np.ones((16, 16), bool), 0)
    for I in range(4):
        # diagonal (chunk_kda_fwd_kernel_intra_sub_chunk): reference row 8 of the sub-chunk
        gm = blk(G, I) - G[:, 16 * I + 8][:, None]
        gq, gk = ex2(gm), ex2(-gm)
        kgt = np.swapaxes(rt(blk(kc, I) * gk), 1, 2)
        aq = mm(rt(blk(qc, I) * gq), kgt) * s
        ak = mm(rt(blk(kc, I) * gq), kgt) * blk(bc, I)[:, :, None]
        Aqk[:, 16 * I:16 * I + 16, 16 * I:16 * I + 16] = R(flags, "aqk_st", bf16)(np.where(tril, aq, 0))
        A[:, 16 * I:16 * I + 16, 16 * I:16 * I + 16] = np.where(tril_s, ak, 0)
        # off-diagonal: reference the first row of row block I
        gn = G[:, 16 * I][:, None]
        gqn = ex2(blk(G, I) - gn)
        for J in range(I):
            kgt = np.swapaxes(rt(blk(kc, J) * ex2(gn - blk(G, J))), 1, 2)
            aq = mm(rt(blk(qc, I) * gqn), kgt)
            ak = mm(rt(blk(kc, I) * gqn), kgt)
            Aqk[:, 16 * I:16 * I + 16, 16 * J:16 * J + 16] = R(flags, "aqk_st", bf16)(aq * s)
            A[:, 16 * I:16 * I + 16, 16 * J:16 * J + 16] = ak * blk(bc, I)[:, :, None]
    # T: diagonal inverses fp32, then the merged inverse with tf32 products
    ri = R(flags, "f_inv_tf32", tf32)
    d = lambda a, b: mm(ri(a), ri(b))
    Ab = lambda I, J: A[:, 16 * I:16 * I + 16, 16 * J:16 * J + 16]
    Ai = {}
    for I in range(4):
        Ai[I, I] = f32(np.linalg.inv(np.eye(16) + Ab(I, I).astype(np.float64)))
    Ai[1, 0] = -d(d(Ai[1, 1], Ab(1, 0)), Ai[0, 0])
    Ai[2, 1] = -d(d(Ai[2, 2], Ab(2, 1)), Ai[1, 1])
    Ai[2, 0] = -d(Ai[2, 2], d(Ab(2, 0), Ai[0, 0]) + d(Ab(2, 1), Ai[1, 0]))
    Ai[3, 2] = -d(d(Ai[3, 3], Ab(3, 2)), Ai[2, 2])
    Ai[3, 1] = -d(Ai[3, 3], d(Ab(3, 1), Ai[1, 1]) + d(Ab(3, 2), Ai[2, 1]))
    Ai[3, 0] = -d(Ai[3, 3], d(Ab(3, 0), Ai[0, 0]) + d(Ab(3, 1), Ai[1, 0]) + d(Ab(3, 2), Ai[2, 0]))
    Tm = np.zeros((N, C, C), np.float32)
    for (I, J), v in Ai.items():
        Tm[:, 16 * I:16 * I + 16, 16 * J:16 * J + 16] = v
    Tb = R(flags, "f_t_st", bf16)(Tm)
    rb = R(flags, "f_b", bf16)
    rw = R(flags, "f_wu_st", bf16)
    e_g = ex2(G)
    U = rw(mm(Tb, rb(vc * bc[:, :, None])))
    W = rw(mm(Tb, rb(kc * bc[:, :, None] * e_g)))
    GL = G[:, -1:, :]
    KT = R(flags, "f_kg", bf16)(kc * ex2(GL - G))
    QG = R(flags, "f_qg", bf16)(qc * e_g)
    return dict(W=W, U=U, QG=QG, KT=KT, Aqk=Aqk, gam=ex2(GL[:, 0]))


# ------------------------------------------------------------------------------------------------------------
def run(x, impl, off=(), fix=()):
    flags = dict(off=set(off), fix=set(fix))
    if impl == "ours":
        return recurrence(x, ours_prep(x, flags), flags)
    K = x["q"].shape[-1]
    return recurrence(x, fla_prep(x, flags), flags, o_scale=K ** -0.5)


def rel(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--gate", default="lb", choices=["lb", "softplus"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attribute", action="store_true", help="one rounding point at a time to fp32")
    ap.add_argument("--ours-fix", default="", help="comma-separated FIXES for ours")
    ap.add_argument("--ours-off", default="", help="comma-separated rounding points of ours to fp32")
    a = ap.parse_args()
    x = make_inputs(a.T, a.H, a.K, a.K, a.gate, a.seed)
    o_ref, _ = oracle(x)
    fix = [f for f in a.ours_fix.split(",") if f]
    off = [f for f in a.ours_off.split(",") if f]
    ours = rel(run(x, "ours", off, fix)[0], o_ref)
    fla = rel(run(x, "fla")[0], o_ref)
    print(f"T {a.T} H {a.H} K {a.K} gate {a.gate}: o rel error ours {ours:.3e}  FLA {fla:.3e}  "
          f"(bf16 of o alone {rel(bf16(o_ref), o_ref):.3e}){'  fix ' + ','.join(fix) if fix else ''}")
    if a.attribute:
        print("\n| rounding point of ours → fp32 | o error | |\n|---|---:|---|")
        for name, what in OURS_POINTS:
            print(f"| `{name}` {what} | {rel(run(x, 'ours', [name] + off, fix)[0], o_ref):.3e} | |")
        print("\n| rounding point of FLA → fp32 | o error | |\n|---|---:|---|")
        for name, what in FLA_POINTS:
            print(f"| `{name}` {what} | {rel(run(x, 'fla', [name])[0], o_ref):.3e} | |")
        print("\n| candidate fix of ours | o error |\n|---|---:|")
        for name, what in FIXES.items():
            print(f"| `{name}` {what} | {rel(run(x, 'ours', off, [name] + fix)[0], o_ref):.3e} |")


if __name__ == "__main__":
    main()
