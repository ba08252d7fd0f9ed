/*
 * Context parallelism across ranks on the CUDA backend, host side (xcp.h; docs/ALGORITHM.md §4a). The folds are
 * one small kernel each, before the forward's or backward's own launches. A summary is made of the backend's own
 * passes over one sequence, so that it has the forward's arithmetic and every option the forward has:
 *   forward  [M | E] of the last local sequence n = N − 1:  E = its final state from its initial state when it
 *            starts here (M = 0), else from zero; M = the final state from the identity (HV × K × K) with v = 0
 *   backward [Mᵀ | dE] of the first, n = 0:  dE = its d_initial_state from its d_final_state when it ends here
 *            (M = 0), else from zero (dE does not depend on the state coming in: the state-gradient chain never
 *            reads S); M as above, placed transposed
 * Each pass runs on the problem restricted to that sequence (one_sequence): varlen offsets from sequence n on,
 * or the pointers moved to row n. A pooled state the pass needs (state_indices) is first copied from its slot
 * into a dense buffer, since the slot's number lies on the device.
 */
#include <string.h>

#include "decode.h"
#include "xcp.h"

static size_t head_states(const kda_problem_t *p) { return (size_t)p->a.num_v_heads * kda_state_head_elems(p); }

/* ---------------------------------------------------------------------------------------------------------
 * The folds
 * ------------------------------------------------------------------------------------------------------- */
size_t kda_cuda_xcp_fold_bytes(const kda_problem_t *p, int backward) {
    const int n = kda_xcp_folds_forward(p) + (backward && kda_xcp_folds_backward(p));
    return n ? 256 + (size_t)n * align256(head_states(p) * sizeof(float)) : 0;
}

void kda_cuda_xcp_fold_places(const kda_problem_t *p, unsigned char *mem, float **fwd, float **bwd) {
    unsigned char *base = (unsigned char *)(((uintptr_t)mem + 255) & ~(uintptr_t)255);
    *fwd = kda_xcp_folds_forward(p) ? (float *)base : NULL;
    if (bwd)
        *bwd =
            kda_xcp_folds_backward(p) ? (float *)(base + (*fwd ? align256(head_states(p) * sizeof(float)) : 0)) : NULL;
}

int kda_cuda_xcp_fold(const kda_problem_t *p, const kda_backward_args_t *b, float *fwd, float *bwd, void *stream) {
    const kda_args_t *a = &p->a;
    int err = 0;
    if (fwd)
        err = kda_xcp_launch_fold((const float *)a->cp_summaries, a->cp_rank - a->cp_pre_ranks, a->cp_pre_ranks, 1,
                                  a->num_v_heads, a->head_dim_k, a->head_dim_v, fwd, stream);
    if (!err && bwd)
        err = kda_xcp_launch_fold((const float *)b->cp_summaries, a->cp_rank + a->cp_post_ranks, a->cp_post_ranks, -1,
                                  a->num_v_heads, a->head_dim_k, a->head_dim_v, bwd, stream);
    return err;
}

/* ---------------------------------------------------------------------------------------------------------
 * The primed path
 * ------------------------------------------------------------------------------------------------------- */
int64_t kda_cuda_xcp_primed_pieces(const cuda_impl_t *impl, const kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (a->cp_num_ranks <= 0 || a->cp_primed != 1 || p->num_seqs != 1 || a->saved || a->chunk_states ||
        kda_cuda_decode_fits(p, 0))
        return 0;
    /* K, V of 64 or 128 and K-first states: where the GPU tests have run the path (tests/gpu/test_xcp_cuda.c);
       padded or 256-wide heads and V-first states compute in full */
    const int K = a->head_dim_k, V = a->head_dim_v;
    if ((K != 64 && K != 128) || (V != 64 && V != 128) || a->state_v_first) return 0;
    kda_cp_problem_t cp;
    if (!kda_cp_problem_from(p, impl->sm_count, a->cu_seqlens_host, &cp)) return 0; /* lengths on the device */
    const int64_t P = kda_cp_piece_chunks(&cp), np = kda_cp_seq_slots(cp.max_chunks, P);
    const kda_cp_capacity_t cap = kda_cp_capacity(&cp, 1);
    return np >= 2 && np <= cap.slots ? np : 0; /* the device's plan is this one: it fits its capacity */
}

size_t kda_cuda_xcp_prefix_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    const int64_t np = kda_cuda_xcp_primed_pieces(impl, p);
    const size_t kc = (size_t)kda_cuda_size_class(p->a.head_dim_k), vc = (size_t)kda_cuda_size_class(p->a.head_dim_v);
    return np ? 256 + align256((size_t)np * (size_t)p->a.num_v_heads * kc * (kc + vc) * 4) : 0;
}

uint64_t kda_cuda_xcp_primed_key(const kda_problem_t *p, const void *ws) {
    kda_args_t a = p->a; /* what the forward writes or reads only after the gather may differ between the calls */
    a.o = a.final_state = NULL;
    a.o_dtype = a.final_state_dtype = (kda_dtype_t)0;
    a.cp_summaries = NULL;
    a.cp_summaries_bytes = 0;
    uint64_t h = 1469598103934665603ull; /* FNV-1a over the arguments' bytes and the workspace's address */
    const unsigned char *b = (const unsigned char *)&a;
    for (size_t i = 0; i < sizeof a; i++) h = (h ^ b[i]) * 1099511628211ull;
    const uintptr_t w = (uintptr_t)ws;
    for (size_t i = 0; i < sizeof w; i++) h = (h ^ (unsigned char)(w >> (8 * i))) * 1099511628211ull;
    return h ? h : 1;
}

/* ---------------------------------------------------------------------------------------------------------
 * The summaries' passes
 * ------------------------------------------------------------------------------------------------------- */
/* p restricted to sequence n: the same rows (varlen: offsets from n on) or row n's pointers; no split, no saved
 * blocks, chunk states or states (the caller sets what the pass reads and writes) */
static void one_sequence(const kda_problem_t *p, int64_t n, kda_problem_t *q) {
    *q = *p;
    kda_args_t *a = &q->a;
    q->num_seqs = 1;
    if (p->varlen) {
        const size_t es = kda_dtype_size(a->cu_seqlens_dtype);
        a->cu_seqlens = (const char *)a->cu_seqlens + n * es;
        a->cu_seqlens_host = a->cu_seqlens_host ? (const char *)a->cu_seqlens_host + n * es : NULL;
        a->num_seqs = 1;
    } else {
        const int64_t row = n * a->seq_len, HQK = a->num_qk_heads, HV = a->num_v_heads, K = a->head_dim_k;
        const size_t es = kda_dtype_size(a->dtype);
        a->q = (const char *)a->q + (size_t)(row * HQK * K) * es;
        a->k = (const char *)a->k + (size_t)(row * HQK * K) * es;
        a->v = (const char *)a->v + (size_t)(row * HV * a->head_dim_v) * es;
        a->g = (const char *)a->g + (size_t)(row * HV * K) * kda_dtype_size(a->g_dtype);
        a->beta = (const char *)a->beta + (size_t)(row * HV) * kda_dtype_size(a->beta_dtype);
        a->batch = 1;
        q->num_tokens = a->seq_len;
    }
    a->initial_state = a->final_state = a->chunk_states = a->saved = NULL;
    a->saved_bytes = 0;
    a->state_indices = NULL;
    a->num_state_slots = 0;
    a->cp_num_ranks = a->cp_rank = a->cp_pre_ranks = a->cp_post_ranks = 0;
    a->cp_summaries = NULL;
    a->cp_summaries_bytes = 0;
    q->cp_state_in = NULL;
    q->idx_stride = 0;
}

/* The map pass: the problem with v = 0 of K columns, from the identity, M into `out` (K-major fp32) */
static void map_problem(const kda_problem_t *p, int64_t n, kda_problem_t *q) {
    one_sequence(p, n, q);
    kda_args_t *a = &q->a;
    a->head_dim_v = a->head_dim_k;
    a->state_v_first = 0;
    a->initial_state_dtype = a->final_state_dtype = KDA_FLOAT32;
    q->bwd = 0;
}

/* A summary call's workspace: the passes' own (the largest, they run one after another), then the buffers */
typedef struct {
    size_t run, out, zero_v, ident, map, part, gather, grads, total;
} xcp_ws_t;

/* The backward pass's per-token gradients (dq, dk, dv, dg, dβ in the caller's dtypes), discarded, in scratch at
 * g: their places into b (NULL: none), and their bytes */
static size_t grad_places(const kda_bwd_problem_t *bp, int64_t rows, unsigned char *g, kda_backward_args_t *b) {
    const kda_args_t *a = &bp->f.a;
    const kda_backward_args_t *s = &bp->b;
    const int64_t HQK = a->num_qk_heads, HV = a->num_v_heads, K = a->head_dim_k, V = a->head_dim_v;
    const size_t bytes[5] = {
        (size_t)(rows * HQK * K) * kda_dtype_size(s->dq_dtype), (size_t)(rows * HQK * K) * kda_dtype_size(s->dk_dtype),
        (size_t)(rows * HV * V) * kda_dtype_size(s->dv_dtype), (size_t)(rows * HV * K) * kda_dtype_size(s->dg_dtype),
        (size_t)(rows * HV) * kda_dtype_size(s->dbeta_dtype)};
    void **out[5] = {b ? &b->dq : NULL, b ? &b->dk : NULL, b ? &b->dv : NULL, b ? &b->dg : NULL, b ? &b->dbeta : NULL};
    size_t off = 0;
    for (int i = 0; i < 5; i++) {
        if (b) *out[i] = g + off;
        off += align256(bytes[i]);
    }
    return off;
}

/* The backward pass's problem: the first sequence alone, no fold, no d_initial_state, dA_log or ddt_bias yet */
static void one_sequence_bwd(const kda_bwd_problem_t *bp, kda_bwd_problem_t *d) {
    *d = *bp;
    one_sequence(&bp->f, 0, &d->f);
    d->b.problem = &d->f.a;
    d->b.d_initial_state = NULL;
    d->b.dA_log = d->b.ddt_bias = NULL;
    d->b.cp_summaries = NULL;
    d->b.cp_summaries_bytes = 0;
    d->cp_dstate_out = NULL;
}

/* Whether the summary has an M to compute (else its M is zero), and the sequence it summarises */
static int needs_map(const kda_problem_t *p, const kda_bwd_problem_t *bp) {
    return bp ? !kda_xcp_first_ends_here(p) : !kda_xcp_last_starts_here(p);
}
static int64_t summary_seq(const kda_problem_t *p, const kda_bwd_problem_t *bp) { return bp ? 0 : p->num_seqs - 1; }

/* The pooled state the pass starts from (forward: the initial state; backward: d_final_state) needs a dense copy */
static int needs_gather(const kda_problem_t *p, const kda_bwd_problem_t *bp) {
    if (!p->a.state_indices) return 0;
    return bp ? kda_xcp_first_ends_here(p) && bp->b.d_final_state : kda_xcp_last_starts_here(p) && p->a.initial_state;
}

static kda_status_t ws_layout(const kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                              xcp_ws_t *w) {
    memset(w, 0, sizeof *w);
    if (p->num_seqs == 0) return KDA_STATUS_SUCCESS; /* the identity map: no pass */
    const int64_t n = summary_seq(p, bp), K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads;
    kda_problem_t q;
    one_sequence(p, n, &q);
    const int64_t rows = q.num_tokens;
    size_t run = 0, b = 0;
    kda_status_t st;
    if (bp) {
        kda_bwd_problem_t d;
        one_sequence_bwd(bp, &d);
        st = ctx->ops->backward_workspace(ctx, &d, &run);
    } else {
        st = ctx->ops->forward_workspace(ctx, &q, &run);
    }
    if (st != KDA_STATUS_SUCCESS) return st;
    const int map = needs_map(p, bp);
    if (map) {
        kda_problem_t m;
        map_problem(p, n, &m);
        if ((st = ctx->ops->forward_workspace(ctx, &m, &b)) != KDA_STATUS_SUCCESS) return st;
        run = b > run ? b : run;
    }
    const size_t es_h = kda_dtype_size(bp ? bp->b.d_final_state_dtype : p->a.initial_state_dtype);
    w->run = align256(run);
    w->out = w->run;
    w->zero_v = w->out + align256((size_t)(rows * HV * (K > V ? K : V)) * kda_dtype_size(p->a.o_dtype));
    w->ident = w->zero_v + (map ? align256((size_t)(rows * HV * K) * kda_dtype_size(p->a.dtype)) : 0);
    w->map = w->ident + (map ? align256((size_t)(HV * K * K) * 4) : 0);
    w->part = w->map + (map ? align256((size_t)(HV * K * K) * 4) : 0);
    w->gather = w->part + align256((size_t)(HV * K * V) * 4);
    w->grads = w->gather + (needs_gather(p, bp) ? align256((size_t)(HV * K * V) * es_h) : 0);
    w->total = 256 + w->grads + (bp ? grad_places(bp, rows, NULL, NULL) : 0);
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_cuda_xcp_summary_workspace(const kda_context_t *ctx, const kda_problem_t *p,
                                            const kda_bwd_problem_t *bp, size_t *bytes) {
    xcp_ws_t w;
    const kda_status_t st = ws_layout(ctx, p, bp, &w);
    if (st == KDA_STATUS_SUCCESS) *bytes = w.total;
    return st;
}

/* The map pass: M of sequence n into base + w->map (K-major) */
static kda_status_t run_map(kda_context_t *ctx, const kda_problem_t *p, int64_t n, const xcp_ws_t *w,
                            unsigned char *base, void *stream) {
    kda_problem_t m;
    map_problem(p, n, &m);
    const int HV = p->a.num_v_heads, K = p->a.head_dim_k;
    float *ident = (float *)(base + w->ident);
    int err = (int)cudaMemsetAsync(base + w->zero_v, 0, w->ident - w->zero_v, (cudaStream_t)stream);
    if (!err) err = (int)cudaMemsetAsync(ident, 0, (size_t)HV * K * K * 4, (cudaStream_t)stream);
    if (!err) err = kda_xcp_launch_identity(ident, HV, K, K, stream);
    if (err)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "kda_cp_summary: the identity state: %s",
                         cudaGetErrorString((cudaError_t)err));
    m.a.v = base + w->zero_v;
    m.a.o = base + w->out;
    m.a.initial_state = ident;
    m.a.final_state = base + w->map;
    return ctx->ops->forward(ctx, &m, base, w->run, stream);
}

/* The E (dE) pass into base + w->part, in the states' layout (state_v_first) */
static kda_status_t run_part(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, int64_t n,
                             const xcp_ws_t *w, unsigned char *base, void *stream) {
    kda_problem_t q;
    one_sequence(p, n, &q);
    const kda_args_t *a = &p->a;
    const void *from = bp ? (kda_xcp_first_ends_here(p) ? bp->b.d_final_state : NULL)
                          : (kda_xcp_last_starts_here(p) ? a->initial_state : NULL);
    const kda_dtype_t from_dt = bp ? bp->b.d_final_state_dtype : a->initial_state_dtype;
    if (from && a->state_indices) {
        const int err = kda_xcp_launch_gather(base + w->gather, from, a->state_indices + n, a->num_state_slots,
                                              (int64_t)head_states(p), (int)kda_dtype_size(from_dt), stream);
        if (err)
            return kda_error(KDA_STATUS_BACKEND_ERROR, "kda_cp_summary: the pooled state: %s",
                             cudaGetErrorString((cudaError_t)err));
        from = base + w->gather;
    } else if (from) {
        from = (const char *)from + (size_t)n * head_states(p) * kda_dtype_size(from_dt);
    }
    if (!bp) {
        q.a.initial_state = from;
        q.a.o = base + w->out;
        q.a.final_state = base + w->part;
        q.a.final_state_dtype = KDA_FLOAT32;
        return ctx->ops->forward(ctx, &q, base, w->run, stream);
    }
    kda_bwd_problem_t d;
    one_sequence_bwd(bp, &d);
    d.b.d_final_state = from;
    (void)grad_places(bp, q.num_tokens, base + w->grads, &d.b);
    d.b.d_initial_state = base + w->part;
    d.b.d_initial_state_dtype = KDA_FLOAT32;
    return ctx->ops->backward(ctx, &d, base, w->run, stream);
}

kda_status_t kda_cuda_xcp_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                  void *summary, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    const int HV = p->a.num_v_heads, K = p->a.head_dim_k, V = p->a.head_dim_v, W = K + V;
    const char *fn = bp ? "kda_cp_backward_summary" : "kda_cp_forward_summary";
    xcp_ws_t w;
    kda_status_t st = ws_layout(ctx, p, bp, &w);
    if (st != KDA_STATUS_SUCCESS) return st;
    unsigned char *base = (unsigned char *)(((uintptr_t)ws + 255) & ~(uintptr_t)255);
    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != ctx->device) e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    const int64_t n = summary_seq(p, bp);
    const int map = p->num_seqs > 0 && needs_map(p, bp);
    if (map) st = run_map(ctx, p, n, &w, base, stream);
    if (st == KDA_STATUS_SUCCESS && p->num_seqs > 0) st = run_part(ctx, p, bp, n, &w, base, stream);
    if (st == KDA_STATUS_SUCCESS) {
        int err = (int)cudaMemsetAsync(summary, 0, (size_t)HV * K * W * 4, (cudaStream_t)stream);
        if (!err && p->num_seqs == 0) err = kda_xcp_launch_identity((float *)summary, HV, K, W, stream);
        if (!err && map)
            err = kda_xcp_launch_place((float *)summary, W, 0, (const float *)(base + w.map), HV, K, K, bp != NULL,
                                       stream);
        if (!err && p->num_seqs > 0)
            err = kda_xcp_launch_place((float *)summary, W, K, (const float *)(base + w.part), HV, K, V,
                                       p->a.state_v_first != 0, stream);
        if (err)
            st = kda_error(KDA_STATUS_BACKEND_ERROR, "%s: placing the summary: %s", fn,
                           cudaGetErrorString((cudaError_t)err));
    }
    if (prev >= 0 && prev != ctx->device) cudaSetDevice(prev);
    return st;
}
