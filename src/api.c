/*
 * The public entry points: version, status text, contexts, and the dispatch of kda_forward /
 * kda_decode to the context's backend after the shared validation (validate.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---------------------------------------------------------------------------------------------------------
 * Version, status, errors
 * ------------------------------------------------------------------------------------------------------- */
int kda_version(void) { return KDA_VERSION; }

const char *kda_status_string(kda_status_t status) {
    switch (status) {
    case KDA_STATUS_SUCCESS:
        return "KDA_STATUS_SUCCESS";
    case KDA_STATUS_INVALID_VALUE:
        return "KDA_STATUS_INVALID_VALUE";
    case KDA_STATUS_NOT_SUPPORTED:
        return "KDA_STATUS_NOT_SUPPORTED";
    case KDA_STATUS_INSUFFICIENT_WORKSPACE:
        return "KDA_STATUS_INSUFFICIENT_WORKSPACE";
    case KDA_STATUS_ALLOC_FAILED:
        return "KDA_STATUS_ALLOC_FAILED";
    case KDA_STATUS_BACKEND_ERROR:
        return "KDA_STATUS_BACKEND_ERROR";
    case KDA_STATUS_INTERNAL_ERROR:
        return "KDA_STATUS_INTERNAL_ERROR";
    case KDA_STATUS_CONTEXT_IN_USE:
        return "KDA_STATUS_CONTEXT_IN_USE";
    }
    return "KDA_STATUS_UNKNOWN";
}

size_t kda_dtype_size(kda_dtype_t dtype) {
    switch (dtype) {
    case KDA_FLOAT32:
        return 4;
    case KDA_FLOAT16:
        return 2;
    case KDA_BFLOAT16:
        return 2;
    case KDA_INT32:
        return 4;
    case KDA_INT64:
        return 8;
    case KDA_FLOAT64:
        return 8;
    }
    return 0;
}

const char *kda_backend_name(kda_backend_t backend) {
    switch (backend) {
    case KDA_BACKEND_AUTO:
        return "auto";
    case KDA_BACKEND_CPU:
        return "cpu";
    case KDA_BACKEND_REFERENCE:
        return "reference";
    case KDA_BACKEND_CUDA:
        return "cuda";
    }
    return "unknown";
}

/* ---------------------------------------------------------------------------------------------------------
 * Contexts
 *
 * A context's in_use counter: every call that reads the context's backend state (the CPU pool and thread
 * count: the calls, their workspace queries, kda_forward_saved_size) holds 1 for its duration, so calls may
 * share a context; kda_set_num_threads and kda_destroy take it from 0 to -1, alone, and answer
 * KDA_STATUS_CONTEXT_IN_USE (changing nothing) when a call runs, as does a call that starts while they hold it.
 * ------------------------------------------------------------------------------------------------------- */
static kda_status_t ctx_enter(const kda_context_t *ctx, const char *fn) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'ctx': NULL", fn);
    int *in_use = (int *)&ctx->in_use; /* kda_create allocates contexts writable */
    int v = __atomic_load_n(in_use, __ATOMIC_ACQUIRE);
    do {
        if (v < 0)
            return kda_error(KDA_STATUS_CONTEXT_IN_USE,
                             "%s: the context is in use: another thread is running "
                             "kda_set_num_threads or kda_destroy on it",
                             fn);
    } while (!__atomic_compare_exchange_n(in_use, &v, v + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return KDA_STATUS_SUCCESS;
}

static void ctx_leave(const kda_context_t *ctx) { __atomic_fetch_sub((int *)&ctx->in_use, 1, __ATOMIC_RELEASE); }

kda_status_t kda_ctx_enter(const kda_context_t *ctx, const char *fn) { return ctx_enter(ctx, fn); }
void kda_ctx_leave(const kda_context_t *ctx) { ctx_leave(ctx); }

/* The context alone (kda_set_num_threads, kda_destroy), or CONTEXT_IN_USE while any call runs on it. */
static kda_status_t ctx_claim(kda_context_t *ctx, const char *fn) {
    int v = 0;
    if (!__atomic_compare_exchange_n(&ctx->in_use, &v, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return kda_error(KDA_STATUS_CONTEXT_IN_USE,
                         "%s: the context is in use: %s on another thread; call it "
                         "when no other call runs on the context",
                         fn, v > 0 ? "a call is running on it" : "kda_set_num_threads or kda_destroy is running");
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cpu_default_threads(int *num_threads);
kda_status_t kda_cpu_start(kda_context_t *ctx, int num_threads, const char *fn);

kda_status_t kda_create(kda_context_t **ctx, kda_backend_t backend, int device) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "kda_create: argument 'ctx': NULL");
    if (backend != KDA_BACKEND_AUTO && backend != KDA_BACKEND_CPU && backend != KDA_BACKEND_REFERENCE &&
        backend != KDA_BACKEND_CUDA)
        return kda_error(KDA_STATUS_INVALID_VALUE, "kda_create: argument 'backend': %d is not a kda_backend_t",
                         (int)backend);
    if ((backend == KDA_BACKEND_CUDA || backend == KDA_BACKEND_AUTO) && device < 0)
        return kda_error(KDA_STATUS_INVALID_VALUE, "kda_create: argument 'device': %d is negative", device);

    kda_context_t *c = (kda_context_t *)calloc(1, sizeof *c);
    if (!c) return kda_error(KDA_STATUS_ALLOC_FAILED, "kda_create: out of host memory");
    c->device = device;

    kda_status_t st = KDA_STATUS_SUCCESS;
    if (backend == KDA_BACKEND_CUDA || backend == KDA_BACKEND_AUTO) {
        st = kda_cuda_init(c, device);
        if (st == KDA_STATUS_SUCCESS) {
            c->backend = KDA_BACKEND_CUDA;
            c->ops = &kda_cuda_ops;
        } else if (backend == KDA_BACKEND_AUTO) {
            backend = KDA_BACKEND_CPU; /* no usable GPU: the CPU is the default */
            st = KDA_STATUS_SUCCESS;
        }
    }
    if (st == KDA_STATUS_SUCCESS && backend == KDA_BACKEND_CPU) {
        c->backend = KDA_BACKEND_CPU;
        c->ops = &kda_cpu_ops;
        int n = 1;
        st = kda_cpu_default_threads(&n);
        if (st == KDA_STATUS_SUCCESS) st = kda_cpu_start(c, n, "kda_create");
    } else if (st == KDA_STATUS_SUCCESS && backend == KDA_BACKEND_REFERENCE) {
        c->backend = KDA_BACKEND_REFERENCE;
        c->ops = &kda_reference_ops;
        c->num_threads = 1;
    }
    if (st != KDA_STATUS_SUCCESS) {
        if (c->ops && c->ops->destroy) c->ops->destroy(c);
        free(c);
        return st; /* the message was set by the backend */
    }
    *ctx = c;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_destroy(kda_context_t *ctx) {
    if (!ctx) return KDA_STATUS_SUCCESS;
    const kda_status_t st = ctx_claim(ctx, "kda_destroy");
    if (st != KDA_STATUS_SUCCESS) return st;
    if (ctx->ops && ctx->ops->destroy) ctx->ops->destroy(ctx);
    free(ctx);
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_get_backend(const kda_context_t *ctx, kda_backend_t *backend) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "kda_get_backend: argument 'ctx': NULL");
    if (!backend) return kda_error(KDA_STATUS_INVALID_VALUE, "kda_get_backend: argument 'backend': NULL");
    *backend = ctx->backend;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_set_num_threads(kda_context_t *ctx, int num_threads) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "kda_set_num_threads: argument 'ctx': NULL");
    if (ctx->backend != KDA_BACKEND_CPU)
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "kda_set_num_threads: the %s backend has no thread count",
                         kda_backend_name(ctx->backend));
    if (num_threads < 1 || num_threads > 1024)
        return kda_error(KDA_STATUS_INVALID_VALUE,
                         "kda_set_num_threads: argument 'num_threads': %d is outside [1, 1024]", num_threads);
    kda_status_t st = ctx_claim(ctx, "kda_set_num_threads");
    if (st != KDA_STATUS_SUCCESS) return st;
    st = kda_cpu_start(ctx, num_threads, "kda_set_num_threads");
    __atomic_store_n(&ctx->in_use, 0, __ATOMIC_RELEASE);
    return st;
}

void kda_set_tuning(kda_context_t *ctx, const kda_tuning_t *tuning) {
    if (ctx) {
        if (tuning) ctx->tuning = *tuning;
        else memset(&ctx->tuning, 0, sizeof ctx->tuning);
    }
}

kda_status_t kda_get_num_threads(const kda_context_t *ctx, int *num_threads) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "kda_get_num_threads: argument 'ctx': NULL");
    if (!num_threads) return kda_error(KDA_STATUS_INVALID_VALUE, "kda_get_num_threads: argument 'num_threads': NULL");
    *num_threads = ctx->num_threads;
    return KDA_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * Arguments and dispatch
 * ------------------------------------------------------------------------------------------------------- */
void kda_args_init_sized(kda_args_t *args, size_t struct_size) {
    if (!args || struct_size < sizeof(size_t)) return;
    kda_args_t d;
    (kda_args_init)(&d);
    memset(args, 0, struct_size);
    memcpy(args, &d, struct_size < sizeof d ? struct_size : sizeof d);
    args->struct_size = struct_size;
}

void(kda_args_init)(kda_args_t *args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->struct_size = sizeof *args;
    args->batch = 1;
    args->seq_len = 0;
    args->num_qk_heads = 1;
    args->num_v_heads = 1;
    args->head_dim_k = 128;
    args->head_dim_v = 128;
    args->cu_seqlens_dtype = KDA_INT32;
    args->dtype = KDA_BFLOAT16;
    args->g_dtype = KDA_BFLOAT16;
    args->beta_dtype = KDA_BFLOAT16;
    args->o_dtype = KDA_BFLOAT16;
    args->initial_state_dtype = KDA_FLOAT32;
    args->final_state_dtype = KDA_FLOAT32;
    args->chunk_states_dtype = KDA_FLOAT32;
}

kda_status_t kda_check_workspace(const char *fn, const void *ws, size_t ws_bytes, size_t need) {
    if (ws_bytes < need)
        return kda_error(KDA_STATUS_INSUFFICIENT_WORKSPACE,
                         "%s: argument 'workspace_bytes': %zu bytes given, %zu needed", fn, ws_bytes, need);
    if (need > 0 && !ws) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'workspace': NULL", fn);
    return KDA_STATUS_SUCCESS;
}

typedef enum { ALGO_FORWARD, ALGO_DECODE } algo_t;

/* Everything a call does before the backend runs: context, arguments, backend support, workspace size. */
static kda_status_t prepare(const kda_context_t *ctx, const kda_args_t *args, algo_t algo, const char *fn,
                            kda_problem_t *p, size_t *need) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'ctx': NULL", fn);
    kda_status_t st = kda_check_args(ctx, args, fn, ctx->backend != KDA_BACKEND_CUDA, p);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_xcp(fn, p, algo == ALGO_DECODE ? KDA_XCP_DECODE : KDA_XCP_FOLD);
    if (st != KDA_STATUS_SUCCESS) return st;
    if (kda_xcp_forward_extra(ctx, p) && !ctx->ops->cp_summary)
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'cp_pre_ranks': the %s backend cannot fold "
                         "cross-rank CP summaries yet (use the cpu or reference backend)",
                         fn, kda_backend_name(ctx->backend));
    if (ctx->ops->supports) {
        st = ctx->ops->supports(ctx, p, fn);
        if (st != KDA_STATUS_SUCCESS) return st;
    }
    st = algo == ALGO_FORWARD ? ctx->ops->forward_workspace(ctx, p, need) : ctx->ops->decode_workspace(ctx, p, need);
    if (st == KDA_STATUS_SUCCESS && algo == ALGO_FORWARD) *need += kda_xcp_forward_extra(ctx, p);
    return st;
}

/* Bytes the backend keeps at saved for this (checked, supported) problem */
static kda_status_t saved_need(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = 0;
    return ctx->ops->saved_size ? ctx->ops->saved_size(ctx, p, bytes) : KDA_STATUS_SUCCESS;
}

/* saved, when set, holds what the backend keeps */
static kda_status_t check_saved(const kda_context_t *ctx, const kda_problem_t *p, const char *fn) {
    if (!p->a.saved) return KDA_STATUS_SUCCESS;
    size_t need = 0;
    const kda_status_t st = saved_need(ctx, p, &need);
    if (st != KDA_STATUS_SUCCESS) return st;
    if (p->a.saved_bytes < need)
        return kda_error(KDA_STATUS_INSUFFICIENT_WORKSPACE,
                         "%s: argument 'saved_bytes': %zu bytes given, %zu needed "
                         "(kda_forward_saved_size)",
                         fn, p->a.saved_bytes, need);
    return KDA_STATUS_SUCCESS;
}

static kda_status_t workspace_size(const kda_context_t *ctx, const kda_args_t *args, size_t *bytes, algo_t algo,
                                   const char *fn) {
    if (!bytes) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'workspace_bytes': NULL", fn);
    kda_status_t st = ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_problem_t p;
    size_t need = 0;
    st = prepare(ctx, args, algo, fn, &p, &need);
    ctx_leave(ctx);
    if (st == KDA_STATUS_SUCCESS) *bytes = need;
    return st;
}

static kda_status_t run(kda_context_t *ctx, const kda_args_t *args, void *ws, size_t ws_bytes, void *stream,
                        algo_t algo, const char *fn) {
    kda_problem_t p;
    size_t need = 0;
    kda_status_t st = prepare(ctx, args, algo, fn, &p, &need);
    if (st == KDA_STATUS_SUCCESS) st = check_saved(ctx, &p, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    if ((st = kda_check_workspace(fn, ws, ws_bytes, need)) != KDA_STATUS_SUCCESS) return st;
    if (p.num_tokens == 0 && !p.a.final_state) return KDA_STATUS_SUCCESS; /* nothing to write */
    if (algo == ALGO_FORWARD && kda_xcp_forward_extra(ctx, &p))
        kda_xcp_fold_forward(&p, (char *)ws + need - kda_xcp_forward_extra(ctx, &p));
    return algo == ALGO_FORWARD ? ctx->ops->forward(ctx, &p, ws, ws_bytes, stream)
                                : ctx->ops->decode(ctx, &p, ws, ws_bytes, stream);
}

kda_status_t kda_forward_workspace_size(const kda_context_t *ctx, const kda_args_t *args, size_t *bytes) {
    return workspace_size(ctx, args, bytes, ALGO_FORWARD, "kda_forward_workspace_size");
}

kda_status_t kda_forward_saved_size(const kda_context_t *ctx, const kda_args_t *args, size_t *bytes) {
    const char *fn = "kda_forward_saved_size";
    if (!bytes) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'saved_bytes': NULL", fn);
    kda_status_t st = ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_problem_t p;
    size_t need = 0, ws = 0;
    st = prepare(ctx, args, ALGO_FORWARD, fn, &p, &ws);
    if (st == KDA_STATUS_SUCCESS) st = saved_need(ctx, &p, &need);
    ctx_leave(ctx);
    if (st == KDA_STATUS_SUCCESS) *bytes = need;
    return st;
}

/* run, holding the context for the call */
static kda_status_t run_held(kda_context_t *ctx, const kda_args_t *args, void *ws, size_t ws_bytes, void *stream,
                             algo_t algo, const char *fn) {
    kda_status_t st = ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    st = run(ctx, args, ws, ws_bytes, stream, algo, fn);
    ctx_leave(ctx);
    return st;
}

kda_status_t kda_forward(kda_context_t *ctx, const kda_args_t *args, void *workspace, size_t workspace_bytes,
                         void *stream) {
    return run_held(ctx, args, workspace, workspace_bytes, stream, ALGO_FORWARD, "kda_forward");
}

kda_status_t kda_decode_workspace_size(const kda_context_t *ctx, const kda_args_t *args, size_t *bytes) {
    return workspace_size(ctx, args, bytes, ALGO_DECODE, "kda_decode_workspace_size");
}

kda_status_t kda_decode(kda_context_t *ctx, const kda_args_t *args, void *workspace, size_t workspace_bytes,
                        void *stream) {
    return run_held(ctx, args, workspace, workspace_bytes, stream, ALGO_DECODE, "kda_decode");
}

/* ---------------------------------------------------------------------------------------------------------
 * The training backward
 * ------------------------------------------------------------------------------------------------------- */
void kda_backward_args_init_sized(kda_backward_args_t *args, size_t struct_size) {
    if (!args || struct_size < sizeof(size_t)) return;
    kda_backward_args_t d;
    (kda_backward_args_init)(&d);
    memset(args, 0, struct_size);
    memcpy(args, &d, struct_size < sizeof d ? struct_size : sizeof d);
    args->struct_size = struct_size;
}

void(kda_backward_args_init)(kda_backward_args_t *args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->struct_size = sizeof *args;
    args->d_o_dtype = KDA_BFLOAT16;
    args->d_final_state_dtype = KDA_FLOAT32;
    args->dq_dtype = args->dk_dtype = args->dv_dtype = args->dg_dtype = args->dbeta_dtype = KDA_BFLOAT16;
    args->d_initial_state_dtype = KDA_FLOAT32;
}

static kda_status_t prepare_backward(const kda_context_t *ctx, const kda_backward_args_t *args, const char *fn,
                                     kda_bwd_problem_t *p, size_t *need) {
    if (!ctx) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'ctx': NULL", fn);
    if (!ctx->ops->backward)
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: the %s backend has no backward yet (use the cpu or "
                         "reference backend)",
                         fn, kda_backend_name(ctx->backend));
    kda_status_t st = kda_check_backward_args(ctx, args, fn, ctx->backend != KDA_BACKEND_CUDA, p);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_xcp(fn, &p->f, KDA_XCP_FOLD);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_xcp_backward(fn, p);
    if (st != KDA_STATUS_SUCCESS) return st;
    if (kda_xcp_backward_extra(ctx, p) && !ctx->ops->cp_summary)
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'cp_num_ranks': the %s backend cannot fold "
                         "cross-rank CP summaries yet (use the cpu or reference backend)",
                         fn, kda_backend_name(ctx->backend));
    if (ctx->ops->supports) {
        st = ctx->ops->supports(ctx, &p->f, fn);
        if (st != KDA_STATUS_SUCCESS) return st;
    }
    st = check_saved(ctx, &p->f, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    st = ctx->ops->backward_workspace(ctx, p, need);
    if (st == KDA_STATUS_SUCCESS) *need += kda_xcp_backward_extra(ctx, p);
    return st;
}

kda_status_t kda_backward_workspace_size(const kda_context_t *ctx, const kda_backward_args_t *args, size_t *bytes) {
    const char *fn = "kda_backward_workspace_size";
    if (!bytes) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'workspace_bytes': NULL", fn);
    kda_status_t st = ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_bwd_problem_t p;
    size_t need = 0;
    st = prepare_backward(ctx, args, fn, &p, &need);
    ctx_leave(ctx);
    if (st == KDA_STATUS_SUCCESS) *bytes = need;
    return st;
}

static kda_status_t backward(kda_context_t *ctx, const kda_backward_args_t *args, void *workspace,
                             size_t workspace_bytes, void *stream, const char *fn) {
    kda_bwd_problem_t p;
    size_t need = 0;
    kda_status_t st = prepare_backward(ctx, args, fn, &p, &need);
    if (st != KDA_STATUS_SUCCESS) return st;
    if ((st = kda_check_workspace(fn, workspace, workspace_bytes, need)) != KDA_STATUS_SUCCESS) return st;
    if (kda_xcp_backward_extra(ctx, &p))
        kda_xcp_fold_backward(&p, (char *)workspace + need - kda_xcp_backward_extra(ctx, &p));
    return ctx->ops->backward(ctx, &p, workspace, workspace_bytes, stream);
}

kda_status_t kda_backward(kda_context_t *ctx, const kda_backward_args_t *args, void *workspace, size_t workspace_bytes,
                          void *stream) {
    const char *fn = "kda_backward";
    kda_status_t st = ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    st = backward(ctx, args, workspace, workspace_bytes, stream, fn);
    ctx_leave(ctx);
    return st;
}
