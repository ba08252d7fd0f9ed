/*
 * CPU chunked backward: the gradients of the WY (chunk) form, float32, one (sequence, query/key head) per task.
 *
 * Forward of one chunk of C = 64 tokens (docs/ALGORITHM.md; G_i the cumulative log decay, S the state at the
 * chunk start, s the scale), with A = Diag(β) M, M[i][j] = Σ_d k_i k_j e^{G_i − G_j} (j < i):
 *     T = (I + A)⁻¹,  X = Diag(β) KΓ,  Y = Diag(β) V,  W = T X,  U = T Y,  Δ = U − W S
 *     O = QΓ S + Aqk Δ,   S⁺ = Diag(γ) S + K̃ᵀ Δ
 * Backward of the chunk, given dO and dS⁺ = ∂L/∂S⁺ (from the later chunks; d_final_state after the last):
 *     dΔ  = Aqkᵀ dO + K̃ dS⁺            dAqk = dO Δᵀ (lower)        dQΓ = dO Sᵀ       dK̃ = Δ dS⁺ᵀ
 *     dγ  = rowsum(dS⁺ ⊙ S)             dS   = Diag(γ) dS⁺ + QΓᵀ dO − Wᵀ dΔ      (to the previous chunk)
 *     dR  = Tᵀ dΔ                       dA   = −dR Δᵀ (strictly lower)      dY = dR,  dX = −dR Sᵀ
 * (dR is the token-level ∂L/∂δ: with dT = dΔ ((I + A) Δ)ᵀ the inverse's −Tᵀ dT Tᵀ collapses to −dR Δᵀ.)
 * Then to the per-token inputs: dv = β dR; dβ = v·dR + Σ_d k e^G dX + Σ_j dA[i][j] M[i][j]; dq, dk and dG
 * from QΓ, X, K̃ (∂/∂G of a factor x e^{±G} is ±x e^{±G}), γ, and from the pair products M and Aqk (block by
 * block: dfa = dM fb, dfb = dMᵀ fa with the factors of the forward, fa = x e^{G_i − R}, fb = k e^{R − G_j},
 * R = G at the first row of the later 16-token block, so every factor is ≤ 1; diagonal blocks pair by pair);
 * dĝ is the reverse cumulative sum of dG within the chunk; finally the clamp, gate, β sigmoid and l2norm.
 *
 * What is saved and recomputed: nothing from the forward. A task
 * reruns the forward of its head to keep S at every chunk start, then walks the chunks last to first,
 * recomputing each chunk's A, Aqk, T, W, U and Δ. The value heads of one query/key head run in the same task
 * and sum their dq, dk in a float32 buffer (no atomics: two calls give identical bytes); dA_log and ddt_bias
 * are summed per (sequence, head) and reduced in a fixed order after the tasks.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "cpu.h"
#include "../dtype.h"
#include "fmath.h"
#include "gemm.h"
#include "threadpool.h"
#include "token.h"

#define C KDA_CHUNK

/* ---------------------------------------------------------------------------------------------------------
 * Scratch of one thread
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    float *states;                               /* (chunks + 1) × K×V: S at every chunk start of the current head */
    float *dqs, *dks;                            /* len × K: Σ over the group's value heads of dq̂, dk̂ */
    float *dS, *ST, *dST;                        /* K×V; V×K transposes of S and dS⁺ */
    float *q, *k, *G, *gx, *gm;                  /* C×K: q̂, k̂, cumulative gate, gate input x, clamp mask */
    float *v, *beta;                             /* C×V, C */
    float *M, *A, *Aqk, *T;                      /* C×C */
    float *X, *W, *QG, *KT;                      /* C×K */
    float *Y, *U, *D, *DT;                       /* C×V (DT: V×C, Δᵀ) */
    float *dO, *dD, *dR;                         /* C×V */
    float *dA, *dAqk;                            /* C×C */
    float *dq, *dk, *dG, *dX, *dQG, *dKT;        /* C×K */
    float *fa, *fq, *fb, *fbt, *dfa, *dfq, *dfb; /* C×K; K×16; C×K; C×K; 16×K */
    float *gamma, *dgamma;                       /* K */
} scratch_t;

static size_t carve(float *base, int K, int V, int64_t max_len, scratch_t *s) {
    const int64_t nc = (max_len + C - 1) / C;
    size_t off = 0;
#define TAKE(field, count)                                                                                             \
    do {                                                                                                               \
        s->field = base ? base + off : NULL;                                                                           \
        off += ((size_t)(count) + 15) & ~(size_t)15;                                                                   \
    } while (0)
    TAKE(states, (size_t)(nc + 1) * K * V);
    TAKE(dqs, (size_t)max_len * K);
    TAKE(dks, (size_t)max_len * K);
    TAKE(dS, (size_t)K * V);
    TAKE(ST, (size_t)K * V);
    TAKE(dST, (size_t)K * V);
    TAKE(q, C * K);
    TAKE(k, C * K);
    TAKE(G, C * K);
    TAKE(gx, C * K);
    TAKE(gm, C * K);
    TAKE(v, C * V);
    TAKE(beta, C);
    TAKE(M, C * C);
    TAKE(A, C * C);
    TAKE(Aqk, C * C);
    TAKE(T, C * C);
    TAKE(X, C * K);
    TAKE(W, C * K);
    TAKE(QG, C * K);
    TAKE(KT, C * K);
    TAKE(Y, C * V);
    TAKE(U, C * V);
    TAKE(D, C * V);
    TAKE(DT, C * V);
    TAKE(dO, C * V);
    TAKE(dD, C * V);
    TAKE(dR, C * V);
    TAKE(dA, C * C);
    TAKE(dAqk, C * C);
    TAKE(dq, C * K);
    TAKE(dk, C * K);
    TAKE(dG, C * K);
    TAKE(dX, C * K);
    TAKE(dQG, C * K);
    TAKE(dKT, C * K);
    TAKE(fa, C * K);
    TAKE(fq, C * K);
    TAKE(fb, C * K);
    TAKE(fbt, 16 * K);
    TAKE(dfa, C * K);
    TAKE(dfq, C * K);
    TAKE(dfb, 16 * K);
    TAKE(gamma, K);
    TAKE(dgamma, K);
#undef TAKE
    return off;
}

static size_t per_thread_bytes(const kda_bwd_problem_t *p) {
    scratch_t s;
    return carve(NULL, p->f.a.head_dim_k, p->f.a.head_dim_v, p->max_seq_len, &s) * sizeof(float);
}

/* dA_log and ddt_bias partial sums: (K + 1) floats per (sequence, value head). */
static size_t partial_floats(const kda_bwd_problem_t *p) {
    if (!p->b.dA_log && !p->b.ddt_bias) return 0;
    return (size_t)p->f.num_seqs * p->f.a.num_v_heads * ((size_t)p->f.a.head_dim_k + 1);
}

/* out[j][i] = in[i][j] for an r×c matrix with row stride ldi; out's row stride ldo. */
KDA_INLINE void transpose(float *out, int64_t ldo, const float *in, int64_t ldi, int r, int c) {
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) out[(int64_t)j * ldo + i] = in[(int64_t)i * ldi + j];
}

/* ---------------------------------------------------------------------------------------------------------
 * The forward of one chunk, kept for the backward
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE void load_chunk(const kda_problem_t *p, scratch_t *s, int64_t t0, int c, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
    const float *bias = a->dt_bias ? a->dt_bias + (int64_t)h * K : NULL;
    for (int i = 0; i < c; i++) {
        const int64_t t = t0 + i;
        float *q = s->q + i * K, *k = s->k + i * K, *G = s->G + i * K, *gx = s->gx + i * K, *gm = s->gm + i * K;
        kda_load_row(q, a->q, a->dtype, (t * HQK + hq) * K, K);
        kda_load_row(k, a->k, a->dtype, (t * HQK + hq) * K, K);
        if (a->use_qk_l2norm) {
            kda_cpu_l2normalise(q, K);
            kda_cpu_l2normalise(k, K);
        }
        kda_load_row(G, a->g, a->g_dtype, (t * HV + h) * K, K);
        if (a->use_gate_in_kernel)
            for (int d = 0; d < K; d++) gx[d] = G[d] + (bias ? bias[d] : 0.0f);
        kda_cpu_gate_row(p, h, G);
        for (int d = 0; d < K; d++) { /* the clamp into [KDA_GATE_MIN, 0]; gm = 1 where it passes */
            const float x = G[d];
            gm[d] = x <= 0.0f && x >= KDA_GATE_MIN ? 1.0f : 0.0f;
            const float y = x > KDA_GATE_MIN ? x : KDA_GATE_MIN;
            G[d] = y < 0.0f ? y : 0.0f;
        }
        if (i > 0)
            for (int d = 0; d < K; d++) G[d] += G[d - K];
        kda_load_row(s->v + i * V, a->v, a->dtype, (t * HV + h) * V, V);
        s->beta[i] = kda_cpu_beta(p, t, h);
    }
}

/* fa, fq (rows [i0, i1)) = k, q ⊙ e^{G − R}; fb (rows [j0, j1)) = k ⊙ e^{R − G}, and its transpose fbt. */
KDA_INLINE void factors(scratch_t *s, int K, int i0, int i1, int j0, int j1, const float *R, int rows) {
    if (rows)
        for (int i = i0; i < i1; i++)
            for (int d = 0; d < K; d++) {
                const float e = kda_expf(s->G[i * K + d] - R[d]);
                s->fa[i * K + d] = s->k[i * K + d] * e;
                s->fq[i * K + d] = s->q[i * K + d] * e;
            }
    for (int j = j0; j < j1; j++) {
        float *fb = s->fb + (j - j0) * K;
        for (int d = 0; d < K; d++) fb[d] = s->k[j * K + d] * kda_expf(R[d] - s->G[j * K + d]);
        for (int d = 0; d < K; d++) s->fbt[d * 16 + (j - j0)] = fb[d];
    }
}

/* M (strictly lower) and Aqk (lower, scaled) by 16-token blocks; diagonal blocks pair by pair. */
KDA_INLINE void pair_products(scratch_t *s, int K, int c, float scale) {
    memset(s->M, 0, sizeof(float) * C * C);
    memset(s->Aqk, 0, sizeof(float) * C * C);
    float prod[16 * 16];
    for (int b0 = 0; b0 < c; b0 += KDA_SUB) {
        const int b1 = b0 + KDA_SUB < c ? b0 + KDA_SUB : c, ni = b1 - b0;
        const float *R = s->G + b0 * K;
        for (int j0 = 0; j0 < b0; j0 += KDA_SUB) {
            factors(s, K, b0, b1, j0, j0 + KDA_SUB, R, j0 == 0);
            kda_gemm(ni, 16, K, s->fa + b0 * K, K, 1, s->fbt, 16, prod, 16, 0);
            for (int i = 0; i < ni; i++) memcpy(s->M + (b0 + i) * C + j0, prod + i * 16, 16 * sizeof(float));
            kda_gemm(ni, 16, K, s->fq + b0 * K, K, 1, s->fbt, 16, prod, 16, 0);
            for (int i = 0; i < ni; i++)
                for (int j = 0; j < 16; j++) s->Aqk[(b0 + i) * C + j0 + j] = scale * prod[i * 16 + j];
        }
        for (int i = b0; i < b1; i++) {
            const float *Gi = s->G + i * K, *qi = s->q + i * K, *ki = s->k + i * K;
            for (int j = b0; j <= i; j++) {
                const float *Gj = s->G + j * K, *kj = s->k + j * K;
                float sa = 0.0f, sq = 0.0f;
                for (int d = 0; d < K; d++) {
                    const float e = kj[d] * kda_expf(Gi[d] - Gj[d]);
                    sa += ki[d] * e;
                    sq += qi[d] * e;
                }
                if (j < i) s->M[i * C + j] = sa;
                s->Aqk[i * C + j] = scale * sq;
            }
        }
    }
}

/* Everything of the chunk that does not depend on S: G, M, A, Aqk, T, X, Y, W, U, QΓ, K̃, γ. */
KDA_INLINE void chunk_prepare(const kda_problem_t *p, scratch_t *s, int64_t t0, int c, int h) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    const float scale = p->scale;
    load_chunk(p, s, t0, c, h);
    pair_products(s, K, c, scale);
    for (int i = 0; i < c; i++)
        for (int j = 0; j < C; j++) s->A[i * C + j] = s->beta[i] * s->M[i * C + j];
    /* T = (I + A)⁻¹ by rows: T[i] = e_i − Σ_{m<i} A[i][m] T[m] */
    for (int i = 0; i < c; i++) {
        float *Ti = s->T + i * C;
        memset(Ti, 0, sizeof(float) * C);
        Ti[i] = 1.0f;
        for (int m = 0; m < i; m++) {
            const float aim = s->A[i * C + m];
            const float *Tm = s->T + m * C;
            for (int j = 0; j <= m; j++) Ti[j] -= aim * Tm[j];
        }
    }
    const float *Glast = s->G + (c - 1) * K;
    for (int d = 0; d < K; d++) s->gamma[d] = kda_expf(Glast[d]);
    for (int i = 0; i < c; i++) {
        const float *G = s->G + i * K, *q = s->q + i * K, *k = s->k + i * K;
        const float b = s->beta[i];
        for (int d = 0; d < K; d++) {
            const float e = kda_expf(G[d]);
            s->X[i * K + d] = b * k[d] * e;
            s->QG[i * K + d] = scale * q[d] * e;
            s->KT[i * K + d] = k[d] * kda_expf(Glast[d] - G[d]);
        }
        for (int j = 0; j < V; j++) s->Y[i * V + j] = b * s->v[i * V + j];
    }
    kda_gemm_tri(c, K, c, s->T, C, 1, s->X, K, s->W, K, 0, 1);
    kda_gemm_tri(c, V, c, s->T, C, 1, s->Y, V, s->U, V, 0, 1);
}

/* Δ = U − W S */
KDA_INLINE void chunk_delta(scratch_t *s, int K, int V, int c, const float *S) {
    kda_gemm(c, V, K, s->W, K, 1, S, V, s->D, V, 0);
    for (int i = 0; i < c * V; i++) s->D[i] = s->U[i] - s->D[i];
}

/* S⁺ = Diag(γ) S + K̃ᵀ Δ */
KDA_INLINE void chunk_state(scratch_t *s, int K, int V, int c, const float *S, float *Snext) {
    for (int d = 0; d < K; d++)
        for (int j = 0; j < V; j++) Snext[d * V + j] = s->gamma[d] * S[d * V + j];
    kda_gemm(K, V, c, s->KT, 1, K, s->D, V, Snext, V, 1);
}

/* ---------------------------------------------------------------------------------------------------------
 * The backward of one chunk: dG, dq, dk (of q̂, k̂), dR, dβ (of β) for its rows; s->dS from dS⁺ to dS
 * ------------------------------------------------------------------------------------------------------- */

/* Pair products backward: dM = Diag(β) dA (strictly lower), dAqk·s, into dq, dk, dG (block by block). */
KDA_INLINE void pair_products_backward(scratch_t *s, int K, int c, float scale) {
    float dM[16 * 16], dQ[16 * 16];
    for (int b0 = 0; b0 < c; b0 += KDA_SUB) {
        const int b1 = b0 + KDA_SUB < c ? b0 + KDA_SUB : c, ni = b1 - b0;
        const float *R = s->G + b0 * K;
        if (b0 > 0) {
            memset(s->dfa + b0 * K, 0, sizeof(float) * (size_t)ni * K);
            memset(s->dfq + b0 * K, 0, sizeof(float) * (size_t)ni * K);
        }
        for (int j0 = 0; j0 < b0; j0 += KDA_SUB) {
            factors(s, K, b0, b1, j0, j0 + KDA_SUB, R, j0 == 0);
            for (int i = 0; i < ni; i++)
                for (int j = 0; j < 16; j++) {
                    dM[i * 16 + j] = s->beta[b0 + i] * s->dA[(b0 + i) * C + j0 + j];
                    dQ[i * 16 + j] = scale * s->dAqk[(b0 + i) * C + j0 + j];
                }
            /* dfa += dM fb, dfq += dQ fb;  dfb = dMᵀ fa + dQᵀ fq */
            kda_gemm(ni, K, 16, dM, 16, 1, s->fb, K, s->dfa + b0 * K, K, 1);
            kda_gemm(ni, K, 16, dQ, 16, 1, s->fb, K, s->dfq + b0 * K, K, 1);
            kda_gemm(16, K, ni, dM, 1, 16, s->fa + b0 * K, K, s->dfb, K, 0);
            kda_gemm(16, K, ni, dQ, 1, 16, s->fq + b0 * K, K, s->dfb, K, 1);
            for (int j = 0; j < 16; j++) {
                const float *fb = s->fb + j * K, *dfb = s->dfb + j * K, *Gj = s->G + (j0 + j) * K;
                float *dk = s->dk + (j0 + j) * K, *dG = s->dG + (j0 + j) * K;
                for (int d = 0; d < K; d++) {
                    dk[d] += dfb[d] * kda_expf(R[d] - Gj[d]);
                    dG[d] -= fb[d] * dfb[d];
                }
            }
        }
        if (b0 > 0)
            for (int i = b0; i < b1; i++) {
                const float *fa = s->fa + i * K, *fq = s->fq + i * K, *dfa = s->dfa + i * K, *dfq = s->dfq + i * K;
                const float *Gi = s->G + i * K;
                float *dk = s->dk + i * K, *dq = s->dq + i * K, *dG = s->dG + i * K;
                for (int d = 0; d < K; d++) {
                    const float e = kda_expf(Gi[d] - R[d]);
                    dk[d] += dfa[d] * e;
                    dq[d] += dfq[d] * e;
                    dG[d] += fa[d] * dfa[d] + fq[d] * dfq[d];
                }
            }
        /* the diagonal block, pair by pair */
        for (int i = b0; i < b1; i++) {
            const float *Gi = s->G + i * K, *qi = s->q + i * K, *ki = s->k + i * K;
            float *dqi = s->dq + i * K, *dki = s->dk + i * K, *dGi = s->dG + i * K;
            for (int j = b0; j <= i; j++) {
                const float *Gj = s->G + j * K, *kj = s->k + j * K;
                float *dkj = s->dk + j * K, *dGj = s->dG + j * K;
                const float cm = j < i ? s->beta[i] * s->dA[i * C + j] : 0.0f, cq = scale * s->dAqk[i * C + j];
                for (int d = 0; d < K; d++) {
                    const float e = kda_expf(Gi[d] - Gj[d]);
                    const float ti = (cm * ki[d] + cq * qi[d]) * e; /* ∂/∂k_j[d] */
                    const float tj = kj[d] * e;                     /* ∂M/∂k_i[d] */
                    dki[d] += cm * tj;
                    dqi[d] += cq * tj;
                    dkj[d] += ti;
                    const float gg = ti * kj[d];
                    dGi[d] += gg;
                    dGj[d] -= gg;
                }
            }
        }
    }
}

KDA_INLINE void chunk_backward(const kda_bwd_problem_t *bp, scratch_t *s, int64_t t0, int c, int h, const float *S) {
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HV = a->num_v_heads;
    const float scale = p->scale;

    chunk_prepare(p, s, t0, c, h);
    chunk_delta(s, K, V, c, S);
    for (int i = 0; i < c; i++) kda_load_row(s->dO + i * V, bp->b.d_o, bp->b.d_o_dtype, ((t0 + i) * HV + h) * V, V);
    transpose(s->ST, K, S, V, K, V);      /* Sᵀ: V×K */
    transpose(s->dST, K, s->dS, V, K, V); /* dS⁺ᵀ: V×K */
    transpose(s->DT, C, s->D, V, c, V);   /* Δᵀ: V×C */

    /* dΔ = Aqkᵀ dO + K̃ dS⁺ */
    kda_gemm(c, V, c, s->Aqk, 1, C, s->dO, V, s->dD, V, 0);
    kda_gemm(c, V, K, s->KT, K, 1, s->dS, V, s->dD, V, 1);
    /* dAqk = dO Δᵀ (lower), dQΓ = dO Sᵀ, dK̃ = Δ dS⁺ᵀ, dγ = rowsum(dS⁺ ⊙ S) */
    kda_gemm(c, c, V, s->dO, V, 1, s->DT, C, s->dAqk, C, 0);
    kda_gemm(c, K, V, s->dO, V, 1, s->ST, K, s->dQG, K, 0);
    kda_gemm(c, K, V, s->D, V, 1, s->dST, K, s->dKT, K, 0);
    for (int d = 0; d < K; d++) {
        float acc = 0.0f;
        for (int j = 0; j < V; j++) acc += s->dS[d * V + j] * S[d * V + j];
        s->dgamma[d] = acc;
    }
    /* dS ← Diag(γ) dS⁺ + QΓᵀ dO − Wᵀ dΔ (W's rows negated through dX's buffer, free until below) */
    for (int d = 0; d < K; d++)
        for (int j = 0; j < V; j++) s->dS[d * V + j] *= s->gamma[d];
    kda_gemm(K, V, c, s->QG, 1, K, s->dO, V, s->dS, V, 1);
    for (int i = 0; i < c * K; i++) s->dX[i] = -s->W[i];
    kda_gemm(K, V, c, s->dX, 1, K, s->dD, V, s->dS, V, 1);
    /* dR = Tᵀ dΔ;  dA = −dR Δᵀ (strictly lower);  dX = −dR Sᵀ */
    kda_gemm(c, V, c, s->T, 1, C, s->dD, V, s->dR, V, 0);
    kda_gemm(c, c, V, s->dR, V, 1, s->DT, C, s->dA, C, 0);
    kda_gemm(c, K, V, s->dR, V, 1, s->ST, K, s->dX, K, 0);
    for (int i = 0; i < c * K; i++) s->dX[i] = -s->dX[i];

    memset(s->dq, 0, sizeof(float) * (size_t)c * K);
    memset(s->dk, 0, sizeof(float) * (size_t)c * K);
    memset(s->dG, 0, sizeof(float) * (size_t)c * K);
    for (int i = 0; i < c; i++)
        for (int j = 0; j < C; j++) {
            s->dA[i * C + j] = j < i ? -s->dA[i * C + j] : 0.0f;
            if (j > i) s->dAqk[i * C + j] = 0.0f;
        }
    pair_products_backward(s, K, c, scale);

    /* X, QΓ, K̃, γ; dβ */
    const float *Glast = s->G + (c - 1) * K;
    float *dGlast = s->dG + (c - 1) * K;
    for (int d = 0; d < K; d++) dGlast[d] += s->gamma[d] * s->dgamma[d];
    for (int i = 0; i < c; i++) {
        const float *G = s->G + i * K, *k = s->k + i * K, *X = s->X + i * K, *dX = s->dX + i * K;
        const float *QG = s->QG + i * K, *dQG = s->dQG + i * K, *KT = s->KT + i * K, *dKT = s->dKT + i * K;
        float *dq = s->dq + i * K, *dk = s->dk + i * K, *dG = s->dG + i * K;
        const float b = s->beta[i];
        float db = 0.0f;
        for (int j = 0; j < i; j++) db += s->dA[i * C + j] * s->M[i * C + j];
        for (int d = 0; d < K; d++) {
            const float e = kda_expf(G[d]);
            dk[d] += b * e * dX[d] + kda_expf(Glast[d] - G[d]) * dKT[d];
            dq[d] += scale * e * dQG[d];
            db += k[d] * e * dX[d];
            const float kt = KT[d] * dKT[d];
            dG[d] += X[d] * dX[d] + QG[d] * dQG[d] - kt;
            dGlast[d] += kt;
        }
        for (int j = 0; j < V; j++) db += s->v[i * V + j] * s->dR[i * V + j];
        s->beta[i] = db; /* β is not needed past this point: the row's dβ */
    }
    /* dĝ = reverse cumulative sum of dG */
    for (int i = c - 2; i >= 0; i--)
        for (int d = 0; d < K; d++) s->dG[i * K + d] += s->dG[(i + 1) * K + d];
}

/* ---------------------------------------------------------------------------------------------------------
 * Per-token outputs of a chunk: dv, dg (through clamp and gate), dβ (through the sigmoid), dq̂/dk̂ sums
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE void chunk_outputs(const kda_bwd_problem_t *bp, scratch_t *s, int64_t t0, int c, int h, int64_t bos,
                              float *part) {
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    const int K = a->head_dim_k, V = a->head_dim_v, HV = a->num_v_heads;
    const float A = a->A_log ? expf(a->A_log[h]) : 1.0f;
    float row[256];
    for (int i = 0; i < c; i++) {
        const int64_t t = t0 + i;
        /* dv = β dR (β reloaded: s->beta holds dβ now) */
        const float be = kda_cpu_beta(p, t, h);
        for (int j = 0; j < V; j++) row[j] = be * s->dR[i * V + j];
        kda_store_row(b->dv, b->dv_dtype, (t * HV + h) * V, row, V);
        /* dg */
        const float *dG = s->dG + i * K, *gm = s->gm + i * K, *gx = s->gx + i * K;
        for (int d = 0; d < K; d++) row[d] = dG[d] * gm[d];
        if (a->use_gate_in_kernel) {
            float dAl = 0.0f;
            for (int d = 0; d < K; d++) {
                const float dgi = row[d], x = gx[d];
                if (p->has_lower_bound) {
                    const float sg = kda_sigmoidf(A * x), ds = a->lower_bound * sg * (1.0f - sg) * A;
                    row[d] = dgi * ds;
                    dAl += dgi * ds * x;
                } else {
                    row[d] = -dgi * A * kda_sigmoidf(x);
                    dAl += -dgi * A * kda_softplusf(x);
                }
            }
            if (part) {
                part[0] += dAl;
                for (int d = 0; d < K; d++) part[1 + d] += row[d];
            }
        }
        kda_store_row(b->dg, b->dg_dtype, (t * HV + h) * K, row, K);
        /* dβ */
        float db = s->beta[i];
        if (a->use_beta_sigmoid) {
            const float sg = kda_sigmoidf(kda_load_f32(a->beta, a->beta_dtype, t * HV + h));
            db *= (a->allow_neg_eigval ? 2.0f : 1.0f) * sg * (1.0f - sg);
        }
        kda_store_f32(b->dbeta, b->dbeta_dtype, t * HV + h, db);
        float *dqs = s->dqs + (t - bos) * K, *dks = s->dks + (t - bos) * K;
        for (int d = 0; d < K; d++) {
            dqs[d] += s->dq[i * K + d];
            dks[d] += s->dk[i * K + d];
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * One (sequence, value head), then one (sequence, query/key head)
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE void state_io(const kda_problem_t *p, const void *src, kda_dtype_t dt, void *dst, int64_t slot, int h,
                         float *S) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    const int64_t base = (slot * a->num_v_heads + h) * (int64_t)K * V;
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++) {
            const int64_t e = base + (a->state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j);
            if (src) S[i * V + j] = kda_load_f32(src, dt, e);
            else kda_store_f32(dst, dt, e, S[i * V + j]);
        }
}

KDA_INLINE void bwd_head(const kda_bwd_problem_t *bp, int64_t n, int h, scratch_t *s, float *part) {
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    const int K = a->head_dim_k, V = a->head_dim_v;
    const int64_t KV = (int64_t)K * V;
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n);
    const int64_t nc = (eos - bos + C - 1) / C;

    /* forward: S at every chunk start */
    kda_cpu_load_seq_state(p, n, h, s->states);
    for (int64_t ci = 0; ci < nc; ci++) {
        const int64_t t0 = bos + ci * C;
        const int c = eos - t0 < C ? (int)(eos - t0) : C;
        chunk_prepare(p, s, t0, c, h);
        chunk_delta(s, K, V, c, s->states + ci * KV);
        chunk_state(s, K, V, c, s->states + ci * KV, s->states + (ci + 1) * KV);
    }
    /* backward */
    if (n == p->num_seqs - 1 && bp->cp_dstate_out) /* continues on later ranks: their fold (xcp.c) */
        for (int64_t i = 0; i < KV; i++) s->dS[i] = (float)bp->cp_dstate_out[h * KV + i];
    else if (b->d_final_state && slot >= 0) state_io(p, b->d_final_state, b->d_final_state_dtype, NULL, slot, h, s->dS);
    else memset(s->dS, 0, sizeof(float) * (size_t)KV);
    for (int64_t ci = nc - 1; ci >= 0; ci--) {
        const int64_t t0 = bos + ci * C;
        const int c = eos - t0 < C ? (int)(eos - t0) : C;
        chunk_backward(bp, s, t0, c, h, s->states + ci * KV);
        chunk_outputs(bp, s, t0, c, h, bos, part);
    }
    if (n == 0 && p->cp_state_in) memset(s->dS, 0, sizeof(float) * (size_t)KV); /* its initial state unread */
    if (b->d_initial_state && slot >= 0)
        state_io(p, NULL, b->d_initial_state_dtype, b->d_initial_state, slot, h, s->dS);
}

/* dx = r (dy − y (y·dy)), y = r x, r = 1 / sqrt(Σ x² + eps); dy in place */
KDA_INLINE void l2norm_backward(float *dy, const float *x, int n) {
    float ss = 0.0f, ydy = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + (float)KDA_L2NORM_EPS);
    for (int i = 0; i < n; i++) ydy += x[i] * dy[i];
    ydy *= r;
    for (int i = 0; i < n; i++) dy[i] = r * (dy[i] - r * x[i] * ydy);
}

KDA_CPU_CLONES
static void bwd_qk_head(const kda_bwd_problem_t *bp, int64_t n, int hq, float *scratch, float *partials) {
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    const int K = a->head_dim_k, HQK = a->num_qk_heads, HV = a->num_v_heads;
    scratch_t s;
    carve(scratch, K, a->head_dim_v, bp->max_seq_len, &s);
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    memset(s.dqs, 0, sizeof(float) * (size_t)(eos - bos) * K);
    memset(s.dks, 0, sizeof(float) * (size_t)(eos - bos) * K);
    for (int h = hq * p->group; h < (hq + 1) * p->group; h++) {
        float *part = partials ? partials + ((size_t)n * HV + h) * (K + 1) : NULL;
        if (part) memset(part, 0, sizeof(float) * (size_t)(K + 1));
        bwd_head(bp, n, h, &s, part);
    }
    float x[256];
    for (int64_t t = bos; t < eos; t++) {
        float *dq = s.dqs + (t - bos) * K, *dk = s.dks + (t - bos) * K;
        if (a->use_qk_l2norm) {
            kda_load_row(x, a->q, a->dtype, (t * HQK + hq) * K, K);
            l2norm_backward(dq, x, K);
            kda_load_row(x, a->k, a->dtype, (t * HQK + hq) * K, K);
            l2norm_backward(dk, x, K);
        }
        kda_store_row(b->dq, b->dq_dtype, (t * HQK + hq) * K, dq, K);
        kda_store_row(b->dk, b->dk_dtype, (t * HQK + hq) * K, dk, K);
    }
}

typedef struct {
    const kda_bwd_problem_t *p;
    char *ws;
    size_t per_thread;
    float *partials;
} job_t;

static void bwd_task(void *arg, int64_t item, int thread) {
    const job_t *job = (const job_t *)arg;
    const int HQK = job->p->f.a.num_qk_heads;
    bwd_qk_head(job->p, item / HQK, (int)(item % HQK), (float *)(job->ws + (size_t)thread * job->per_thread),
                job->partials);
}

kda_status_t kda_cpu_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes) {
    *bytes = (size_t)ctx->num_threads * per_thread_bytes(p) + partial_floats(p) * sizeof(float) + 64;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_backward(kda_context_t *ctx, const kda_bwd_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    (void)stream;
    const kda_args_t *a = &p->f.a;
    const kda_backward_args_t *b = &p->b;
    const int K = a->head_dim_k, HV = a->num_v_heads;
    char *base = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    const size_t per_thread = per_thread_bytes(p);
    float *partials = partial_floats(p) ? (float *)(base + (size_t)ctx->num_threads * per_thread) : NULL;

    /* with a state pool, slots no sequence reads get a zero gradient (the tasks write the others) */
    if (b->d_initial_state && a->state_indices) {
        const int64_t total = a->num_state_slots * HV * kda_state_head_elems(&p->f);
        memset(b->d_initial_state, 0, (size_t)total * kda_dtype_size(b->d_initial_state_dtype));
    }
    job_t job = {p, base, per_thread, partials};
    kda_pool_run(ctx->pool, p->f.num_seqs * a->num_qk_heads, bwd_task, &job);

    /* dA_log, ddt_bias: the partial sums in sequence order */
    if (b->dA_log) memset(b->dA_log, 0, sizeof(float) * (size_t)HV);
    if (b->ddt_bias) memset(b->ddt_bias, 0, sizeof(float) * (size_t)HV * K);
    if (partials)
        for (int64_t n = 0; n < p->f.num_seqs; n++)
            for (int h = 0; h < HV; h++) {
                const float *part = partials + ((size_t)n * HV + h) * (K + 1);
                if (b->dA_log) b->dA_log[h] += part[0];
                if (b->ddt_bias)
                    for (int d = 0; d < K; d++) b->ddt_bias[h * K + d] += part[1 + d];
            }
    return KDA_STATUS_SUCCESS;
}
