/*
 * The oracle: KDA straight from its definition, in float64, one token at a time, one thread.
 *
 * For each sequence and value head h (query/key head h / G), with S a K×V matrix:
 *     q, k  <- l2norm(q), l2norm(k)                   if use_qk_l2norm
 *     gate  <- g, or the in-kernel gate of g           (docs/ALGORITHM.md, "Gate modes")
 *     gate  <- min(max(gate, KDA_GATE_MIN), 0)          (NaN stays NaN)
 *     β     <- beta, sigmoid(beta) or 2 sigmoid(beta)   (a scalar, or a V-vector with beta_headwise)
 *     S     <- Diag(exp(gate)) S                       decay
 *     δ     <- β ⊙ (v − Sᵀ k)                          delta-rule correction, a V-vector
 *     S     <- S + k δᵀ                                i.e. S_t = (I − β k kᵀ) Diag(α) S_{t−1} + β k vᵀ
 *     o     <- scale · Sᵀ q
 * State slots: read from kda_state_slot (1-D state_indices, or 2-D: the slot of the last accepted token);
 * written after the last token (1-D), or after every token t to state_indices[n][t] (2-D).
 * chunk_states (kda_forward): S before tokens 0, 64, 128, ... of each sequence, into the sequence's rows.
 * Non-finite inputs (docs/ALGORITHM.md §7, the contract): a non-finite q, k, v, gate (after the clamp) or β of
 * token t sets S to NaN before token t, so o_t, every later output and the final state are NaN while earlier
 * outputs are untouched. A non-finite element in column j of the initial state (value channel j) sets that
 * column to NaN before the first token: channel j of every output and of the final state is NaN, and the other
 * channels, which never read column j, are as without it.
 * Readable over fast: every other backend is checked against this file.
 */
#include <math.h>
#include <string.h>

#include "../internal.h"
#include "reference.h"
#include "../dtype.h"
#include "reference_cp.h"

/* Scratch: S (K*V), double (the per-token vectors, up to 256 each, live on the stack). */
static size_t ref_workspace(const kda_problem_t *p) { return (size_t)kda_state_head_elems(p) * sizeof(double); }

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

/* S (K×V, K-major) into head h of row `row` of a state tensor (final_state's slot, or a chunk_states row) */
static void store_head(const kda_problem_t *p, void *dst, kda_dtype_t dt, int64_t row, int h, const double *S) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++) kda_store_f32(dst, dt, state_index(p, row, h, i, j), (float)S[i * V + j]);
}

static void store_state(const kda_problem_t *p, int64_t slot, int h, const double *S) {
    if (!p->a.final_state || slot < 0) return;
    store_head(p, p->a.final_state, p->a.final_state_dtype, slot, h, S);
}

static int all_finite(const double *x, int n) {
    for (int i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

void kda_reference_poison_columns(double *S, int K, int V) {
    for (int j = 0; j < V; j++) {
        int bad = 0;
        for (int i = 0; i < K; i++) bad |= !isfinite(S[i * V + j]);
        if (bad)
            for (int i = 0; i < K; i++) S[i * V + j] = NAN;
    }
}

/* The initial state of value head h of sequence n into S (K×V, K-major): its slot's, or zeros; a column with a
 * non-finite element is NaN whole (value channel j poisoned from the first token). */
void kda_ref_initial_state(const kda_problem_t *p, int64_t n, int h, double *S) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    const int64_t slot = kda_state_slot(p, n);
    if (n == 0 && p->cp_state_in) { /* cross-rank CP: the fold of the earlier ranks' maps (xcp.c) */
        memcpy(S, p->cp_state_in + (size_t)h * K * V, sizeof(double) * (size_t)K * V);
    } else if (a->initial_state && slot >= 0) {
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++)
                S[i * V + j] = kda_load_f32(a->initial_state, a->initial_state_dtype, state_index(p, slot, h, i, j));
    } else {
        memset(S, 0, sizeof(double) * (size_t)K * V);
    }
    kda_reference_poison_columns(S, K, V);
}

/* Token t's inputs for value head h, as the oracle uses them: q, k (l2-normalised with use_qk_l2norm), v, the log
 * decay (the in-kernel gate, then the clamp into [KDA_GATE_MIN, 0]) and β (after its sigmoid; V of them with
 * beta_headwise). Returns 1 when the token poisons its (sequence, head): a non-finite q, k, v, gate or β. */
int kda_ref_token(const kda_problem_t *p, int64_t t, int h, double *q, double *k, double *v, double *gate,
                  double *beta) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
    const double A = a->A_log ? exp((double)a->A_log[h]) : 1.0;
    load_vec(q, a->q, a->dtype, (t * HQK + hq) * K, K, 0);
    load_vec(k, a->k, a->dtype, (t * HQK + hq) * K, K, 0);
    load_vec(v, a->v, a->dtype, (t * HV + h) * V, V, 0);
    load_vec(gate, a->g, a->g_dtype, (t * HV + h) * K, K, 0);
    if (a->use_gate_in_kernel) {
        for (int i = 0; i < K; i++) {
            double x = gate[i] + (a->dt_bias ? (double)a->dt_bias[h * K + i] : 0.0);
            gate[i] = p->has_lower_bound ? (double)a->lower_bound * kda_sigmoid(A * x) : -A * kda_softplus(x);
        }
    }
    for (int i = 0; i < K; i++) { /* clamp into [KDA_GATE_MIN, 0]; NaN stays NaN */
        if (gate[i] > 0.0) gate[i] = 0.0;
        if (gate[i] < (double)KDA_GATE_MIN) gate[i] = (double)KDA_GATE_MIN;
    }
    const int nb = a->beta_headwise ? V : 1;
    for (int j = 0; j < nb; j++) {
        double b = (double)kda_load_f32(a->beta, a->beta_dtype, (t * HV + h) * nb + j);
        if (a->use_beta_sigmoid) b = (a->allow_neg_eigval ? 2.0 : 1.0) * kda_sigmoid(b);
        beta[j] = b;
    }
    if (!all_finite(q, K) || !all_finite(k, K) || !all_finite(v, V) || !all_finite(gate, K) || !all_finite(beta, nb))
        return 1;
    if (a->use_qk_l2norm) {
        load_vec(q, a->q, a->dtype, (t * HQK + hq) * K, K, 1);
        load_vec(k, a->k, a->dtype, (t * HQK + hq) * K, K, 1);
    }
    return 0;
}

/* Sequence n, value head h, tokens [bos, t_end): S ends as the state after token t_end − 1. `write`: store o of
 * each token and the final state(s), as kda_forward does, and with chunk_states the state before each chunk
 * into rows row0, row0 + 1, ...; else S is the only result (kda_ref_state_at). */
static void ref_run(const kda_problem_t *p, int64_t n, int h, int64_t t_end, double *S, int write, int64_t row0) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HV = a->num_v_heads;
    double q[256], k[256], v[256], gate[256], d[256], beta[256];
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n);
    const int per_token_slots = a->state_indices && a->state_indices_cols > 0;

    /* S <- initial state, or zeros; a column with a non-finite element is NaN (the non-finite contract) */
    kda_ref_initial_state(p, n, h, S);
    int poisoned = 0;

    for (int64_t t = bos; t < t_end; t++) {
        if (write && a->chunk_states && (t - bos) % KDA_CHUNK == 0) /* the state before this chunk's tokens */
            store_head(p, a->chunk_states, a->chunk_states_dtype, row0 + (t - bos) / KDA_CHUNK, h, S);
        if (kda_ref_token(p, t, h, q, k, v, gate, beta)) poisoned = 1;
        if (poisoned)
            for (int i = 0; i < K * V; i++) S[i] = NAN;

        /* S <- Diag(exp(gate)) S */
        for (int i = 0; i < K; i++) {
            double alpha = exp(gate[i]);
            for (int j = 0; j < V; j++) S[i * V + j] *= alpha;
        }
        /* δ = β (v − Sᵀ k) */
        for (int j = 0; j < V; j++) d[j] = 0.0;
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) d[j] += k[i] * S[i * V + j];
        for (int j = 0; j < V; j++) d[j] = beta[a->beta_headwise ? j : 0] * (v[j] - d[j]);
        /* S <- S + k δᵀ */
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) S[i * V + j] += k[i] * d[j];
        if (!write) continue;
        /* o = scale Sᵀ q */
        for (int j = 0; j < V; j++) v[j] = 0.0;
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) v[j] += q[i] * S[i * V + j];
        for (int j = 0; j < V; j++)
            kda_store_f32(a->o, a->o_dtype, (t * HV + h) * V + j, (float)((double)p->scale * v[j]));
        /* speculative decoding: the state after every token to that token's slot */
        if (per_token_slots) store_state(p, kda_state_slot_after(p, n, t - bos), h, S);
    }

    if (write && !per_token_slots) store_state(p, slot, h, S);
}

void kda_ref_state_at(const kda_problem_t *p, int64_t n, int h, int64_t t_end, double *S) {
    ref_run(p, n, h, t_end, S, 0, 0);
}

static kda_status_t ref_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ctx;
    (void)ws_bytes;
    (void)stream;
    double *S = (double *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    int64_t row0 = 0; /* chunk_states: the first row of sequence n */
    for (int64_t n = 0; n < p->num_seqs; n++) {
        int64_t bos, eos;
        kda_seq_bounds(p, n, &bos, &eos);
        for (int h = 0; h < p->a.num_v_heads; h++) ref_run(p, n, h, eos, S, 1, row0);
        row0 += (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK;
    }
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
    .cp_summary_workspace = kda_ref_xcp_summary_workspace,
    .cp_summary = kda_ref_xcp_summary,
};
