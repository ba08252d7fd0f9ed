/*
 * CPU chunked forward: the WY (chunk) form of KDA, float32 arithmetic, one (sequence, value head) per task.
 *
 * Notation of docs/ALGORITHM.md. A sequence is cut into chunks of C = 64 tokens (the last may be shorter).
 * Inside a chunk, with G_i = g_0 + ... + g_i the cumulative log decay (a K-vector) and Γ_i = Diag(exp(G_i)):
 *
 *   A[i][j]   = β_i Σ_d k_i[d] k_j[d] e^{G_i[d] − G_j[d]}      j < i      (strictly lower)
 *   Aqk[i][j] = s   Σ_d q_i[d] k_j[d] e^{G_i[d] − G_j[d]}      j ≤ i      (s = scale)
 *   T = (I + A)⁻¹,   W = T Diag(β) KΓ,   U = T Diag(β) V          (KΓ rows k_i ⊙ e^{G_i})
 *   Δ = U − W S                                               (the δ_i of every token, C×V)
 *   O = QΓ S + Aqk Δ                                           (QΓ rows s q_i ⊙ e^{G_i})
 *   S ← Diag(γ) S + K̃ᵀ Δ                                       (K̃ rows k_j ⊙ e^{G_last − G_j}, γ = e^{G_last})
 *
 * Every exponent above is ≤ 0 except inside A and Aqk, where e^{G_i − G_j} is split in two factors around a
 * reference R so that the products become matrix products: for 16-token blocks I > J the reference is G at
 * the first row of block I (both factors ≤ 1, always safe); for a diagonal block it is G at the block's middle
 * row, safe while every exponent stays within ±KDA_DIAG_RANGE; past that (decays stronger than ~4 nats per
 * token in some channel) the block falls back to per-pair exponentials. The CUDA kernels use the same
 * blocking and the same fallback rule, so the CPU tests exercise both paths (they also take the middle-row
 * reference for the off-diagonal blocks of a row whose diagonal block splits: factors ≤ e^{KDA_DIAG_RANGE}).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "cpu.h"
#include "dtype.h"
#include "fmath.h"
#include "gemm.h"
#include "threadpool.h"
#include "token.h"

/* ---------------------------------------------------------------------------------------------------------
 * Scratch of one thread
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    float *S;                 /* K×V state, K-major */
    float *q, *k, *G;         /* C×K: normalised q, k; cumulative gate */
    float *v, *beta;          /* C×V, C */
    float *A, *Aqk, *Tinv;    /* C×C */
    float *W, *QG, *KT;       /* C×K */
    float *U, *D, *O;         /* C×V */
    float *fa, *fq, *fbt;     /* C×K factors of rows (k-side, q-side); K×16 factors of 16 columns */
    float *bk, *gamma;        /* C×K: β k ⊙ e^{G}; K: e^{G_last} */
} scratch_t;

/* Lay the arrays out from `base` (64-byte aligned, each array rounded up to 16 floats); returns the floats
 * used. With base NULL only the size is computed. */
static size_t carve(float *base, int K, int V, scratch_t *s) {
    const size_t C = KDA_CHUNK;
    size_t off = 0;
#define TAKE(field, count)                                                                                  \
    do {                                                                                                    \
        s->field = base ? base + off : NULL;                                                                \
        off += ((size_t)(count) + 15) & ~(size_t)15;                                                        \
    } while (0)
    TAKE(S, (size_t)K * V);
    TAKE(q, C * K);
    TAKE(k, C * K);
    TAKE(G, C * K);
    TAKE(v, C * V);
    TAKE(beta, C);
    TAKE(A, C * C);
    TAKE(Aqk, C * C);
    TAKE(Tinv, C * C);
    TAKE(W, C * K);
    TAKE(QG, C * K);
    TAKE(KT, C * K);
    TAKE(U, C * V);
    TAKE(D, C * V);
    TAKE(O, C * V);
    TAKE(fa, C * K);
    TAKE(fq, C * K);
    TAKE(fbt, 16 * K);
    TAKE(bk, C * K);
    TAKE(gamma, K);
#undef TAKE
    return off;
}

static size_t per_thread_bytes(const kda_problem_t *p) {
    scratch_t s;
    return carve(NULL, p->a.head_dim_k, p->a.head_dim_v, &s) * sizeof(float);
}

/* ---------------------------------------------------------------------------------------------------------
 * Non-finite inputs (docs/ALGORITHM.md, "Non-finite and out-of-range inputs"): from the first token with a
 * non-finite q, k, v, clamped gate or β on, the outputs of the (sequence, head) and its final state are NaN.
 * The chunk never computes with such a row: it and the rows after it are replaced by a neutral token (q = k =
 * v = 0, gate 0, β = 0), the chunk runs on finite numbers (so nothing can leak into earlier rows through a
 * product), and those rows' outputs are then overwritten with NaN. (A row's finite gate is kept, so that the
 * earlier rows' rounding does not depend on a later token's q, k, v or β either.)
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE void neutral_row(scratch_t *s, int K, int V, int i) {
    memset(s->q + i * K, 0, sizeof(float) * K);
    memset(s->k + i * K, 0, sizeof(float) * K);
    memset(s->v + i * V, 0, sizeof(float) * V);
    s->beta[i] = 0.0f;
    float *G = s->G + i * K; /* a finite gate is kept: the diagonal block's reference row stays as it was */
    for (int d = 0; d < K; d++) G[d] = G[d] == G[d] ? G[d] : 0.0f;
}

KDA_INLINE void store_nan_rows(const kda_problem_t *p, float *row, int64_t t0, int64_t t1, int h) {
    const int V = p->a.head_dim_v;
    for (int j = 0; j < V; j++) row[j] = NAN;
    for (int64_t t = t0; t < t1; t++) kda_store_row(p->a.o, p->a.o_dtype, (t * p->a.num_v_heads + h) * V, row, V);
}

/* ---------------------------------------------------------------------------------------------------------
 * Per-token inputs: q, k (normalised), gate, β, v of the rows of one chunk. Returns the first row that
 * poisons the head (c if none); that row and later ones are neutral.
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE int load_chunk(const kda_problem_t *p, scratch_t *s, int64_t t0, int c, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
    int bad = c;
    for (int i = 0; i < c; i++) {
        const int64_t t = t0 + i;
        float *q = s->q + i * K, *k = s->k + i * K, *G = s->G + i * K;
        kda_load_row(q, a->q, a->dtype, (t * HQK + hq) * K, K);
        kda_load_row(k, a->k, a->dtype, (t * HQK + hq) * K, K);
        if (a->use_qk_l2norm) {
            kda_cpu_l2normalise(q, K);
            kda_cpu_l2normalise(k, K);
        }
        kda_load_row(G, a->g, a->g_dtype, (t * HV + h) * K, K);
        kda_cpu_gate_row(p, h, G);
        kda_cpu_gate_clamp(G, K);
        kda_load_row(s->v + i * V, a->v, a->dtype, (t * HV + h) * V, V);
        s->beta[i] = kda_cpu_beta(p, t, h);
        if (bad == c && kda_cpu_token_poisons(q, k, s->v + i * V, G, s->beta[i], K, V)) bad = i;
        if (i >= bad) neutral_row(s, K, V, i);
        if (i > 0)
            for (int d = 0; d < K; d++) G[d] += G[d - K]; /* cumulative within the chunk */
    }
    return bad;
}

/* ---------------------------------------------------------------------------------------------------------
 * A and Aqk by 16-token blocks
 * ------------------------------------------------------------------------------------------------------- */

/* fa[i] = k_i ⊙ e^{G_i − R}, fq[i] = q_i ⊙ e^{G_i − R} for rows [i0, i1); fb[j] = k_j ⊙ e^{R − G_j} for rows
 * [j0, j1), transposed into fbt (K × 16) for the product. */
KDA_INLINE void row_factors(scratch_t *s, int K, int i0, int i1, const float *R) {
    for (int i = i0; i < i1; i++) {
        const float *G = s->G + i * K, *q = s->q + i * K, *k = s->k + i * K;
        float *fa = s->fa + i * K, *fq = s->fq + i * K;
        for (int d = 0; d < K; d++) {
            const float e = kda_expf(G[d] - R[d]);
            fa[d] = k[d] * e;
            fq[d] = q[d] * e;
        }
    }
}

KDA_INLINE void col_factors(scratch_t *s, int K, int j0, int j1, const float *R) {
    float row[256];
    for (int j = j0; j < j1; j++) {
        const float *G = s->G + j * K, *k = s->k + j * K;
        for (int d = 0; d < K; d++) row[d] = k[d] * kda_expf(R[d] - G[d]); /* vectorised */
        for (int d = 0; d < K; d++) s->fbt[d * 16 + (j - j0)] = row[d];
    }
    for (int j = j1 - j0; j < 16; j++)
        for (int d = 0; d < K; d++) s->fbt[d * 16 + j] = 0.0f;
}

/* A[i][j] (β-scaled) and Aqk[i][j] (scale-scaled) for i in block [i0,i1), j in [j0,j1), from fa/fq and fbt. */
KDA_INLINE void block_products(scratch_t *s, int K, int i0, int i1, int j0, int j1, float scale) {
    float prod[16 * 16];
    const int ni = i1 - i0, nj = j1 - j0;
    kda_gemm(ni, 16, K, s->fa + i0 * K, K, 1, s->fbt, 16, prod, 16, 0);
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++) s->A[(i0 + i) * KDA_CHUNK + j0 + j] = s->beta[i0 + i] * prod[i * 16 + j];
    kda_gemm(ni, 16, K, s->fq + i0 * K, K, 1, s->fbt, 16, prod, 16, 0);
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++) s->Aqk[(i0 + i) * KDA_CHUNK + j0 + j] = scale * prod[i * 16 + j];
}

/* The diagonal block [b0, b1): the middle-row reference when every exponent fits, else per-pair exponentials. */
KDA_INLINE void diagonal_block(scratch_t *s, int K, int b0, int b1, float scale) {
    const int m = b0 + (b1 - b0 - 1) / 2;
    const float *Gm = s->G + m * K, *G0 = s->G + b0 * K, *G1 = s->G + (b1 - 1) * K;
    float range = 0.0f;
    for (int d = 0; d < K; d++) {
        const float up = G0[d] - Gm[d], down = Gm[d] - G1[d];
        range = up > range ? up : range;
        range = down > range ? down : range;
    }
    if (range <= KDA_DIAG_RANGE) {
        row_factors(s, K, b0, b1, Gm);
        col_factors(s, K, b0, b1, Gm);
        block_products(s, K, b0, b1, b0, b1, scale);
    } else {
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
                s->A[i * KDA_CHUNK + j] = s->beta[i] * sa;
                s->Aqk[i * KDA_CHUNK + j] = scale * sq;
            }
        }
    }
    /* A is strictly lower, Aqk lower with its diagonal: clear what the block product put above */
    for (int i = b0; i < b1; i++) {
        s->A[i * KDA_CHUNK + i] = 0.0f;
        for (int j = i + 1; j < b1; j++) {
            s->A[i * KDA_CHUNK + j] = 0.0f;
            s->Aqk[i * KDA_CHUNK + j] = 0.0f;
        }
    }
}

KDA_INLINE void intra_chunk_attention(scratch_t *s, int K, int c, float scale) {
    memset(s->A, 0, sizeof(float) * KDA_CHUNK * KDA_CHUNK);
    memset(s->Aqk, 0, sizeof(float) * KDA_CHUNK * KDA_CHUNK);
    for (int b0 = 0; b0 < c; b0 += KDA_SUB) {
        const int b1 = b0 + KDA_SUB < c ? b0 + KDA_SUB : c;
        /* blocks left of the diagonal: reference = G at row b0 */
        if (b0 > 0) {
            const float *R = s->G + b0 * K;
            row_factors(s, K, b0, b1, R);
            for (int j0 = 0; j0 < b0; j0 += KDA_SUB) {
                col_factors(s, K, j0, j0 + KDA_SUB, R);
                block_products(s, K, b0, b1, j0, j0 + KDA_SUB, scale);
            }
        }
        diagonal_block(s, K, b0, b1, scale);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * One chunk: T = (I + A)⁻¹, W, U, QΓ, K̃, γ, then the state step
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE void solve_unit_lower(scratch_t *s, int c) {
    /* rows of T: T[i] = e_i − Σ_{m<i} A[i][m] T[m] */
    float *T = s->Tinv;
    for (int i = 0; i < c; i++) {
        float *Ti = T + i * KDA_CHUNK;
        memset(Ti, 0, sizeof(float) * KDA_CHUNK);
        Ti[i] = 1.0f;
        for (int m = 0; m < i; m++) {
            const float aim = s->A[i * KDA_CHUNK + m];
            const float *Tm = T + m * KDA_CHUNK;
            for (int j = 0; j <= m; j++) Ti[j] -= aim * Tm[j];
        }
    }
}

/* Returns the first row that poisons the head (c if none). */
KDA_INLINE int chunk_step(const kda_problem_t *p, scratch_t *s, int64_t t0, int c, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HV = a->num_v_heads;
    const float scale = p->scale;

    const int bad = load_chunk(p, s, t0, c, h);
    intra_chunk_attention(s, K, c, scale);
    solve_unit_lower(s, c);

    const float *Glast = s->G + (c - 1) * K;
    for (int d = 0; d < K; d++) s->gamma[d] = kda_expf(Glast[d]);
    for (int i = 0; i < c; i++) {
        const float *G = s->G + i * K, *q = s->q + i * K, *k = s->k + i * K;
        float *bk = s->bk + i * K, *qg = s->QG + i * K, *kt = s->KT + i * K;
        const float b = s->beta[i];
        for (int d = 0; d < K; d++) {
            const float e = kda_expf(G[d]);
            bk[d] = b * k[d] * e;
            qg[d] = scale * q[d] * e;
            kt[d] = k[d] * kda_expf(Glast[d] - G[d]);
        }
        float *v = s->v + i * V;
        for (int j = 0; j < V; j++) v[j] *= b; /* v now holds β v */
    }
    /* W = T Diag(β) KΓ, U = T Diag(β) V (T lower triangular) */
    kda_gemm_tri(c, K, c, s->Tinv, KDA_CHUNK, 1, s->bk, K, s->W, K, 0, 1);
    kda_gemm_tri(c, V, c, s->Tinv, KDA_CHUNK, 1, s->v, V, s->U, V, 0, 1);

    /* Δ = U − W S */
    kda_gemm(c, V, K, s->W, K, 1, s->S, V, s->D, V, 0);
    for (int i = 0; i < c * V; i++) s->D[i] = s->U[i] - s->D[i];
    /* O = QΓ S + Aqk Δ */
    kda_gemm(c, V, K, s->QG, K, 1, s->S, V, s->O, V, 0);
    kda_gemm_tri(c, V, c, s->Aqk, KDA_CHUNK, 1, s->D, V, s->O, V, 1, 1);
    /* S ← Diag(γ) S + K̃ᵀ Δ */
    for (int d = 0; d < K; d++) {
        float *row = s->S + (int64_t)d * V;
        const float gd = s->gamma[d];
        for (int j = 0; j < V; j++) row[j] *= gd;
    }
    kda_gemm(K, V, c, s->KT, 1, K, s->D, V, s->S, V, 1);

    for (int i = 0; i < bad; i++) kda_store_row(a->o, a->o_dtype, ((t0 + i) * HV + h) * V, s->O + i * V, V);
    if (bad < c) store_nan_rows(p, s->O, t0 + bad, t0 + c, h);
    return bad;
}

/* ---------------------------------------------------------------------------------------------------------
 * One (sequence, head): load the state, run the chunks, store the state
 * ------------------------------------------------------------------------------------------------------- */
KDA_CPU_CLONES
static void chunk_head(const kda_problem_t *p, int64_t n, int h, float *scratch) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    scratch_t s;
    carve(scratch, K, V, &s);
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n);

    kda_cpu_load_state(p, slot, h, s.S);
    int poisoned = !kda_cpu_all_finite(s.S, (int64_t)K * V);
    int64_t nan_from = poisoned ? bos : eos; /* tokens from here on are NaN without arithmetic */
    for (int64_t t0 = bos; t0 < nan_from; t0 += KDA_CHUNK) {
        const int c = eos - t0 < KDA_CHUNK ? (int)(eos - t0) : KDA_CHUNK;
        if (chunk_step(p, &s, t0, c, h) < c) {
            poisoned = 1;
            nan_from = t0 + c;
        }
    }
    if (poisoned) {
        store_nan_rows(p, s.O, nan_from, eos, h);
        for (int64_t i = 0; i < (int64_t)K * V; i++) s.S[i] = NAN;
    }
    kda_cpu_store_state(p, slot, h, s.S);
}

typedef struct {
    const kda_problem_t *p;
    char *ws;
    size_t per_thread;
} job_t;

static void chunk_task(void *arg, int64_t item, int thread) {
    const job_t *job = (const job_t *)arg;
    const int HV = job->p->a.num_v_heads;
    chunk_head(job->p, item / HV, (int)(item % HV), (float *)(job->ws + (size_t)thread * job->per_thread));
}

kda_status_t kda_cpu_chunk_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = (size_t)ctx->num_threads * per_thread_bytes(p) + 64;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_chunk_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes) {
    (void)ws_bytes;
    job_t job = {p, (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), per_thread_bytes(p)};
    kda_pool_run(ctx->pool, p->num_seqs * p->a.num_v_heads, chunk_task, &job);
    return KDA_STATUS_SUCCESS;
}
