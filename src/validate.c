/*
 * Argument validation, in one place for every backend and entry point.
 *
 * Each failure returns a status and a message that names the argument (the kda_args_t field) and says what
 * is wrong with it. Nothing here writes to any output. Contents of host memory (cu_seqlens, state_indices)
 * are checked when the backend's pointers are host pointers; on CUDA the optional cu_seqlens_host copy is
 * checked instead, and the kernels clamp what they read.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* the public header's piece multiple is the chunk of every backend */
_Static_assert(KDA_CP_PIECE_MULTIPLE == KDA_CHUNK, "KDA_CP_PIECE_MULTIPLE (kda.h) must equal KDA_CHUNK");

#define FAIL(st, arg, ...) return fail_arg((st), fn, (arg), __VA_ARGS__)

KDA_PRINTF(4, 5)
static kda_status_t fail_arg(kda_status_t st, const char *fn, const char *arg, const char *fmt, ...) {
    char what[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kda_error(st, "%s: argument '%s': %s", fn, arg, what);
}

static int is_float_dtype(kda_dtype_t d) { return d == KDA_FLOAT32 || d == KDA_FLOAT16 || d == KDA_BFLOAT16; }
static int is_state_dtype(kda_dtype_t d) { return d == KDA_FLOAT32 || d == KDA_BFLOAT16; }

static const char *dtype_name(kda_dtype_t d) {
    switch (d) {
    case KDA_FLOAT32:
        return "float32";
    case KDA_FLOAT16:
        return "float16";
    case KDA_BFLOAT16:
        return "bfloat16";
    case KDA_INT32:
        return "int32";
    case KDA_INT64:
        return "int64";
    case KDA_FLOAT64:
        return "float64";
    }
    return "unknown";
}

static int64_t read_offset(const void *cu, kda_dtype_t dt, int64_t i) {
    return dt == KDA_INT64 ? ((const int64_t *)cu)[i] : (int64_t)((const int32_t *)cu)[i];
}

static kda_status_t check_cu_seqlens(const char *fn, const char *arg, const void *cu, kda_dtype_t dt, int64_t n,
                                     int64_t total) {
    int64_t first = read_offset(cu, dt, 0);
    if (first != 0) FAIL(KDA_STATUS_INVALID_VALUE, arg, "must start at 0 (%s[0] = %lld)", arg, (long long)first);
    for (int64_t i = 1; i <= n; i++) {
        int64_t a = read_offset(cu, dt, i - 1), b = read_offset(cu, dt, i);
        if (b < a)
            FAIL(KDA_STATUS_INVALID_VALUE, arg, "not monotone (%s[%lld] = %lld < %s[%lld] = %lld)", arg, (long long)i,
                 (long long)b, arg, (long long)(i - 1), (long long)a);
    }
    int64_t last = read_offset(cu, dt, n);
    if (last != total)
        FAIL(KDA_STATUS_INVALID_VALUE, arg, "must end at seq_len = %lld (%s[%lld] = %lld)", (long long)total, arg,
             (long long)n, (long long)last);
    return KDA_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * Aliasing: the byte range of every tensor; an output may overlap no input and no other output, except the
 * in-place state pool (final_state exactly initial_state: same address, same dtype, hence the same range).
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    const char *name;
    uintptr_t lo, hi; /* [lo, hi); empty when lo == hi */
} extent_t;

static extent_t extent(const char *name, const void *ptr, int64_t elems, size_t elem_size) {
    extent_t e = {name, (uintptr_t)ptr, (uintptr_t)ptr};
    if (!ptr || elems <= 0) return e;
    const uint64_t bytes = (uint64_t)elems * elem_size; /* elems <= 2^52, elem_size <= 8 */
    e.hi = bytes > UINTPTR_MAX - e.lo ? UINTPTR_MAX : e.lo + (uintptr_t)bytes;
    return e;
}

static int overlap(extent_t x, extent_t y) { return x.lo < x.hi && y.lo < y.hi && x.lo < y.hi && y.lo < x.hi; }

static kda_status_t check_overlaps(const char *fn, const kda_problem_t *p, int need_o) {
    const kda_args_t *a = &p->a;
    const int64_t T = p->num_tokens, HQK = a->num_qk_heads, HV = a->num_v_heads, K = a->head_dim_k, V = a->head_dim_v,
                  N = p->num_seqs;
    const int64_t slots = a->state_indices ? a->num_state_slots : N;
    const size_t cu_size = kda_dtype_size(a->cu_seqlens_dtype);
    const extent_t in[] = {
        extent("initial_state", a->initial_state, slots * HV * K * V, kda_dtype_size(a->initial_state_dtype)),
        extent("q", a->q, T * HQK * K, kda_dtype_size(a->dtype)),
        extent("k", a->k, T * HQK * K, kda_dtype_size(a->dtype)),
        extent("v", a->v, T * HV * V, kda_dtype_size(a->dtype)),
        extent("g", a->g, T * HV * K, kda_dtype_size(a->g_dtype)),
        extent("beta", a->beta, T * HV * (a->beta_headwise ? V : 1), kda_dtype_size(a->beta_dtype)),
        extent("A_log", a->A_log, HV, sizeof(float)),
        extent("dt_bias", a->dt_bias, HV * K, sizeof(float)),
        extent("cu_seqlens", a->cu_seqlens, N + 1, cu_size),
        extent("cu_seqlens_host", a->cu_seqlens_host, N + 1, cu_size),
        extent("state_indices", a->state_indices,
               a->state_indices_cols > 0 ? (N > 0 ? (N - 1) * p->idx_stride + a->state_indices_cols : 0) : N,
               sizeof(int32_t)),
        extent("num_accepted_tokens", a->num_accepted_tokens, N, sizeof(*a->num_accepted_tokens)),
    };
    const extent_t o = extent("o", need_o ? a->o : NULL, T * HV * V, kda_dtype_size(a->o_dtype));
    const extent_t fs = extent("final_state", a->final_state, slots * HV * K * V, kda_dtype_size(a->final_state_dtype));
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
        if (overlap(o, in[i])) FAIL(KDA_STATUS_INVALID_VALUE, "o", "overlaps the memory of input '%s'", in[i].name);
        const int is_initial_state = i == 0, in_place = is_initial_state && fs.lo == in[i].lo && fs.hi == in[i].hi;
        if (overlap(fs, in[i]) && !in_place)
            FAIL(KDA_STATUS_INVALID_VALUE, "final_state", "overlaps the memory of input '%s'%s", in[i].name,
                 is_initial_state ? " (only final_state == initial_state exactly, an in-place update, is allowed)"
                                  : "");
    }
    if (overlap(o, fs)) FAIL(KDA_STATUS_INVALID_VALUE, "o", "overlaps the memory of output 'final_state'");
    const extent_t cs =
        extent("chunk_states", a->chunk_states, p->chunk_rows * HV * K * V, kda_dtype_size(a->chunk_states_dtype));
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        if (overlap(cs, in[i]))
            FAIL(KDA_STATUS_INVALID_VALUE, "chunk_states", "overlaps the memory of input '%s'", in[i].name);
    if (overlap(cs, o)) FAIL(KDA_STATUS_INVALID_VALUE, "chunk_states", "overlaps the memory of output 'o'");
    if (overlap(cs, fs)) FAIL(KDA_STATUS_INVALID_VALUE, "chunk_states", "overlaps the memory of output 'final_state'");
    const extent_t sv = extent("saved", a->saved,
                               (int64_t)(a->saved_bytes > (size_t)KDA_MAX_ELEMS ? KDA_MAX_ELEMS : a->saved_bytes), 1);
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        if (overlap(sv, in[i]))
            FAIL(KDA_STATUS_INVALID_VALUE, "saved", "overlaps the memory of input '%s'", in[i].name);
    if (overlap(sv, o)) FAIL(KDA_STATUS_INVALID_VALUE, "saved", "overlaps the memory of output 'o'");
    if (overlap(sv, fs)) FAIL(KDA_STATUS_INVALID_VALUE, "saved", "overlaps the memory of output 'final_state'");
    if (overlap(sv, cs)) FAIL(KDA_STATUS_INVALID_VALUE, "saved", "overlaps the memory of output 'chunk_states'");
    return KDA_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * The problem (kda_args_t), one named check per group of fields, in the order check_problem runs them: the
 * first failing check's message is the call's. Each reads only what the checks before it have bounded.
 * ------------------------------------------------------------------------------------------------------- */
#define TRY(x)                                                                                                         \
    do {                                                                                                               \
        const kda_status_t st_ = (x);                                                                                  \
        if (st_ != KDA_STATUS_SUCCESS) return st_;                                                                     \
    } while (0)

/* struct_size of `type` (docs/API.md §13): at least its first release's `min`; above this library's `ours`, a
 * newer header's (NOT_SUPPORTED) only when plausible (a multiple of the struct's alignment `align`, at most
 * KDA_STRUCT_SIZE_MAX), else garbage: the struct was not initialised (INVALID_VALUE). */
static kda_status_t check_struct_size(const char *fn, size_t size, size_t min, size_t ours, size_t align,
                                      const char *type, const char *init) {
    if (size < min)
        FAIL(KDA_STATUS_INVALID_VALUE, "struct_size",
             "%zu is smaller than the first %s (%zu bytes); initialise the "
             "struct with %s()",
             size, type, min, init);
    if (size > ours && (size > KDA_STRUCT_SIZE_MAX || size % align != 0))
        FAIL(KDA_STATUS_INVALID_VALUE, "struct_size",
             "%zu is no size of a %s (this library's is %zu bytes, a newer "
             "one's a multiple of %zu up to %zu): the struct looks uninitialised; initialise it with %s()",
             size, type, ours, align, KDA_STRUCT_SIZE_MAX, init);
    if (size > ours)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "struct_size",
             "%zu is larger than this library's sizeof(%s) = %zu: the "
             "program was built against a newer libkda",
             size, type, ours);
    return KDA_STATUS_SUCCESS;
}

/* struct_size, then the copy: an older program's shorter struct reads as the defaults of the fields it lacks. */
static kda_status_t load_args(const char *fn, const kda_args_t *args, kda_problem_t *p) {
    if (!args) FAIL(KDA_STATUS_INVALID_VALUE, "args", "NULL");
    TRY(check_struct_size(fn, args->struct_size, KDA_ARGS_MIN_SIZE, sizeof(kda_args_t), _Alignof(kda_args_t),
                          "kda_args_t", "kda_args_init"));
    memset(p, 0, sizeof *p);
    (kda_args_init)(&p->a);
    memcpy(&p->a, args, args->struct_size);
    p->a.struct_size = sizeof(kda_args_t);
    return KDA_STATUS_SUCCESS;
}

/* batch, seq_len, the heads and head sizes; every element count must fit comfortably in int64. */
static kda_status_t check_sizes(const char *fn, kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (a->batch < 0) FAIL(KDA_STATUS_INVALID_VALUE, "batch", "%lld is negative", (long long)a->batch);
    if (a->seq_len < 0) FAIL(KDA_STATUS_INVALID_VALUE, "seq_len", "%lld is negative", (long long)a->seq_len);
    if (a->num_qk_heads < 1) FAIL(KDA_STATUS_INVALID_VALUE, "num_qk_heads", "%d must be at least 1", a->num_qk_heads);
    if (a->num_v_heads < 1) FAIL(KDA_STATUS_INVALID_VALUE, "num_v_heads", "%d must be at least 1", a->num_v_heads);
    if (a->num_v_heads % a->num_qk_heads != 0)
        FAIL(KDA_STATUS_INVALID_VALUE, "num_v_heads", "%d is not a multiple of num_qk_heads = %d", a->num_v_heads,
             a->num_qk_heads);
    if (a->head_dim_k < 1 || a->head_dim_k > KDA_MAX_HEAD_DIM)
        FAIL(KDA_STATUS_INVALID_VALUE, "head_dim_k", "%d is outside [1, %d]", a->head_dim_k, KDA_MAX_HEAD_DIM);
    if (a->head_dim_v < 1 || a->head_dim_v > KDA_MAX_HEAD_DIM)
        FAIL(KDA_STATUS_INVALID_VALUE, "head_dim_v", "%d is outside [1, %d]", a->head_dim_v, KDA_MAX_HEAD_DIM);
    if (a->batch > 0 && a->seq_len > KDA_MAX_TOKENS / a->batch)
        FAIL(KDA_STATUS_INVALID_VALUE, "seq_len", "batch * seq_len = %lld * %lld is too large", (long long)a->batch,
             (long long)a->seq_len);
    p->num_tokens = a->batch * a->seq_len;
    if (p->num_tokens > KDA_MAX_ELEMS / ((int64_t)a->num_v_heads * 256))
        FAIL(KDA_STATUS_INVALID_VALUE, "seq_len", "%lld tokens of %d value heads is too large",
             (long long)p->num_tokens, a->num_v_heads);
    p->group = a->num_v_heads / a->num_qk_heads;
    return KDA_STATUS_SUCCESS;
}

static kda_status_t check_float_dtype(const char *fn, const char *arg, kda_dtype_t d) {
    if (!is_float_dtype(d))
        FAIL(KDA_STATUS_INVALID_VALUE, arg, "%s (%d) is not float32, float16 or bfloat16", dtype_name(d), (int)d);
    return KDA_STATUS_SUCCESS;
}

static kda_status_t check_dtypes(const char *fn, const kda_args_t *a) {
    TRY(check_float_dtype(fn, "dtype", a->dtype));
    TRY(check_float_dtype(fn, "g_dtype", a->g_dtype));
    TRY(check_float_dtype(fn, "beta_dtype", a->beta_dtype));
    TRY(check_float_dtype(fn, "o_dtype", a->o_dtype));
    return KDA_STATUS_SUCCESS;
}

/* Elements of all value heads' states of one sequence or slot: <= 2^31 * 2^16. */
static int64_t state_elems(const kda_args_t *a) { return (int64_t)a->num_v_heads * a->head_dim_k * a->head_dim_v; }

/* N: num_seqs with cu_seqlens (whose contents are checked where readable), else batch. The states and the
 * per-(sequence, head) work are bounded whatever seq_len (with seq_len = 0 nothing else bounds batch), and
 * before cu_seqlens is read. */
static kda_status_t check_sequences(const char *fn, int host_readable, kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (a->cu_seqlens) {
        p->varlen = 1;
        if (a->batch != 1)
            FAIL(KDA_STATUS_INVALID_VALUE, "batch", "must be 1 with cu_seqlens (got %lld); flatten the rows",
                 (long long)a->batch);
        if (a->cu_seqlens_dtype != KDA_INT32 && a->cu_seqlens_dtype != KDA_INT64)
            FAIL(KDA_STATUS_INVALID_VALUE, "cu_seqlens_dtype", "%s is not int32 or int64",
                 dtype_name(a->cu_seqlens_dtype));
        if (a->num_seqs < 0) FAIL(KDA_STATUS_INVALID_VALUE, "num_seqs", "%lld is negative", (long long)a->num_seqs);
        if (a->num_seqs > KDA_MAX_ELEMS / state_elems(a))
            FAIL(KDA_STATUS_INVALID_VALUE, "num_seqs",
                 "%lld sequences of %d value heads of %d x %d states is too "
                 "large (more than 2^52 state elements)",
                 (long long)a->num_seqs, a->num_v_heads, a->head_dim_k, a->head_dim_v);
        if (a->cu_seqlens_host && host_readable)
            FAIL(KDA_STATUS_INVALID_VALUE, "cu_seqlens_host",
                 "is for the CUDA backend; on the CPU pass the host "
                 "array as cu_seqlens");
        const void *readable = host_readable ? a->cu_seqlens : a->cu_seqlens_host;
        if (readable)
            TRY(check_cu_seqlens(fn, host_readable ? "cu_seqlens" : "cu_seqlens_host", readable, a->cu_seqlens_dtype,
                                 a->num_seqs, a->seq_len));
        p->num_seqs = a->num_seqs;
    } else {
        if (a->num_seqs != 0)
            FAIL(KDA_STATUS_INVALID_VALUE, "num_seqs", "%lld is set but cu_seqlens is NULL", (long long)a->num_seqs);
        if (a->cu_seqlens_host) FAIL(KDA_STATUS_INVALID_VALUE, "cu_seqlens_host", "is set but cu_seqlens is NULL");
        if (a->batch > KDA_MAX_ELEMS / state_elems(a))
            FAIL(KDA_STATUS_INVALID_VALUE, "batch",
                 "%lld sequences of %d value heads of %d x %d states is too "
                 "large (more than 2^52 state elements)",
                 (long long)a->batch, a->num_v_heads, a->head_dim_k, a->head_dim_v);
        p->num_seqs = a->batch;
    }
    return KDA_STATUS_SUCCESS;
}

/* The inputs (and o where the entry point writes it) are required when there are tokens. */
static kda_status_t check_tensors(const char *fn, const kda_problem_t *p, int need_o) {
    const kda_args_t *a = &p->a;
    if (p->num_tokens > 0) {
        if (!a->q) FAIL(KDA_STATUS_INVALID_VALUE, "q", "NULL");
        if (!a->k) FAIL(KDA_STATUS_INVALID_VALUE, "k", "NULL");
        if (!a->v) FAIL(KDA_STATUS_INVALID_VALUE, "v", "NULL");
        if (!a->g) FAIL(KDA_STATUS_INVALID_VALUE, "g", "NULL");
        if (!a->beta) FAIL(KDA_STATUS_INVALID_VALUE, "beta", "NULL");
        if (need_o && !a->o) FAIL(KDA_STATUS_INVALID_VALUE, "o", "NULL");
    }
    return KDA_STATUS_SUCCESS;
}

/* The states' dtypes and the shape of state_indices (1-D or 2-D, its row stride), num_accepted_tokens and
 * beta_headwise: nothing here reads memory. */
static kda_status_t check_state_layout(const char *fn, kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (a->initial_state && !is_state_dtype(a->initial_state_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "initial_state_dtype", "%s is not float32 or bfloat16",
             dtype_name(a->initial_state_dtype));
    if (a->final_state && !is_state_dtype(a->final_state_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "final_state_dtype", "%s is not float32 or bfloat16",
             dtype_name(a->final_state_dtype));
    if (a->initial_state && a->initial_state == a->final_state && a->initial_state_dtype != a->final_state_dtype)
        FAIL(KDA_STATUS_INVALID_VALUE, "final_state",
             "is the memory of initial_state but its dtype differs "
             "(%s vs %s)",
             dtype_name(a->final_state_dtype), dtype_name(a->initial_state_dtype));
    if (a->state_indices_cols < 0)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_cols", "%lld is negative", (long long)a->state_indices_cols);
    if (a->state_indices_cols > 0 && !a->state_indices)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_cols", "%lld is set but state_indices is NULL",
             (long long)a->state_indices_cols);
    if (a->state_indices_row_stride != 0) {
        if (a->state_indices_cols == 0)
            FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_row_stride",
                 "%lld is set but state_indices is 1-D "
                 "(state_indices_cols = 0)",
                 (long long)a->state_indices_row_stride);
        if (a->state_indices_row_stride < a->state_indices_cols)
            FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_row_stride",
                 "%lld is smaller than state_indices_cols = "
                 "%lld",
                 (long long)a->state_indices_row_stride, (long long)a->state_indices_cols);
    }
    if (a->state_indices_cols > KDA_MAX_TOKENS)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_cols", "%lld is larger than 2^40 (T_max, a sequence's tokens)",
             (long long)a->state_indices_cols);
    if (a->state_indices_row_stride > KDA_MAX_TOKENS)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_row_stride", "%lld is larger than 2^40 elements",
             (long long)a->state_indices_row_stride);
    p->idx_stride = a->state_indices_row_stride ? a->state_indices_row_stride : a->state_indices_cols;
    /* the extent of a 2-D state_indices, (N - 1) * stride + T_max elements, is bounded before any is read */
    if (a->state_indices_cols > 0 && p->num_seqs > 1 &&
        p->num_seqs - 1 > (KDA_MAX_TOKENS - a->state_indices_cols) / p->idx_stride)
        FAIL(KDA_STATUS_INVALID_VALUE, a->state_indices_row_stride ? "state_indices_row_stride" : "state_indices_cols",
             "%lld rows of %lld elements apart (T_max = %lld) span more than 2^40 elements", (long long)p->num_seqs,
             (long long)p->idx_stride, (long long)a->state_indices_cols);
    if (a->num_accepted_tokens && a->state_indices_cols == 0)
        FAIL(KDA_STATUS_INVALID_VALUE, "num_accepted_tokens",
             "needs a 2-D state_indices (state_indices_cols = "
             "T_max >= 1)");
    if (a->beta_headwise != 0 && a->beta_headwise != 1)
        FAIL(KDA_STATUS_INVALID_VALUE, "beta_headwise", "%d is not 0 or 1", a->beta_headwise);
    return KDA_STATUS_SUCCESS;
}

/* Host-readable state_indices: every slot it reads below num_state_slots (2-D: the columns of each sequence's
 * tokens and the column it reads, num_accepted_tokens[n] - 1, itself within [1, T_max]). */
static kda_status_t check_slot_ranges(const char *fn, const kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    const int64_t cols = a->state_indices_cols;
    for (int64_t n = 0; n < p->num_seqs; n++) {
        if (cols == 0) {
            int64_t s = a->state_indices[n];
            if (s >= a->num_state_slots)
                FAIL(KDA_STATUS_INVALID_VALUE, "state_indices",
                     "state_indices[%lld] = %lld is not below "
                     "num_state_slots = %lld",
                     (long long)n, (long long)s, (long long)a->num_state_slots);
            continue;
        }
        if (a->num_accepted_tokens) {
            int64_t an = a->num_accepted_tokens[n];
            if (an < 1 || an > cols)
                FAIL(KDA_STATUS_INVALID_VALUE, "num_accepted_tokens",
                     "num_accepted_tokens[%lld] = %lld is "
                     "outside [1, T_max = %lld]",
                     (long long)n, (long long)an, (long long)cols);
        }
        int64_t bos, eos;
        kda_seq_bounds(p, n, &bos, &eos);
        const int64_t rd = a->num_accepted_tokens ? a->num_accepted_tokens[n] - 1 : 0;
        for (int64_t t = -1; t < eos - bos; t++) {
            const int64_t col = t < 0 ? rd : t;
            int64_t s = a->state_indices[n * p->idx_stride + col];
            if (s >= a->num_state_slots)
                FAIL(KDA_STATUS_INVALID_VALUE, "state_indices",
                     "state_indices[%lld][%lld] = %lld is not "
                     "below num_state_slots = %lld",
                     (long long)n, (long long)col, (long long)s, (long long)a->num_state_slots);
        }
    }
    return KDA_STATUS_SUCCESS;
}

/* A state pool (state_indices): its size, a 2-D index's columns against the sequences' lengths, and on the
 * host the slots' range and distinctness. */
static kda_status_t check_state_pool(const char *fn, int host_readable, const kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (!a->state_indices) {
        if (a->num_state_slots != 0)
            FAIL(KDA_STATUS_INVALID_VALUE, "num_state_slots", "%lld is set but state_indices is NULL",
                 (long long)a->num_state_slots);
        return KDA_STATUS_SUCCESS;
    }
    if (!a->initial_state && !a->final_state)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices", "is set but neither initial_state nor final_state is");
    if (a->num_state_slots < 1)
        FAIL(KDA_STATUS_INVALID_VALUE, "num_state_slots", "%lld must be at least 1 with state_indices",
             (long long)a->num_state_slots);
    if (a->num_state_slots > KDA_MAX_ELEMS / state_elems(a))
        FAIL(KDA_STATUS_INVALID_VALUE, "num_state_slots",
             "%lld slots of %d value heads of %d x %d states is "
             "too large (more than 2^52 state elements)",
             (long long)a->num_state_slots, a->num_v_heads, a->head_dim_k, a->head_dim_v);
    const int64_t cols = a->state_indices_cols;
    if (cols > 0 && !p->varlen && a->seq_len > cols)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_cols",
             "T_max = %lld is smaller than seq_len = %lld (a "
             "2-D state_indices needs a slot for every token)",
             (long long)cols, (long long)a->seq_len);
    const void *cu_readable = host_readable ? a->cu_seqlens : a->cu_seqlens_host;
    if (cols > 0 && p->varlen && cu_readable) {
        for (int64_t n = 0; n < p->num_seqs; n++) {
            int64_t len =
                read_offset(cu_readable, a->cu_seqlens_dtype, n + 1) - read_offset(cu_readable, a->cu_seqlens_dtype, n);
            if (len > cols)
                FAIL(KDA_STATUS_INVALID_VALUE, "state_indices_cols",
                     "T_max = %lld is smaller than sequence "
                     "%lld's %lld tokens (a 2-D state_indices needs a slot for every token)",
                     (long long)cols, (long long)n, (long long)len);
        }
    }
    if (host_readable) {
        TRY(check_slot_ranges(fn, p));
        TRY(kda_check_state_slots(p, fn));
    }
    return KDA_STATUS_SUCCESS;
}

/* chunk_states (kda_forward only) and its rows, for the aliasing check. */
static kda_status_t check_chunk_states(const char *fn, int host_readable, int need_o, int decode, kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (!a->chunk_states) return KDA_STATUS_SUCCESS;
    if (!is_state_dtype(a->chunk_states_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "chunk_states_dtype", "%s is not float32 or bfloat16",
             dtype_name(a->chunk_states_dtype));
    if (a->beta_headwise)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "chunk_states",
             "is not written with beta_headwise (the token "
             "recurrence runs those calls)");
    if (a->state_indices && a->state_indices_cols > 0)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "chunk_states",
             "is not written with a 2-D state_indices (speculative "
             "decoding keeps a state per token instead)");
    if (!need_o || decode)
        FAIL(KDA_STATUS_INVALID_VALUE, "chunk_states", "is written by kda_forward only; set it to NULL here");
    const void *lens = !p->varlen ? NULL : host_readable ? a->cu_seqlens : a->cu_seqlens_host;
    if (!p->varlen) {
        p->chunk_rows = a->batch * ((a->seq_len + KDA_CHUNK - 1) / KDA_CHUNK);
    } else if (lens) {
        kda_problem_t q = *p; /* the lengths as the CPU backends read them */
        q.a.cu_seqlens = lens;
        for (int64_t n = 0; n < p->num_seqs; n++) {
            int64_t bos, eos;
            kda_seq_bounds(&q, n, &bos, &eos);
            p->chunk_rows += (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK;
        }
    } else {
        p->chunk_rows = (p->num_tokens + KDA_CHUNK - 1) / KDA_CHUNK;
    }
    return KDA_STATUS_SUCCESS;
}

/* saved: what kda_forward writes and kda_backward reads. */
static kda_status_t check_saved_arg(const char *fn, int decode, const kda_args_t *a) {
    if (!a->saved && a->saved_bytes != 0)
        FAIL(KDA_STATUS_INVALID_VALUE, "saved_bytes", "%zu is set but saved is NULL", a->saved_bytes);
    if (a->saved && decode)
        FAIL(KDA_STATUS_INVALID_VALUE, "saved", "is for kda_forward and kda_backward only; set it to NULL here");
    return KDA_STATUS_SUCCESS;
}

/* scale, the in-kernel gate (lower_bound, A_log, dt_bias, safe_gate) and the β options. */
static kda_status_t check_options(const char *fn, kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (!isfinite(a->scale)) FAIL(KDA_STATUS_INVALID_VALUE, "scale", "%g is not finite", (double)a->scale);
    p->scale = a->scale != 0.0f ? a->scale : (float)(1.0 / sqrt((double)a->head_dim_k));

    if (a->lower_bound != 0.0f) {
        if (!isfinite(a->lower_bound) || a->lower_bound > 0.0f)
            FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound", "%g must be finite and negative (0 means unset)",
                 (double)a->lower_bound);
        if (!a->use_gate_in_kernel)
            FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound",
                 "is set but use_gate_in_kernel is 0 (the bound shapes "
                 "the in-kernel gate only)");
        p->has_lower_bound = 1;
    }
    if (a->use_gate_in_kernel) {
        if (!a->A_log && !p->has_lower_bound)
            FAIL(KDA_STATUS_INVALID_VALUE, "A_log",
                 "NULL; it is required with use_gate_in_kernel unless "
                 "lower_bound is set");
        if (a->safe_gate) {
            if (!p->has_lower_bound)
                FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound",
                     "must be set when safe_gate and use_gate_in_kernel "
                     "are");
            if (a->lower_bound < -5.0f)
                FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound", "%g is outside the safe range [-5, 0)",
                     (double)a->lower_bound);
        }
    } else {
        if (a->A_log) FAIL(KDA_STATUS_INVALID_VALUE, "A_log", "is set but use_gate_in_kernel is 0");
        if (a->dt_bias) FAIL(KDA_STATUS_INVALID_VALUE, "dt_bias", "is set but use_gate_in_kernel is 0");
    }
    if (a->allow_neg_eigval && !a->use_beta_sigmoid)
        FAIL(KDA_STATUS_INVALID_VALUE, "allow_neg_eigval", "requires use_beta_sigmoid");
    return KDA_STATUS_SUCCESS;
}

/* Intra-card context parallelism (CUDA; the CPU backends ignore it, but a bad value is an error on every
 * backend, so that a program is portable). */
static kda_status_t check_cp(const char *fn, const kda_args_t *a) {
    if (a->cp_mode != KDA_CP_AUTO && a->cp_mode != KDA_CP_OFF && a->cp_mode != KDA_CP_ON)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_mode", "%d is not KDA_CP_AUTO (0), KDA_CP_OFF (1) or KDA_CP_ON (2)",
             (int)a->cp_mode);
    if (a->cp_mode == KDA_CP_ON) {
        if (a->cp_piece_len <= 0)
            FAIL(KDA_STATUS_INVALID_VALUE, "cp_piece_len",
                 "%lld must be positive with cp_mode = KDA_CP_ON (tokens "
                 "per piece, a multiple of %d)",
                 (long long)a->cp_piece_len, KDA_CP_PIECE_MULTIPLE);
        if (a->cp_piece_len % KDA_CP_PIECE_MULTIPLE != 0)
            FAIL(KDA_STATUS_INVALID_VALUE, "cp_piece_len", "%lld is not a multiple of the chunk (%d tokens)",
                 (long long)a->cp_piece_len, KDA_CP_PIECE_MULTIPLE);
        if (a->cp_piece_len > KDA_CP_MAX_PIECE_LEN)
            FAIL(KDA_STATUS_INVALID_VALUE, "cp_piece_len", "%lld is larger than KDA_CP_MAX_PIECE_LEN = %d",
                 (long long)a->cp_piece_len, KDA_CP_MAX_PIECE_LEN);
    } else if (a->cp_piece_len != 0) {
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_piece_len", "%lld is set but cp_mode is not KDA_CP_ON (it is %s)",
             (long long)a->cp_piece_len, a->cp_mode == KDA_CP_OFF ? "KDA_CP_OFF" : "KDA_CP_AUTO");
    }
    return KDA_STATUS_SUCCESS;
}

/* need_o: the entry point writes o (the forward and decode; the backward does not read it). */
static kda_status_t check_problem(const kda_args_t *args, const char *fn, int host_readable, int need_o,
                                  kda_problem_t *out) {
    const int decode = strncmp(fn, "kda_decode", 10) == 0; /* kda_decode and its workspace query */
    kda_problem_t p;
    TRY(load_args(fn, args, &p));
    TRY(check_sizes(fn, &p));
    TRY(check_dtypes(fn, &p.a));
    TRY(check_sequences(fn, host_readable, &p));
    TRY(check_tensors(fn, &p, need_o));
    TRY(check_state_layout(fn, &p));
    TRY(check_state_pool(fn, host_readable, &p));
    TRY(check_chunk_states(fn, host_readable, need_o, decode, &p));
    TRY(check_saved_arg(fn, decode, &p.a));
    TRY(check_options(fn, &p));
    TRY(check_cp(fn, &p.a));
    TRY(check_overlaps(fn, &p, need_o));
    *out = p;
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_check_args(const kda_context_t *ctx, const kda_args_t *args, const char *fn, int host_readable,
                            kda_problem_t *out) {
    (void)ctx;
    return check_problem(args, fn, host_readable, 1, out);
}

/* ---------------------------------------------------------------------------------------------------------
 * The backward's arguments
 * ------------------------------------------------------------------------------------------------------- */

/* A tensor's memory, for the aliasing check: [ptr, ptr + bytes). */
typedef struct {
    const char *name;
    const void *ptr;
    size_t bytes;
} span_t;

static int overlaps(span_t x, span_t y) {
    if (!x.ptr || !y.ptr || x.bytes == 0 || y.bytes == 0) return 0;
    const char *a = (const char *)x.ptr, *b = (const char *)y.ptr;
    return a < b + y.bytes && b < a + x.bytes;
}

/* A gradient output's dtype: its input's dtype or float32. */
static kda_status_t check_grad_dtype(const char *fn, const char *arg, kda_dtype_t d, kda_dtype_t input,
                                     const char *input_name) {
    if (d != KDA_FLOAT32 && d != input)
        FAIL(KDA_STATUS_INVALID_VALUE, arg, "%s is neither %s's dtype (%s) nor float32", dtype_name(d), input_name,
             dtype_name(input));
    return KDA_STATUS_SUCCESS;
}

/* What a call on problem pf reads, into out[READ_SPANS_MAX]: the forward's inputs, and with b the backward's d_o,
 * d_final_state and saved. Returns the count. */
#define READ_SPANS_MAX 13
static int read_spans(const kda_problem_t *pf, const kda_backward_args_t *b, span_t *out) {
    const kda_args_t *a = &pf->a;
    const size_t T = (size_t)pf->num_tokens, HQK = (size_t)a->num_qk_heads, HV = (size_t)a->num_v_heads;
    const size_t K = (size_t)a->head_dim_k, V = (size_t)a->head_dim_v;
    const size_t nstate = (size_t)(a->state_indices ? a->num_state_slots : pf->num_seqs);
    const size_t cu_bytes = a->cu_seqlens ? ((size_t)pf->num_seqs + 1) * kda_dtype_size(a->cu_seqlens_dtype) : 0;
    const span_t inputs[READ_SPANS_MAX] = {
        {"q", a->q, T * HQK * K * kda_dtype_size(a->dtype)},
        {"k", a->k, T * HQK * K * kda_dtype_size(a->dtype)},
        {"v", a->v, T * HV * V * kda_dtype_size(a->dtype)},
        {"g", a->g, T * HV * K * kda_dtype_size(a->g_dtype)},
        {"beta", a->beta, T * HV * kda_dtype_size(a->beta_dtype)},
        {"initial_state", a->initial_state, nstate * HV * K * V * kda_dtype_size(a->initial_state_dtype)},
        {"A_log", a->A_log, a->A_log ? HV * 4 : 0},
        {"dt_bias", a->dt_bias, a->dt_bias ? HV * K * 4 : 0},
        {"cu_seqlens", a->cu_seqlens, cu_bytes},
        {"state_indices", a->state_indices, a->state_indices ? (size_t)pf->num_seqs * 4 : 0},
        {"d_o", b ? b->d_o : NULL, b ? T * HV * V * kda_dtype_size(b->d_o_dtype) : 0},
        {"d_final_state", b ? b->d_final_state : NULL,
         b ? nstate * HV * K * V * kda_dtype_size(b->d_final_state_dtype) : 0},
        {"saved", a->saved, a->saved ? a->saved_bytes : 0},
    };
    const int n = b ? READ_SPANS_MAX : READ_SPANS_MAX - 3; /* the last three: the backward's */
    memcpy(out, inputs, (size_t)n * sizeof inputs[0]);
    return n;
}

/* The backward's aliasing: no gradient output may share memory with an input or with another output. */
static kda_status_t check_bwd_overlaps(const char *fn, const kda_bwd_problem_t *bp) {
    const kda_problem_t *pf = &bp->f;
    const kda_args_t *a = &pf->a;
    const kda_backward_args_t *b = &bp->b;
    const size_t T = (size_t)pf->num_tokens, HQK = (size_t)a->num_qk_heads, HV = (size_t)a->num_v_heads;
    const size_t K = (size_t)a->head_dim_k, V = (size_t)a->head_dim_v;
    const size_t nstate = (size_t)(a->state_indices ? a->num_state_slots : pf->num_seqs);
    span_t inputs[READ_SPANS_MAX + 2];
    int n_in = read_spans(pf, b, inputs);
    if (a->cp_num_ranks > 0) { /* the folds' inputs (the summary calls may write into their own gather) */
        const size_t sb = kda_xcp_summary_bytes(pf) * (size_t)a->cp_num_ranks;
        inputs[n_in++] = (span_t){"problem->cp_summaries", a->cp_pre_ranks > 0 ? a->cp_summaries : NULL,
                                  a->cp_pre_ranks > 0 ? sb : 0};
        inputs[n_in++] =
            (span_t){"cp_summaries", a->cp_post_ranks > 0 ? b->cp_summaries : NULL, a->cp_post_ranks > 0 ? sb : 0};
    }
    const span_t outputs[] = {
        {"dq", b->dq, T * HQK * K * kda_dtype_size(b->dq_dtype)},
        {"dk", b->dk, T * HQK * K * kda_dtype_size(b->dk_dtype)},
        {"dv", b->dv, T * HV * V * kda_dtype_size(b->dv_dtype)},
        {"dg", b->dg, T * HV * K * kda_dtype_size(b->dg_dtype)},
        {"dbeta", b->dbeta, T * HV * kda_dtype_size(b->dbeta_dtype)},
        {"d_initial_state", b->d_initial_state, nstate * HV * K * V * kda_dtype_size(b->d_initial_state_dtype)},
        {"dA_log", b->dA_log, b->dA_log ? HV * 4 : 0},
        {"ddt_bias", b->ddt_bias, b->ddt_bias ? HV * K * 4 : 0},
    };
    const int n_out = (int)(sizeof outputs / sizeof outputs[0]);
    for (int i = 0; i < n_out; i++) {
        for (int j = 0; j < n_in; j++)
            if (overlaps(outputs[i], inputs[j]))
                FAIL(KDA_STATUS_INVALID_VALUE, outputs[i].name, "overlaps the memory of input '%s'", inputs[j].name);
        for (int j = 0; j < i; j++)
            if (overlaps(outputs[i], outputs[j]))
                FAIL(KDA_STATUS_INVALID_VALUE, outputs[i].name, "overlaps the memory of output '%s'", outputs[j].name);
    }
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_check_not_read(const char *fn, const kda_problem_t *p, const kda_backward_args_t *b, const char *name,
                                const void *ptr, size_t bytes) {
    span_t in[READ_SPANS_MAX];
    const int n = read_spans(p, b, in);
    const span_t out = {name, ptr, bytes};
    for (int i = 0; i < n; i++)
        if (overlaps(out, in[i]))
            return kda_error(KDA_STATUS_INVALID_VALUE, "%s: argument '%s': overlaps %s, which the call reads", fn, name,
                             in[i].name);
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_check_backward_args(const kda_context_t *ctx, const kda_backward_args_t *args, const char *fn,
                                     int host_readable, kda_bwd_problem_t *out) {
    (void)ctx;
    if (!args) FAIL(KDA_STATUS_INVALID_VALUE, "args", "NULL");
    TRY(check_struct_size(fn, args->struct_size, KDA_BACKWARD_ARGS_MIN_SIZE, sizeof(kda_backward_args_t),
                          _Alignof(kda_backward_args_t), "kda_backward_args_t", "kda_backward_args_init"));
    kda_bwd_problem_t p;
    memset(&p, 0, sizeof p);
    (kda_backward_args_init)(&p.b);
    memcpy(&p.b, args, args->struct_size);
    p.b.struct_size = sizeof(kda_backward_args_t);
    if (!p.b.problem) FAIL(KDA_STATUS_INVALID_VALUE, "problem", "NULL (the forward's kda_args_t)");
    kda_status_t st = check_problem(p.b.problem, fn, host_readable, 0, &p.f);
    if (st != KDA_STATUS_SUCCESS) return st;
    if (p.f.a.beta_headwise)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "beta_headwise", "the backward of a headwise beta is not implemented");
    if (p.f.a.state_indices_cols > 0)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "state_indices_cols",
             "the backward of per-token state slots (2-D "
             "state_indices) is not implemented");
    p.f.a.o = NULL;
    p.f.a.final_state = NULL;
    const kda_args_t *a = &p.f.a;
    const kda_backward_args_t *b = &p.b;

    /* -- dtypes ------------------------------------------------------------------------------------------ */
    if (!is_float_dtype(b->d_o_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "d_o_dtype", "%s (%d) is not float32, float16 or bfloat16",
             dtype_name(b->d_o_dtype), (int)b->d_o_dtype);
    if (b->d_final_state && !is_state_dtype(b->d_final_state_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "d_final_state_dtype", "%s is not float32 or bfloat16",
             dtype_name(b->d_final_state_dtype));
    if ((st = check_grad_dtype(fn, "dq_dtype", b->dq_dtype, a->dtype, "q")) != KDA_STATUS_SUCCESS) return st;
    if ((st = check_grad_dtype(fn, "dk_dtype", b->dk_dtype, a->dtype, "k")) != KDA_STATUS_SUCCESS) return st;
    if ((st = check_grad_dtype(fn, "dv_dtype", b->dv_dtype, a->dtype, "v")) != KDA_STATUS_SUCCESS) return st;
    if ((st = check_grad_dtype(fn, "dg_dtype", b->dg_dtype, a->g_dtype, "g")) != KDA_STATUS_SUCCESS) return st;
    if ((st = check_grad_dtype(fn, "dbeta_dtype", b->dbeta_dtype, a->beta_dtype, "beta")) != KDA_STATUS_SUCCESS)
        return st;

    /* -- required buffers -------------------------------------------------------------------------------- */
    if (p.f.num_tokens > 0) {
        if (!b->d_o) FAIL(KDA_STATUS_INVALID_VALUE, "d_o", "NULL");
        if (!b->dq) FAIL(KDA_STATUS_INVALID_VALUE, "dq", "NULL");
        if (!b->dk) FAIL(KDA_STATUS_INVALID_VALUE, "dk", "NULL");
        if (!b->dv) FAIL(KDA_STATUS_INVALID_VALUE, "dv", "NULL");
        if (!b->dg) FAIL(KDA_STATUS_INVALID_VALUE, "dg", "NULL");
        if (!b->dbeta) FAIL(KDA_STATUS_INVALID_VALUE, "dbeta", "NULL");
    }
    /* -- optional ones and what they require ------------------------------------------------------------- */
    if (b->d_initial_state) {
        if (!a->initial_state)
            FAIL(KDA_STATUS_INVALID_VALUE, "d_initial_state", "is set but the problem has no initial_state");
        if (!is_state_dtype(b->d_initial_state_dtype))
            FAIL(KDA_STATUS_INVALID_VALUE, "d_initial_state_dtype", "%s is not float32 or bfloat16",
                 dtype_name(b->d_initial_state_dtype));
    }
    if (b->dA_log && !(a->use_gate_in_kernel && a->A_log))
        FAIL(KDA_STATUS_INVALID_VALUE, "dA_log",
             "is set but the problem has no A_log (use_gate_in_kernel with "
             "A_log)");
    if (b->ddt_bias && !(a->use_gate_in_kernel && a->dt_bias))
        FAIL(KDA_STATUS_INVALID_VALUE, "ddt_bias",
             "is set but the problem has no dt_bias (use_gate_in_kernel "
             "with dt_bias)");

    TRY(check_bwd_overlaps(fn, &p));

    /* -- the longest sequence (workspace of the CPU backends) ----------------------------------------------- */
    p.max_seq_len = a->cu_seqlens ? 0 : a->seq_len;
    if (a->cu_seqlens && host_readable)
        for (int64_t n = 0; n < p.f.num_seqs; n++) {
            const int64_t len = read_offset(a->cu_seqlens, a->cu_seqlens_dtype, n + 1) -
                                read_offset(a->cu_seqlens, a->cu_seqlens_dtype, n);
            if (len > p.max_seq_len) p.max_seq_len = len;
        }
    else if (a->cu_seqlens) p.max_seq_len = a->seq_len;

    p.f.bwd = 1;
    *out = p;
    out->b.problem = &out->f.a;
    return KDA_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * Distinct slots (host-readable state_indices, already range-checked). The slots a call touches form a
 * stream of items in sequence order: 1-D, state_indices[n] for each n; 2-D, for each row n its written slots
 * (columns [0, len_n)), then the slot it reads (column num_accepted_tokens[n] - 1) unless that is one of its
 * own written slots. Negative slots are no item. The items must be pairwise distinct; the call reports the
 * first item that repeats an earlier one.
 *
 * Time and memory do not depend on num_state_slots, and nothing is allocated: a 16 KB table on the stack.
 * Two ways to find the repeats, the cheaper for the call: (a) an open-addressing hash set of up to
 * SLOT_BLOCK items at a time (block nested loop: a block's items are inserted, then every later item is
 * looked up), one pass for up to SLOT_BLOCK items, O(items^2 / SLOT_BLOCK) beyond; (b) a bitmap of
 * SLOT_WINDOW slot values at a time, one pass over the items per window of the pool (pools of up to
 * SLOT_WINDOW slots: one pass). Both stop at the first repeat found so far, so they report the same item.
 * ------------------------------------------------------------------------------------------------------- */
#define SLOT_TABLE 4096                        /* int32 entries: 16 KB */
#define SLOT_BLOCK (SLOT_TABLE / 2)            /* items per hash block: the table at most half full */
#define SLOT_WINDOW ((int64_t)SLOT_TABLE * 32) /* slot values per bitmap window (the same 16 KB) */

/* A position in the item stream: row n, and t: 1-D 0; 2-D t < len a written column, t = len the read. */
typedef struct {
    int64_t n, t, len;
} slot_cursor_t;

static int64_t slot_row_len(const kda_problem_t *p, int64_t n) {
    if (p->a.state_indices_cols == 0 || n >= p->num_seqs) return 0;
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    return eos - bos;
}

static slot_cursor_t slot_first(const kda_problem_t *p) {
    const slot_cursor_t c = {0, 0, slot_row_len(p, 0)};
    return c;
}

static void slot_next(const kda_problem_t *p, slot_cursor_t *c) {
    if (++c->t > (p->a.state_indices_cols ? c->len : 0)) {
        c->n++;
        c->t = 0;
        c->len = slot_row_len(p, c->n);
    }
}

static int slot_before(slot_cursor_t x, slot_cursor_t y) { return x.n < y.n || (x.n == y.n && x.t < y.t); }

/* The slot of the item at c, or -1 when it is no item (negative, or a read of the row's own slot). */
static int64_t slot_at(const kda_problem_t *p, slot_cursor_t c) {
    const kda_args_t *a = &p->a;
    if (a->state_indices_cols == 0) return a->state_indices[c.n];
    const int32_t *row = a->state_indices + c.n * p->idx_stride;
    if (c.t < c.len) return row[c.t];
    const int64_t r = row[a->num_accepted_tokens ? a->num_accepted_tokens[c.n] - 1 : 0];
    for (int64_t t = 0; t < c.len; t++)
        if (row[t] == r) return -1;
    return r;
}

/* Hash set of int32 slots (-1: empty) in a power-of-two table of 2^bits entries. Returns 1 when s was in it. */
static int slot_insert(int32_t *table, int bits, int64_t s, int insert) {
    const uint32_t mask = ((uint32_t)1 << bits) - 1;
    for (uint32_t h = ((uint32_t)s * 0x9E3779B1u) >> (32 - bits);; h = (h + 1) & mask) {
        if (table[h] == (int32_t)s) return 1;
        if (table[h] < 0) {
            if (insert) table[h] = (int32_t)s;
            return 0;
        }
    }
}

/* (a): the first repeated item, or the end of the stream when none. */
static slot_cursor_t first_repeat_hashed(const kda_problem_t *p, int32_t *table) {
    const slot_cursor_t end = {p->num_seqs, 0, 0};
    slot_cursor_t best = end, blk = slot_first(p);
    while (slot_before(blk, best)) {
        int bits = 4; /* a table of at least twice the block's items (fewer for small calls) */
        int64_t n_items = 0;
        for (slot_cursor_t c = blk; slot_before(c, best) && n_items < SLOT_BLOCK; slot_next(p, &c)) n_items++;
        while (((int64_t)1 << bits) < 2 * n_items) bits++;
        memset(table, 0xff, sizeof(int32_t) << bits);
        slot_cursor_t c = blk;
        for (int64_t items = 0; slot_before(c, best) && items < SLOT_BLOCK; slot_next(p, &c)) {
            const int64_t s = slot_at(p, c);
            if (s < 0) continue;
            if (slot_insert(table, bits, s, 1)) {
                best = c;
                break;
            }
            items++;
        }
        blk = c;
        for (slot_cursor_t d = c; slot_before(d, best); slot_next(p, &d)) {
            const int64_t s = slot_at(p, d);
            if (s >= 0 && slot_insert(table, bits, s, 0)) {
                best = d;
                break;
            }
        }
    }
    return best;
}

/* (b): the same, by windows of slot values. */
static slot_cursor_t first_repeat_windowed(const kda_problem_t *p, uint64_t *bm, int64_t slots) {
    const slot_cursor_t end = {p->num_seqs, 0, 0};
    slot_cursor_t best = end;
    for (int64_t w0 = 0; w0 < slots; w0 += SLOT_WINDOW) {
        memset(bm, 0, SLOT_WINDOW / 8);
        for (slot_cursor_t c = slot_first(p); slot_before(c, best); slot_next(p, &c)) {
            const int64_t s = slot_at(p, c) - w0;
            if (s < 0 || s >= SLOT_WINDOW) continue;
            if ((bm[s >> 6] >> (s & 63)) & 1u) {
                best = c;
                break;
            }
            bm[s >> 6] |= (uint64_t)1 << (s & 63);
        }
    }
    return best;
}

kda_status_t kda_check_state_slots(const kda_problem_t *p, const char *fn) {
    const kda_args_t *a = &p->a;
    if (!a->state_indices || p->num_seqs == 0) return KDA_STATUS_SUCCESS;
    uint64_t mem[SLOT_TABLE / 2]; /* the table of either way */
    /* positions in the stream: N (1-D) or Σ (len_n + 1) (2-D), each len_n <= T_max */
    int64_t items = p->num_seqs;
    if (a->state_indices_cols > 0)
        for (int64_t n = 0; n < p->num_seqs; n++) items += slot_row_len(p, n);
    /* slot values are int32: a pool's slots past 2^31 - 1 are never named */
    const int64_t slots = a->num_state_slots < ((int64_t)1 << 31) ? a->num_state_slots : ((int64_t)1 << 31);
    const int64_t hashed_passes = (items + SLOT_BLOCK - 1) / SLOT_BLOCK;
    const int64_t windows = (slots + SLOT_WINDOW - 1) / SLOT_WINDOW;
    const slot_cursor_t r =
        windows < hashed_passes ? first_repeat_windowed(p, mem, slots) : first_repeat_hashed(p, (int32_t *)(void *)mem);
    if (r.n >= p->num_seqs) return KDA_STATUS_SUCCESS;
    const int64_t s = slot_at(p, r), n = r.n;
    if (a->state_indices_cols == 0) {
        int64_t m = 0;
        while (m < n && a->state_indices[m] != s) m++;
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices",
             "state_indices[%lld] and state_indices[%lld] are both "
             "%lld; slots must be distinct",
             (long long)m, (long long)n, (long long)s);
    }
    if (r.t < r.len)
        FAIL(KDA_STATUS_INVALID_VALUE, "state_indices",
             "slot %lld (state_indices[%lld][%lld]) is touched twice in "
             "one call; the slots of a call must be distinct",
             (long long)s, (long long)n, (long long)r.t);
    const int64_t rd = a->num_accepted_tokens ? a->num_accepted_tokens[n] - 1 : 0;
    FAIL(KDA_STATUS_INVALID_VALUE, "state_indices",
         "slot %lld (state_indices[%lld][%lld], the slot sequence %lld "
         "reads) is touched by another sequence of the call",
         (long long)s, (long long)n, (long long)rd, (long long)n);
}

/* ---------------------------------------------------------------------------------------------------------
 * Context parallelism across ranks: the cp_* fields (docs/API.md §14, docs/ALGORITHM.md §4a)
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_XCP_MAX_RANKS (1 << 20)

size_t kda_xcp_summary_bytes(const kda_problem_t *p) {
    const kda_args_t *a = &p->a;
    if (a->cp_num_ranks <= 0) return 0;
    const size_t el = a->cp_summary_dtype == KDA_FLOAT64 ? 8 : 4;
    size_t n = 0;
    if (__builtin_mul_overflow((size_t)a->num_v_heads * (size_t)a->head_dim_k,
                               (size_t)a->head_dim_k + (size_t)a->head_dim_v, &n) ||
        __builtin_mul_overflow(n, el, &n))
        return SIZE_MAX;
    return n;
}

/* `bytes` at `ptr` hold the R gathered summaries of problem p (arg: the field names for the message) */
static kda_status_t check_gathered(const char *fn, const kda_problem_t *p, const void *ptr, size_t bytes,
                                   const char *arg, const char *bytes_arg, const char *why) {
    const int32_t R = p->a.cp_num_ranks;
    if (!ptr)
        FAIL(KDA_STATUS_INVALID_VALUE, arg,
             "NULL, but %s: the all-gathered summaries of the %d ranks are "
             "needed",
             why, (int)R);
    size_t need = 0;
    if (__builtin_mul_overflow(kda_xcp_summary_bytes(p), (size_t)R, &need) || bytes < need)
        FAIL(KDA_STATUS_INVALID_VALUE, bytes_arg,
             "%zu bytes given, %d ranks' summaries of %zu bytes each (%s "
             "elements; kda_cp_summary_size) need %zu",
             bytes, (int)R, kda_xcp_summary_bytes(p), p->a.cp_summary_dtype == KDA_FLOAT64 ? "float64" : "float32",
             need);
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_check_xcp(const char *fn, const kda_problem_t *p, int call) {
    const kda_args_t *a = &p->a;
    if (a->cp_summary_dtype != KDA_FLOAT32 && a->cp_summary_dtype != KDA_FLOAT64)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_summary_dtype", "%s is neither float32 nor float64",
             dtype_name(a->cp_summary_dtype));
    const int32_t R = a->cp_num_ranks;
    if (R < 0 || R > KDA_XCP_MAX_RANKS)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_num_ranks", "%d is outside [0, %d] (0: no split across ranks)", (int)R,
             KDA_XCP_MAX_RANKS);
    if (R == 0) {
        if (a->cp_rank) FAIL(KDA_STATUS_INVALID_VALUE, "cp_rank", "%d is set but cp_num_ranks is 0", (int)a->cp_rank);
        if (a->cp_pre_ranks)
            FAIL(KDA_STATUS_INVALID_VALUE, "cp_pre_ranks", "%d is set but cp_num_ranks is 0", (int)a->cp_pre_ranks);
        if (a->cp_post_ranks)
            FAIL(KDA_STATUS_INVALID_VALUE, "cp_post_ranks", "%d is set but cp_num_ranks is 0", (int)a->cp_post_ranks);
        if (a->cp_summaries) FAIL(KDA_STATUS_INVALID_VALUE, "cp_summaries", "set but cp_num_ranks is 0");
        if (a->cp_primed)
            FAIL(KDA_STATUS_INVALID_VALUE, "cp_primed", "%d is set but cp_num_ranks is 0", (int)a->cp_primed);
        return KDA_STATUS_SUCCESS;
    }
    if (a->cp_primed != 0 && a->cp_primed != 1)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_primed", "%d is neither 0 nor 1", (int)a->cp_primed);
    if (call == KDA_XCP_DECODE)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_num_ranks",
             "%d: kda_decode takes no split across ranks (kda_forward "
             "runs it)",
             (int)R);
    if (a->cp_rank < 0 || a->cp_rank >= R)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_rank", "%d is outside [0, cp_num_ranks = %d)", (int)a->cp_rank, (int)R);
    if (a->cp_pre_ranks < 0 || a->cp_pre_ranks > a->cp_rank)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_pre_ranks",
             "%d is outside [0, cp_rank = %d]: only the ranks before "
             "this one can chain into its first sequence",
             (int)a->cp_pre_ranks, (int)a->cp_rank);
    if (a->cp_post_ranks < 0 || a->cp_post_ranks > R - 1 - a->cp_rank)
        FAIL(KDA_STATUS_INVALID_VALUE, "cp_post_ranks",
             "%d is outside [0, cp_num_ranks - 1 - cp_rank = %d]: only "
             "the ranks after this one can continue its last sequence",
             (int)a->cp_post_ranks, (int)(R - 1 - a->cp_rank));
    if (p->num_seqs == 0 && (a->cp_pre_ranks || a->cp_post_ranks))
        FAIL(KDA_STATUS_INVALID_VALUE, a->cp_pre_ranks ? "cp_pre_ranks" : "cp_post_ranks",
             "%d, but this rank holds "
             "no sequence to continue (a slice a sequence passes through is one empty sequence)",
             (int)(a->cp_pre_ranks ? a->cp_pre_ranks : a->cp_post_ranks));
    if (a->beta_headwise)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "beta_headwise",
             "a headwise beta has no K x K state map: it cannot be split "
             "across ranks");
    if (a->state_indices && a->state_indices_cols > 0)
        FAIL(KDA_STATUS_NOT_SUPPORTED, "state_indices_cols",
             "%lld: per-token state slots cannot be split across "
             "ranks",
             (long long)a->state_indices_cols);
    if (call == KDA_XCP_SUMMARY) return KDA_STATUS_SUCCESS;
    if (a->cp_pre_ranks > 0)
        TRY(check_gathered(fn, p, a->cp_summaries, a->cp_summaries_bytes, "cp_summaries", "cp_summaries_bytes",
                           "cp_pre_ranks > 0"));
    if (a->cp_pre_ranks > 0) { /* the fold's input must not be written by the call */
        size_t sb = kda_xcp_summary_bytes(p) * (size_t)R;
        const size_t T = (size_t)p->num_tokens, HV = (size_t)a->num_v_heads;
        const size_t KV = (size_t)a->head_dim_k * (size_t)a->head_dim_v;
        const size_t nstate = (size_t)(a->state_indices ? a->num_state_slots : p->num_seqs);
        const span_t sums = {"cp_summaries", a->cp_summaries, sb};
        const span_t outs[] = {
            {"o", a->o, T * HV * (size_t)a->head_dim_v * kda_dtype_size(a->o_dtype)},
            {"final_state", a->final_state, nstate * HV * KV * kda_dtype_size(a->final_state_dtype)},
            {"chunk_states", a->chunk_states,
             a->chunk_states ? (size_t)p->chunk_rows * HV * KV * kda_dtype_size(a->chunk_states_dtype) : 0},
            {"saved", a->saved, a->saved ? a->saved_bytes : 0},
        };
        for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
            if (overlaps(sums, outs[i]))
                FAIL(KDA_STATUS_INVALID_VALUE, "cp_summaries", "overlaps %s, which the call writes", outs[i].name);
    }
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_check_xcp_backward(const char *fn, const kda_bwd_problem_t *bp) {
    const kda_args_t *a = &bp->f.a;
    const kda_backward_args_t *b = &bp->b;
    if (a->cp_num_ranks == 0) {
        if (b->cp_summaries) FAIL(KDA_STATUS_INVALID_VALUE, "cp_summaries", "set but problem->cp_num_ranks is 0");
        return KDA_STATUS_SUCCESS;
    }
    if (a->cp_post_ranks > 0)
        TRY(check_gathered(fn, &bp->f, b->cp_summaries, b->cp_summaries_bytes, "cp_summaries", "cp_summaries_bytes",
                           "problem->cp_post_ranks > 0"));
    return KDA_STATUS_SUCCESS;
}
