/*
 * CPU chunked forward: the WY (chunk) form of KDA, float32 arithmetic, (sequence, value head) tasks.
 *
 * Notation of docs/ALGORITHM.md. A sequence is cut into chunks of C = KDA_CPU_CHUNK = 16 tokens (the last may be
 * shorter). Inside a chunk, with G_i = g_0 + ... + g_i the cumulative log decay (a K-vector) and Γ_i = Diag(exp(G_i)):
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
 * When every diagonal block of a chunk fits (the usual case), all these factors and those of βKΓ, QΓ and K̃
 * come from one exponential per token and channel, e^{G_i − M}, by its reciprocal and per-channel scales
 * ("Shared factors" below); a chunk with a block that does not fit takes the per-block exponentials.
 *
 * A chunk is two stages (as on the GPU): prep, the state-independent products (A, Aqk, T, W, U, QΓ, K̃, γ),
 * and the recurrence (Δ, O, S), which is separable in the V columns. Many (sequence, head) tasks run in groups
 * of up to KDA_CPU_GROUP heads per thread item, chunk by chunk; fewer tasks than threads run their preps on
 * whichever thread is free and their recurrence over column slices, without barriers (the flow schedule:
 * "Scheduling" below). Not the affine pieces of ALGORITHM.md §4: a piece's pre-scan (its K×K transition) costs
 * about what running the piece costs, so two threads would gain a third at best, while slicing the state's
 * columns does no work twice. Causality under non-finite inputs: no product forms a structurally-zero
 * coefficient times a later row (gemm.h's triangular products, the diagonal block's fallback). A later token's
 * gate can change the block's reference row or its fallback choice, so it moves the block's earlier rows by
 * rounding, never to a non-finite value (the stated bound: docs/ALGORITHM.md §7, item 6).
 */
#ifndef KDA_CPU_ISA /* the portable object (and the dispatcher); CMake builds one per level of KDA_CPU_ISAS beside it */
#define KDA_CPU_ISA portable
#define KDA_CPU_ISA_PORTABLE 1
#endif
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "cpu.h"
#include "../dtype.h"
#include "fmath.h"
#include "fmath8.h"
#include "gemm.h"
#include "threadpool.h"
#include "token.h"
#if KDA_CPU_HAVE_V4 || KDA_CPU_HAVE_V3
#include "x86_level.h"
#endif

/* Tokens per chunk of the CPU forward: one 16-token block (KDA_SUB). The state products cost 6 K V FLOPs a token
 * whatever the chunk length, the intra-chunk ones (A, Aqk, W, U, Aqk Δ, the solve) O(C (K + V)) a token: at
 * K = V = 128, 139 kFLOP a token with C = 64, 119 with 32, ~110 with 16. The GPU's
 * 64 (KDA_CHUNK) fills its tensor-core tiles; a CPU core has no such tile to fill. The code below works for any
 * multiple of KDA_SUB up to 64. */
#define KDA_CPU_CHUNK 16
_Static_assert(KDA_CHUNK % KDA_CPU_CHUNK == 0,
               "chunk_states are kept every KDA_CHUNK tokens: a whole number of CPU chunks");

/* Value heads per task of the many-task schedule (task_whole), at most. */
#define KDA_CPU_GROUP 4

/* ---------------------------------------------------------------------------------------------------------
 * Storage
 * ------------------------------------------------------------------------------------------------------- */
/* The state-independent products of one chunk (prep), all the recurrence needs. */
typedef struct {
    float *Aqk;   /* C×C: scale-scaled, lower with its diagonal */
    float *W, *U; /* C×K, C×V */
    float *QG;    /* C×K */
    float *KT;    /* K×C: K̃ transposed (row d holds k_j[d] e^{G_last[d] − G_j[d]}, j < c) */
    float *gamma; /* K */
    int bad;      /* the chunk's first poisoned row (docs/ALGORITHM.md §7), c if none */
} prep_t;

/* Scratch of one thread. */
typedef struct {
    float *q, *k, *G;     /* C×K: normalised q, k; cumulative gate */
    float *v, *beta;      /* C×V (β v after prep), C */
    float *A, *Tinv;      /* C×C */
    float *kT, *GT;       /* K×C: k and G transposed (rows past the chunk's end zero; GT only when a block
                                 does not fit) */
    float *fa, *fq, *fbt; /* C×K factors of rows (k-side, q-side); K×C factors of columns */
    float *fa2, *fq2;     /* 16×K: a block's off-diagonal row factors (shared factors, chunk_factors) */
    float *fbd, *kc;      /* K×16: a block's diagonal column factors; K×C: k_j ⊙ e^{E_J − G_j} */
    float *ea, *eaT;      /* 16×K: a block's e^{G_i − M}; K×16: the same transposed */
    float *bk;            /* C×K: β k ⊙ e^{G} */
    float *D, *O;         /* C×V: Δ and the outputs of the recurrence's column slice */
    float *S;             /* KDA_CPU_GROUP × K×V: the states of the task's heads */
    prep_t pr;            /* the prep of the task's current chunk */
} scratch_t;

#define TAKE(field, count)                                                                                             \
    do {                                                                                                               \
        field = base ? base + off : NULL;                                                                              \
        off += ((size_t)(count) + 15) & ~(size_t)15;                                                                   \
    } while (0)

/* Lay the arrays out from `base` (64-byte aligned, each array rounded up to 16 floats); return the floats
 * used. With base NULL only the size is computed. */
static size_t carve_prep(float *base, int K, int V, prep_t *s) {
    const size_t C = KDA_CPU_CHUNK;
    size_t off = 0;
    TAKE(s->Aqk, C * C);
    TAKE(s->W, C * K);
    TAKE(s->U, C * V);
    TAKE(s->QG, C * K);
    TAKE(s->KT, C * K);
    TAKE(s->gamma, K);
    return off;
}

static size_t carve(float *base, int K, int V, scratch_t *s) {
    const size_t C = KDA_CPU_CHUNK;
    size_t off = 0;
    TAKE(s->q, C * K);
    TAKE(s->k, C * K);
    TAKE(s->G, C * K);
    TAKE(s->v, C * V);
    TAKE(s->beta, C);
    TAKE(s->A, C * C);
    TAKE(s->Tinv, C * C);
    TAKE(s->kT, C * K);
    TAKE(s->GT, C * K);
    TAKE(s->fa, C * K);
    TAKE(s->fq, C * K);
    TAKE(s->fbt, C * K);
    TAKE(s->fa2, 16 * K);
    TAKE(s->fq2, 16 * K);
    TAKE(s->fbd, 16 * K);
    TAKE(s->kc, C * K);
    TAKE(s->ea, 16 * K);
    TAKE(s->eaT, 16 * K);
    TAKE(s->bk, C * K);
    TAKE(s->D, C * V);
    TAKE(s->O, C * V);
    TAKE(s->S, (size_t)KDA_CPU_GROUP * K * V);
    off += carve_prep(base ? base + off : NULL, K, V, &s->pr);
    return off;
}
#undef TAKE

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

/* dst[d][u] = src[u][d] for u < n (a multiple of 8), d < K: src n×K row-major, dst K rows of stride ld. With
 * 8-float vectors, by 8×8 tiles in registers (three rounds of shuffles, not one scalar load per element). */
#if KDA_GEMM_VW == 8
#if defined(__clang__)
#define KDA_SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t kda_vi8 __attribute__((vector_size(32)));
#define KDA_SHUF8(a, b, ...) __builtin_shuffle(a, b, (kda_vi8){__VA_ARGS__})
#endif
KDA_INLINE void transpose_rows(float *restrict dst, int ld, const float *restrict src, int K, int n) {
    for (int i0 = 0; i0 < n; i0 += 8)
        for (int d = 0; d + 8 <= K; d += 8) {
            kda_vf r[8], t[8], u[8];
            for (int i = 0; i < 8; i++) r[i] = kda_ldv(src + (i0 + i) * K + d);
            for (int i = 0; i < 8; i += 2) {
                t[i] = KDA_SHUF8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
                t[i + 1] = KDA_SHUF8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = KDA_SHUF8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 1] = KDA_SHUF8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
                u[i + 2] = KDA_SHUF8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 3] = KDA_SHUF8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
            }
            for (int j = 0; j < 4; j++) {
                kda_stv(dst + (d + j) * ld + i0, KDA_SHUF8(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11));
                kda_stv(dst + (d + j + 4) * ld + i0, KDA_SHUF8(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15));
            }
        }
    for (int d = K - K % 8; d < K; d++) /* K not a multiple of 8 */
        for (int u = 0; u < n; u++) dst[d * ld + u] = src[u * K + d];
}
#undef KDA_SHUF8
#else
KDA_INLINE void transpose_rows(float *restrict dst, int ld, const float *restrict src, int K, int n) {
    for (int i0 = 0; i0 < n; i0 += 8) /* by 8 rows: one 8-float store per channel */
        for (int d = 0; d < K; d++) {
            float *restrict t = dst + d * ld + i0;
            const float *restrict x = src + i0 * K + d;
            for (int u = 0; u < 8; u++) t[u] = x[u * K];
        }
}
#endif

/* ---------------------------------------------------------------------------------------------------------
 * Per-token inputs: q, k (normalised), gate, β, v of the rows of one chunk. Returns the first row that
 * poisons the head (c if none); that row and later ones are neutral.
 * ------------------------------------------------------------------------------------------------------- */
/* Prefetch the rows of token t, value head h (q, k, g, v: what load_chunk reads next for that head). */
KDA_INLINE void prefetch_token(const kda_problem_t *p, int64_t t, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group, e = a->dtype == KDA_FLOAT32 ? 4 : 2, eg = a->g_dtype == KDA_FLOAT32 ? 4 : 2;
    const char *q = (const char *)a->q + (t * HQK + hq) * K * e, *k = (const char *)a->k + (t * HQK + hq) * K * e;
    const char *g = (const char *)a->g + (t * HV + h) * K * eg, *v = (const char *)a->v + (t * HV + h) * V * e;
    for (int b = 0; b < K * e; b += 64) {
        __builtin_prefetch(q + b);
        __builtin_prefetch(k + b);
    }
    for (int b = 0; b < K * eg; b += 64) __builtin_prefetch(g + b);
    for (int b = 0; b < V * e; b += 64) __builtin_prefetch(v + b);
}

/* Token t's rows by the scalar helpers of token.h, into row i; 1 when the token poisons the head. */
KDA_INLINE int load_token(const kda_problem_t *p, scratch_t *s, int64_t t, int i, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
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
    return kda_cpu_token_poisons(q, k, s->v + i * V, G, s->beta[i], K, V);
}

/* load_token in one pass per tensor over vectors of 8 floats, for head sizes that are multiples of 8: the bf16 ->
 * float conversion, l2norm (q's and k's sums of squares as two chains in one loop), the gate, its clamp and the
 * cumulative sum within the chunk (G_i = G_{i-1} + g_i), and the non-finite test as a mask ORed over the rows and
 * tested once. The same operations in the same order as load_token (fmath.h's 8-float functions), so the same
 * bits. Returns 0 when the token poisons the head: the caller then redoes the row with load_token, which the
 * neutral row follows. (One pass per tensor instead of load_token's passes over each row.) */
typedef uint32_t kda_u8 __attribute__((vector_size(32)));
typedef uint16_t kda_h8 __attribute__((vector_size(16)));

KDA_INLINE kda_f8 ld8(const void *src, kda_dtype_t dt, int64_t i) {
    kda_f8 x;
    if (dt == KDA_FLOAT32) {
        memcpy(&x, (const float *)src + i, sizeof x);
    } else if (dt == KDA_BFLOAT16) {
        kda_h8 b;
        memcpy(&b, (const uint16_t *)src + i, sizeof b);
        x = (kda_f8)(__builtin_convertvector(b, kda_u8) << 16);
    } else {
        float f[8];
        for (int u = 0; u < 8; u++) f[u] = kda_f16_to_f32(((const uint16_t *)src)[i + u]);
        memcpy(&x, f, sizeof x);
    }
    return x;
}

KDA_INLINE kda_f8 ldf8(const float *p) {
    kda_f8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

KDA_INLINE void stf8(float *p, kda_f8 x) { memcpy(p, &x, sizeof x); }

/* lanes whose exponent bits are all ones (inf, NaN) */
KDA_INLINE kda_i8 nonfinite8(kda_f8 x) {
    const kda_i8 e = (kda_i8){0} + 0x7f800000;
    return ((kda_i8)x & e) == e;
}

/* l2norm's sum: the 8 lanes summed in kda_cpu_l2normalise's order */
KDA_INLINE float hsum8(kda_f8 p) { return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7])); }

/* The gate's per-head constants, once per chunk: mode 0 none (g is the log decay), 1 softplus, 2 lower bound. */
typedef struct {
    int mode;
    float A;
    const float *bias;
} gate_consts_t;

KDA_INLINE gate_consts_t gate_consts(const kda_problem_t *p, int h) {
    const kda_args_t *a = &p->a;
    gate_consts_t c = {0, 1.0f, NULL};
    if (!a->use_gate_in_kernel) return c;
    c.mode = p->has_lower_bound ? 2 : 1;
    c.A = a->A_log ? expf(a->A_log[h]) : 1.0f;
    c.bias = a->dt_bias ? a->dt_bias + (int64_t)h * a->head_dim_k : NULL;
    return c;
}

KDA_INLINE int load_token8(const kda_problem_t *p, scratch_t *s, const gate_consts_t *gp, int64_t t, int i, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int64_t oq = (t * HQK + h / p->group) * K, og = (t * HV + h) * K, ov = (t * HV + h) * V;
    float *restrict q = s->q + i * K, *restrict k = s->k + i * K, *restrict G = s->G + i * K;
    float *restrict v = s->v + i * V;
    kda_i8 bad = {0};
    if (a->use_qk_l2norm) {
        kda_f8 pq = {0}, pk = {0};
        for (int d = 0; d < K; d += 8) {
            const kda_f8 xq = ld8(a->q, a->dtype, oq + d), xk = ld8(a->k, a->dtype, oq + d);
            stf8(q + d, xq);
            stf8(k + d, xk);
            pq += xq * xq;
            pk += xk * xk;
        }
        const float rq = 1.0f / sqrtf(hsum8(pq) + (float)KDA_L2NORM_EPS);
        const float rk = 1.0f / sqrtf(hsum8(pk) + (float)KDA_L2NORM_EPS);
        for (int d = 0; d < K; d += 8) {
            const kda_f8 xq = ldf8(q + d) * rq, xk = ldf8(k + d) * rk;
            stf8(q + d, xq);
            stf8(k + d, xk);
            bad |= nonfinite8(xq) | nonfinite8(xk);
        }
    } else {
        for (int d = 0; d < K; d += 8) {
            const kda_f8 xq = ld8(a->q, a->dtype, oq + d), xk = ld8(a->k, a->dtype, oq + d);
            stf8(q + d, xq);
            stf8(k + d, xk);
            bad |= nonfinite8(xq) | nonfinite8(xk);
        }
    }
    /* the gate (kda_cpu_gate_row), its clamp (kda_cpu_gate_clamp), then the cumulative sum: a loop per case */
    const float *bias = gp->bias, *Gp = G - K;
    const float A = gp->A, lb = a->lower_bound;
    const void *g = a->g;
    const kda_dtype_t gdt = a->g_dtype;
/* the clamp of a gate vector x (columns d..d+7), its check, and its store into G (CUM: plus the previous row) */
#define KDA_GATE_STORE(x, CUM)                                                                                         \
    do {                                                                                                               \
        x = kda_sel8(x < gmin, gmin, x);                                                                               \
        x = kda_sel8(x > zero, zero, x);                                                                               \
        bad |= nonfinite8(x);                                                                                          \
        stf8(G + d, CUM ? x + ldf8(Gp + d) : x);                                                                       \
    } while (0)
#define KDA_GATE_LOOP(TRANSFORM, CUM)                                                                                  \
    for (int d = 0; d < K; d += 8) {                                                                                   \
        kda_f8 x = ld8(g, gdt, og + d);                                                                                \
        if (bias) x = x + ldf8(bias + d);                                                                              \
        x = TRANSFORM;                                                                                                 \
        KDA_GATE_STORE(x, CUM);                                                                                        \
    }
    /* the lower-bound gate in three passes over the row, lb / (1 + e^{−A x}): −A x and the exponential's range
     * reduction, the rest of the exponential, then the division, clamp and sum. The one loop's chain (exponential,
     * division: ~85 cycles per 8 floats) is latency-bound on a core whose FP scheduler holds less than one
     * iteration; three shorter chains overlap (the same operations, so the same bits) */
#define KDA_GATE_REST(CUM)                                                                                             \
    for (int d = 0; d < K; d += 8) {                                                                                   \
        kda_f8 x = lb * (1.0f / (1.0f + ldf8(e + d)));                                                                 \
        KDA_GATE_STORE(x, CUM);                                                                                        \
    }
    const kda_f8 gmin = (kda_f8){0} + KDA_GATE_MIN, zero = {0};
    if (gp->mode == 2) {
        float e[KDA_MAX_HEAD_DIM], en[KDA_MAX_HEAD_DIM], er[KDA_MAX_HEAD_DIM];
        for (int d = 0; d < K; d += 8) {
            kda_f8 x = ld8(g, gdt, og + d), r;
            if (bias) x = x + ldf8(bias + d);
            x = -(A * x);
            stf8(e + d, x);
            stf8(en + d, kda_expf8_reduce(kda_expf8_clamp(x), &r));
            stf8(er + d, r);
        }
        for (int d = 0; d < K; d += 8)
            stf8(e + d, kda_expf8_special(ldf8(e + d), kda_expf8_finish(ldf8(en + d), ldf8(er + d))));
        if (i > 0) KDA_GATE_REST(1)
        else KDA_GATE_REST(0)
    } else if (gp->mode == 1) {
        if (i > 0) KDA_GATE_LOOP(-A * kda_softplusf8(x), 1)
        else KDA_GATE_LOOP(-A * kda_softplusf8(x), 0)
    } else {
        if (i > 0) KDA_GATE_LOOP(x, 1)
        else KDA_GATE_LOOP(x, 0)
    }
#undef KDA_GATE_LOOP
#undef KDA_GATE_REST
#undef KDA_GATE_STORE
    for (int d = 0; d < V; d += 8) {
        const kda_f8 x = ld8(a->v, a->dtype, ov + d);
        stf8(v + d, x);
        bad |= nonfinite8(x);
    }
    s->beta[i] = kda_cpu_beta(p, t, h);
    int any = !kda_cpu_all_finite(&s->beta[i], 1);
    for (int u = 0; u < 8; u++) any |= bad[u];
    return !any;
}

KDA_INLINE int load_chunk(const kda_problem_t *p, scratch_t *s, int64_t t0, int c, int h, int64_t pf_t0, int pf_h,
                          int pf_c) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, vec = K % 8 == 0 && V % 8 == 0;
    const gate_consts_t gc = gate_consts(p, h);
    int bad = c;
    for (int i = 0; i < c; i++) {
        const int64_t t = t0 + i;
        if (i < pf_c) prefetch_token(p, pf_t0 + i, pf_h); /* the rows the task loads next */
        if (vec && bad == c && load_token8(p, s, &gc, t, i, h)) continue;
        if (load_token(p, s, t, i, h) && bad == c) bad = i;
        if (i >= bad) neutral_row(s, K, V, i);
        float *G = s->G + i * K;
        if (i > 0)
            for (int d = 0; d < K; d++) G[d] += G[d - K]; /* cumulative within the chunk */
    }
    /* k transposed for the column factors, zero past the chunk's end up to its last 16-token block */
    const int cpad = (c + KDA_SUB - 1) / KDA_SUB * KDA_SUB;
    for (int i = c; i < cpad; i++) {
        memset(s->k + i * K, 0, sizeof(float) * K);
        memset(s->G + i * K, 0, sizeof(float) * K);
    }
    transpose_rows(s->kT, KDA_CPU_CHUNK, s->k, K, cpad);
    return bad;
}

/* ---------------------------------------------------------------------------------------------------------
 * A and Aqk by 16-token blocks
 * ------------------------------------------------------------------------------------------------------- */

/* fa[i] = k_i ⊙ e^{G_i − R}, fq[i] = q_i ⊙ e^{G_i − R} for rows [i0, i1); fb[j] = k_j ⊙ e^{R − G_j} for rows
 * [j0, j0 + 16), from k and G transposed (load_chunk), into fbt (K × 16) for the product. */
KDA_INLINE void row_factors(scratch_t *s, int K, int i0, int i1, const float *R) {
    for (int i = i0; i < i1; i++) {
        const float *restrict G = s->G + i * K, *restrict q = s->q + i * K, *restrict k = s->k + i * K;
        float *restrict fa = s->fa + i * K, *restrict fq = s->fq + i * K, e[256];
        kda_expf_row_fin(e, G, R, K);
        for (int d = 0; d < K; d++) {
            fa[d] = k[d] * e[d];
            fq[d] = q[d] * e[d];
        }
    }
}

KDA_INLINE void col_factors(scratch_t *s, int K, int j0, const float *R) {
    for (int d = 0; d < K; d++) { /* from the transposed k and G: 16 columns of one channel are contiguous */
        const float *restrict k = s->kT + d * KDA_CPU_CHUNK + j0, *restrict G = s->GT + d * KDA_CPU_CHUNK + j0;
        float *restrict f = s->fbt + d * 16;
        const float r = R[d];
        for (int j = 0; j < 16; j++) f[j] = k[j] * kda_expf_fin(r - G[j]);
    }
}

/* A[i][j] (β-scaled) and Aqk[i][j] (scale-scaled) for i in block [i0,i1), j in [j0,j1), from fa/fq and fbt.
 * Each element is its own dot product: a non-finite factor of column j only reaches the elements of column j,
 * which the diagonal block then overwrites above the diagonal. */
KDA_INLINE void block_products(scratch_t *s, float *Aqk, int K, int i0, int i1, int j0, int j1, float scale) {
    float prod[16 * 16];
    const int ni = i1 - i0, nj = j1 - j0;
    kda_gemm(ni, 16, K, s->fa + i0 * K, K, 1, s->fbt, 16, prod, 16, 0);
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++) s->A[(i0 + i) * KDA_CPU_CHUNK + j0 + j] = s->beta[i0 + i] * prod[i * 16 + j];
    kda_gemm(ni, 16, K, s->fq + i0 * K, K, 1, s->fbt, 16, prod, 16, 0);
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++) Aqk[(i0 + i) * KDA_CPU_CHUNK + j0 + j] = scale * prod[i * 16 + j];
}

/* The middle row of the 16-token block [b0, b1): the reference of its split exponentials. */
KDA_INLINE int block_mid(int b0, int b1) { return b0 + (b1 - b0 - 1) / 2; }

/* 1 when the block [b0, b1) may use its middle row as the reference: every exponent G_i − G_m of its rows within
 * KDA_DIAG_RANGE, and the middle row's log decay not NaN. */
KDA_INLINE int block_fits(const scratch_t *s, int K, int b0, int b1) {
    const float *Gm = s->G + block_mid(b0, b1) * K, *G0 = s->G + b0 * K, *G1 = s->G + (b1 - 1) * K;
    float range = 0.0f;
    int nan = 0;
    for (int d = 0; d < K; d++) {
        const float up = G0[d] - Gm[d], down = Gm[d] - G1[d];
        range = up > range ? up : range;
        range = down > range ? down : range;
        nan |= Gm[d] != Gm[d];
    }
    return range <= KDA_DIAG_RANGE && !nan;
}

/* The diagonal block [b0, b1): the middle-row reference when every exponent fits, else per-pair exponentials.
 * A NaN log decay at the middle row (or before it) takes the per-pair path, so that rows before a NaN gate
 * never see it through their factors e^{G_i − G_m}. */
KDA_INLINE void diagonal_block(scratch_t *s, float *Aqk, int K, int b0, int b1, float scale) {
    const float *Gm = s->G + block_mid(b0, b1) * K;
    if (block_fits(s, K, b0, b1)) {
        row_factors(s, K, b0, b1, Gm);
        col_factors(s, K, b0, Gm);
        block_products(s, Aqk, K, b0, b1, b0, b1, scale);
    } else {
        for (int i = b0; i < b1; i++) {
            const float *Gi = s->G + i * K, *qi = s->q + i * K, *ki = s->k + i * K;
            for (int j = b0; j <= i; j++) {
                const float *Gj = s->G + j * K, *kj = s->k + j * K;
                float sa = 0.0f, sq = 0.0f, e[256];
                kda_expf_row_fin(e, Gi, Gj, K);
                for (int d = 0; d < K; d++) {
                    sa += ki[d] * (kj[d] * e[d]);
                    sq += qi[d] * (kj[d] * e[d]);
                }
                s->A[i * KDA_CPU_CHUNK + j] = s->beta[i] * sa;
                Aqk[i * KDA_CPU_CHUNK + j] = scale * sq;
            }
        }
    }
    /* A is strictly lower, Aqk lower with its diagonal: clear what the block product put above */
    for (int i = b0; i < b1; i++) {
        s->A[i * KDA_CPU_CHUNK + i] = 0.0f;
        for (int j = i + 1; j < b1; j++) {
            s->A[i * KDA_CPU_CHUNK + j] = 0.0f;
            Aqk[i * KDA_CPU_CHUNK + j] = 0.0f;
        }
    }
}

KDA_INLINE void intra_chunk_attention(scratch_t *s, float *Aqk, int K, int c, float scale) {
    memset(s->A, 0, sizeof(float) * KDA_CPU_CHUNK * KDA_CPU_CHUNK);
    memset(Aqk, 0, sizeof(float) * KDA_CPU_CHUNK * KDA_CPU_CHUNK);
    for (int b0 = 0; b0 < c; b0 += KDA_SUB) {
        const int b1 = b0 + KDA_SUB < c ? b0 + KDA_SUB : c;
        /* blocks left of the diagonal: reference = G at row b0 */
        if (b0 > 0) {
            const float *R = s->G + b0 * K;
            row_factors(s, K, b0, b1, R);
            for (int j0 = 0; j0 < b0; j0 += KDA_SUB) {
                col_factors(s, K, j0, R);
                block_products(s, Aqk, K, b0, b1, j0, j0 + KDA_SUB, scale);
            }
        }
        diagonal_block(s, Aqk, K, b0, b1, scale);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Shared factors (the usual path: every diagonal block fits). Per 16-token block J with rows [b0, b1), first
 * row P = G_{b0}, middle row M = G_m, last row E = G_{b1−1} (all K-vectors, P ≥ M ≥ E), one exponential per
 * token and channel:
 *   a_i = e^{G_i − M}  (rows),  b_j = 1 / a_j = e^{M − G_j}  (columns)       both within e^{±KDA_DIAG_RANGE}
 * and from them, by per-channel scales of one exponential per channel and block (every factor ≤ 1 but a, b):
 *   diagonal block       A_JJ[i][j]  = Σ_d (β_i k_i a_i)[d] (k_j b_j)[d]
 *   row factor           e^{G_i − P_I} = a_i ⊙ e^{M_I − P_I}                       (≤ 1)
 *   column factor        k_j ⊙ e^{E_J − G_j} = (k_j b_j) ⊙ e^{E_J − M_J}  = kc_j   (≤ 1)
 *   block I > J          A_IJ[i][j]  = Σ_d (β_i k_i e^{G_i − P_I})[d] (kc_j ⊙ e^{P_I − E_J})[d]
 *   βKΓ, QΓ rows         β_i k_i e^{G_i} = (β_i k_i e^{G_i − P_J}) ⊙ e^{P_J}
 *   K̃ (transposed)      k_j e^{G_last − G_j} = kc_j ⊙ e^{G_last − E_J}
 * (Aqk the same with scale·q_i for β_i k_i.) Every product of two factors is a product of numbers within
 * e^{±64}, or of two factors ≤ 1, so it loses nothing unless its true value is below the smallest normal float.
 * ~11 K exponentials a chunk at K = 128, where one set per block pair would take ~50 K.
 * ------------------------------------------------------------------------------------------------------- */

/* The products of shared_factors, out of line: inlined there, GCC keeps the exponential's constants in
 * registers across them and spills two of the tile's accumulators. */
static __attribute__((noinline)) void factor_gemm(int m, int n, const float *A, int K, const float *B, int ldb,
                                                  float *C) {
    kda_gemm(m, n, K, A, K, 1, B, ldb, C, KDA_CPU_CHUNK, 0);
}

/* 1 when every 16-token block of the chunk passes the diagonal block's test (diagonal_block). */
KDA_INLINE int blocks_fit(const scratch_t *s, int K, int c) {
    for (int b0 = 0; b0 < c; b0 += KDA_SUB)
        if (!block_fits(s, K, b0, b0 + KDA_SUB < c ? b0 + KDA_SUB : c)) return 0;
    return 1;
}

/* Row i's factors from e = e^{G_i − M}, sp = e^{M − P}, ep = e^{P}: fa = β k e, fq = s q e (diagonal block),
 * fa2 = fa ⊙ sp, fq2 = fq ⊙ sp (blocks left of it), bk = fa2 ⊙ ep, qg = fq2 ⊙ ep. */
KDA_INLINE void shared_row(float *restrict fa, float *restrict fq, float *restrict fa2, float *restrict fq2,
                           float *restrict bk, float *restrict qg, const float *restrict k, const float *restrict q,
                           const float *restrict e, const float *restrict sp, const float *restrict ep, float b,
                           float scale, int K) {
    if (!fa2) { /* the chunk's first block: nothing left of it needs fa2, fq2 */
        for (int d = 0; d < K; d++) {
            const float x = b * k[d] * e[d], y = scale * q[d] * e[d];
            fa[d] = x;
            fq[d] = y;
            bk[d] = x * sp[d] * ep[d];
            qg[d] = y * sp[d] * ep[d];
        }
        return;
    }
    for (int d = 0; d < K; d++) {
        const float x = b * k[d] * e[d], y = scale * q[d] * e[d];
        const float x2 = x * sp[d], y2 = y * sp[d];
        fa[d] = x;
        fq[d] = y;
        fa2[d] = x2;
        fq2[d] = y2;
        bk[d] = x2 * ep[d];
        qg[d] = y2 * ep[d];
    }
}

/* Channel d's 16 columns of block [b0, b0 + 16): fbd = k b with b = 1 / a = e^{M − G_j}, kc = fbd se
 * (se = e^{E − M}), kt = kc el (el = e^{G_last − E}). Columns past the chunk's end have k = 0 (and a = 1). */
KDA_INLINE void shared_cols(float *fbd, float *kc, float *kt, const float *k, const float *a, float se, float el) {
    for (int j = 0; j < 16; j += KDA_GEMM_VW) { /* vectors along the columns (see scale_cols) */
        const kda_vf x = kda_ldv(k + j) / kda_ldv(a + j), y = x * se;
        kda_stv(fbd + j, x);
        kda_stv(kc + j, y);
        kda_stv(kt + j, y * el);
    }
}

/* shared_cols for the chunk's last block: E = G_last, so el = e^0 = 1 exactly and kt = kc, which no later block
 * needs (the same bits as shared_cols, without kc and the exponential row of el). */
KDA_INLINE void shared_cols_last(float *fbd, float *kt, const float *k, const float *a, float se) {
    for (int j = 0; j < 16; j += KDA_GEMM_VW) {
        const kda_vf x = kda_ldv(k + j) / kda_ldv(a + j);
        kda_stv(fbd + j, x);
        kda_stv(kt + j, x * se);
    }
}

/* f = kc sc over 16 columns, in vectors along the columns (as a plain loop GCC vectorises the caller's loop
 * over channels instead, with a permute per element). */
KDA_INLINE void scale_cols(float *f, const float *kc, float sc) {
    for (int j = 0; j < 16; j += KDA_GEMM_VW) kda_stv(f + j, kda_ldv(kc + j) * sc);
}

/* A, Aqk, βKΓ, QΓ and K̃ (transposed) of a chunk whose blocks all fit (blocks_fit). */
KDA_INLINE void shared_factors(scratch_t *s, prep_t *o, int K, int c, float scale) {
    float *Aqk = o->Aqk;
    memset(s->A, 0, sizeof(float) * KDA_CPU_CHUNK * KDA_CPU_CHUNK);
    memset(Aqk, 0, sizeof(float) * KDA_CPU_CHUNK * KDA_CPU_CHUNK);
    const float *Glast = s->G + (c - 1) * K;
    float sp[KDA_MAX_HEAD_DIM], ep[KDA_MAX_HEAD_DIM], se[KDA_MAX_HEAD_DIM], el[KDA_MAX_HEAD_DIM];
    float e[KDA_MAX_HEAD_DIM];
    for (int b0 = 0; b0 < c; b0 += KDA_SUB) {
        const int b1 = b0 + KDA_SUB < c ? b0 + KDA_SUB : c, m = block_mid(b0, b1), ni = b1 - b0;
        const float *P = s->G + b0 * K, *M = s->G + m * K, *E = s->G + (b1 - 1) * K;
        kda_expf_row_fin(sp, M, P, K);
        kda_expf_row_fin(ep, P, NULL, K);
        const int last = b1 == c; /* E = G_last: el = 1 (shared_cols_last); at 16-token chunks, always */
        kda_expf_row_fin(se, E, M, K);
        if (!last) kda_expf_row_fin(el, Glast, E, K);
        for (int i = b0; i < b1; i++) {
            float *ei = s->ea + (i - b0) * K;
            kda_expf_row_fin(ei, s->G + i * K, M, K);
            shared_row(s->fa + i * K, s->fq + i * K, b0 ? s->fa2 + (i - b0) * K : NULL, s->fq2 + (i - b0) * K,
                       s->bk + i * K, o->QG + i * K, s->k + i * K, s->q + i * K, ei, sp, ep, s->beta[i], scale, K);
        }
        for (int i = b1; i < b0 + 16; i++) /* past the chunk's end */
            for (int d = 0; d < K; d++) s->ea[(i - b0) * K + d] = 1.0f;
        transpose_rows(s->eaT, 16, s->ea, K, 16);
        if (last)
            for (int d = 0; d < K; d++)
                shared_cols_last(s->fbd + d * 16, o->KT + d * KDA_CPU_CHUNK + b0, s->kT + d * KDA_CPU_CHUNK + b0,
                                 s->eaT + d * 16, se[d]);
        else
            for (int d = 0; d < K; d++)
                shared_cols(s->fbd + d * 16, s->kc + d * KDA_CPU_CHUNK + b0, o->KT + d * KDA_CPU_CHUNK + b0,
                            s->kT + d * KDA_CPU_CHUNK + b0, s->eaT + d * 16, se[d], el[d]);
        /* the diagonal block, then clear above its diagonal (A strictly lower, Aqk with its diagonal). Its first
         * tile of rows (m1 = KDA_GEMM_MR) needs only the columns j ≤ i < m1: n1 columns, the vectors covering them
         * (AVX2: 6 rows × 8 columns, not 16; each element is the same FMA chain, so the same bits) */
        const int m1 = ni < KDA_GEMM_MR ? ni : KDA_GEMM_MR, nv1 = (m1 + KDA_GEMM_VW - 1) / KDA_GEMM_VW * KDA_GEMM_VW;
        const int n1 = nv1 < 16 ? nv1 : 16;
        factor_gemm(m1, n1, s->fa + b0 * K, K, s->fbd, 16, s->A + b0 * KDA_CPU_CHUNK + b0);
        factor_gemm(m1, n1, s->fq + b0 * K, K, s->fbd, 16, Aqk + b0 * KDA_CPU_CHUNK + b0);
        if (ni > m1) {
            factor_gemm(ni - m1, 16, s->fa + (b0 + m1) * K, K, s->fbd, 16, s->A + (b0 + m1) * KDA_CPU_CHUNK + b0);
            factor_gemm(ni - m1, 16, s->fq + (b0 + m1) * K, K, s->fbd, 16, Aqk + (b0 + m1) * KDA_CPU_CHUNK + b0);
        }
        for (int i = b0; i < b1; i++) {
            s->A[i * KDA_CPU_CHUNK + i] = 0.0f;
            for (int j = i + 1; j < b0 + 16; j++) {
                s->A[i * KDA_CPU_CHUNK + j] = 0.0f;
                Aqk[i * KDA_CPU_CHUNK + j] = 0.0f;
            }
        }
        if (b0 == 0) continue;
        /* blocks left of the diagonal, one product: columns of block J scaled by e^{P − E_J} */
        for (int j0 = 0; j0 < b0; j0 += KDA_SUB) {
            kda_expf_row_fin(e, P, s->G + (j0 + KDA_SUB - 1) * K, K);
            for (int d = 0; d < K; d++)
                scale_cols(s->fbt + d * KDA_CPU_CHUNK + j0, s->kc + d * KDA_CPU_CHUNK + j0, e[d]);
        }
        factor_gemm(ni, b0, s->fa2, K, s->fbt, KDA_CPU_CHUNK, s->A + b0 * KDA_CPU_CHUNK);
        factor_gemm(ni, b0, s->fq2, K, s->fbt, KDA_CPU_CHUNK, Aqk + b0 * KDA_CPU_CHUNK);
    }
}

/* βKΓ, QΓ and K̃ (transposed) when some block does not fit: one exponential each. */
KDA_INLINE void direct_factors(scratch_t *s, prep_t *o, int K, int c, float scale) {
    const float *Glast = s->G + (c - 1) * K;
    for (int i = 0; i < c; i++) {
        const float *G = s->G + i * K, *k = s->k + i * K, *q = s->q + i * K, b = s->beta[i];
        float e[KDA_MAX_HEAD_DIM];
        kda_expf_row_fin(e, G, NULL, K);
        float *restrict bk = s->bk + i * K, *restrict qg = o->QG + i * K;
        for (int d = 0; d < K; d++) {
            bk[d] = b * k[d] * e[d];
            qg[d] = scale * q[d] * e[d];
        }
    }
    for (int d = 0; d < K; d++) {
        const float *restrict k = s->kT + d * KDA_CPU_CHUNK, *restrict G = s->GT + d * KDA_CPU_CHUNK;
        float *restrict kt = o->KT + d * KDA_CPU_CHUNK;
        const float gl = Glast[d];
        for (int j = 0; j < c; j++) kt[j] = k[j] * kda_expf_fin(gl - G[j]);
    }
}

/* y[j] += a x[j] for j < n, n a multiple of the vector width. The loops with several row pointers are functions
 * with restrict parameters: clang honours restrict only on parameters, and left these loops scalar without it
 * (inlined, the qualifiers stay). */
KDA_INLINE void row_axpy(float *restrict y, float a, const float *restrict x, int n) {
    for (int j = 0; j < n; j += KDA_GEMM_VW) kda_stv(y + j, kda_ldv(y + j) + a * kda_ldv(x + j));
}

/* T = (I + A)⁻¹ by rows: T[i] = e_i − Σ_{m<i} A[i][m] T[m]. Row m of T is zero right of its diagonal, and at step
 * m the entries j > m of T[i] are still +0 (or the diagonal's 1): the vector lanes past j = m add −A[i][m]·0 = ±0
 * to them, which leaves every bit as it was for a finite A (+0 + −0 = +0). Whole vectors instead of a loop that
 * may end anywhere: clang runs the last ≤ 31 elements of such a row scalar. */
KDA_INLINE void solve_unit_lower(scratch_t *s, int c) {
    float *T = s->Tinv;
    for (int i = 0; i < c; i++) {
        float *Ti = T + i * KDA_CPU_CHUNK;
        memset(Ti, 0, sizeof(float) * KDA_CPU_CHUNK);
        Ti[i] = 1.0f;
        for (int m = 0; m < i; m++)
            row_axpy(Ti, -s->A[i * KDA_CPU_CHUNK + m], T + m * KDA_CPU_CHUNK,
                     (m + KDA_GEMM_VW) / KDA_GEMM_VW * KDA_GEMM_VW);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The two stages of a chunk. prep: everything that does not depend on the state (A, Aqk, T, W, U, QΓ, K̃, γ),
 * chunks independent of each other, and the chunk's first poisoned row (o->bad, c if none; its rows and later
 * ones are neutral). recurrence: the state step on a slice of the V columns, columns independent of each other
 * (S, Δ, O are column-separable; the slices only read the prep); rows from o->bad on are stored as NaN.
 * ------------------------------------------------------------------------------------------------------- */
KDA_INLINE void chunk_prep(const kda_problem_t *p, scratch_t *s, prep_t *o, int64_t t0, int c, int h, int64_t pf_t0,
                           int pf_h, int pf_c) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    const float scale = p->scale;

    o->bad = load_chunk(p, s, t0, c, h, pf_t0, pf_h, pf_c);
    if (blocks_fit(s, K, c)) {
        shared_factors(s, o, K, c, scale);
    } else {
        transpose_rows(s->GT, KDA_CPU_CHUNK, s->G, K, (c + KDA_SUB - 1) / KDA_SUB * KDA_SUB);
        intra_chunk_attention(s, o->Aqk, K, c, scale);
        direct_factors(s, o, K, c, scale);
    }
    solve_unit_lower(s, c);
    kda_expf_row_fin(o->gamma, s->G + (c - 1) * K, NULL, K);
    for (int i = 0; i < c; i++) {
        float *restrict v = s->v + i * V;
        const float b = s->beta[i];
        for (int j = 0; j < V; j++) v[j] *= b; /* v now holds β v */
    }
    /* W = T Diag(β) KΓ, U = T Diag(β) V (T lower triangular) */
    kda_gemm_tri(c, K, c, s->Tinv, KDA_CPU_CHUNK, 1, s->bk, K, o->W, K, 0, 1);
    kda_gemm_tri(c, V, c, s->Tinv, KDA_CPU_CHUNK, 1, s->v, V, o->U, V, 0, 1);
}

/* Columns [j0, j0 + w) of one chunk's state step and outputs; D and O are c×w scratch. */
KDA_INLINE void chunk_recurrence(const kda_problem_t *p, const prep_t *o, float *S, int j0, int w, float *D, float *O,
                                 int64_t t0, int c, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HV = a->num_v_heads;
    float *Sj = S + j0;
    /* Δ = U − W S (U subtracted from in the product's store) */
    kda_gemm_ex(c, w, K, o->W, K, 1, Sj, V, D, w, KDA_GEMM_SUB_FROM, o->U + j0, V, 0);
    /* O = QΓ S + Aqk Δ */
    kda_gemm(c, w, K, o->QG, K, 1, Sj, V, O, w, 0);
    kda_gemm_tri(c, w, c, o->Aqk, KDA_CPU_CHUNK, 1, D, w, O, w, 1, 1);
    /* S ← Diag(γ) S + K̃ᵀ Δ (the decay in the product's store, not a pass of its own) */
    kda_gemm_ex(K, w, c, o->KT, KDA_CPU_CHUNK, 1, D, w, Sj, V, KDA_GEMM_SCALE_ADD, o->gamma, 0, 0);

    for (int i = 0; i < c; i++) {
        float *row = O + i * w;
        if (i >= o->bad)
            for (int j = 0; j < w; j++) row[j] = NAN;
        kda_store_row(a->o, a->o_dtype, ((t0 + i) * HV + h) * V + j0, row, w);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Scheduling. Many (sequence, head) tasks: one task per thread item, prep and recurrence chunk by chunk.
 * Fewer tasks than threads: each task in turn, on every thread at once, in one pool run without barriers
 * (the flow schedule). Thread item r < nslices owns the column slice r of the recurrence (slice_bounds) and
 * runs it chunk by chunk; the other items, if any, only prepare: each claims the next unprepared chunk
 * (an atomic counter) and prepares it into a ring of KDA_CPU_RING prep buffers, running ahead of the
 * recurrence by up to the ring; a slice owner whose next chunk is not prepared yet claims and prepares one
 * too, so the preps spread over whichever threads are free. A ring slot is reused once every slice has run
 * the chunk it held.
 * Every output element is computed by the same operations in the same order on both schedules and for any
 * slicing (gemm.h: one FMA chain per element), so results do not depend on the thread count.
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_CPU_RING                                                                                                   \
    64 /* preps in flight: 1024 tokens of look-ahead at 16-token chunks, so that a prep thread
                           delayed by a few chunks (another process on its core) does not leave the recurrence
                           waiting */
#define KDA_CPU_MAX_SLICES 64

typedef struct {
    const kda_problem_t *p;
    char *ws;          /* per-thread scratch, then (flow schedule) the prep ring and the state */
    size_t per_thread; /* bytes */
    /* flow schedule: the current task */
    int64_t bos, eos, nchunks;
    int h, nslices;
    int slice_j0[KDA_CPU_MAX_SLICES + 1]; /* slice r: columns [slice_j0[r], slice_j0[r + 1]) */
    int group;                            /* many-task schedule: value heads per task */
    const int64_t *rows;                  /* chunk_states: each sequence's first row (kda_chunk_rows), or NULL */
    int64_t row0;                         /* flow schedule: the current sequence's first row */
    prep_t *ring;                         /* KDA_CPU_RING preps */
    float *S;
    atomic_int_fast64_t next_prep;                /* the next chunk to prepare */
    atomic_int_fast64_t ready[KDA_CPU_RING];      /* the chunk whose prep a slot holds, -1 none */
    atomic_int_fast64_t done[KDA_CPU_MAX_SLICES]; /* chunks whose recurrence slice r has run */
    atomic_int_fast64_t stop;                     /* 1 + the chunk with a poisoned row (0 none) */
} job_t;

static void task_whole(void *arg, int64_t item, int thread) {
    const job_t *job = (const job_t *)arg;
    const kda_problem_t *p = job->p;
    const int HV = p->a.num_v_heads, K = p->a.head_dim_k, V = p->a.head_dim_v, G = job->group;
    const int ngroups = (HV + G - 1) / G;
    const int64_t n = item / ngroups;
    const int h0 = (int)(item % ngroups) * G, nh = HV - h0 < G ? HV - h0 : G;
    scratch_t s;
    carve((float *)(job->ws + (size_t)thread * job->per_thread), K, V, &s);
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n);
    int64_t nan_from[KDA_CPU_GROUP]; /* per head: tokens from here on are NaN without arithmetic */
    int poisoned[KDA_CPU_GROUP];
    for (int u = 0; u < nh; u++) {
        /* a non-finite column is NaN now, and stays in its column */
        kda_cpu_load_seq_state(p, n, h0 + u, s.S + (size_t)u * K * V);
        nan_from[u] = eos;
        poisoned[u] = 0;
    }
    for (int64_t t0 = bos; t0 < eos; t0 += KDA_CPU_CHUNK) {
        const int c = eos - t0 < KDA_CPU_CHUNK ? (int)(eos - t0) : KDA_CPU_CHUNK;
        int live = 0;
        for (int u = 0; u < nh; u++) { /* the heads of the group chunk by chunk: a token's rows share pages */
            if (t0 >= nan_from[u]) continue;
            live = 1;
            /* prefetch the next head's rows of this chunk (the same pages), or the first head's of the next */
            const int64_t nt0 = u + 1 < nh ? t0 : t0 + c;
            const int nc = eos - nt0 < KDA_CPU_CHUNK ? (int)(eos - nt0) : KDA_CPU_CHUNK;
            chunk_prep(p, &s, &s.pr, t0, c, h0 + u, nt0, u + 1 < nh ? h0 + u + 1 : h0, nh > 1 ? nc : 0);
            if (job->rows && (t0 - bos) % KDA_CHUNK == 0) /* the state before each 64-token chunk (KDA_CHUNK) */
                kda_cpu_store_chunk_state(p, job->rows[n] + (t0 - bos) / KDA_CHUNK, h0 + u, s.S + (size_t)u * K * V, 0,
                                          V);
            chunk_recurrence(p, &s.pr, s.S + (size_t)u * K * V, 0, V, s.D, s.O, t0, c, h0 + u);
            if (s.pr.bad < c) {
                poisoned[u] = 1;
                nan_from[u] = t0 + c;
            }
        }
        if (!live) break;
    }
    for (int u = 0; u < nh; u++) {
        float *S = s.S + (size_t)u * K * V;
        if (poisoned[u]) {
            store_nan_rows(p, s.O, nan_from[u], eos, h0 + u);
            for (int64_t i = 0; i < (int64_t)K * V; i++) S[i] = NAN;
            if (job->rows) kda_cpu_store_chunk_states_from(p, job->rows[n], bos, nan_from[u], eos, h0 + u, S);
        }
        kda_cpu_store_state(p, slot, h0 + u, S);
    }
}

KDA_INLINE void spin_pause(unsigned *spins) {
    if (++*spins % 1024 == 0) {
        sched_yield(); /* the machine may be oversubscribed: let the thread we wait for run */
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Prepare the next unprepared chunk if its ring slot is free; 1 if a prep was done or claimed by another
 * thread meanwhile (try again at once), 0 if there is nothing to prepare now. */
static int flow_try_prep(job_t *job, scratch_t *s) {
    const int64_t ci = atomic_load_explicit(&job->next_prep, memory_order_relaxed);
    if (ci >= job->nchunks || atomic_load_explicit(&job->stop, memory_order_relaxed)) return 0;
    for (int r = 0; r < job->nslices; r++) /* the slot's previous chunk, ci - RING, run by every slice */
        if (atomic_load_explicit(&job->done[r], memory_order_acquire) <= ci - KDA_CPU_RING) return 0;
    int_fast64_t expect = ci;
    if (!atomic_compare_exchange_strong(&job->next_prep, &expect, ci + 1)) return 1;
    const int64_t t0 = job->bos + ci * KDA_CPU_CHUNK;
    const int c = job->eos - t0 < KDA_CPU_CHUNK ? (int)(job->eos - t0) : KDA_CPU_CHUNK;
    chunk_prep(job->p, s, &job->ring[ci % KDA_CPU_RING], t0, c, job->h, 0, 0, 0);
    atomic_store_explicit(&job->ready[ci % KDA_CPU_RING], ci, memory_order_release);
    return 1;
}

static void task_flow(void *arg, int64_t item, int thread) {
    job_t *job = (job_t *)arg;
    const kda_problem_t *p = job->p;
    const int V = p->a.head_dim_v;
    scratch_t s;
    carve((float *)(job->ws + (size_t)thread * job->per_thread), p->a.head_dim_k, V, &s);
    unsigned spins = 0;
    if (item >= job->nslices) { /* a thread without a slice: preps while there are any */
        while (atomic_load_explicit(&job->next_prep, memory_order_relaxed) < job->nchunks &&
               !atomic_load_explicit(&job->stop, memory_order_relaxed))
            if (!flow_try_prep(job, &s)) spin_pause(&spins);
        return;
    }
    const int r = (int)item, j0 = job->slice_j0[r], w = job->slice_j0[r + 1] - j0;
    for (int64_t ci = 0; ci < job->nchunks; ci++) {
        const prep_t *pr = &job->ring[ci % KDA_CPU_RING];
        while (atomic_load_explicit(&job->ready[ci % KDA_CPU_RING], memory_order_acquire) != ci)
            if (!flow_try_prep(job, &s)) spin_pause(&spins);
        const int64_t t0 = job->bos + ci * KDA_CPU_CHUNK;
        const int c = job->eos - t0 < KDA_CPU_CHUNK ? (int)(job->eos - t0) : KDA_CPU_CHUNK;
        if (job->rows && (t0 - job->bos) % KDA_CHUNK == 0) /* the state before each 64-token chunk */
            kda_cpu_store_chunk_state(p, job->row0 + (t0 - job->bos) / KDA_CHUNK, job->h, job->S, j0, w);
        chunk_recurrence(p, pr, job->S, j0, w, s.D, s.O, t0, c, job->h);
        const int bad = pr->bad < c;
        atomic_store_explicit(&job->done[r], ci + 1, memory_order_release);
        if (bad) { /* every slice stops after this chunk (each reads the same flag) */
            atomic_store_explicit(&job->stop, ci + 1, memory_order_relaxed);
            return;
        }
    }
}

/* The flow schedule when there are fewer (sequence, head) tasks than threads and more than one thread. */
static int split_schedule(const kda_context_t *ctx, const kda_problem_t *p) {
    return ctx->num_threads > 1 && p->num_seqs * p->a.num_v_heads < ctx->num_threads;
}

/* Value heads per task of the many-task schedule: 4, 2 or 1, the most that still gives every thread two tasks
 * (16 heads on 2 threads: 4 tasks of 4 heads). A task runs its heads chunk by chunk, so the rows of a token
 * that the heads load lie on the same pages (at H16 each token's row of one head is a new 4 KB page). The
 * heads' arithmetic does not depend on the grouping: results are the same for any thread count. */
static int head_group(const kda_context_t *ctx, const kda_problem_t *p) {
    for (int g = KDA_CPU_GROUP; g > 1; g /= 2)
        if (p->num_seqs * ((p->a.num_v_heads + g - 1) / g) >= 2 * (int64_t)ctx->num_threads) return g;
    return 1;
}

/* Column slices of the flow schedule (bounds into j0[0..n], n returned), each a multiple of KDA_GEMM_NR floats wide.
 * A prep costs about ρ = 64 / V of a whole-width recurrence (K = V = 128, 16-token chunks: 0.5). Where one thread can prepare every chunk and still run a slice, every thread owns a slice and the last
 * one is narrower by the preps: n threads, each (1 + ρ) / n of a chunk's work, the last a slice of ((1 + ρ) / n − ρ)
 * V columns (2 threads, V = 128: 96 + 32). Its slice ends first, so it runs ahead and prepares the chunks (a thread
 * prepares only when its next chunk is not ready). Otherwise half the threads (rounded up) own equal slices and the
 * others only prepare (2 threads, V = 64: one whole-width recurrence and one prep thread). The slicing never
 * changes a result (gemm.h: one FMA chain per element, whatever the columns). */
static int slice_bounds(const kda_context_t *ctx, const kda_problem_t *p, int *j0) {
    const int V = p->a.head_dim_v, nr = KDA_GEMM_NR, T = ctx->num_threads;
    const double rho = 64.0 / V;
    const int last = (int)(((1.0 + rho) / T - rho) * V / nr + 0.5) * nr; /* the preparing thread's slice */
    if (T <= KDA_CPU_MAX_SLICES && last >= nr && last < V && (V - last) / (T - 1) >= nr) {
        const int w = ((V - last) / (T - 1) + nr - 1) / nr * nr;
        int n = 0;
        for (int c = 0; c < V - last; c += w) j0[n++] = c;
        j0[n++] = V - last;
        j0[n] = V;
        return n;
    }
    const int half = (T + 1) / 2, ns = half < KDA_CPU_MAX_SLICES ? half : KDA_CPU_MAX_SLICES;
    int w = (V + ns - 1) / ns;
    w = (w + nr - 1) / nr * nr;
    w = w < V ? w : V;
    int n = 0;
    for (int c = 0; c < V; c += w) j0[n++] = c;
    j0[n] = V;
    return n;
}

static size_t per_thread_bytes(const kda_problem_t *p) {
    scratch_t s;
    return carve(NULL, p->a.head_dim_k, p->a.head_dim_v, &s) * sizeof(float);
}

static size_t per_prep_bytes(const kda_problem_t *p) {
    prep_t s;
    return carve_prep(NULL, p->a.head_dim_k, p->a.head_dim_v, &s) * sizeof(float);
}

__attribute__((unused)) static size_t workspace_bytes(const kda_context_t *ctx, const kda_problem_t *p) {
    size_t b = (size_t)ctx->num_threads * per_thread_bytes(p) + 64;
    if (split_schedule(ctx, p)) b += KDA_CPU_RING * per_prep_bytes(p) + (size_t)kda_state_head_elems(p) * sizeof(float);
    return b + kda_chunk_rows_bytes(p); /* last: chunk_states' rows */
}

static void run(kda_context_t *ctx, const kda_problem_t *p, void *ws) {
    job_t job;
    memset(&job, 0, sizeof job);
    job.p = p;
    job.ws = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    job.per_thread = per_thread_bytes(p);
    job.rows = kda_chunk_rows(p, (char *)ws + workspace_bytes(ctx, p) - kda_chunk_rows_bytes(p));
    if (!split_schedule(ctx, p)) {
        job.group = head_group(ctx, p);
        const int64_t ngroups = (p->a.num_v_heads + job.group - 1) / job.group;
        kda_pool_run(ctx->pool, p->num_seqs * ngroups, task_whole, &job);
        return;
    }
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    char *base = job.ws + (size_t)ctx->num_threads * job.per_thread;
    const size_t per_prep = per_prep_bytes(p);
    prep_t ring[KDA_CPU_RING];
    for (int i = 0; i < KDA_CPU_RING; i++) carve_prep((float *)(base + i * per_prep), K, V, &ring[i]);
    job.ring = ring;
    job.S = (float *)(base + KDA_CPU_RING * per_prep);
    job.nslices = slice_bounds(ctx, p, job.slice_j0);
    for (int64_t item = 0; item < p->num_seqs * p->a.num_v_heads; item++) {
        const int64_t n = item / p->a.num_v_heads;
        job.h = (int)(item % p->a.num_v_heads);
        kda_seq_bounds(p, n, &job.bos, &job.eos);
        job.row0 = job.rows ? job.rows[n] : 0;
        const int64_t slot = kda_state_slot(p, n);
        kda_cpu_load_seq_state(p, n, job.h, job.S);
        /* non-finite contract: a non-finite column of the initial state is NaN (kda_cpu_load_state) and stays
           in its column; a chunk's poisoned row poisons from the end of that chunk (its own rows are NaN from
           the row on) */
        int poisoned = 0;
        int64_t nan_from = job.eos; /* tokens from here on are NaN without arithmetic */
        if (job.eos > job.bos) {
            job.nchunks = (job.eos - job.bos + KDA_CPU_CHUNK - 1) / KDA_CPU_CHUNK;
            atomic_store(&job.next_prep, 0);
            atomic_store(&job.stop, 0);
            for (int i = 0; i < KDA_CPU_RING; i++) atomic_store(&job.ready[i], -1);
            for (int r = 0; r < job.nslices; r++) atomic_store(&job.done[r], 0);
            kda_pool_run(ctx->pool, ctx->num_threads, task_flow, &job);
            const int64_t stop = atomic_load(&job.stop);
            if (stop) {
                poisoned = 1;
                nan_from = job.bos + stop * KDA_CPU_CHUNK;
                nan_from = nan_from < job.eos ? nan_from : job.eos;
            }
        }
        if (poisoned) {
            scratch_t s; /* thread 0's scratch: the pool is idle here */
            carve((float *)job.ws, K, V, &s);
            store_nan_rows(p, s.O, nan_from, job.eos, job.h);
            for (int64_t i = 0; i < (int64_t)K * V; i++) job.S[i] = NAN;
            if (job.rows) kda_cpu_store_chunk_states_from(p, job.row0, job.bos, nan_from, job.eos, job.h, job.S);
        }
        kda_cpu_store_state(p, slot, job.h, job.S);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Cross-rank context parallelism (docs/ALGORITHM.md §4a): a rank's summary per value head, from the chunks'
 * preps. The forward map of a part, X = [M | E] (K × (K + V), row stride K + V), starts from [I | 0] (or [0 | S0]
 * for a sequence that starts here, whose M columns stay 0 and are not computed) and takes each chunk's step on
 * its columns [j0, j0 + w), §3's state step with [0 | U] for U (M's columns read no v):
 *     D = [0 | U] − W X,   X ← Diag(γ) X + K̃ᵀ D
 * the same two products as chunk_recurrence, so E of a sequence that starts here is the forward's own final
 * state. The backward's dE walks the part's chunks last first with §6's state-gradient step:
 *     dΔ = Aqkᵀ dO + K̃ dS,   dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ
 * A chunk with a poisoned row makes the forward map NaN (as the state through it would be); the backward has no
 * non-finite contract of its own (§7) and walks the neutral rows.
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    const kda_problem_t *p;
    const kda_bwd_problem_t *bp; /* NULL: the forward's summary */
    double *out;
    char *ws;
    size_t per_thread;
} xjob_t;

/* Floats per thread beyond the chunk scratch: X (K × (K + V)), [0 | U] and D (C × (K + V)), dO (C × V), two K×V */
static size_t xcp_extra_floats(const kda_problem_t *p) {
    const size_t K = (size_t)p->a.head_dim_k, V = (size_t)p->a.head_dim_v, W = K + V, C = KDA_CPU_CHUNK;
    return ((K * W + 15) & ~(size_t)15) + 2 * ((C * W + 15) & ~(size_t)15) + ((C * V + 15) & ~(size_t)15) +
           2 * ((K * V + 15) & ~(size_t)15);
}

static size_t xcp_thread_bytes(const kda_problem_t *p) {
    return per_thread_bytes(p) + xcp_extra_floats(p) * sizeof(float);
}

/* X's columns [j0, j0 + w) through the chunks of tokens [t0, t1) of head h */
static void xcp_map(const kda_problem_t *p, scratch_t *s, float *X, int j0, int w, float *Ue, float *D, int64_t t0,
                    int64_t t1, int h) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, W = K + V;
    for (int64_t c0 = t0; c0 < t1; c0 += KDA_CPU_CHUNK) {
        const int c = t1 - c0 < KDA_CPU_CHUNK ? (int)(t1 - c0) : KDA_CPU_CHUNK;
        chunk_prep(p, s, &s->pr, c0, c, h, 0, 0, 0);
        if (s->pr.bad < c) {
            for (int64_t i = 0; i < (int64_t)K * W; i++) X[i] = NAN;
            return;
        }
        for (int i = 0; i < c; i++) {
            memset(Ue + (size_t)i * W, 0, sizeof(float) * (size_t)K);
            memcpy(Ue + (size_t)i * W + K, s->pr.U + (size_t)i * V, sizeof(float) * (size_t)V);
        }
        kda_gemm_ex(c, w, K, s->pr.W, K, 1, X + j0, W, D + j0, W, KDA_GEMM_SUB_FROM, Ue + j0, W, 0);
        kda_gemm_ex(K, w, c, s->pr.KT, KDA_CPU_CHUNK, 1, D + j0, W, X + j0, W, KDA_GEMM_SCALE_ADD, s->pr.gamma, 0, 0);
    }
}

/* dS (K×V) back through the chunks of tokens [t0, t1) of head h; dO, dD C×V and T K×V scratch */
static void xcp_adjoint(const kda_bwd_problem_t *bp, scratch_t *s, float *dS, float *dO, float *dD, float *T,
                        int64_t t0, int64_t t1, int h) {
    const kda_problem_t *p = &bp->f;
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads;
    const int64_t nc = (t1 - t0 + KDA_CPU_CHUNK - 1) / KDA_CPU_CHUNK;
    for (int64_t ci = nc - 1; ci >= 0; ci--) {
        const int64_t c0 = t0 + ci * KDA_CPU_CHUNK;
        const int c = t1 - c0 < KDA_CPU_CHUNK ? (int)(t1 - c0) : KDA_CPU_CHUNK;
        chunk_prep(p, s, &s->pr, c0, c, h, 0, 0, 0);
        for (int i = 0; i < c; i++)
            kda_load_row(dO + (size_t)i * V, bp->b.d_o, bp->b.d_o_dtype, ((c0 + i) * HV + h) * V, V);
        /* dΔ = Aqkᵀ dO + K̃ dS (Aqk lower with its diagonal: zeros above it) */
        kda_gemm_ex(c, V, c, s->pr.Aqk, 1, KDA_CPU_CHUNK, dO, V, dD, V, KDA_GEMM_SET, NULL, 0, 0);
        kda_gemm_ex(c, V, K, s->pr.KT, 1, KDA_CPU_CHUNK, dS, V, dD, V, KDA_GEMM_ADD, NULL, 0, 0);
        /* T = QΓᵀ dO − Wᵀ dΔ, then dS = Diag(γ) dS + T */
        kda_gemm_ex(K, V, c, s->pr.QG, 1, K, dO, V, T, V, KDA_GEMM_SET, NULL, 0, 0);
        kda_gemm_ex(K, V, c, s->pr.W, 1, K, dD, V, T, V, KDA_GEMM_SUB_FROM, T, V, 0);
        for (int i = 0; i < K; i++) {
            const float gm = s->pr.gamma[i];
            for (int j = 0; j < V; j++) dS[(size_t)i * V + j] = gm * dS[(size_t)i * V + j] + T[(size_t)i * V + j];
        }
    }
}

static void xcp_task(void *arg, int64_t item, int thread) {
    const xjob_t *job = (const xjob_t *)arg;
    const kda_problem_t *p = job->p;
    const kda_bwd_problem_t *bp = job->bp;
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, W = K + V, h = (int)item;
    const size_t C = KDA_CPU_CHUNK;
    scratch_t s;
    float *base = (float *)(job->ws + (size_t)thread * job->per_thread);
    float *X = base + carve(base, K, V, &s);
    float *Ue = X + (((size_t)K * W + 15) & ~(size_t)15), *D = Ue + ((C * W + 15) & ~(size_t)15);
    float *dO = D + ((C * W + 15) & ~(size_t)15), *S1 = dO + ((C * V + 15) & ~(size_t)15);
    float *S2 = S1 + (((size_t)K * V + 15) & ~(size_t)15);
    const int64_t n = bp ? 0 : p->num_seqs - 1;
    const int zero_m = bp ? kda_xcp_first_ends_here(p) : kda_xcp_last_starts_here(p);
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    memset(X, 0, sizeof(float) * (size_t)K * W);
    if (!zero_m)
        for (int i = 0; i < K; i++) X[(size_t)i * W + i] = 1.0f;
    if (!bp) { /* [M | E] of the last part; a sequence that starts here: [0 | its state], E's columns only */
        if (zero_m) {
            kda_cpu_load_seq_state(p, n, h, S1);
            for (int i = 0; i < K; i++) memcpy(X + (size_t)i * W + K, S1 + (size_t)i * V, sizeof(float) * (size_t)V);
        }
        xcp_map(p, &s, X, zero_m ? K : 0, zero_m ? V : W, Ue, D, bos, eos, h);
    } else { /* [Mᵀ | dE] of the first part: M's columns only, then dE from dS_out (d_final_state, or 0) */
        if (!zero_m) xcp_map(p, &s, X, 0, K, Ue, D, bos, eos, h);
        kda_cpu_load_head(p, zero_m ? bp->b.d_final_state : NULL, bp->b.d_final_state_dtype, kda_state_slot(p, n), h,
                          S1);
        xcp_adjoint(bp, &s, S1, dO, D, S2, bos, eos, h);
        for (int i = 0; i < K; i++) memcpy(X + (size_t)i * W + K, S1 + (size_t)i * V, sizeof(float) * (size_t)V);
    }
    double *o = job->out + (size_t)h * K * W;
    for (int i = 0; i < K; i++)
        for (int l = 0; l < W; l++)
            o[(size_t)i * W + l] = (double)(bp && l < K ? X[(size_t)l * W + i] : X[(size_t)i * W + l]);
}

static void xcp_run(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out, void *ws) {
    xjob_t job = {p, bp, out, (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), 0};
    job.per_thread = (xcp_thread_bytes(p) + 63) & ~(size_t)63;
    kda_pool_run(ctx->pool, p->a.num_v_heads, xcp_task, &job);
}

/* ---------------------------------------------------------------------------------------------------------
 * Entry points. This file is compiled once without a target level (the portable object) and once per x86-64
 * level of CMakeLists.txt's KDA_CPU_ISAS, with KDA_CPU_ISA = v4 or v3 and -march=x86-64-v4/-v3; the portable
 * object also holds the dispatcher, which picks the highest level built that the CPU runs (KDA_CPU_HAVE_V4 and
 * KDA_CPU_HAVE_V3 on the portable object say which were built): a property of the machine and the build, never
 * of a setting.
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_CAT2(a, b) a##_##b
#define KDA_CAT(a, b) KDA_CAT2(a, b)

void KDA_CAT(kda_cpu_chunk_run, KDA_CPU_ISA)(kda_context_t *ctx, const kda_problem_t *p, void *ws);
void KDA_CAT(kda_cpu_chunk_run, KDA_CPU_ISA)(kda_context_t *ctx, const kda_problem_t *p, void *ws) { run(ctx, p, ws); }
void KDA_CAT(kda_cpu_xcp_run, KDA_CPU_ISA)(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                           double *out, void *ws);
void KDA_CAT(kda_cpu_xcp_run, KDA_CPU_ISA)(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                           double *out, void *ws) {
    xcp_run(ctx, p, bp, out, ws);
}

#ifdef KDA_CPU_ISA_PORTABLE
#if KDA_CPU_HAVE_V4
void kda_cpu_chunk_run_v4(kda_context_t *ctx, const kda_problem_t *p, void *ws);
void kda_cpu_xcp_run_v4(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out, void *ws);
#endif
#if KDA_CPU_HAVE_V3
void kda_cpu_chunk_run_v3(kda_context_t *ctx, const kda_problem_t *p, void *ws);
void kda_cpu_xcp_run_v3(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out, void *ws);
#endif

/* The target level the chunked path runs at on this CPU: 4 or 3 (the highest level built that the CPU supports; a
 * v4 CPU runs the v3 object when only v3 is built), or 0 (the portable object). */
int kda_cpu_chunk_isa(void) {
#if KDA_CPU_HAVE_V4 || KDA_CPU_HAVE_V3
    const int cpu = kda_cpu_x86_level();
#endif
#if KDA_CPU_HAVE_V4
    if (cpu >= 4) return 4;
#endif
#if KDA_CPU_HAVE_V3
    if (cpu >= 3) return 3;
#endif
    return 0;
}

kda_status_t kda_cpu_chunk_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = workspace_bytes(ctx, p);
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_chunk_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes) {
    (void)ws_bytes;
    switch (kda_cpu_chunk_isa()) {
#if KDA_CPU_HAVE_V4
    case 4:
        kda_cpu_chunk_run_v4(ctx, p, ws);
        break;
#endif
#if KDA_CPU_HAVE_V3
    case 3:
        kda_cpu_chunk_run_v3(ctx, p, ws);
        break;
#endif
    default:
        kda_cpu_chunk_run_portable(ctx, p, ws);
        break;
    }
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_xcp_workspace(const kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                   size_t *bytes) {
    (void)bp;
    *bytes = (size_t)ctx->num_threads * ((xcp_thread_bytes(p) + 63) & ~(size_t)63) + 64;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_xcp_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out,
                                 void *ws, size_t ws_bytes) {
    (void)ws_bytes;
    switch (kda_cpu_chunk_isa()) {
#if KDA_CPU_HAVE_V4
    case 4:
        kda_cpu_xcp_run_v4(ctx, p, bp, out, ws);
        break;
#endif
#if KDA_CPU_HAVE_V3
    case 3:
        kda_cpu_xcp_run_v3(ctx, p, bp, out, ws);
        break;
#endif
    default:
        kda_cpu_xcp_run_portable(ctx, p, bp, out, ws);
        break;
    }
    return KDA_STATUS_SUCCESS;
}
#endif
