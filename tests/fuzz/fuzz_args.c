/*
 * libFuzzer harness over the argument checks and small problems of kda_forward / kda_decode (CPU and reference
 * backends), built with clang -fsanitize=fuzzer,address,undefined,float-cast-overflow (tests/fuzz/run.sh).
 *
 * The input bytes choose a problem — sizes (with negative and huge values), dtypes (with invalid ones),
 * varlen offsets, state pools and indices, flags, an output aliased into an input, a short or missing
 * workspace, the backend and the entry point — and the values of every tensor (finite, huge, ±inf, NaN).
 * Every buffer is allocated at its exact size, so the sanitizers see any access past it. Contract checks
 * (a violation aborts, which libFuzzer reports like a crash):
 *   - on error: a known status, a message "<fn>: argument '<name>': ...", and every buffer (inputs and
 *     outputs) byte-identical to before the call;
 *   - on success: o fully written (a signalling-NaN sentinel, which no arithmetic produces, is gone from every
 *     element), every input unchanged (initial_state excepted when it is the in-place pool), and the pool
 *     slots that no sequence names byte-identical;
 *   - with tame values (|x| <= 2, l2norm on, β <= 1, no huge values), the NaN pattern of o and of the final
 *     state is the same on the CPU forward, the CPU decode and the fp64 oracle (the non-finite contract).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda.h"

#define CHECK(cond, ...)                                                                                    \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "contract violation: %s: ", #cond);                                             \
            fprintf(stderr, __VA_ARGS__);                                                                   \
            fprintf(stderr, "\n");                                                                          \
            abort();                                                                                        \
        }                                                                                                   \
    } while (0)

/* ---------------------------------------------------------------------------------------------------------
 * Reading the input
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *d;
    size_t n, i;
    uint64_t lcg; /* values past the end of the input */
} reader_t;

static uint8_t r8(reader_t *r) {
    if (r->i < r->n) return r->d[r->i++];
    r->lcg = r->lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (uint8_t)(r->lcg >> 56);
}

#define PICK(r, table) ((table)[r8(r) % (sizeof(table) / sizeof((table)[0]))])

/* ---------------------------------------------------------------------------------------------------------
 * Buffers: each allocated at its exact size, with a copy to compare against
 * ------------------------------------------------------------------------------------------------------- */
enum { B_Q, B_K, B_V, B_G, B_BETA, B_O, B_H0, B_HT, B_ALOG, B_DTB, B_CU, B_IDX, B_CS, NBUF };
static const char *buf_name[NBUF] = {"q", "k", "v", "g", "beta", "o", "initial_state", "final_state",
                                     "A_log", "dt_bias", "cu_seqlens", "state_indices", "chunk_states"};

typedef struct {
    void *p[NBUF];
    size_t bytes[NBUF];
    void *copy[NBUF];
} buffers_t;

#define CAP_BYTES ((size_t)1 << 22) /* larger tensors are left NULL: the call must then refuse or write nothing */

static int64_t sat_mul(int64_t a, int64_t b) {
    if (a <= 0 || b <= 0) return 0;
    if (a > INT64_MAX / b) return INT64_MAX;
    return a * b;
}

static void *alloc_buf(buffers_t *b, int i, int64_t elems, size_t es) {
    if (elems <= 0 || elems > (int64_t)(CAP_BYTES / (es ? es : 1))) return NULL;
    b->bytes[i] = (size_t)elems * es;
    b->p[i] = malloc(b->bytes[i]);
    return b->p[i];
}

static void snapshot(buffers_t *b) {
    for (int i = 0; i < NBUF; i++) {
        b->copy[i] = b->p[i] ? malloc(b->bytes[i]) : NULL;
        if (b->p[i]) memcpy(b->copy[i], b->p[i], b->bytes[i]);
    }
}

static void free_buffers(buffers_t *b) {
    for (int i = 0; i < NBUF; i++) {
        free(b->p[i]);
        free(b->copy[i]);
    }
}

static size_t dsize(kda_dtype_t d) {
    size_t s = kda_dtype_size(d);
    return s ? s : 4; /* an invalid dtype: the call refuses it; allocate as float32 */
}

/* Values of a float tensor: a table of finite, huge and non-finite values; `tame` keeps |x| <= 2 and no huge. */
static float value(reader_t *r, int tame) {
    static const float any[] = {0.0f, 1.0f, -1.0f, 0.5f, -0.25f, 2.0f, 1e30f, -1e30f, INFINITY, -INFINITY, NAN,
                                1e-30f, 3.0f, -3.0f, 65504.0f, 1e5f};
    static const float gentle[] = {0.0f, 1.0f, -1.0f, 0.5f, -0.25f, 2.0f, 0.75f, -2.0f};
    static const float special[] = {INFINITY, -INFINITY, NAN};
    if (!tame) return PICK(r, any);
    uint8_t u = r8(r);
    return u < 250 ? gentle[u % 8] : special[u % 3];
}

static void fill(reader_t *r, void *p, kda_dtype_t dt, int64_t n, int tame) {
    for (int64_t i = 0; i < n; i++) {
        const float x = value(r, tame);
        uint32_t u;
        memcpy(&u, &x, 4);
        if (dt == KDA_BFLOAT16) {
            uint16_t h = (uint16_t)(u >> 16);
            memcpy((char *)p + 2 * i, &h, 2);
        } else if (dt == KDA_FLOAT16) {
            uint16_t h = isnan(x) ? 0x7e00 : isinf(x) || fabsf(x) > 65504.0f ? (x < 0 ? 0xfc00 : 0x7c00)
                         : (uint16_t)0x3c00; /* finite values other than ±inf: 1.0 is enough here */
            if (x == 0.0f) h = 0;
            memcpy((char *)p + 2 * i, &h, 2);
        } else {
            memcpy((char *)p + 4 * i, &x, 4);
        }
    }
}

/* A signalling NaN that arithmetic never produces (quiet NaNs only), to find unwritten outputs. */
static void sentinel(void *p, kda_dtype_t dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (dt == KDA_FLOAT32) {
            const uint32_t u = 0x7f80dead;
            memcpy((char *)p + 4 * i, &u, 4);
        } else {
            const uint16_t u = dt == KDA_FLOAT16 ? 0x7c01 : 0x7f81;
            memcpy((char *)p + 2 * i, &u, 2);
        }
    }
}

static int is_sentinel(const void *p, kda_dtype_t dt, int64_t i) {
    if (dt == KDA_FLOAT32) {
        uint32_t u;
        memcpy(&u, (const char *)p + 4 * i, 4);
        return u == 0x7f80dead;
    }
    uint16_t u;
    memcpy(&u, (const char *)p + 2 * i, 2);
    return u == (dt == KDA_FLOAT16 ? 0x7c01 : 0x7f81);
}

static int is_nan_at(const void *p, kda_dtype_t dt, int64_t i) {
    if (dt == KDA_FLOAT32) {
        float x;
        memcpy(&x, (const char *)p + 4 * i, 4);
        return isnan(x);
    }
    uint16_t u;
    memcpy(&u, (const char *)p + 2 * i, 2);
    return dt == KDA_FLOAT16 ? (u & 0x7fff) > 0x7c00 : (u & 0x7fff) > 0x7f80;
}

/* ---------------------------------------------------------------------------------------------------------
 * Contexts: made once (thread start-up is not what is fuzzed)
 * ------------------------------------------------------------------------------------------------------- */
static kda_context_t *context(int which) {
    static kda_context_t *ctx[2];
    if (!ctx[which]) {
        CHECK(kda_create(&ctx[which], which ? KDA_BACKEND_REFERENCE : KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS,
              "kda_create: %s", kda_last_error());
        if (!which) CHECK(kda_set_num_threads(ctx[which], 2) == KDA_STATUS_SUCCESS, "threads");
    }
    return ctx[which];
}

/* One call with a fresh workspace of `ws_mode`: 0 exact, 1 one byte short, 2 NULL, 3 exact at an odd address. */
static kda_status_t call(kda_context_t *ctx, const kda_args_t *a, int decode, int ws_mode, const char **fn) {
    *fn = decode ? "kda_decode" : "kda_forward";
    size_t need = 0;
    kda_status_t st = decode ? kda_decode_workspace_size(ctx, a, &need) : kda_forward_workspace_size(ctx, a, &need);
    if (st != KDA_STATUS_SUCCESS) {
        *fn = decode ? "kda_decode_workspace_size" : "kda_forward_workspace_size";
        return st;
    }
    CHECK(need < ((size_t)1 << 34), "workspace of %zu bytes for a small problem", need);
    size_t bytes = ws_mode == 1 && need > 0 ? need - 1 : need;
    char *mem = ws_mode == 2 ? NULL : (char *)malloc(bytes + 1);
    void *ws = mem && ws_mode == 3 ? mem + 1 : mem;
    st = decode ? kda_decode(ctx, a, ws, bytes, NULL) : kda_forward(ctx, a, ws, bytes, NULL);
    free(mem);
    return st;
}

static void check_error(kda_status_t st, const char *fn, const buffers_t *b) {
    CHECK(st == KDA_STATUS_INVALID_VALUE || st == KDA_STATUS_NOT_SUPPORTED ||
              st == KDA_STATUS_INSUFFICIENT_WORKSPACE,
          "%s: unexpected status %s: %s", fn, kda_status_string(st), kda_last_error());
    const char *msg = kda_last_error();
    const size_t fl = strlen(fn);
    CHECK(strncmp(msg, fn, fl) == 0 && strncmp(msg + fl, ": argument '", 12) == 0,
          "%s: message does not name an argument: \"%s\"", fn, msg);
    for (int i = 0; i < NBUF; i++)
        CHECK(!b->p[i] || memcmp(b->p[i], b->copy[i], b->bytes[i]) == 0, "%s: %s written on error (%s)", fn,
              buf_name[i], msg);
}

/* ---------------------------------------------------------------------------------------------------------
 * The problem
 * ------------------------------------------------------------------------------------------------------- */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader_t r = {data, size, 0, 0x9e3779b97f4a7c15ull ^ size};
    for (size_t i = 0; i < size; i++) r.lcg = r.lcg * 31 + data[i];

    static const int64_t batches[] = {1, 1, 2, 3, 0, 1, 2, 4, -1, (int64_t)1 << 40, (int64_t)1 << 62, 1};
    static const int64_t seq_lens[] = {1, 2, 3, 5, 7, 16, 17, 0, 4, 9, 33, 65, -1, (int64_t)1 << 62, 2, 1};
    static const int32_t hqks[] = {1, 1, 2, 1, 0, -3, 1, 2};
    static const int32_t groups[] = {1, 2, 1, 3, 1, 2, 1, 1};
    static const int32_t dims[] = {1, 2, 3, 4, 8, 16, 5, 4, 0, 257, 8, 2, 4, 16, 1, 32};
    static const kda_dtype_t dtypes[] = {KDA_FLOAT32, KDA_FLOAT32, KDA_BFLOAT16, KDA_FLOAT16,
                                         KDA_FLOAT32, KDA_BFLOAT16, KDA_INT32,   (kda_dtype_t)42};
    static const float scales[] = {0.0f, 0.0f, 1.0f, 0.5f, 0.0f, NAN, INFINITY, 0.0f};
    static const float bounds[] = {0.0f, 0.0f, 0.0f, -1.0f, -5.0f, -6.0f, 1.0f, NAN};

    const uint8_t mode = r8(&r), flags = r8(&r), opts = r8(&r), misc = r8(&r);
    const int reference = mode & 1, decode = (mode >> 1) & 1, varlen = (mode >> 2) & 1,
              with_h0 = (mode >> 3) & 1, with_ht = (mode >> 4) & 1, in_place = (mode >> 5) & 1,
              with_idx = (mode >> 6) & 1, tame = (mode >> 7) & 1;

    kda_args_t a;
    kda_args_init(&a);
    a.batch = varlen ? ((misc & 7) == 7 ? 2 : 1) : PICK(&r, batches);
    a.num_qk_heads = PICK(&r, hqks);
    a.num_v_heads = a.num_qk_heads * PICK(&r, groups);
    if ((misc >> 3 & 15) == 15) a.num_v_heads = -1;
    a.head_dim_k = PICK(&r, dims);
    a.head_dim_v = PICK(&r, dims);
    a.dtype = PICK(&r, dtypes);
    a.g_dtype = PICK(&r, dtypes);
    a.beta_dtype = PICK(&r, dtypes);
    a.o_dtype = PICK(&r, dtypes);
    a.initial_state_dtype = (flags & 1) ? KDA_BFLOAT16 : KDA_FLOAT32;
    a.final_state_dtype = (flags & 2) ? KDA_BFLOAT16 : KDA_FLOAT32;
    if ((flags & 0xc0) == 0xc0) a.initial_state_dtype = KDA_FLOAT16; /* invalid */
    a.state_v_first = (flags >> 2) & 1;
    a.use_qk_l2norm = tame || ((flags >> 3) & 1);
    a.use_gate_in_kernel = (flags >> 4) & 1;
    a.use_beta_sigmoid = (flags >> 5) & 1;
    a.allow_neg_eigval = a.use_beta_sigmoid && !tame && (opts & 1);
    if (tame && !a.use_beta_sigmoid) a.beta_dtype = KDA_FLOAT32; /* β then in [0, 1] (below) */
    a.scale = PICK(&r, scales);
    a.lower_bound = a.use_gate_in_kernel || (opts & 2) ? PICK(&r, bounds) : 0.0f;
    a.safe_gate = (opts >> 2) & 1;
    /* intra-card context parallelism: checked on every backend, ignored by the CPU ones (drawn from a hash of the
       input, so that the corpus keeps its meaning) */
    static const kda_cp_mode_t cp_modes[] = {KDA_CP_AUTO, KDA_CP_AUTO, KDA_CP_OFF, KDA_CP_ON,
                                             KDA_CP_ON,   KDA_CP_ON,   KDA_CP_ON,  (kda_cp_mode_t)3};
    static const int64_t cp_lens[] = {0, 64, 0, 64, 128, 96, 0, (int64_t)KDA_CP_MAX_PIECE_LEN + 64};
    a.cp_mode = cp_modes[(r.lcg >> 40) & 7];
    a.cp_piece_len = cp_lens[(r.lcg >> 43) & 7];
    if (a.cp_mode == KDA_CP_AUTO && ((r.lcg >> 46) & 3) != 0) a.cp_piece_len = 0; /* mostly valid */
    if ((opts & 0x38) == 0x38) a.struct_size = (misc & 0x80) ? sizeof(kda_args_t) + 8 : 16;

    buffers_t b;
    memset(&b, 0, sizeof b);

    /* sequences */
    int64_t num_seqs = a.batch;
    if (varlen) {
        num_seqs = (int64_t)(r8(&r) % 6) - ((opts & 0xc0) == 0xc0 ? 2 : 0); /* -2..5 */
        a.num_seqs = num_seqs;
        a.cu_seqlens_dtype = (opts & 0x40) ? KDA_INT64 : KDA_INT32;
        if ((misc & 0x70) == 0x70) a.cu_seqlens_dtype = KDA_FLOAT32;
        int64_t total = 0;
        if (num_seqs >= 0) {
            const size_t es = a.cu_seqlens_dtype == KDA_INT64 ? 8 : 4;
            void *cu = alloc_buf(&b, B_CU, num_seqs + 1, es);
            for (int64_t n = 0; n <= num_seqs; n++) {
                int64_t len = n == 0 ? 0 : PICK(&r, seq_lens);
                if (len < 0 || len > 70) len = (r8(&r) & 1) ? -1 : 0; /* occasionally not monotone */
                total = n == 0 ? 0 : total + len;
                if (es == 8) ((int64_t *)cu)[n] = total;
                else ((int32_t *)cu)[n] = (int32_t)total;
            }
            if (r8(&r) == 0) { /* a wrong start or end */
                if (es == 8) ((int64_t *)cu)[num_seqs] += 1;
                else ((int32_t *)cu)[0] = 1;
            }
            a.cu_seqlens = cu;
        }
        a.seq_len = total < 0 ? 0 : total;
    } else {
        a.seq_len = PICK(&r, seq_lens);
        if ((misc & 0x70) == 0x60) a.num_seqs = 1; /* num_seqs without cu_seqlens */
    }
    const int64_t T = sat_mul(a.batch < 0 ? 0 : a.batch, a.seq_len < 0 ? 0 : a.seq_len);
    const int64_t HQK = a.num_qk_heads > 0 ? a.num_qk_heads : 0, HV = a.num_v_heads > 0 ? a.num_v_heads : 0;
    const int64_t K = a.head_dim_k > 0 ? a.head_dim_k : 0, V = a.head_dim_v > 0 ? a.head_dim_v : 0;

    /* inputs */
    const int64_t nq = sat_mul(sat_mul(T, HQK), K), nv = sat_mul(sat_mul(T, HV), V),
                  ng = sat_mul(sat_mul(T, HV), K), nb = sat_mul(T, HV);
    if ((a.q = alloc_buf(&b, B_Q, nq, dsize(a.dtype)))) fill(&r, b.p[B_Q], a.dtype, nq, tame);
    if ((a.k = alloc_buf(&b, B_K, nq, dsize(a.dtype)))) fill(&r, b.p[B_K], a.dtype, nq, tame);
    if ((a.v = alloc_buf(&b, B_V, nv, dsize(a.dtype)))) fill(&r, b.p[B_V], a.dtype, nv, tame);
    if ((a.g = alloc_buf(&b, B_G, ng, dsize(a.g_dtype)))) {
        fill(&r, b.p[B_G], a.g_dtype, ng, tame);
        if (tame && !a.use_gate_in_kernel && a.g_dtype == KDA_FLOAT32) /* mostly log decays <= 0 */
            for (int64_t i = 0; i < ng; i++) ((float *)b.p[B_G])[i] = -fabsf(((float *)b.p[B_G])[i]);
    }
    if ((a.beta = alloc_buf(&b, B_BETA, nb, dsize(a.beta_dtype)))) {
        fill(&r, b.p[B_BETA], a.beta_dtype, nb, tame);
        if (tame && !a.use_beta_sigmoid && a.beta_dtype == KDA_FLOAT32) /* β in [0, 1] or non-finite */
            for (int64_t i = 0; i < nb; i++) {
                float *x = (float *)b.p[B_BETA] + i;
                if (isfinite(*x)) *x = fminf(fabsf(*x), 1.0f);
            }
    }
    if ((opts & 0x18) != 0x18 || r8(&r) & 1) { /* most often; occasionally a NULL input */
    } else {
        a.k = NULL;
    }
    if (a.use_gate_in_kernel || (misc & 0x7) == 3) {
        if (!(opts & 0x20) && alloc_buf(&b, B_ALOG, HV, 4)) {
            fill(&r, b.p[B_ALOG], KDA_FLOAT32, HV, tame);
            a.A_log = (const float *)b.p[B_ALOG];
        }
        if ((misc & 1) && alloc_buf(&b, B_DTB, sat_mul(HV, K), 4)) {
            fill(&r, b.p[B_DTB], KDA_FLOAT32, sat_mul(HV, K), tame);
            a.dt_bias = (const float *)b.p[B_DTB];
        }
    }

    /* states and pool */
    int64_t slots = num_seqs;
    if (with_idx && num_seqs > 0 && num_seqs < 64) {
        slots = (int64_t)(r8(&r) % 6) + ((misc & 0x40) ? 0 : 1); /* 0 slots: refused */
        int32_t *idx = (int32_t *)alloc_buf(&b, B_IDX, num_seqs, 4);
        for (int64_t n = 0; n < num_seqs; n++) idx[n] = (int32_t)(r8(&r) % (slots + 2)) - 1; /* -1 .. slots */
        a.state_indices = idx;
        a.num_state_slots = slots;
    }
    const int64_t ns = sat_mul(sat_mul(sat_mul(slots, HV), K), V);
    if (with_h0 && (a.initial_state = alloc_buf(&b, B_H0, ns, dsize(a.initial_state_dtype))))
        fill(&r, b.p[B_H0], a.initial_state_dtype, ns, tame);
    if (with_ht && !(in_place && a.initial_state)) {
        if ((a.final_state = alloc_buf(&b, B_HT, ns, dsize(a.final_state_dtype))))
            fill(&r, b.p[B_HT], a.final_state_dtype, ns, 0);
    } else if (with_ht) {
        a.final_state = (void *)a.initial_state; /* the in-place pool */
        a.final_state_dtype = a.initial_state_dtype;
    }

    /* output */
    if ((a.o = alloc_buf(&b, B_O, nv, dsize(a.o_dtype)))) sentinel(b.p[B_O], a.o_dtype, nv);

    /* chunk_states (kda_forward only; kda_decode refuses it), drawn from the hash as the CP fields: rows for the
       lengths as given, a bad dtype now and then, now and then pointed into q */
    int64_t ncs = 0;
    if (((r.lcg >> 48) & 3) == 0) {
        int64_t rows = 0;
        if (varlen && a.cu_seqlens) {
            for (int64_t n = 0; n < num_seqs; n++) {
                const int64_t lo = a.cu_seqlens_dtype == KDA_INT64 ? ((const int64_t *)a.cu_seqlens)[n]
                                                                   : ((const int32_t *)a.cu_seqlens)[n];
                const int64_t hi = a.cu_seqlens_dtype == KDA_INT64 ? ((const int64_t *)a.cu_seqlens)[n + 1]
                                                                   : ((const int32_t *)a.cu_seqlens)[n + 1];
                if (hi > lo) rows += (hi - lo + 63) / 64;
            }
        } else if (!varlen && a.seq_len >= 0) {
            rows = sat_mul(a.batch, (a.seq_len + 63) / 64);
        }
        const uint64_t h = r.lcg >> 50;
        a.chunk_states_dtype = (h & 7) == 7 ? KDA_FLOAT16 : (h & 1) ? KDA_BFLOAT16 : KDA_FLOAT32;
        ncs = sat_mul(sat_mul(rows, HV), sat_mul(K, V));
        if ((a.chunk_states = alloc_buf(&b, B_CS, ncs, dsize(a.chunk_states_dtype))))
            sentinel(b.p[B_CS], a.chunk_states_dtype, ncs);
        if (((h >> 3) & 7) == 0 && b.p[B_Q]) /* aliased into an input (inside it: never past its end) */
            a.chunk_states = (char *)b.p[B_Q] + (b.bytes[B_Q] > 4 ? 4 : 0);
    }

    /* aliasing: an output pointed into an input (or a partial overlap of the pool) */
    const uint8_t alias = r8(&r);
    if (alias < 24) {
        static const int targets[] = {B_Q, B_K, B_V, B_G, B_BETA, B_H0, B_ALOG, B_DTB, B_CU, B_IDX, B_HT, B_O};
        const int t = targets[alias % 12];
        if (b.p[t]) {
            const size_t off = (alias / 12) ? (b.bytes[t] > 4 ? 4 : 0) : 0;
            if (alias % 2 == 0 || !a.final_state) {
                if (t != B_O) a.o = (char *)b.p[t] + off;
            } else if (t != B_HT) {
                a.final_state = (char *)b.p[t] + off;
            }
        }
    }

    /* the call */
    const int ws_mode = (misc >> 5) == 7 ? (r8(&r) % 3) + 1 : 0;
    kda_context_t *ctx = context(reference);
    if ((misc & 0x0f) == 0x0b) ctx = NULL;
    snapshot(&b);
    const char *fn;
    const int args_null = (opts & 0xf8) == 0xf8 && (misc & 1);
    kda_status_t st;
    if (!ctx) {
        fn = decode ? "kda_decode" : "kda_forward";
        st = decode ? kda_decode(NULL, &a, NULL, 0, NULL) : kda_forward(NULL, &a, NULL, 0, NULL);
    } else if (args_null) {
        fn = decode ? "kda_decode" : "kda_forward";
        st = decode ? kda_decode(ctx, NULL, NULL, 0, NULL) : kda_forward(ctx, NULL, NULL, 0, NULL);
    } else {
        st = call(ctx, &a, decode, ws_mode, &fn);
    }

    if (st != KDA_STATUS_SUCCESS) {
        check_error(st, fn, &b);
        free_buffers(&b);
        return 0;
    }

    /* success: o fully written, inputs unchanged, untouched pool slots unchanged */
    const int o_own = a.o == b.p[B_O];
    /* o pointed into the final_state buffer while final_state is NULL: not an alias, that memory is o's now */
    const int o_in_unused_ht = !o_own && b.p[B_HT] && !a.final_state && (char *)a.o >= (char *)b.p[B_HT] &&
                               (char *)a.o < (char *)b.p[B_HT] + b.bytes[B_HT];
    CHECK(o_own || o_in_unused_ht || nv == 0, "%s: success with o aliased into an input", fn);
    if (o_own)
        for (int64_t i = 0; i < nv; i++) CHECK(!is_sentinel(b.p[B_O], a.o_dtype, i), "%s: o[%lld] unwritten", fn,
                                               (long long)i);
    const int cs_own = a.chunk_states && a.chunk_states == b.p[B_CS];
    CHECK(!a.chunk_states || cs_own || ncs == 0, "%s: success with chunk_states aliased into an input", fn);
    if (cs_own)
        for (int64_t i = 0; i < ncs; i++)
            CHECK(!is_sentinel(b.p[B_CS], a.chunk_states_dtype, i), "%s: chunk_states[%lld] unwritten", fn,
                  (long long)i);
    for (int i = 0; i < NBUF; i++) {
        if (i == B_O || i == B_HT || i == B_CS || !b.p[i]) continue;
        if (i == B_H0 && a.final_state == a.initial_state) continue;
        CHECK(memcmp(b.p[i], b.copy[i], b.bytes[i]) == 0, "%s: input %s written", fn, buf_name[i]);
    }
    void *pool = a.final_state;
    const int pool_buf = pool == b.p[B_HT] ? B_HT : B_H0;
    if (pool && a.state_indices) {
        const size_t slot_bytes = (size_t)(HV * K * V) * dsize(a.final_state_dtype);
        for (int64_t s = 0; s < slots; s++) {
            int named = 0;
            for (int64_t n = 0; n < num_seqs; n++) named |= a.state_indices[n] == s;
            if (!named)
                CHECK(memcmp((char *)pool + s * slot_bytes, (char *)b.copy[pool_buf] + s * slot_bytes, slot_bytes) == 0,
                      "%s: pool slot %lld written though no sequence names it", fn, (long long)s);
        }
    }
    if (!pool && b.p[B_HT] && !o_in_unused_ht)
        CHECK(memcmp(b.p[B_HT], b.copy[B_HT], b.bytes[B_HT]) == 0, "%s: final_state written", fn);

    /* tame values: the NaN pattern of o and of the final state agrees between forward, decode and oracle */
    if (tame && o_own && ctx && nv > 0 && (!pool || pool == b.p[B_HT])) {
        void *o1 = malloc(b.bytes[B_O]), *h1 = pool ? malloc(b.bytes[B_HT]) : NULL;
        void *c1 = cs_own ? malloc(b.bytes[B_CS]) : NULL;
        memcpy(o1, b.p[B_O], b.bytes[B_O]);
        if (h1) memcpy(h1, pool, b.bytes[B_HT]);
        if (c1) memcpy(c1, b.p[B_CS], b.bytes[B_CS]);
        for (int other = 0; other < 3; other++) {
            kda_context_t *c2 = context(other == 2);
            const int dec2 = other == 0 ? !decode : other == 1 ? decode : 0;
            if (c2 == ctx && dec2 == decode) continue;
            memcpy(b.p[B_O], b.copy[B_O], b.bytes[B_O]);
            if (pool) memcpy(pool, b.copy[B_HT], b.bytes[B_HT]);
            const char *fn2;
            kda_args_t a2 = a;
            if (dec2) a2.chunk_states = NULL; /* kda_forward's only */
            CHECK(call(c2, &a2, dec2, 0, &fn2) == KDA_STATUS_SUCCESS, "%s refused what %s took: %s", fn2, fn,
                  kda_last_error());
            if (c1 && !dec2)
                for (int64_t i = 0; i < ncs; i++)
                    CHECK(is_nan_at(c1, a.chunk_states_dtype, i) == is_nan_at(b.p[B_CS], a.chunk_states_dtype, i),
                          "chunk_states[%lld]: NaN on one of %s and %s only", (long long)i, fn, fn2);
            for (int64_t i = 0; i < nv; i++)
                CHECK(is_nan_at(o1, a.o_dtype, i) == is_nan_at(b.p[B_O], a.o_dtype, i),
                      "o[%lld]: NaN on one of %s (%s) and %s (%s) only", (long long)i, fn, reference ? "ref" : "cpu",
                      fn2, other == 2 ? "ref" : "cpu");
            if (pool)
                for (int64_t i = 0; i < ns; i++)
                    CHECK(is_nan_at(h1, a.final_state_dtype, i) == is_nan_at(pool, a.final_state_dtype, i),
                          "final_state[%lld]: NaN on one of %s and %s only", (long long)i, fn, fn2);
        }
        free(o1);
        free(h1);
        free(c1);
    }
    free_buffers(&b);
    return 0;
}
