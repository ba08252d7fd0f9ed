/*
 * libFuzzer harness over the arguments of kda_decode (and kda_forward) with state pools, and of kda_backward, on
 * the CPU and reference backends; built as fuzz_args is (tests/fuzz/run.sh).
 *
 * The first byte chooses the part:
 *   - decode: 1-D and 2-D state_indices (speculative decoding: state_indices_cols, state_indices_row_stride with
 *     padding, huge and negative strides, num_accepted_tokens in and out of [1, T_max]), slots distinct,
 *     repeated, negative and out of range, num_state_slots from 0 to beyond 2^52 state elements, in-place and
 *     separate pools, outputs pointed into inputs (the index arrays included), a short or missing workspace;
 *   - backward: a small problem (varlen, GVA, the in-kernel gate and β options, states and 1-D pools), gradient
 *     dtypes (the input's, float32, and others), NULL gradients, the optional gradients with and without what
 *     they require, gradients pointed into inputs or into one another, `saved`, odd struct sizes.
 * Every buffer is allocated at its exact size, so the sanitizers see any access past it. Contract checks (a
 * violation aborts, which libFuzzer reports like a crash):
 *   - on error: a known status, a message "<fn>: argument '<name>': ...", every buffer byte-identical;
 *   - decode, on success: o fully written, no output over an input, inputs unchanged (the in-place pool excepted),
 *     every pool slot that no row names byte-identical; with tame values (|x| <= 2, l2norm on, β <= 1) the NaN
 *     pattern of o and of the pool the same on the CPU decode, the CPU forward and the fp64 oracle;
 *   - backward, on success: every gradient given fully written, none over an input or another gradient, inputs
 *     unchanged; with finite tame values, every gradient finite on both backends.
 */
#include "fuzz_common.h"

enum {
    B_Q, B_K, B_V, B_G, B_BETA, B_O, B_H0, B_HT, B_ALOG, B_DTB, B_CU, B_IDX, B_ACC, B_SAVED,
    B_DO, B_DHT, B_DQ, B_DK, B_DV, B_DG, B_DBETA, B_DH0, B_DALOG, B_DDTB, NBUF
};
static const char *const buf_name[NBUF] = {
    "q", "k", "v", "g", "beta", "o", "initial_state", "final_state", "A_log", "dt_bias", "cu_seqlens",
    "state_indices", "num_accepted_tokens", "saved", "d_o", "d_final_state", "dq", "dk", "dv", "dg", "dbeta",
    "d_initial_state", "dA_log", "ddt_bias"};

#define MAX_SEQS 4

typedef struct {
    kda_args_t a;
    fuzz_bufs_t b;
    int64_t N, T, HQK, HV, K, V; /* T: every token; sizes clamped at 0 */
    int64_t lens[MAX_SEQS];      /* per sequence (meaningful when the call succeeds) */
    int64_t slots;               /* slots allocated in each pool (the claimed num_state_slots may be larger) */
    int64_t row_stride;          /* elements between rows of a 2-D state_indices, as the library reads them */
    int tame, finite;
} prob_t;

static void prob_init(prob_t *p, int tame, int finite) {
    memset(p, 0, sizeof *p);
    kda_args_init(&p->a);
    p->b.name = buf_name;
    p->b.n = NBUF;
    p->tame = tame;
    p->finite = finite;
}

/* ---------------------------------------------------------------------------------------------------------
 * The problem: sizes and sequences, options, inputs, states and pools
 * ------------------------------------------------------------------------------------------------------- */
static void make_sequences(reader_t *r, prob_t *p, int long_seqs) {
    static const int64_t short_lens[] = {1, 1, 2, 3, 4, 0, 1, 2};
    static const int64_t long_lens[] = {1, 2, 3, 5, 16, 17, 63, 64, 65, 70, 0, 7, 33, 1, 4, 9};
    kda_args_t *a = &p->a;
    const uint8_t m = r8(r);
    p->N = r8(r) % (MAX_SEQS + 1);
    if (m & 1) { /* varlen */
        a->cu_seqlens_dtype = (m & 2) ? KDA_INT64 : KDA_INT32;
        const size_t es = a->cu_seqlens_dtype == KDA_INT64 ? 8 : 4;
        void *cu = fuzz_alloc(&p->b, B_CU, p->N + 1, es);
        int64_t total = 0;
        for (int64_t n = 0; n <= p->N; n++) {
            if (n > 0) total += p->lens[n - 1] = long_seqs ? PICK(r, long_lens) : PICK(r, short_lens);
            if (es == 8) ((int64_t *)cu)[n] = total;
            else ((int32_t *)cu)[n] = (int32_t)total;
        }
        if ((m & 0x1c) == 0x1c) { /* a wrong end */
            if (es == 8) ((int64_t *)cu)[p->N] += 1;
            else ((int32_t *)cu)[p->N] -= 1;
        }
        a->cu_seqlens = cu;
        a->num_seqs = p->N;
        a->batch = 1;
        a->seq_len = total;
        p->T = total;
    } else {
        const int64_t len = long_seqs ? PICK(r, long_lens) : PICK(r, short_lens);
        for (int64_t n = 0; n < p->N; n++) p->lens[n] = len;
        a->batch = p->N;
        a->seq_len = len;
        p->T = p->N * len;
    }
}

static void make_sizes(reader_t *r, prob_t *p, int long_seqs) {
    static const int32_t hqks[] = {1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 0};
    static const int32_t groups[] = {1, 2, 1, 1};
    static const int32_t dims[] = {1, 2, 3, 4, 8, 16, 5, 4, 2, 8, 16, 1, 4, 3, 6, 7,
                                   1, 2, 3, 4, 8, 16, 5, 4, 2, 8, 16, 1, 4, 3, 0, 257};
    static const kda_dtype_t dtypes[] = {KDA_FLOAT32,  KDA_FLOAT32,  KDA_BFLOAT16, KDA_FLOAT16,
                                         KDA_FLOAT32,  KDA_BFLOAT16, KDA_BFLOAT16, KDA_FLOAT32,
                                         KDA_FLOAT32,  KDA_FLOAT32,  KDA_BFLOAT16, KDA_FLOAT16,
                                         KDA_FLOAT32,  KDA_BFLOAT16, KDA_BFLOAT16, KDA_INT32};
    kda_args_t *a = &p->a;
    make_sequences(r, p, long_seqs);
    a->num_qk_heads = PICK(r, hqks);
    a->num_v_heads = a->num_qk_heads * PICK(r, groups);
    a->head_dim_k = PICK(r, dims);
    a->head_dim_v = PICK(r, dims);
    a->dtype = PICK(r, dtypes);
    a->g_dtype = PICK(r, dtypes);
    a->beta_dtype = PICK(r, dtypes);
    a->o_dtype = PICK(r, dtypes);
    p->HQK = a->num_qk_heads > 0 ? a->num_qk_heads : 0;
    p->HV = a->num_v_heads > 0 ? a->num_v_heads : 0;
    p->K = a->head_dim_k > 0 ? a->head_dim_k : 0;
    p->V = a->head_dim_v > 0 ? a->head_dim_v : 0;
}

static void make_options(reader_t *r, prob_t *p) {
    static const float scales[] = {0.0f, 0.0f, 1.0f, 0.5f, 0.0f, 0.25f, 2.0f, 0.0f,
                                   0.0f, 0.0f, 1.0f, 0.5f, 0.0f, 0.25f, 2.0f, NAN};
    static const float bounds[] = {0.0f, -1.0f, -5.0f, -1.0f, -0.5f, -3.0f, 0.0f, -2.0f,
                                   0.0f, -1.0f, -5.0f, -1.0f, -0.5f, -6.0f, 1.0f, NAN};
    kda_args_t *a = &p->a;
    const uint8_t f = r8(r);
    a->use_qk_l2norm = p->tame || (f & 1);
    a->use_gate_in_kernel = (f >> 1) & 1;
    a->use_beta_sigmoid = (f >> 2) & 1;
    a->allow_neg_eigval = a->use_beta_sigmoid && !p->tame && ((f >> 3) & 1);
    a->state_v_first = (f >> 4) & 1;
    a->safe_gate = a->use_gate_in_kernel && ((f >> 5) & 1);
    a->beta_headwise = (f >> 6) == 3;
    a->scale = PICK(r, scales);
    a->lower_bound = a->use_gate_in_kernel ? PICK(r, bounds) : 0.0f;
    if (p->tame && !a->use_beta_sigmoid) a->beta_dtype = KDA_FLOAT32; /* β then in [0, 1] (below) */
}

static void make_inputs(reader_t *r, prob_t *p) {
    kda_args_t *a = &p->a;
    fuzz_bufs_t *b = &p->b;
    const int64_t nq = p->T * p->HQK * p->K, nv = p->T * p->HV * p->V, ng = p->T * p->HV * p->K;
    const int64_t nb = p->T * p->HV * (a->beta_headwise ? p->V : 1);
    const int t = p->tame, fin = p->finite;
    if ((a->q = fuzz_alloc(b, B_Q, nq, dsize(a->dtype)))) fuzz_fill(r, b->p[B_Q], a->dtype, nq, t, fin);
    if ((a->k = fuzz_alloc(b, B_K, nq, dsize(a->dtype)))) fuzz_fill(r, b->p[B_K], a->dtype, nq, t, fin);
    if ((a->v = fuzz_alloc(b, B_V, nv, dsize(a->dtype)))) fuzz_fill(r, b->p[B_V], a->dtype, nv, t, fin);
    if ((a->g = fuzz_alloc(b, B_G, ng, dsize(a->g_dtype)))) {
        fuzz_fill(r, b->p[B_G], a->g_dtype, ng, t, fin);
        if (t && !a->use_gate_in_kernel && a->g_dtype == KDA_FLOAT32) /* log decays <= 0 */
            for (int64_t i = 0; i < ng; i++) ((float *)b->p[B_G])[i] = -fabsf(((float *)b->p[B_G])[i]);
    }
    if ((a->beta = fuzz_alloc(b, B_BETA, nb, dsize(a->beta_dtype)))) {
        fuzz_fill(r, b->p[B_BETA], a->beta_dtype, nb, t, fin);
        if (t && !a->use_beta_sigmoid && a->beta_dtype == KDA_FLOAT32) /* β in [0, 1] or non-finite */
            for (int64_t i = 0; i < nb; i++) {
                float *x = (float *)b->p[B_BETA] + i;
                if (isfinite(*x)) *x = fminf(fabsf(*x), 1.0f);
            }
    }
    const uint8_t m = r8(r);
    if (a->use_gate_in_kernel || m == 0xff) {
        if (!(m & 1) && fuzz_alloc(b, B_ALOG, p->HV, 4)) {
            fuzz_fill(r, b->p[B_ALOG], KDA_FLOAT32, p->HV, t, fin);
            a->A_log = (const float *)b->p[B_ALOG];
        }
        if ((m & 2) && fuzz_alloc(b, B_DTB, p->HV * p->K, 4)) {
            fuzz_fill(r, b->p[B_DTB], KDA_FLOAT32, p->HV * p->K, t, fin);
            a->dt_bias = (const float *)b->p[B_DTB];
        }
    }
}

/* A slot for one entry of state_indices: mostly the next unused one of a shuffled list (or -1 when none is
 * left), now and then -1, one already given, or one out of range (refused, where the claim is exact). */
static int32_t next_slot(reader_t *r, int32_t *order, int64_t *used, int64_t slots, int exact) {
    const uint8_t u = r8(r);
    if (u < 16) return -1;
    if (u < 24 && *used > 0) return order[u % *used];
    if (u < 28 && exact) return (int32_t)(slots + (u & 1));
    return *used < slots ? order[(*used)++] : -1;
}

/* 2-D state_indices: T_max columns, rows row_stride apart (padding filled with garbage the library must not
 * read), and num_accepted_tokens. */
static void make_indices_2d(reader_t *r, prob_t *p, int32_t *order, int exact) {
    static const int64_t huge_strides[] = {-1, (int64_t)1 << 53, (int64_t)1 << 62, INT64_MAX};
    kda_args_t *a = &p->a;
    int64_t tmax = 1;
    for (int64_t n = 0; n < p->N; n++) tmax = p->lens[n] > tmax ? p->lens[n] : tmax;
    const uint8_t m = r8(r), s = r8(r);
    const int64_t cols_choice[] = {tmax, tmax, tmax, tmax + 1, tmax + 2, tmax - 1, 1, -1};
    const int64_t cols = cols_choice[m & 7];
    int64_t stride = 0; /* contiguous */
    if ((s & 3) == 1) stride = cols + (s >> 2) % 4;
    else if ((s & 3) == 2) stride = (s & 4) ? cols - 1 : huge_strides[(s >> 3) & 3];
    const int64_t eff = stride ? stride : cols;
    const int sane = cols >= 1 && eff >= cols && eff <= cols + 4;
    /* a huge or negative stride: a buffer for a contiguous layout, the library must refuse before reading; cols
       0 (tmax - 1 with one token) makes it 1-D, N entries; negative cols: refused */
    const int64_t elems = p->N == 0 || cols < 0 ? 1 : cols == 0 ? p->N : sane ? (p->N - 1) * eff + cols
                                                                               : p->N * cols;
    int32_t *idx = (int32_t *)fuzz_alloc(&p->b, B_IDX, elems, 4);
    if (!idx) return;
    for (int64_t i = 0; i < elems; i++) idx[i] = (int32_t)(r8(r) % (2 * p->slots + 3)) - 2; /* padding */
    int64_t used = 0;
    if (sane)
        for (int64_t n = 0; n < p->N; n++)
            for (int64_t c = 0; c < cols; c++) idx[n * eff + c] = next_slot(r, order, &used, p->slots, exact);
    if (cols == 0)
        for (int64_t n = 0; n < p->N; n++) idx[n] = next_slot(r, order, &used, p->slots, exact);
    a->state_indices = idx;
    a->state_indices_cols = cols;
    a->state_indices_row_stride = stride;
    p->row_stride = eff;
    if ((m >> 3) & 1) {
        const int64_t acc_choice[] = {1, 1, 1, 2, 3, cols, 0, cols + 1, -1, INT32_MAX, 1, 2, 1, 1, 2, 4};
        int32_t *acc = (int32_t *)fuzz_alloc(&p->b, B_ACC, p->N, 4);
        for (int64_t n = 0; acc && n < p->N; n++) acc[n] = (int32_t)acc_choice[r8(r) % 16];
        a->num_accepted_tokens = acc;
    }
}

/* state_indices (1-D, or 2-D where allowed) over pools of p->slots slots, with num_state_slots claimed exactly
 * (mostly), larger (indices then stay below p->slots), 0, negative, or past 2^52 state elements. */
static void make_indices(reader_t *r, prob_t *p, int allow_2d) {
    kda_args_t *a = &p->a;
    const uint8_t m = r8(r);
    p->slots = 1 + m % 6;
    const int64_t claims[] = {p->slots, p->slots, p->slots, p->slots, p->slots, p->slots + 3, (int64_t)1 << 20,
                              (int64_t)1 << 30, 0, -1, (int64_t)1 << 52, p->slots};
    a->num_state_slots = claims[r8(r) % 12];
    const int exact = a->num_state_slots == p->slots;
    int32_t order[8];
    for (int i = 0; i < 8; i++) order[i] = i;
    for (int i = (int)p->slots - 1; i > 0; i--) { /* shuffled */
        const int j = r8(r) % (i + 1);
        const int32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    if (allow_2d && (m & 0x40)) {
        make_indices_2d(r, p, order, exact);
    } else {
        int32_t *idx = (int32_t *)fuzz_alloc(&p->b, B_IDX, p->N, 4);
        int64_t used = 0;
        for (int64_t n = 0; idx && n < p->N; n++) idx[n] = next_slot(r, order, &used, p->slots, exact);
        a->state_indices = idx;
        if ((m & 0xf0) == 0x80) a->state_indices_row_stride = 1 + (m & 1); /* with a 1-D state_indices: refused */
    }
}

static void make_states(reader_t *r, prob_t *p, int allow_2d) {
    kda_args_t *a = &p->a;
    const uint8_t m = r8(r);
    const int with_h0 = m & 1, with_ht = (m >> 1) & 1, in_place = (m >> 2) & 1, with_idx = (m >> 3) & 3;
    p->slots = p->N;
    if (with_idx && p->N > 0) make_indices(r, p, allow_2d);
    a->initial_state_dtype = (m & 0x20) ? KDA_BFLOAT16 : KDA_FLOAT32;
    a->final_state_dtype = (m & 0x40) ? KDA_BFLOAT16 : KDA_FLOAT32;
    if ((m & 0xe0) == 0xe0) a->initial_state_dtype = KDA_FLOAT16; /* invalid */
    const int64_t ns = p->slots * p->HV * p->K * p->V;
    if (with_h0 && (a->initial_state = fuzz_alloc(&p->b, B_H0, ns, dsize(a->initial_state_dtype))))
        fuzz_fill(r, p->b.p[B_H0], a->initial_state_dtype, ns, p->tame, p->finite);
    if (with_ht && in_place && a->initial_state) {
        a->final_state = (void *)a->initial_state; /* the in-place pool */
        a->final_state_dtype = a->initial_state_dtype;
    } else if (with_ht && (a->final_state = fuzz_alloc(&p->b, B_HT, ns, dsize(a->final_state_dtype)))) {
        fuzz_fill(r, p->b.p[B_HT], a->final_state_dtype, ns, 0, 0);
    }
}

/* Buffer `out` pointed at (or 4 bytes into) input `in`: 1 when that is an overlap the library sees. */
static int alias_into(prob_t *p, void **out, int64_t out_bytes, int in, uint8_t u) {
    if (!p->b.p[in] || out_bytes <= 0) return 0;
    const size_t off = (u & 1) && p->b.bytes[in] > 4 ? 4 : 0;
    *out = (char *)p->b.p[in] + off;
    return p->b.bytes[in] > off;
}

/* ---------------------------------------------------------------------------------------------------------
 * kda_decode / kda_forward over pools
 * ------------------------------------------------------------------------------------------------------- */
static kda_status_t call_fwd(kda_context_t *ctx, const kda_args_t *a, int decode, int ws_mode, const char **fn) {
    *fn = decode ? "kda_decode" : "kda_forward";
    size_t need = 0, bytes;
    kda_status_t st = decode ? kda_decode_workspace_size(ctx, a, &need) : kda_forward_workspace_size(ctx, a, &need);
    if (st != KDA_STATUS_SUCCESS) {
        *fn = decode ? "kda_decode_workspace_size" : "kda_forward_workspace_size";
        return st;
    }
    char *mem;
    void *ws = fuzz_workspace(need, ws_mode, &bytes, &mem);
    st = decode ? kda_decode(ctx, a, ws, bytes, NULL) : kda_forward(ctx, a, ws, bytes, NULL);
    free(mem);
    return st;
}

/* Whether a row of state_indices names slot s: its read slot or a written one (docs/API.md §6). Valid indices. */
static int slot_named(const prob_t *p, int64_t s) {
    const kda_args_t *a = &p->a;
    for (int64_t n = 0; n < p->N; n++) {
        if (a->state_indices_cols == 0) {
            if (a->state_indices[n] == s) return 1;
            continue;
        }
        const int64_t an = a->num_accepted_tokens ? a->num_accepted_tokens[n] : 1;
        const int64_t lim = p->lens[n] > an ? p->lens[n] : an;
        for (int64_t c = 0; c < lim; c++)
            if (a->state_indices[n * p->row_stride + c] == s) return 1;
    }
    return 0;
}

static void check_decode_success(const prob_t *p, const char *fn, int o_alias, int ht_alias) {
    const kda_args_t *a = &p->a;
    const fuzz_bufs_t *b = &p->b;
    const int64_t nv = p->T * p->HV * p->V;
    CHECK(!o_alias && !ht_alias, "%s: success with an output over an input", fn);
    for (int64_t i = 0; i < nv; i++)
        CHECK(!fuzz_is_sentinel(a->o, a->o_dtype, i), "%s: o[%lld] unwritten", fn, (long long)i);
    for (int i = 0; i < NBUF; i++) {
        if (i == B_O || i == B_HT || (i == B_H0 && a->final_state == a->initial_state)) continue;
        CHECK(fuzz_unchanged(b, i), "%s: input %s written", fn, buf_name[i]);
    }
    const int pool_buf = a->final_state == b->p[B_HT] ? B_HT : B_H0;
    if (!a->final_state || !a->state_indices) return;
    const size_t slot_bytes = (size_t)(p->HV * p->K * p->V) * dsize(a->final_state_dtype);
    for (int64_t s = 0; s < p->slots; s++)
        if (!slot_named(p, s))
            CHECK(memcmp((char *)a->final_state + s * slot_bytes, (char *)b->copy[pool_buf] + s * slot_bytes,
                         slot_bytes) == 0,
                  "%s: pool slot %lld written though no row names it", fn, (long long)s);
}

/* Tame values: the NaN pattern of o and of the final pool is the same on the CPU decode, the CPU forward and the
 * oracle (each run from the inputs as they were). */
static void check_decode_agree(prob_t *p, int reference, int decode, const char *fn) {
    kda_args_t *a = &p->a;
    fuzz_bufs_t *b = &p->b;
    const int64_t nv = p->T * p->HV * p->V, ns = p->slots * p->HV * p->K * p->V;
    const int pool_buf = a->final_state == b->p[B_HT] ? B_HT : B_H0;
    void *o1 = malloc(b->bytes[B_O]), *h1 = a->final_state ? malloc(b->bytes[pool_buf]) : NULL;
    memcpy(o1, a->o, b->bytes[B_O]);
    if (h1) memcpy(h1, a->final_state, b->bytes[pool_buf]);
    for (int other = 0; other < 3; other++) {
        const int ref2 = other == 2, dec2 = other == 0 ? !decode : other == 1 ? decode : 1;
        if (ref2 == reference && dec2 == decode) continue;
        fuzz_restore(b, B_O);
        fuzz_restore(b, B_H0);
        fuzz_restore(b, B_HT);
        const char *fn2;
        CHECK(call_fwd(fuzz_context(ref2), a, dec2, 0, &fn2) == KDA_STATUS_SUCCESS, "%s refused what %s took: %s",
              fn2, fn, kda_last_error());
        for (int64_t i = 0; i < nv; i++)
            CHECK(fuzz_is_nan_at(o1, a->o_dtype, i) == fuzz_is_nan_at(a->o, a->o_dtype, i),
                  "o[%lld]: NaN on one of %s (%s) and %s (%s) only", (long long)i, fn, reference ? "ref" : "cpu", fn2,
                  ref2 ? "ref" : "cpu");
        for (int64_t i = 0; h1 && i < ns; i++)
            CHECK(fuzz_is_nan_at(h1, a->final_state_dtype, i) ==
                      fuzz_is_nan_at(a->final_state, a->final_state_dtype, i),
                  "final_state[%lld]: NaN on one of %s and %s only", (long long)i, fn, fn2);
    }
    free(o1);
    free(h1);
}

static void fuzz_decode(reader_t *r, uint8_t mode) {
    static const int o_targets[] = {B_Q, B_V, B_BETA, B_H0, B_CU, B_IDX, B_ACC, B_G};
    static const int ht_targets[] = {B_K, B_IDX, B_ACC, B_CU, B_ALOG, B_DTB, B_Q, B_BETA};
    const int reference = (mode >> 1) & 1, decode = ((mode >> 2) & 3) != 0, tame = (mode >> 4) & 1;
    prob_t p;
    prob_init(&p, tame, 0);
    kda_args_t *a = &p.a;
    make_sizes(r, &p, 0);
    make_options(r, &p);
    make_inputs(r, &p);
    make_states(r, &p, 1);
    const int64_t nv = p.T * p.HV * p.V;
    if ((a->o = fuzz_alloc(&p.b, B_O, nv, dsize(a->o_dtype)))) fuzz_sentinel(p.b.p[B_O], a->o_dtype, nv);

    const uint8_t al = r8(r);
    int o_alias = 0, ht_alias = 0;
    const int64_t o_bytes = nv * (int64_t)dsize(a->o_dtype);
    const int64_t claimed = a->state_indices && a->num_state_slots > 0 ? a->num_state_slots : p.N;
    const int64_t ht_bytes = sat_mul(sat_mul(claimed, p.HV * p.K * p.V), (int64_t)dsize(a->final_state_dtype));
    if (al < 16) o_alias = alias_into(&p, &a->o, o_bytes, o_targets[al % 8], al >> 3);
    else if (al < 32 && a->final_state != a->initial_state)
        ht_alias = alias_into(&p, &a->final_state, ht_bytes, ht_targets[al % 8], al >> 3);

    const int ws_mode = (mode >> 5) == 7 ? (r8(r) % 3) + 1 : 0;
    fuzz_snapshot(&p.b);
    const char *fn;
    const kda_status_t st = call_fwd(fuzz_context(reference), a, decode, ws_mode, &fn);
    if (st != KDA_STATUS_SUCCESS) {
        fuzz_check_error(st, fn, &p.b);
    } else {
        check_decode_success(&p, fn, o_alias, ht_alias);
        if (tame && a->o && a->o == p.b.p[B_O] && nv > 0) check_decode_agree(&p, reference, decode, fn);
    }
    fuzz_free(&p.b);
}

/* ---------------------------------------------------------------------------------------------------------
 * kda_backward
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    kda_backward_args_t g;
    int64_t n[NBUF];        /* elements of each gradient output */
    kda_dtype_t dt[NBUF];   /* its dtype */
    int aliased;            /* a gradient was pointed into an input or another gradient (an overlap) */
} grads_t;

/* A gradient output's dtype: mostly its input's or float32, now and then another (refused unless equal). */
static kda_dtype_t grad_dtype(reader_t *r, kda_dtype_t input) {
    static const kda_dtype_t others[] = {KDA_BFLOAT16, KDA_FLOAT16, KDA_INT32, (kda_dtype_t)42};
    const uint8_t u = r8(r);
    return u < 120 ? input : u < 248 ? KDA_FLOAT32 : others[u % 4];
}

/* Gradient buffer i (n elements of dt, the sentinel in it), NULL now and then; returns the pointer set. */
static void *grad_buffer(reader_t *r, prob_t *p, grads_t *d, int i, int64_t n, kda_dtype_t dt, int optional) {
    d->n[i] = n;
    d->dt[i] = dt;
    const uint8_t u = r8(r);
    if (optional ? u < 128 : u < 6) return NULL;
    void *x = fuzz_alloc(&p->b, i, n, dsize(dt));
    if (x) fuzz_sentinel(x, dt, n);
    return x;
}

static void make_grads(reader_t *r, prob_t *p, grads_t *d) {
    static const kda_dtype_t do_dtypes[] = {KDA_FLOAT32, KDA_BFLOAT16, KDA_FLOAT16, KDA_FLOAT32,
                                            KDA_BFLOAT16, KDA_FLOAT32, KDA_FLOAT16, KDA_INT32};
    static const kda_dtype_t state_dtypes[] = {KDA_FLOAT32, KDA_FLOAT32, KDA_BFLOAT16, KDA_FLOAT16};
    const kda_args_t *a = &p->a;
    kda_backward_args_t *g = &d->g;
    const int64_t nq = p->T * p->HQK * p->K, nv = p->T * p->HV * p->V, ng = p->T * p->HV * p->K;
    /* the state gradients span every slot the problem claims (d_initial_state is written whole) */
    const int64_t claimed = a->state_indices && a->num_state_slots > 0 ? a->num_state_slots : p->slots;
    const int64_t nb = p->T * p->HV, ns = sat_mul(sat_mul(claimed, p->HV), p->K * p->V);
    g->d_o_dtype = PICK(r, do_dtypes);
    if (r8(r) >= 4 && (g->d_o = fuzz_alloc(&p->b, B_DO, nv, dsize(g->d_o_dtype))))
        fuzz_fill(r, p->b.p[B_DO], g->d_o_dtype, nv, p->tame, p->finite);
    g->d_final_state_dtype = PICK(r, state_dtypes);
    if (r8(r) & 1 && (g->d_final_state = fuzz_alloc(&p->b, B_DHT, ns, dsize(g->d_final_state_dtype))))
        fuzz_fill(r, p->b.p[B_DHT], g->d_final_state_dtype, ns, p->tame, p->finite);
    g->dq = grad_buffer(r, p, d, B_DQ, nq, g->dq_dtype = grad_dtype(r, a->dtype), 0);
    g->dk = grad_buffer(r, p, d, B_DK, nq, g->dk_dtype = grad_dtype(r, a->dtype), 0);
    g->dv = grad_buffer(r, p, d, B_DV, nv, g->dv_dtype = grad_dtype(r, a->dtype), 0);
    g->dg = grad_buffer(r, p, d, B_DG, ng, g->dg_dtype = grad_dtype(r, a->g_dtype), 0);
    g->dbeta = grad_buffer(r, p, d, B_DBETA, nb, g->dbeta_dtype = grad_dtype(r, a->beta_dtype), 0);
    g->d_initial_state_dtype = PICK(r, state_dtypes);
    g->d_initial_state = grad_buffer(r, p, d, B_DH0, ns, g->d_initial_state_dtype, 1);
    g->dA_log = (float *)grad_buffer(r, p, d, B_DALOG, p->HV, KDA_FLOAT32, 1);
    g->ddt_bias = (float *)grad_buffer(r, p, d, B_DDTB, p->HV * p->K, KDA_FLOAT32, 1);
}

/* A gradient pointed into an input of the backward or into another gradient (always an overlap the library
 * must refuse when both have bytes), or `saved` and the struct size set oddly. */
static void make_grad_oddities(reader_t *r, prob_t *p, grads_t *d) {
    static const int outs[] = {B_DQ, B_DK, B_DV, B_DG, B_DBETA, B_DH0, B_DALOG, B_DDTB};
    static const int ins[] = {B_Q, B_K, B_V, B_G, B_BETA, B_H0, B_ALOG, B_DTB, B_CU, B_IDX, B_DO, B_DHT,
                              B_DQ, B_DK, B_DV, B_DH0};
    kda_backward_args_t *g = &d->g;
    void **slot[NBUF] = {0};
    slot[B_DQ] = &g->dq, slot[B_DK] = &g->dk, slot[B_DV] = &g->dv, slot[B_DG] = &g->dg;
    slot[B_DBETA] = &g->dbeta, slot[B_DH0] = &g->d_initial_state;
    slot[B_DALOG] = (void **)&g->dA_log, slot[B_DDTB] = (void **)&g->ddt_bias;
    const uint8_t u = r8(r), v = r8(r);
    if (u < 48) {
        const int o = outs[u % 8], in = ins[v % 16];
        if (o != in && *slot[o])
            d->aliased = alias_into(p, slot[o], sat_mul(d->n[o], (int64_t)dsize(d->dt[o])), in, v >> 4);
    }
    if (u >= 248) {
        static const size_t saved_bytes[] = {0, 1, 64, 4096};
        p->a.saved = fuzz_alloc(&p->b, B_SAVED, 64, 1);
        p->a.saved_bytes = saved_bytes[v % 4];
    }
    if (u == 240) g->struct_size = 8;
    if (u == 241) g->struct_size = sizeof(kda_backward_args_t) + 8;
    if (u == 242) g->problem = NULL;
}

static kda_status_t call_bwd(kda_context_t *ctx, const kda_backward_args_t *g, int ws_mode, const char **fn) {
    size_t need = 0, bytes;
    *fn = "kda_backward_workspace_size";
    kda_status_t st = kda_backward_workspace_size(ctx, g, &need);
    if (st != KDA_STATUS_SUCCESS) return st;
    *fn = "kda_backward";
    char *mem;
    void *ws = fuzz_workspace(need, ws_mode, &bytes, &mem);
    st = kda_backward(ctx, g, ws, bytes, NULL);
    free(mem);
    return st;
}

static int is_grad(int i) { return i >= B_DQ && i <= B_DDTB; }

static void check_bwd_success(const prob_t *p, const grads_t *d, const char *fn) {
    CHECK(!d->aliased, "%s: success with a gradient over an input or another gradient", fn);
    for (int i = B_DQ; i <= B_DDTB; i++)
        if (p->b.p[i])
            for (int64_t e = 0; e < d->n[i]; e++)
                CHECK(!fuzz_is_sentinel(p->b.p[i], d->dt[i], e), "%s: %s[%lld] unwritten", fn, buf_name[i],
                      (long long)e);
    for (int i = 0; i < NBUF; i++)
        if (!is_grad(i)) CHECK(fuzz_unchanged(&p->b, i), "%s: %s written", fn, buf_name[i]);
}

/* Finite tame inputs: every gradient finite, on this backend and on the other one; a float16 gradient may be ±inf
 * where its value lies past float16's range (65504; docs/API.md §12: with K = 1 and l2norm, a k of 0 scales its
 * gradient by ε^(-1/2) = 1000), never NaN. */
static void check_bwd_finite(prob_t *p, const grads_t *d, int reference, const char *fn) {
    for (int pass = 0; pass < 2; pass++) {
        if (pass) {
            for (int i = B_DQ; i <= B_DDTB; i++)
                if (p->b.p[i]) fuzz_sentinel(p->b.p[i], d->dt[i], d->n[i]);
            const char *fn2;
            CHECK(call_bwd(fuzz_context(!reference), &d->g, 0, &fn2) == KDA_STATUS_SUCCESS,
                  "%s on the %s backend refused what the other took: %s", fn2, reference ? "cpu" : "reference",
                  kda_last_error());
        }
        for (int i = B_DQ; i <= B_DDTB; i++)
            for (int64_t e = 0; p->b.p[i] && e < d->n[i]; e++)
                CHECK(fuzz_is_finite_at(p->b.p[i], d->dt[i], e) ||
                          (d->dt[i] == KDA_FLOAT16 && !fuzz_is_nan_at(p->b.p[i], d->dt[i], e)),
                      "%s (%s): %s[%lld] not finite from finite inputs",
                      fn, (reference ^ pass) ? "reference" : "cpu", buf_name[i], (long long)e);
    }
}

static void fuzz_backward(reader_t *r, uint8_t mode) {
    const int reference = (mode >> 1) & 1, tame = (mode >> 2) & 1, finite = tame && ((mode >> 3) & 1);
    prob_t p;
    prob_init(&p, tame, finite);
    make_sizes(r, &p, 1);
    make_options(r, &p);
    if (p.a.beta_headwise && (r8(r) & 7)) p.a.beta_headwise = 0; /* NOT_SUPPORTED: mostly not drawn */
    make_inputs(r, &p);
    make_states(r, &p, (mode >> 4) == 15); /* a 2-D state_indices now and then: NOT_SUPPORTED */
    grads_t d;
    memset(&d, 0, sizeof d);
    kda_backward_args_init(&d.g);
    d.g.problem = &p.a;
    make_grads(r, &p, &d);
    make_grad_oddities(r, &p, &d);

    const int ws_mode = (mode >> 5) == 7 ? (r8(r) % 3) + 1 : 0;
    fuzz_snapshot(&p.b);
    const char *fn;
    const kda_status_t st = call_bwd(fuzz_context(reference), &d.g, ws_mode, &fn);
    if (st != KDA_STATUS_SUCCESS) {
        fuzz_check_error(st, fn, &p.b);
    } else {
        check_bwd_success(&p, &d, fn);
        if (finite) check_bwd_finite(&p, &d, reference, fn);
    }
    fuzz_free(&p.b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader_t r = reader(data, size);
    const uint8_t mode = r8(&r);
    if (mode & 1) fuzz_backward(&r, mode);
    else fuzz_decode(&r, mode);
    return 0;
}
