/*
 * Per-token inputs of the CPU paths (chunked and recurrent), in float: l2norm of q and k, the in-kernel gate and
 * β, as docs/ALGORITHM.md §2 defines them. Always inlined, so each target clone of a caller gets its own copy.
 */
#ifndef KDA_CPU_TOKEN_H
#define KDA_CPU_TOKEN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../internal.h"
#include "../dtype.h"
#include "fmath.h"

#ifndef KDA_INLINE
#define KDA_INLINE static inline __attribute__((always_inline))
#endif

/* x ← x / sqrt(Σ x² + eps) */
KDA_INLINE void kda_cpu_l2normalise(float *x, int n) {
    float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}; /* 8 lanes: one vector, not a serial chain */
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++) part[u] += x[i + u] * x[i + u];
    float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + (float)KDA_L2NORM_EPS);
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* The log decay of one token of value head h from its g row (in place); unchanged without the in-kernel gate. */
KDA_INLINE void kda_cpu_gate_row(const kda_problem_t *p, int h, float *g) {
    const kda_args_t *a = &p->a;
    if (!a->use_gate_in_kernel) return;
    const int K = a->head_dim_k;
    const float A = a->A_log ? expf(a->A_log[h]) : 1.0f;
    const float *bias = a->dt_bias ? a->dt_bias + (int64_t)h * K : NULL;
    if (bias) /* the branches outside the loops, which then vectorise */
        for (int i = 0; i < K; i++) g[i] += bias[i];
    if (p->has_lower_bound) {
        const float lb = a->lower_bound;
        int fin = 1; /* every e^{-A g} argument finite and ≤ 88 (NaN fails): kda_expf_fin gives kda_expf's bits */
        for (int i = 0; i < K; i++) fin &= A * g[i] >= -88.0f;
        if (fin)
            for (int i = 0; i < K; i++) g[i] = lb * (1.0f / (1.0f + kda_expf_fin(-(A * g[i]))));
        else
            for (int i = 0; i < K; i++) g[i] = lb * kda_sigmoidf(A * g[i]);
    } else {
        for (int i = 0; i < K; i++) g[i] = -A * kda_softplusf(g[i]);
    }
}

/* The non-finite input contract (docs/ALGORITHM.md, "Non-finite and out-of-range inputs"), step 1: each log
 * decay into [KDA_GATE_MIN, 0], positive or +inf -> 0, below KDA_GATE_MIN or -inf -> KDA_GATE_MIN; a NaN stays
 * NaN (both comparisons are false for it) and poisons the token. */
KDA_INLINE void kda_cpu_gate_clamp(float *g, int n) {
    for (int i = 0; i < n; i++) {
        const float x = g[i] < KDA_GATE_MIN ? KDA_GATE_MIN : g[i];
        g[i] = x > 0.0f ? 0.0f : x;
    }
}

/* 1 when every x[0..n) is finite (its exponent bits are not all ones): an integer OR, which vectorises. */
KDA_INLINE int kda_cpu_all_finite(const float *x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* Step 2 of the contract for the initial state, K×V (row i = key channel, column j = value channel j): a
 * column holding an inf or NaN is set to NaN whole, the other columns are left as they are. The recurrence
 * never mixes columns, so value channel j of o and of the final state is then NaN for every token, and the other
 * channels are computed as if column j were absent. */
KDA_INLINE void kda_cpu_poison_columns(float *S, int K, int V) {
    if (kda_cpu_all_finite(S, (int64_t)K * V)) return;
    unsigned char bad[KDA_MAX_HEAD_DIM] = {0};
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++) bad[j] |= !isfinite(S[(size_t)i * V + j]);
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++)
            if (bad[j]) S[(size_t)i * V + j] = NAN;
}

/* Step 2 of the contract: 1 when token t poisons its (sequence, value head): a non-finite q, k (after l2norm),
 * v, log decay (after the gate transform and the clamp) or β (after its sigmoid). */
KDA_INLINE int kda_cpu_token_poisons(const float *q, const float *k, const float *v, const float *gate, float beta,
                                     int K, int V) {
    return !(kda_cpu_all_finite(q, K) && kda_cpu_all_finite(k, K) && kda_cpu_all_finite(v, V) &&
             kda_cpu_all_finite(gate, K) && kda_cpu_all_finite(&beta, 1));
}

/* β of token t (a row of the flattened tensors), value head h. */
KDA_INLINE float kda_cpu_beta(const kda_problem_t *p, int64_t t, int h) {
    const kda_args_t *a = &p->a;
    float b = kda_load_f32(a->beta, a->beta_dtype, t * a->num_v_heads + h);
    if (a->use_beta_sigmoid) b = (a->allow_neg_eigval ? 2.0f : 1.0f) * kda_sigmoidf(b);
    return b;
}

#endif /* KDA_CPU_TOKEN_H */
