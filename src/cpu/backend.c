/*
 * The CPU backend: context start-up (its thread pool), state I/O shared by its two algorithms, and the
 * kda_backend_ops_t table (forward = chunked, decode = recurrent).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../internal.h"
#include "cpu.h"
#include "../dtype.h"
#include "threadpool.h"
#include "token.h"

/* The thread count of a new CPU context: KDA_NUM_THREADS when set (a whole number in [1, 1024], else
 * kda_create fails naming it: a setting the user made is never ignored silently), else one per core. */
kda_status_t kda_cpu_default_threads(int *num_threads) {
    const char *env = getenv("KDA_NUM_THREADS");
    if (env && *env) {
        char *end;
        errno = 0;
        long n = strtol(env, &end, 10);
        while (*end == ' ' || *end == '\t' || *end == '\n') end++;
        if (errno || *end || end == env || n < 1 || n > 1024)
            return kda_error(KDA_STATUS_INVALID_VALUE,
                             "kda_create: environment variable KDA_NUM_THREADS='%.64s' is not a number of threads "
                             "in [1, 1024] (unset it for one thread per core)",
                             env);
        *num_threads = (int)n;
        return KDA_STATUS_SUCCESS;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    *num_threads = n >= 1 ? (int)(n > 1024 ? 1024 : n) : 1;
    return KDA_STATUS_SUCCESS;
}

static void cpu_destroy(kda_context_t *ctx) {
    kda_pool_destroy(ctx->pool);
    ctx->pool = NULL;
}

kda_status_t kda_cpu_start(kda_context_t *ctx, int num_threads, const char *fn) {
    kda_threadpool_t *pool = kda_pool_create(num_threads);
    if (!pool) return kda_error(KDA_STATUS_ALLOC_FAILED, "%s: could not start %d CPU threads", fn, num_threads);
    cpu_destroy(ctx);
    ctx->pool = pool;
    ctx->num_threads = num_threads;
    return KDA_STATUS_SUCCESS;
}

void kda_cpu_load_state(const kda_problem_t *p, int64_t slot, int h, float *S) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    if (!a->initial_state || slot < 0) {
        memset(S, 0, sizeof(float) * (size_t)K * V);
        return;
    }
    const int64_t base = (slot * a->num_v_heads + h) * (int64_t)K * V;
    if (!a->state_v_first) {
        for (int i = 0; i < K; i++)
            kda_load_row(S + (size_t)i * V, a->initial_state, a->initial_state_dtype, base + (int64_t)i * V, V);
    } else {
        for (int j = 0; j < V; j++)
            for (int i = 0; i < K; i++)
                S[(size_t)i * V + j] =
                    kda_load_f32(a->initial_state, a->initial_state_dtype, base + (int64_t)j * K + i);
    }
    kda_cpu_poison_columns(S, K, V); /* the non-finite contract (docs/ALGORITHM.md §7): per value channel */
}

void kda_cpu_load_seq_state(const kda_problem_t *p, int64_t n, int h, float *S) {
    if (n == 0 && p->cp_state_in) { /* cross-rank CP: the fold of the earlier ranks' maps (xcp.c), fp64 */
        const int64_t KV = kda_state_head_elems(p);
        for (int64_t i = 0; i < KV; i++) S[i] = (float)p->cp_state_in[h * KV + i];
        kda_cpu_poison_columns(S, p->a.head_dim_k, p->a.head_dim_v);
        return;
    }
    kda_cpu_load_state(p, kda_state_slot(p, n), h, S);
}

void kda_cpu_load_head(const kda_problem_t *p, const void *src, kda_dtype_t dt, int64_t slot, int h, float *S) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    if (!src || slot < 0) {
        memset(S, 0, sizeof(float) * (size_t)K * V);
        return;
    }
    const int64_t base = (slot * a->num_v_heads + h) * (int64_t)K * V;
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++)
            S[(size_t)i * V + j] =
                kda_load_f32(src, dt, base + (a->state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j));
}

/* Columns [j0, j0 + w) of S (K×V K-major) into head h of row `row` of a state tensor (final_state or
 * chunk_states: [rows, HV, K, V], V-first [rows, HV, V, K]) of dtype dt. */
static void store_head(const kda_problem_t *p, void *dst, kda_dtype_t dt, int64_t row, int h, const float *S, int j0,
                       int w) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    const int64_t base = (row * a->num_v_heads + h) * (int64_t)K * V;
    if (!a->state_v_first) {
        for (int i = 0; i < K; i++) kda_store_row(dst, dt, base + (int64_t)i * V + j0, S + (size_t)i * V + j0, w);
    } else {
        for (int j = j0; j < j0 + w; j++)
            for (int i = 0; i < K; i++) kda_store_f32(dst, dt, base + (int64_t)j * K + i, S[(size_t)i * V + j]);
    }
}

void kda_cpu_store_state(const kda_problem_t *p, int64_t slot, int h, const float *S) {
    if (!p->a.final_state || slot < 0) return;
    store_head(p, p->a.final_state, p->a.final_state_dtype, slot, h, S, 0, p->a.head_dim_v);
}

void kda_cpu_store_chunk_state(const kda_problem_t *p, int64_t row, int h, const float *S, int j0, int w) {
    store_head(p, p->a.chunk_states, p->a.chunk_states_dtype, row, h, S, j0, w);
}

void kda_cpu_store_chunk_states_from(const kda_problem_t *p, int64_t row0, int64_t bos, int64_t t0, int64_t eos, int h,
                                     const float *S) {
    if (!p->a.chunk_states) return;
    for (int64_t c = (t0 - bos + KDA_CHUNK - 1) / KDA_CHUNK; bos + c * KDA_CHUNK < eos; c++)
        kda_cpu_store_chunk_state(p, row0 + c, h, S, 0, p->a.head_dim_v);
}

/* Headwise β (one β per value channel: a T = (I + A)⁻¹ per channel) and per-token state slots (2-D
 * state_indices) have no chunked form here: kda_forward takes the token recurrence for them. */
static int needs_recurrence(const kda_problem_t *p) {
    return p->a.beta_headwise || (p->a.state_indices && p->a.state_indices_cols > 0);
}

static kda_status_t cpu_forward_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    return needs_recurrence(p) ? kda_cpu_recurrent_workspace(ctx, p, bytes) : kda_cpu_chunk_workspace(ctx, p, bytes);
}

static kda_status_t cpu_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)stream;
    if (needs_recurrence(p)) return kda_cpu_recurrent_forward(ctx, p, ws, ws_bytes);
    return kda_cpu_chunk_forward(ctx, p, ws, ws_bytes);
}

static kda_status_t cpu_decode(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)stream;
    return kda_cpu_recurrent_forward(ctx, p, ws, ws_bytes);
}

const kda_backend_ops_t kda_cpu_ops = {
    .name = "cpu",
    .forward_workspace = cpu_forward_workspace,
    .forward = cpu_forward,
    .decode_workspace = kda_cpu_recurrent_workspace,
    .decode = cpu_decode,
    .supports = NULL,
    .destroy = cpu_destroy,
    .backward_workspace = kda_cpu_backward_workspace,
    .backward = kda_cpu_backward,
    .cp_summary_workspace = kda_cpu_xcp_workspace,
    .cp_summary = kda_cpu_xcp_summary,
};
