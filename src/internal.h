/*
 * Internal declarations shared by the API layer and the backends.
 *
 * The API layer (api.c) validates every call once (validate.c) into a kda_problem_t, then hands it to the
 * context's backend through kda_backend_ops_t. Backends receive checked arguments only.
 */
#ifndef KDA_INTERNAL_H
#define KDA_INTERNAL_H

#include <stdarg.h>
#include <stdint.h>
#include <stddef.h>

#include "error.h"
#include "kda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sizeof(kda_args_t) of the first released header (1.x): the shortest struct a call accepts. A later header
 * that appends fields keeps this value, so programs built against the first release keep working. */
#define KDA_ARGS_MIN_SIZE (offsetof(kda_args_t, allow_neg_eigval) + sizeof(int))
/* The same for kda_backward_args_t: its first release ends at ddt_bias. */
#define KDA_BACKWARD_ARGS_MIN_SIZE (offsetof(kda_backward_args_t, ddt_bias) + sizeof(float *))
/* The largest struct_size taken for a newer header's struct (a multiple of its alignment): anything larger, or
 * misaligned, is garbage (an uninitialised struct), not a newer library's. */
#define KDA_STRUCT_SIZE_MAX ((size_t)65536)

/* ---------------------------------------------------------------------------------------------------------
 * The chunked algorithm's blocking, shared by the CPU and CUDA backends (docs/ALGORITHM.md)
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_CHUNK 64 /* tokens per chunk of the recurrence */
#if KDA_CHUNK != KDA_CHUNK_SIZE
#error "the public chunk size (chunk_states' rows) is the algorithm's"
#endif
#define KDA_SUB 16           /* tokens per block of the intra-chunk matrices A and Aqk */
#define KDA_MAX_HEAD_DIM 256 /* largest K and V, every backend */
#define KDA_DIAG_RANGE 64.0f /* largest |exponent| of a diagonal block's factors before per-pair exps */
#define KDA_L2NORM_EPS 1e-6  /* the epsilon of FLA's l2norm: x / sqrt(sum x^2 + eps) */
#define KDA_GATE_MIN                                                                                                   \
    (-80.0f) /* every path clamps each token's log decay into [KDA_GATE_MIN, 0]: e^-80 is
                                 below float32's resolution of anything it multiplies, and the bound keeps the
                                 chunk's cumulative sums small enough to subtract exactly */

/* CUDA kda_decode: the recurrent kernels (src/cuda/decode/) run bf16 problems of up to this many tokens per
 * sequence on average (num_tokens / N); longer ones go to the chunked kernels (scalar β, 1-D state_indices
 * only). fp32 / fp16 inputs always take the recurrent kernels (fp32 arithmetic). The recurrent kernels' cost grows
 * with every token, the chunked kernels' with every 64-token chunk plus a fixed prep, so short sequences are the
 * recurrent kernels'; the bound sits at or below where the two cross on the supported GPUs
 * (bench/bench_decode.py compares them). */
#define KDA_DECODE_MAX_TOKENS_PER_SEQ 8

/* ---------------------------------------------------------------------------------------------------------
 * A checked problem: the caller's kda_args_t (copied, so that older/shorter structs read as defaults) plus
 * what follows from it
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_problem {
    kda_args_t a;              /* the arguments, normalised */
    int64_t num_seqs;          /* N */
    int64_t num_tokens;        /* rows of q/k/v/g/beta/o: B * T */
    int32_t group;             /* G = HV / HQK */
    float scale;               /* resolved: a.scale, or K^-1/2 when a.scale == 0 */
    int varlen;                /* cu_seqlens given */
    int has_lower_bound;       /* a.lower_bound != 0 (sigmoid gate) */
    int64_t idx_stride;        /* 2-D state_indices: elements between rows (0 for 1-D) */
    int64_t chunk_rows;        /* with chunk_states: its rows, Σ ceil(len_n / 64), when the lengths are host-readable;
                              else ceil(T / 64), a lower bound (the aliasing check only) */
    int bwd;                   /* the backward's problem (kda_check_backward_args): a backend may lay out what its
                              stages read differently (the CUDA chunk blocks' K̃_lo) */
    const double *cp_state_in; /* cross-rank CP: the folded state entering sequence 0, [HV, K, V] K-major fp64, in
                                  place of its initial state (xcp.c, in the call's workspace); NULL: none */
} kda_problem_t;

/* First and last+1 token (row of the flattened [B*T] tensors) of sequence n. The CPU backends call this with
 * host cu_seqlens only. */
static inline void kda_seq_bounds(const kda_problem_t *p, int64_t n, int64_t *bos, int64_t *eos) {
    if (!p->varlen) {
        *bos = n * p->a.seq_len;
        *eos = *bos + p->a.seq_len;
    } else if (p->a.cu_seqlens_dtype == KDA_INT64) {
        *bos = ((const int64_t *)p->a.cu_seqlens)[n];
        *eos = ((const int64_t *)p->a.cu_seqlens)[n + 1];
    } else {
        *bos = ((const int32_t *)p->a.cu_seqlens)[n];
        *eos = ((const int32_t *)p->a.cu_seqlens)[n + 1];
    }
}

/* chunk_states: the row of each sequence's first chunk, rows[n] = Σ_{m<n} ceil(len_m / KDA_CHUNK), from host
 * lengths (the CPU backends), into kda_chunk_rows_bytes of workspace at `mem`; NULL when chunk_states is unset. */
static inline size_t kda_chunk_rows_bytes(const kda_problem_t *p) {
    return p->a.chunk_states ? (size_t)p->num_seqs * sizeof(int64_t) + 8 : 0;
}
static inline int64_t *kda_chunk_rows(const kda_problem_t *p, void *mem) {
    if (!p->a.chunk_states) return NULL;
    int64_t *rows = (int64_t *)(((uintptr_t)mem + 7) & ~(uintptr_t)7), r = 0;
    for (int64_t n = 0; n < p->num_seqs; n++) {
        int64_t bos, eos;
        kda_seq_bounds(p, n, &bos, &eos);
        rows[n] = r;
        r += (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK;
    }
    return rows;
}

/* Elements of one head's state (K * V) and the row stride of the state tensors (per sequence or slot). */
static inline int64_t kda_state_head_elems(const kda_problem_t *p) {
    return (int64_t)p->a.head_dim_k * p->a.head_dim_v;
}

/* The slot sequence n reads its initial state from: n without state_indices, else state_indices[n] (2-D:
 * state_indices[n][num_accepted_tokens[n] - 1]); negative: none. Host only. */
static inline int64_t kda_state_slot(const kda_problem_t *p, int64_t n) {
    if (!p->a.state_indices) return n;
    if (p->a.state_indices_cols == 0) return (int64_t)p->a.state_indices[n];
    const int64_t col = p->a.num_accepted_tokens ? (int64_t)p->a.num_accepted_tokens[n] - 1 : 0;
    return (int64_t)p->a.state_indices[n * p->idx_stride + col];
}

/* 2-D state_indices only: the slot the state after token t (0-based within sequence n) is written to. */
static inline int64_t kda_state_slot_after(const kda_problem_t *p, int64_t n, int64_t t) {
    return (int64_t)p->a.state_indices[n * p->idx_stride + t];
}

/* Host-readable state_indices (already range-checked): no slot is touched by two sequences (or written twice
 * by one). A 16 KB table on the stack, no allocation; time independent of num_state_slots: O(N) for up to 2048
 * slots touched (or pools of up to 2^17 slots), at most O(items^2 / 2048) beyond (validate.c). */
kda_status_t kda_check_state_slots(const kda_problem_t *p, const char *fn);

/* A checked backward problem: the forward's problem and the backward's arguments, normalised. */
typedef struct kda_bwd_problem {
    kda_problem_t f;             /* the forward's problem (f.a.o and f.a.final_state are not used) */
    kda_backward_args_t b;       /* the backward's arguments; b.problem points to f.a */
    int64_t max_seq_len;         /* the longest sequence (host-readable offsets; else the batch rows' T) */
    const double *cp_dstate_out; /* cross-rank CP: the folded ∂L/∂S at the end of sequence N − 1, [HV, K, V]
                                    K-major fp64, in place of its d_final_state (xcp.c); NULL: none */
} kda_bwd_problem_t;

/* Validate the backward's `args` for `fn` and fill `out`: the forward's problem as kda_check_args does (its o
 * need not be set), then the gradients' buffers, dtypes and aliasing. */
/* INVALID_VALUE naming `name` where [ptr, ptr + bytes) overlaps memory the call on p reads (b: the backward's too) */
kda_status_t kda_check_not_read(const char *fn, const kda_problem_t *p, const kda_backward_args_t *b, const char *name,
                                const void *ptr, size_t bytes);
kda_status_t kda_check_backward_args(const kda_context_t *ctx, const kda_backward_args_t *args, const char *fn,
                                     int host_readable, kda_bwd_problem_t *out);

/* Largest element count of any tensor (and of the states of all sequences, whatever seq_len): 2^52, so that
 * every count times every element size fits in int64 and size_t, and a loop over them cannot overflow. */
#define KDA_MAX_ELEMS ((int64_t)1 << 52)
/* Largest batch * seq_len (tokens of a call), and the largest extent of any index array (a 2-D state_indices'
 * (N - 1) * row stride + T_max): far beyond any real call, small enough that each times a head count and size
 * stays below KDA_MAX_ELEMS. */
#define KDA_MAX_TOKENS ((int64_t)1 << 40)

/* Validate `args` for entry point `fn` on `ctx` and fill `out`. `host_readable`: the pointers are host memory,
 * so the contents of cu_seqlens and state_indices can be checked as well. */
kda_status_t kda_check_args(const kda_context_t *ctx, const kda_args_t *args, const char *fn, int host_readable,
                            kda_problem_t *out);

/* A call's workspace (api.c): INSUFFICIENT_WORKSPACE naming workspace_bytes when short, INVALID_VALUE naming
 * workspace when it is NULL and `need` > 0 */
kda_status_t kda_check_workspace(const char *fn, const void *ws, size_t ws_bytes, size_t need);

/* ---------------------------------------------------------------------------------------------------------
 * Backends
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_threadpool kda_threadpool_t;

typedef struct kda_backend_ops {
    const char *name;
    /* Both algorithms: workspace size, then the call. Arguments are already checked. */
    kda_status_t (*forward_workspace)(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes);
    kda_status_t (*forward)(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream);
    kda_status_t (*decode_workspace)(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes);
    kda_status_t (*decode)(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream);
    /* Backend-specific checks beyond the shared ones (e.g. supported head sizes), or NULL. */
    kda_status_t (*supports)(const kda_context_t *ctx, const kda_problem_t *p, const char *fn);
    void (*destroy)(kda_context_t *ctx);
    /* Bytes kda_forward keeps at a.saved for the backward (NULL: the backend keeps nothing, 0 bytes). */
    kda_status_t (*saved_size)(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes);
    /* The training backward (NULL: the backend has none; kda_backward answers NOT_SUPPORTED). */
    kda_status_t (*backward_workspace)(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes);
    kda_status_t (*backward)(kda_context_t *ctx, const kda_bwd_problem_t *p, void *ws, size_t ws_bytes, void *stream);
    /* Cross-rank CP (docs/ALGORITHM.md §4a; NULL: the backend has none: NOT_SUPPORTED, for the summaries and for a
     * forward or backward that folds): this rank's summary, [HV, K, K + V] fp64, into `out`, for p's num_seqs >= 1.
     * bp NULL: the forward's ([M | E] of the last local part); else the backward's ([Mᵀ | dE] of the first). The
     * backend reads p->cp_state_in / bp->cp_dstate_out where set (xcp.c's folds). */
    kda_status_t (*cp_summary_workspace)(const kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                         size_t *bytes);
    kda_status_t (*cp_summary)(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out,
                               void *ws, size_t ws_bytes);
    /* A backend whose memory the host cannot read (CUDA) has these instead: the summary straight into the
     * caller's `summary` (its dtype, on `stream`), for any num_seqs; its forward and backward fold the gathered
     * summaries themselves, within their own workspace (xcp.c's host folds are not used). */
    kda_status_t (*cp_device_summary_workspace)(const kda_context_t *ctx, const kda_problem_t *p,
                                                const kda_bwd_problem_t *bp, size_t *bytes);
    kda_status_t (*cp_device_summary)(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                      void *summary, void *ws, size_t ws_bytes, void *stream);
} kda_backend_ops_t;

/* Tuning a caller cannot reach: tests force tilings through kda_set_tuning (internal symbol, linked statically),
 * a development build's harness through kda_dev_set_tuning. Zero fields leave the backend's choice. */
typedef struct kda_tuning {
    int bv;       /* CUDA recurrence: V columns per CTA (32, 64 or 128) */
    int rec_mma;  /* CUDA recurrence: 1 = mma.sync where warpgroup MMA would run (A/B of the two) */
    int stages;   /* CUDA recurrence: ring stages (2 or 3) */
    int dev_skip; /* development builds only (KDA_SKIP in src/cuda/common/kda_cuda.h): phases left out, results wrong */
    int decode_ctas;   /* CUDA decode kernel: at most this many (persistent) CTAs, each then walks several tiles;
                        the same bits for any count */
    int decode_kernel; /* CUDA decode: 1 the staged kernel (decode_staged.cuh), 2 the tile kernel (decode_tile.cuh)
                          where it fits, 3 / 4 that with 8 / 16 chunks per thread (where V allows 16); 0 the choice */
} kda_tuning_t;

void kda_set_tuning(kda_context_t *ctx, const kda_tuning_t *tuning);

struct kda_context {
    kda_backend_t backend;
    const kda_backend_ops_t *ops;
    int device;             /* CUDA ordinal */
    int num_threads;        /* CPU */
    kda_threadpool_t *pool; /* CPU */
    void *impl;             /* backend data (CUDA: device properties) */
    kda_tuning_t tuning;    /* zeros unless a test set it */
    int in_use;             /* calls running on the context (each holds 1 for its duration), or -1 while
                                   kda_set_num_threads / kda_destroy holds it alone; read and written only with
                                   the __atomic builtins (api.c) */
};

/* ---------------------------------------------------------------------------------------------------------
 * Context parallelism across ranks (xcp.c; docs/ALGORITHM.md §4a)
 * ------------------------------------------------------------------------------------------------------- */
/* The last local sequence starts on this rank (its forward summary has M = 0); the first ends on it (the
 * backward summary's M = 0). */
/* Whether a call folds the earlier ranks' summaries into its first sequence (forward), the later ranks' into its
 * last (backward) */
static inline int kda_xcp_folds_forward(const kda_problem_t *p) {
    return p->a.cp_num_ranks > 0 && p->a.cp_pre_ranks > 0;
}
static inline int kda_xcp_folds_backward(const kda_problem_t *p) {
    return p->a.cp_num_ranks > 0 && p->a.cp_post_ranks > 0;
}
static inline int kda_xcp_last_starts_here(const kda_problem_t *p) { return p->num_seqs > 1 || p->a.cp_pre_ranks == 0; }
static inline int kda_xcp_first_ends_here(const kda_problem_t *p) { return p->num_seqs > 1 || p->a.cp_post_ranks == 0; }

/* The cp_* fields of a checked problem (validate.c, its last section): ranges, dtype, what cannot be split, and
 * for `call` KDA_XCP_FOLD (kda_forward, kda_backward) the gathered forward summaries where the forward folds;
 * KDA_XCP_SUMMARY (the summary calls) reads no gathered summary; KDA_XCP_DECODE refuses the fields. */
enum { KDA_XCP_FOLD = 0, KDA_XCP_DECODE = 1, KDA_XCP_SUMMARY = 2 };
kda_status_t kda_check_xcp(const char *fn, const kda_problem_t *p, int call);
/* The backward's gathered summaries (kda_backward_args_t.cp_summaries) against its problem. */
kda_status_t kda_check_xcp_backward(const char *fn, const kda_bwd_problem_t *bp);
/* Bytes of one rank's summary (0 when cp_num_ranks is 0), saturating at SIZE_MAX. */
size_t kda_xcp_summary_bytes(const kda_problem_t *p);

/* The host folds (xcp.c): workspace beyond the backend's (0 where the backend folds on the device), and the fold
 * into it (setting cp_state_in, cp_dstate_out). */
size_t kda_xcp_forward_extra(const kda_context_t *ctx, const kda_problem_t *p);
void kda_xcp_fold_forward(kda_problem_t *p, void *mem);
size_t kda_xcp_backward_extra(const kda_context_t *ctx, const kda_bwd_problem_t *bp);
void kda_xcp_fold_backward(kda_bwd_problem_t *bp, void *mem);

/* The context's in-use count around a call (api.c). */
kda_status_t kda_ctx_enter(const kda_context_t *ctx, const char *fn);
void kda_ctx_leave(const kda_context_t *ctx);

extern const kda_backend_ops_t kda_cpu_ops;
extern const kda_backend_ops_t kda_reference_ops;

/* CUDA backend: defined in src/cuda/ when the build has CUDA; otherwise these answer NOT_SUPPORTED. */
kda_status_t kda_cuda_init(kda_context_t *ctx, int device);
extern const kda_backend_ops_t kda_cuda_ops;

#ifdef __cplusplus
}
#endif

#endif /* KDA_INTERNAL_H */
