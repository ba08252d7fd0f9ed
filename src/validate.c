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
    case KDA_FLOAT32: return "float32";
    case KDA_FLOAT16: return "float16";
    case KDA_BFLOAT16: return "bfloat16";
    case KDA_INT32: return "int32";
    case KDA_INT64: return "int64";
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
            FAIL(KDA_STATUS_INVALID_VALUE, arg, "not monotone (%s[%lld] = %lld < %s[%lld] = %lld)", arg,
                 (long long)i, (long long)b, arg, (long long)(i - 1), (long long)a);
    }
    int64_t last = read_offset(cu, dt, n);
    if (last != total)
        FAIL(KDA_STATUS_INVALID_VALUE, arg, "must end at seq_len = %lld (%s[%lld] = %lld)", (long long)total, arg,
             (long long)n, (long long)last);
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_check_args(const kda_context_t *ctx, const kda_args_t *args, const char *fn, int host_readable,
                            kda_problem_t *out) {
    (void)ctx;
    if (!args) FAIL(KDA_STATUS_INVALID_VALUE, "args", "NULL");
    if (args->struct_size < KDA_ARGS_MIN_SIZE)
        FAIL(KDA_STATUS_INVALID_VALUE, "struct_size", "%zu is smaller than the first kda_args_t (%zu bytes); "
             "initialise the struct with kda_args_init()", args->struct_size, (size_t)KDA_ARGS_MIN_SIZE);
    if (args->struct_size > sizeof(kda_args_t))
        FAIL(KDA_STATUS_NOT_SUPPORTED, "struct_size", "%zu is larger than this library's sizeof(kda_args_t) = %zu: "
             "the program was built against a newer libkda", args->struct_size, sizeof(kda_args_t));

    /* an older program's shorter struct: the fields it lacks take their defaults */
    kda_problem_t p;
    memset(&p, 0, sizeof p);
    (kda_args_init)(&p.a);
    memcpy(&p.a, args, args->struct_size);
    p.a.struct_size = sizeof(kda_args_t);
    const kda_args_t *a = &p.a;

    /* -- sizes ------------------------------------------------------------------------------------------- */
    if (a->batch < 0) FAIL(KDA_STATUS_INVALID_VALUE, "batch", "%lld is negative", (long long)a->batch);
    if (a->seq_len < 0) FAIL(KDA_STATUS_INVALID_VALUE, "seq_len", "%lld is negative", (long long)a->seq_len);
    if (a->num_qk_heads < 1)
        FAIL(KDA_STATUS_INVALID_VALUE, "num_qk_heads", "%d must be at least 1", a->num_qk_heads);
    if (a->num_v_heads < 1) FAIL(KDA_STATUS_INVALID_VALUE, "num_v_heads", "%d must be at least 1", a->num_v_heads);
    if (a->num_v_heads % a->num_qk_heads != 0)
        FAIL(KDA_STATUS_INVALID_VALUE, "num_v_heads", "%d is not a multiple of num_qk_heads = %d", a->num_v_heads,
             a->num_qk_heads);
    if (a->head_dim_k < 1 || a->head_dim_k > KDA_MAX_HEAD_DIM)
        FAIL(KDA_STATUS_INVALID_VALUE, "head_dim_k", "%d is outside [1, %d]", a->head_dim_k, KDA_MAX_HEAD_DIM);
    if (a->head_dim_v < 1 || a->head_dim_v > KDA_MAX_HEAD_DIM)
        FAIL(KDA_STATUS_INVALID_VALUE, "head_dim_v", "%d is outside [1, %d]", a->head_dim_v, KDA_MAX_HEAD_DIM);
    /* every element count must fit comfortably in int64 */
    if (a->batch > 0 && a->seq_len > ((int64_t)1 << 40) / a->batch)
        FAIL(KDA_STATUS_INVALID_VALUE, "seq_len", "batch * seq_len = %lld * %lld is too large",
             (long long)a->batch, (long long)a->seq_len);
    p.num_tokens = a->batch * a->seq_len;
    if (p.num_tokens > ((int64_t)1 << 52) / ((int64_t)a->num_v_heads * 256))
        FAIL(KDA_STATUS_INVALID_VALUE, "seq_len", "%lld tokens of %d value heads is too large",
             (long long)p.num_tokens, a->num_v_heads);
    p.group = a->num_v_heads / a->num_qk_heads;

    /* -- dtypes ------------------------------------------------------------------------------------------ */
    if (!is_float_dtype(a->dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "dtype", "%s (%d) is not float32, float16 or bfloat16",
             dtype_name(a->dtype), (int)a->dtype);
    if (!is_float_dtype(a->g_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "g_dtype", "%s (%d) is not float32, float16 or bfloat16",
             dtype_name(a->g_dtype), (int)a->g_dtype);
    if (!is_float_dtype(a->beta_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "beta_dtype", "%s (%d) is not float32, float16 or bfloat16",
             dtype_name(a->beta_dtype), (int)a->beta_dtype);
    if (!is_float_dtype(a->o_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "o_dtype", "%s (%d) is not float32, float16 or bfloat16",
             dtype_name(a->o_dtype), (int)a->o_dtype);

    /* -- sequences --------------------------------------------------------------------------------------- */
    if (a->cu_seqlens) {
        p.varlen = 1;
        if (a->batch != 1)
            FAIL(KDA_STATUS_INVALID_VALUE, "batch", "must be 1 with cu_seqlens (got %lld); flatten the rows",
                 (long long)a->batch);
        if (a->cu_seqlens_dtype != KDA_INT32 && a->cu_seqlens_dtype != KDA_INT64)
            FAIL(KDA_STATUS_INVALID_VALUE, "cu_seqlens_dtype", "%s is not int32 or int64",
                 dtype_name(a->cu_seqlens_dtype));
        if (a->num_seqs < 0) FAIL(KDA_STATUS_INVALID_VALUE, "num_seqs", "%lld is negative", (long long)a->num_seqs);
        if (a->cu_seqlens_host && host_readable)
            FAIL(KDA_STATUS_INVALID_VALUE, "cu_seqlens_host", "is for the CUDA backend; on the CPU pass the host "
                 "array as cu_seqlens");
        const void *readable = host_readable ? a->cu_seqlens : a->cu_seqlens_host;
        if (readable) {
            kda_status_t st = check_cu_seqlens(fn, host_readable ? "cu_seqlens" : "cu_seqlens_host", readable,
                                               a->cu_seqlens_dtype, a->num_seqs, a->seq_len);
            if (st != KDA_STATUS_SUCCESS) return st;
        }
        p.num_seqs = a->num_seqs;
    } else {
        if (a->num_seqs != 0)
            FAIL(KDA_STATUS_INVALID_VALUE, "num_seqs", "%lld is set but cu_seqlens is NULL", (long long)a->num_seqs);
        if (a->cu_seqlens_host)
            FAIL(KDA_STATUS_INVALID_VALUE, "cu_seqlens_host", "is set but cu_seqlens is NULL");
        p.num_seqs = a->batch;
    }

    /* -- tensors ----------------------------------------------------------------------------------------- */
    if (p.num_tokens > 0) {
        if (!a->q) FAIL(KDA_STATUS_INVALID_VALUE, "q", "NULL");
        if (!a->k) FAIL(KDA_STATUS_INVALID_VALUE, "k", "NULL");
        if (!a->v) FAIL(KDA_STATUS_INVALID_VALUE, "v", "NULL");
        if (!a->g) FAIL(KDA_STATUS_INVALID_VALUE, "g", "NULL");
        if (!a->beta) FAIL(KDA_STATUS_INVALID_VALUE, "beta", "NULL");
        if (!a->o) FAIL(KDA_STATUS_INVALID_VALUE, "o", "NULL");
        if (a->o == a->q || a->o == a->k || a->o == a->v || a->o == a->g)
            FAIL(KDA_STATUS_INVALID_VALUE, "o", "must not be the memory of an input");
    }

    /* -- states ------------------------------------------------------------------------------------------ */
    if (a->initial_state && !is_state_dtype(a->initial_state_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "initial_state_dtype", "%s is not float32 or bfloat16",
             dtype_name(a->initial_state_dtype));
    if (a->final_state && !is_state_dtype(a->final_state_dtype))
        FAIL(KDA_STATUS_INVALID_VALUE, "final_state_dtype", "%s is not float32 or bfloat16",
             dtype_name(a->final_state_dtype));
    if (a->initial_state && a->initial_state == a->final_state &&
        a->initial_state_dtype != a->final_state_dtype)
        FAIL(KDA_STATUS_INVALID_VALUE, "final_state", "is the memory of initial_state but its dtype differs "
             "(%s vs %s)", dtype_name(a->final_state_dtype), dtype_name(a->initial_state_dtype));
    if (a->state_indices) {
        if (!a->initial_state && !a->final_state)
            FAIL(KDA_STATUS_INVALID_VALUE, "state_indices", "is set but neither initial_state nor final_state is");
        if (a->num_state_slots < 1)
            FAIL(KDA_STATUS_INVALID_VALUE, "num_state_slots", "%lld must be at least 1 with state_indices",
                 (long long)a->num_state_slots);
        if (host_readable) {
            for (int64_t n = 0; n < p.num_seqs; n++) {
                int64_t s = a->state_indices[n];
                if (s >= a->num_state_slots)
                    FAIL(KDA_STATUS_INVALID_VALUE, "state_indices", "state_indices[%lld] = %lld is not below "
                         "num_state_slots = %lld", (long long)n, (long long)s, (long long)a->num_state_slots);
            }
            /* distinct: quadratic only for few sequences, else a bitmap would need memory; decode batches
               are small and prefill batches rarely use a pool, so check up to 4096 sequences */
            if (p.num_seqs <= 4096) {
                for (int64_t n = 0; n < p.num_seqs; n++) {
                    if (a->state_indices[n] < 0) continue;
                    for (int64_t m = 0; m < n; m++)
                        if (a->state_indices[m] == a->state_indices[n])
                            FAIL(KDA_STATUS_INVALID_VALUE, "state_indices", "state_indices[%lld] and "
                                 "state_indices[%lld] are both %d; slots must be distinct", (long long)m,
                                 (long long)n, a->state_indices[n]);
                }
            }
        }
    } else if (a->num_state_slots != 0) {
        FAIL(KDA_STATUS_INVALID_VALUE, "num_state_slots", "%lld is set but state_indices is NULL",
             (long long)a->num_state_slots);
    }

    /* -- options ----------------------------------------------------------------------------------------- */
    if (!isfinite(a->scale)) FAIL(KDA_STATUS_INVALID_VALUE, "scale", "%g is not finite", (double)a->scale);
    p.scale = a->scale != 0.0f ? a->scale : (float)(1.0 / sqrt((double)a->head_dim_k));

    if (a->lower_bound != 0.0f) {
        if (!isfinite(a->lower_bound) || a->lower_bound > 0.0f)
            FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound", "%g must be finite and negative (0 means unset)",
                 (double)a->lower_bound);
        if (!a->use_gate_in_kernel)
            FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound", "is set but use_gate_in_kernel is 0 (the bound shapes "
                 "the in-kernel gate only)");
        p.has_lower_bound = 1;
    }
    if (a->use_gate_in_kernel) {
        if (!a->A_log && !p.has_lower_bound)
            FAIL(KDA_STATUS_INVALID_VALUE, "A_log", "NULL; it is required with use_gate_in_kernel unless "
                 "lower_bound is set");
        if (a->safe_gate) {
            if (!p.has_lower_bound)
                FAIL(KDA_STATUS_INVALID_VALUE, "lower_bound", "must be set when safe_gate and use_gate_in_kernel "
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

    *out = p;
    return KDA_STATUS_SUCCESS;
}
