/*
 * The oracle: KDA straight from its definition, in float64, one token at a time, one thread.
 *
 * For each sequence and value head h (query/key head h / G), with S a K×V matrix:
 *     q, k  <- l2norm(q), l2norm(k)                   if use_qk_l2norm
 *     gate  <- g, or the in-kernel gate of g           (docs/ALGORITHM.md, "Gate modes")
 *     β     <- beta, sigmoid(beta) or 2 sigmoid(beta)
 *     S     <- Diag(exp(gate)) S                       decay
 *     δ     <- β (v − Sᵀ k)                            delta-rule correction, a V-vector
 *     S     <- S + k δᵀ                                i.e. S_t = (I − β k kᵀ) Diag(α) S_{t−1} + β k vᵀ
 *     o     <- scale · Sᵀ q
 * Readable over fast: every other backend is checked against this file.
 */
#include <math.h>
#include <string.h>

#include "../internal.h"
#include "cpu.h"
#include "dtype.h"
#include "fmath.h"

/* Scratch: S (K*V) and five vectors of up to 256, all double. */
static size_t ref_workspace(const kda_problem_t *p) {
    return ((size_t)kda_state_head_elems(p) + 5 * 256) * sizeof(double);
}

static kda_status_t ref_forward_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    (void)ctx;
    *bytes = ref_workspace(p) + 64;
    return KDA_STATUS_SUCCESS;
}

/* State element (i, j) of head (slot, h): i indexes K, j indexes V, in either layout. */
static int64_t state_index(const kda_problem_t *p, int64_t slot, int h, int i, int j) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    int64_t base = (slot * p->a.num_v_heads + h) * (int64_t)K * V;
    return base + (p->a.state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j);
}

/* Load a row of n elements as double, optionally l2-normalised. */
static void load_vec(double *x, const void *src, kda_dtype_t dt, int64_t off, int n, int l2norm) {
    for (int i = 0; i < n; i++) x[i] = (double)kda_load_f32(src, dt, off + i);
    if (l2norm) {
        double ss = 0.0;
        for (int i = 0; i < n; i++) ss += x[i] * x[i];
        double r = 1.0 / sqrt(ss + KDA_L2NORM_EPS);
        for (int i = 0; i < n; i++) x[i] *= r;
    }
}

static void ref_head(const kda_problem_t *p, int64_t n, int h, double *S, double *q, double *k, double *gate,
                     double *v, double *d) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n);

    /* S <- initial state, or zeros */
    if (a->initial_state && slot >= 0) {
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++)
                S[i * V + j] = kda_load_f32(a->initial_state, a->initial_state_dtype, state_index(p, slot, h, i, j));
    } else {
        memset(S, 0, sizeof(double) * (size_t)K * V);
    }

    const double A = a->A_log ? exp((double)a->A_log[h]) : 1.0;
    for (int64_t t = bos; t < eos; t++) {
        load_vec(q, a->q, a->dtype, (t * HQK + hq) * K, K, a->use_qk_l2norm);
        load_vec(k, a->k, a->dtype, (t * HQK + hq) * K, K, a->use_qk_l2norm);
        load_vec(v, a->v, a->dtype, (t * HV + h) * V, V, 0);
        load_vec(gate, a->g, a->g_dtype, (t * HV + h) * K, K, 0);
        if (a->use_gate_in_kernel) {
            for (int i = 0; i < K; i++) {
                double x = gate[i] + (a->dt_bias ? (double)a->dt_bias[h * K + i] : 0.0);
                gate[i] = p->has_lower_bound ? (double)a->lower_bound * kda_sigmoid(A * x) : -A * kda_softplus(x);
            }
        }
        double beta = (double)kda_load_f32(a->beta, a->beta_dtype, t * HV + h);
        if (a->use_beta_sigmoid) beta = (a->allow_neg_eigval ? 2.0 : 1.0) * kda_sigmoid(beta);

        /* S <- Diag(exp(gate)) S */
        for (int i = 0; i < K; i++) {
            double alpha = exp(gate[i]);
            for (int j = 0; j < V; j++) S[i * V + j] *= alpha;
        }
        /* δ = β (v − Sᵀ k) */
        for (int j = 0; j < V; j++) d[j] = 0.0;
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) d[j] += k[i] * S[i * V + j];
        for (int j = 0; j < V; j++) d[j] = beta * (v[j] - d[j]);
        /* S <- S + k δᵀ */
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) S[i * V + j] += k[i] * d[j];
        /* o = scale Sᵀ q */
        for (int j = 0; j < V; j++) v[j] = 0.0;
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) v[j] += q[i] * S[i * V + j];
        for (int j = 0; j < V; j++)
            kda_store_f32(a->o, a->o_dtype, (t * HV + h) * V + j, (float)((double)p->scale * v[j]));
    }

    if (a->final_state && slot >= 0) {
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++)
                kda_store_f32(a->final_state, a->final_state_dtype, state_index(p, slot, h, i, j),
                              (float)S[i * V + j]);
    }
}

static kda_status_t ref_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes,
                                void *stream) {
    (void)ctx;
    (void)ws_bytes;
    (void)stream;
    double *S = (double *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    double *vecs = S + kda_state_head_elems(p);
    for (int64_t n = 0; n < p->num_seqs; n++)
        for (int h = 0; h < p->a.num_v_heads; h++)
            ref_head(p, n, h, S, vecs, vecs + 256, vecs + 512, vecs + 768, vecs + 1024);
    return KDA_STATUS_SUCCESS;
}

const kda_backend_ops_t kda_reference_ops = {
    .name = "reference",
    .forward_workspace = ref_forward_workspace,
    .forward = ref_forward,
    .decode_workspace = ref_forward_workspace,
    .decode = ref_forward,
    .supports = NULL,
    .destroy = NULL,
    .backward_workspace = kda_reference_backward_workspace,
    .backward = kda_reference_backward,
};
