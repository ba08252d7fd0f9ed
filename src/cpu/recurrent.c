/*
 * CPU recurrent path (kda_decode): the token-by-token recurrence of the oracle in float32, one
 * (sequence, value head) per task, for the few tokens per sequence of a decode step. The state may be a pool
 * updated in place (state_indices): each task reads its slot before it writes it, and slots are distinct.
 *
 * Per token, with S K×V (K-major):  S ← Diag(e^{gate}) S;  δ = β ⊙ (v − Sᵀk);  S ← S + k δᵀ;  o = scale Sᵀq,
 * gate clamped into [KDA_GATE_MIN, 0] (NaN kept), β a scalar or (beta_headwise) a V-vector. Slots as the oracle
 * (reference.c): 2-D state_indices write the state after every token to its own slot. A non-finite input of a
 * token turns S into NaN from that token on; a non-finite element in column j of the initial state makes
 * column j NaN (kda_cpu_load_state), which the recurrence keeps in column j (the non-finite contract).
 */
#include <math.h>
#include <string.h>

#include "../internal.h"
#include "cpu.h"
#include "../dtype.h"
#include "fmath.h"
#include "gemm.h"
#include "threadpool.h"
#include "token.h"

/* Scratch per thread: S (K*V), and q, k, gate, v, δ, β of up to 256 each. */
static size_t per_thread_bytes(const kda_problem_t *p) {
    return ((size_t)kda_state_head_elems(p) + 6 * 256) * sizeof(float);
}

static int finite_row(const float *x, int n) {
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= isfinite(x[i]) != 0;
    return ok;
}

KDA_CPU_CLONES
static void recurrent_head(const kda_problem_t *p, int64_t n, int h, float *S) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
    float *q = S + (size_t)K * V, *k = q + 256, *gate = k + 256, *v = gate + 256, *d = v + 256, *beta = d + 256;
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n);
    const int per_token_slots = a->state_indices && a->state_indices_cols > 0;
    const int nb = a->beta_headwise ? V : 1;
    const float bscale = a->allow_neg_eigval ? 2.0f : 1.0f;

    kda_cpu_load_state(p, slot, h, S); /* a column (value channel) with an inf or NaN is NaN whole now */
    int poisoned = 0;
    for (int64_t t = bos; t < eos; t++) {
        kda_load_row(q, a->q, a->dtype, (t * HQK + hq) * K, K);
        kda_load_row(k, a->k, a->dtype, (t * HQK + hq) * K, K);
        kda_load_row(gate, a->g, a->g_dtype, (t * HV + h) * K, K);
        kda_cpu_gate_row(p, h, gate);
        for (int i = 0; i < K; i++) { /* clamp into [KDA_GATE_MIN, 0]; NaN stays NaN */
            if (gate[i] > 0.0f) gate[i] = 0.0f;
            if (gate[i] < KDA_GATE_MIN) gate[i] = KDA_GATE_MIN;
        }
        kda_load_row(v, a->v, a->dtype, (t * HV + h) * V, V);
        kda_load_row(beta, a->beta, a->beta_dtype, (t * HV + h) * nb, nb);
        if (a->use_beta_sigmoid)
            for (int j = 0; j < nb; j++) beta[j] = bscale * kda_sigmoidf(beta[j]);
        if (!(finite_row(q, K) & finite_row(k, K) & finite_row(gate, K) & finite_row(v, V) & finite_row(beta, nb)))
            poisoned = 1;
        if (poisoned) {
            for (size_t i = 0; i < (size_t)K * V; i++) S[i] = NAN;
        } else if (a->use_qk_l2norm) {
            kda_cpu_l2normalise(q, K);
            kda_cpu_l2normalise(k, K);
        }

        /* decay, and Sᵀk on the decayed state, in one pass over S */
        for (int j = 0; j < V; j++) d[j] = 0.0f;
        for (int i = 0; i < K; i++) {
            float *row = S + (size_t)i * V;
            const float alpha = kda_expf(gate[i]), ki = k[i];
            for (int j = 0; j < V; j++) {
                row[j] *= alpha;
                d[j] += ki * row[j];
            }
        }
        if (a->beta_headwise)
            for (int j = 0; j < V; j++) d[j] = beta[j] * (v[j] - d[j]);
        else
            for (int j = 0; j < V; j++) d[j] = beta[0] * (v[j] - d[j]);
        /* S += k δᵀ and o = Sᵀ q in one pass */
        for (int j = 0; j < V; j++) v[j] = 0.0f;
        for (int i = 0; i < K; i++) {
            float *row = S + (size_t)i * V;
            const float ki = k[i], qi = q[i];
            for (int j = 0; j < V; j++) {
                row[j] += ki * d[j];
                v[j] += qi * row[j];
            }
        }
        for (int j = 0; j < V; j++) v[j] *= p->scale;
        kda_store_row(a->o, a->o_dtype, (t * HV + h) * V, v, V);
        /* speculative decoding: the state after every token to that token's slot */
        if (per_token_slots) kda_cpu_store_state(p, kda_state_slot_after(p, n, t - bos), h, S);
    }
    if (!per_token_slots) kda_cpu_store_state(p, slot, h, S);
}

typedef struct {
    const kda_problem_t *p;
    char *ws;
    size_t per_thread;
} job_t;

static void recurrent_task(void *arg, int64_t item, int thread) {
    const job_t *job = (const job_t *)arg;
    const int HV = job->p->a.num_v_heads;
    recurrent_head(job->p, item / HV, (int)(item % HV), (float *)(job->ws + (size_t)thread * job->per_thread));
}

kda_status_t kda_cpu_recurrent_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = (size_t)ctx->num_threads * per_thread_bytes(p) + 64;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_recurrent_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes) {
    (void)ws_bytes;
    job_t job = {p, (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), per_thread_bytes(p)};
    kda_pool_run(ctx->pool, p->num_seqs * p->a.num_v_heads, recurrent_task, &job);
    return KDA_STATUS_SUCCESS;
}
