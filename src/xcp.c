/*
 * Context parallelism across ranks (docs/ALGORITHM.md §4a, docs/API.md §14): the summary entry points and the
 * folds, transport-free. A rank's summary is, per value head, X = [A | C] (K × (K + V)): the forward's [M | E] of
 * its last local sequence part (S_out = M S_in + E), the backward's [Mᵀ | dE] of its first (dS_in = Mᵀ dS_out + dE).
 * Both folds are the same product over a chain of gathered summaries:
 *     S ← 0;   S ← A_j S + C_j   for the chain's ranks j in order
 * (forward: j = r − c .. r − 1, giving the state entering the first local sequence; backward: j = r + c' down to
 * r + 1, giving ∂L/∂S at the end of the last). The first map of a chain has A = 0, so S needs no start of its own.
 * On the CPU backends the fold runs in fp64 on the host into the call's workspace, and the backend then reads it in
 * place of that sequence's initial state (kda_problem_t.cp_state_in) or d_final_state (cp_dstate_out); the CUDA
 * backend folds on the device within its own calls, and writes its summaries itself (src/cuda/xcp/).
 */
#include <string.h>

#include "internal.h"

/* ---------------------------------------------------------------------------------------------------------
 * The folds
 * ------------------------------------------------------------------------------------------------------- */
static double summary_elem(const void *s, kda_dtype_t dt, size_t i) {
    return dt == KDA_FLOAT64 ? ((const double *)s)[i] : (double)((const float *)s)[i];
}

static size_t head_state_doubles(const kda_problem_t *p) { return (size_t)kda_state_head_elems(p); }

/* out [HV, K, V] = the fold of `count` summaries of `sums`, ranks first, first + step, ...; tmp K×V */
static void fold(const kda_problem_t *p, const void *sums, int32_t first, int32_t count, int step, double *out,
                 double *tmp) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads, W = K + V;
    const kda_dtype_t dt = p->a.cp_summary_dtype;
    for (int h = 0; h < HV; h++) {
        double *S = out + (size_t)h * K * V;
        memset(S, 0, sizeof(double) * (size_t)K * V);
        for (int32_t m = 0; m < count; m++) {
            const size_t base = ((size_t)(first + m * step) * HV + h) * (size_t)K * W;
            for (int i = 0; i < K; i++) {
                const size_t row = base + (size_t)i * W;
                for (int j = 0; j < V; j++) tmp[i * V + j] = summary_elem(sums, dt, row + K + j);
                for (int l = 0; m > 0 && l < K; l++) { /* the chain's first map (A = 0) starts from S = 0 */
                    const double x = summary_elem(sums, dt, row + l);
                    for (int j = 0; j < V; j++) tmp[i * V + j] += x * S[l * V + j];
                }
            }
            memcpy(S, tmp, sizeof(double) * (size_t)K * V);
        }
    }
}

size_t kda_xcp_forward_extra(const kda_context_t *ctx, const kda_problem_t *p) {
    if (!kda_xcp_folds_forward(p) || ctx->ops->cp_device_summary) return 0;
    return ((size_t)p->a.num_v_heads + 1) * head_state_doubles(p) * sizeof(double) + 64;
}

void kda_xcp_fold_forward(kda_problem_t *p, void *mem) {
    double *out = (double *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    double *tmp = out + (size_t)p->a.num_v_heads * head_state_doubles(p);
    fold(p, p->a.cp_summaries, p->a.cp_rank - p->a.cp_pre_ranks, p->a.cp_pre_ranks, 1, out, tmp);
    p->cp_state_in = out;
}

size_t kda_xcp_backward_extra(const kda_context_t *ctx, const kda_bwd_problem_t *bp) {
    const int n = kda_xcp_folds_forward(&bp->f) + kda_xcp_folds_backward(&bp->f);
    if (!n || ctx->ops->cp_device_summary) return 0;
    return ((size_t)n * bp->f.a.num_v_heads + 1) * head_state_doubles(&bp->f) * sizeof(double) + 64;
}

void kda_xcp_fold_backward(kda_bwd_problem_t *bp, void *mem) {
    kda_problem_t *p = &bp->f;
    const size_t hs = (size_t)p->a.num_v_heads * head_state_doubles(p);
    const int nf = kda_xcp_folds_forward(p), nb = kda_xcp_folds_backward(p);
    double *base = (double *)(((uintptr_t)mem + 63) & ~(uintptr_t)63), *tmp = base + (size_t)(nf + nb) * hs;
    if (nf) {
        fold(p, p->a.cp_summaries, p->a.cp_rank - p->a.cp_pre_ranks, p->a.cp_pre_ranks, 1, base, tmp);
        p->cp_state_in = base;
    }
    if (nb) {
        double *out = base + (size_t)nf * hs;
        fold(p, bp->b.cp_summaries, p->a.cp_rank + p->a.cp_post_ranks, p->a.cp_post_ranks, -1, out, tmp);
        bp->cp_dstate_out = out;
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The summary entry points
 * ------------------------------------------------------------------------------------------------------- */
/* The checks every summary call makes on a checked problem, then the backend's workspace (plus the fp64 summary) */
static kda_status_t summary_prepare(const kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                    const char *fn, size_t *need) {
    if (p->a.cp_num_ranks == 0)
        return kda_error(KDA_STATUS_INVALID_VALUE,
                         "%s: argument 'cp_num_ranks': 0 (no split across ranks): set "
                         "cp_num_ranks, cp_rank and the chain counts first",
                         fn);
    if (!ctx->ops->cp_summary && !ctx->ops->cp_device_summary)
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: the %s backend has no cross-rank CP summaries yet (use the "
                         "cpu or reference backend)",
                         fn, kda_backend_name(ctx->backend));
    if (ctx->ops->supports) {
        const kda_status_t st = ctx->ops->supports(ctx, p, fn);
        if (st != KDA_STATUS_SUCCESS) return st;
    }
    size_t b = 0;
    if (ctx->ops->cp_device_summary) return ctx->ops->cp_device_summary_workspace(ctx, p, bp, need);
    if (p->num_seqs > 0) {
        const kda_status_t st = ctx->ops->cp_summary_workspace(ctx, p, bp, &b);
        if (st != KDA_STATUS_SUCCESS) return st;
    }
    *need = b +
            (size_t)p->a.num_v_heads * (size_t)p->a.head_dim_k * ((size_t)p->a.head_dim_k + p->a.head_dim_v) *
                sizeof(double) +
            64;
    return KDA_STATUS_SUCCESS;
}

/* The summary buffer: present, large enough, and not over an input the call reads */
static kda_status_t check_summary_out(const kda_problem_t *p, const kda_bwd_problem_t *bp, const void *summary,
                                      size_t bytes, const char *fn) {
    if (!summary) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'summary': NULL", fn);
    const size_t need = kda_xcp_summary_bytes(p);
    if (bytes < need)
        return kda_error(KDA_STATUS_INVALID_VALUE,
                         "%s: argument 'summary_bytes': %zu bytes given, %zu needed "
                         "(kda_cp_summary_size)",
                         fn, bytes, need);
    return kda_check_not_read(fn, p, bp ? &bp->b : NULL, "summary", summary, need);
}

/* Run the backend's summary into the workspace's fp64 block, then store it in the summary's dtype. A rank with no
 * sequence passes any chain through: the identity map. */
static kda_status_t summary_run(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, void *summary,
                                void *ws, size_t need, void *stream) {
    if (ctx->ops->cp_device_summary) return ctx->ops->cp_device_summary(ctx, p, bp, summary, ws, need, stream);
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads, W = K + V;
    const size_t n = (size_t)HV * K * W;
    double *out = (double *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    if (p->num_seqs > 0) {
        const size_t own = need - n * sizeof(double) - 64;
        const kda_status_t st = ctx->ops->cp_summary(ctx, p, bp, out, (char *)out + n * sizeof(double), own);
        if (st != KDA_STATUS_SUCCESS) return st;
    } else {
        memset(out, 0, n * sizeof(double));
        for (int h = 0; h < HV; h++)
            for (int i = 0; i < K; i++) out[((size_t)h * K + i) * W + i] = 1.0;
    }
    if (p->a.cp_summary_dtype == KDA_FLOAT64) memcpy(summary, out, n * sizeof(double));
    else
        for (size_t i = 0; i < n; i++) ((float *)summary)[i] = (float)out[i];
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cp_summary_size(const kda_context_t *ctx, const kda_args_t *args, size_t *bytes) {
    const char *fn = "kda_cp_summary_size";
    if (!bytes) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'summary_bytes': NULL", fn);
    kda_status_t st = kda_ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_problem_t p;
    st = kda_check_args(ctx, args, fn, ctx->backend != KDA_BACKEND_CUDA, &p);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_xcp(fn, &p, KDA_XCP_SUMMARY);
    kda_ctx_leave(ctx);
    if (st == KDA_STATUS_SUCCESS) *bytes = kda_xcp_summary_bytes(&p);
    return st;
}

static kda_status_t forward_prepare(const kda_context_t *ctx, const kda_args_t *args, const char *fn, kda_problem_t *p,
                                    size_t *need) {
    kda_status_t st = kda_check_args(ctx, args, fn, ctx->backend != KDA_BACKEND_CUDA, p);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_xcp(fn, p, KDA_XCP_SUMMARY);
    if (st == KDA_STATUS_SUCCESS) st = summary_prepare(ctx, p, NULL, fn, need);
    return st;
}

kda_status_t kda_cp_forward_summary_workspace_size(const kda_context_t *ctx, const kda_args_t *args, size_t *bytes) {
    const char *fn = "kda_cp_forward_summary_workspace_size";
    if (!bytes) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'workspace_bytes': NULL", fn);
    kda_status_t st = kda_ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_problem_t p;
    size_t need = 0;
    st = forward_prepare(ctx, args, fn, &p, &need);
    kda_ctx_leave(ctx);
    if (st == KDA_STATUS_SUCCESS) *bytes = need;
    return st;
}

kda_status_t kda_cp_forward_summary(kda_context_t *ctx, const kda_args_t *args, void *summary, size_t summary_bytes,
                                    void *workspace, size_t workspace_bytes, void *stream) {
    const char *fn = "kda_cp_forward_summary";
    kda_status_t st = kda_ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_problem_t p;
    size_t need = 0;
    st = forward_prepare(ctx, args, fn, &p, &need);
    if (st == KDA_STATUS_SUCCESS) st = check_summary_out(&p, NULL, summary, summary_bytes, fn);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_workspace(fn, workspace, workspace_bytes, need);
    if (st == KDA_STATUS_SUCCESS) st = summary_run(ctx, &p, NULL, summary, workspace, need, stream);
    kda_ctx_leave(ctx);
    return st;
}

static kda_status_t backward_prepare(const kda_context_t *ctx, const kda_backward_args_t *args, const char *fn,
                                     kda_bwd_problem_t *bp, size_t *need) {
    kda_status_t st = kda_check_backward_args(ctx, args, fn, ctx->backend != KDA_BACKEND_CUDA, bp);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_xcp(fn, &bp->f, KDA_XCP_SUMMARY);
    if (st == KDA_STATUS_SUCCESS) st = summary_prepare(ctx, &bp->f, bp, fn, need);
    return st;
}

kda_status_t kda_cp_backward_summary_workspace_size(const kda_context_t *ctx, const kda_backward_args_t *args,
                                                    size_t *bytes) {
    const char *fn = "kda_cp_backward_summary_workspace_size";
    if (!bytes) return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument 'workspace_bytes': NULL", fn);
    kda_status_t st = kda_ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_bwd_problem_t bp;
    size_t need = 0;
    st = backward_prepare(ctx, args, fn, &bp, &need);
    kda_ctx_leave(ctx);
    if (st == KDA_STATUS_SUCCESS) *bytes = need;
    return st;
}

kda_status_t kda_cp_backward_summary(kda_context_t *ctx, const kda_backward_args_t *args, void *summary,
                                     size_t summary_bytes, void *workspace, size_t workspace_bytes, void *stream) {
    const char *fn = "kda_cp_backward_summary";
    kda_status_t st = kda_ctx_enter(ctx, fn);
    if (st != KDA_STATUS_SUCCESS) return st;
    kda_bwd_problem_t bp;
    size_t need = 0;
    st = backward_prepare(ctx, args, fn, &bp, &need);
    if (st == KDA_STATUS_SUCCESS) st = check_summary_out(&bp.f, &bp, summary, summary_bytes, fn);
    if (st == KDA_STATUS_SUCCESS) st = kda_check_workspace(fn, workspace, workspace_bytes, need);
    if (st == KDA_STATUS_SUCCESS) st = summary_run(ctx, &bp.f, &bp, summary, workspace, need, stream);
    kda_ctx_leave(ctx);
    return st;
}
