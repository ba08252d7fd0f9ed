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
#include "fuzz_common.h"

enum { B_Q, B_K, B_V, B_G, B_BETA, B_O, B_H0, B_HT, B_ALOG, B_DTB, B_CU, B_IDX, B_CS, NBUF };
static const char *const buf_name[NBUF] = {"q", "k", "v", "g", "beta", "o", "initial_state", "final_state",
                                           "A_log", "dt_bias", "cu_seqlens", "state_indices", "chunk_states"};

/* One call with a fresh workspace of `ws_mode`: 0 exact, 1 one byte short, 2 NULL, 3 exact at an odd address. */
static kda_status_t call(kda_context_t *ctx, const kda_args_t *a, int decode, int ws_mode, const char **fn) {
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

/* ---------------------------------------------------------------------------------------------------------
 * The problem
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    reader_t r;
    kda_args_t a;
    fuzz_bufs_t b;
    uint8_t mode, flags, opts, misc;
    int reference, decode, varlen, with_h0, with_ht, in_place, with_idx, tame;
    int64_t num_seqs, T, HQK, HV, K, V, slots, ns, nv, ncs;
} fz_t;

/* Sizes, dtypes, options and the CP fields (drawn from a hash of the input, so that the corpus keeps its
 * meaning). */
static void draw_sizes_options(fz_t *f) {
    static const int64_t batches[] = {1, 1, 2, 3, 0, 1, 2, 4, -1, (int64_t)1 << 40, (int64_t)1 << 62, 1};
    static const int32_t hqks[] = {1, 1, 2, 1, 0, -3, 1, 2};
    static const int32_t groups[] = {1, 2, 1, 3, 1, 2, 1, 1};
    static const int32_t dims[] = {1, 2, 3, 4, 8, 16, 5, 4, 0, 257, 8, 2, 4, 16, 1, 32};
    static const kda_dtype_t dtypes[] = {KDA_FLOAT32, KDA_FLOAT32, KDA_BFLOAT16, KDA_FLOAT16,
                                         KDA_FLOAT32, KDA_BFLOAT16, KDA_INT32,   (kda_dtype_t)42};
    static const float scales[] = {0.0f, 0.0f, 1.0f, 0.5f, 0.0f, NAN, INFINITY, 0.0f};
    static const float bounds[] = {0.0f, 0.0f, 0.0f, -1.0f, -5.0f, -6.0f, 1.0f, NAN};
    static const kda_cp_mode_t cp_modes[] = {KDA_CP_AUTO, KDA_CP_AUTO, KDA_CP_OFF, KDA_CP_ON,
                                             KDA_CP_ON,   KDA_CP_ON,   KDA_CP_ON,  (kda_cp_mode_t)3};
    static const int64_t cp_lens[] = {0, 64, 0, 64, 128, 96, 0, (int64_t)KDA_CP_MAX_PIECE_LEN + 64};
    reader_t *r = &f->r;
    kda_args_t *a = &f->a;
    f->mode = r8(r), f->flags = r8(r), f->opts = r8(r), f->misc = r8(r);
    const uint8_t mode = f->mode, flags = f->flags, opts = f->opts, misc = f->misc;
    f->reference = mode & 1, f->decode = (mode >> 1) & 1, f->varlen = (mode >> 2) & 1;
    f->with_h0 = (mode >> 3) & 1, f->with_ht = (mode >> 4) & 1, f->in_place = (mode >> 5) & 1;
    f->with_idx = (mode >> 6) & 1, f->tame = (mode >> 7) & 1;
    kda_args_init(a);
    a->batch = f->varlen ? ((misc & 7) == 7 ? 2 : 1) : PICK(r, batches);
    a->num_qk_heads = PICK(r, hqks);
    a->num_v_heads = a->num_qk_heads * PICK(r, groups);
    if ((misc >> 3 & 15) == 15) a->num_v_heads = -1;
    a->head_dim_k = PICK(r, dims);
    a->head_dim_v = PICK(r, dims);
    a->dtype = PICK(r, dtypes);
    a->g_dtype = PICK(r, dtypes);
    a->beta_dtype = PICK(r, dtypes);
    a->o_dtype = PICK(r, dtypes);
    a->initial_state_dtype = (flags & 1) ? KDA_BFLOAT16 : KDA_FLOAT32;
    a->final_state_dtype = (flags & 2) ? KDA_BFLOAT16 : KDA_FLOAT32;
    if ((flags & 0xc0) == 0xc0) a->initial_state_dtype = KDA_FLOAT16; /* invalid */
    a->state_v_first = (flags >> 2) & 1;
    a->use_qk_l2norm = f->tame || ((flags >> 3) & 1);
    a->use_gate_in_kernel = (flags >> 4) & 1;
    a->use_beta_sigmoid = (flags >> 5) & 1;
    a->allow_neg_eigval = a->use_beta_sigmoid && !f->tame && (opts & 1);
    if (f->tame && !a->use_beta_sigmoid) a->beta_dtype = KDA_FLOAT32; /* β then in [0, 1] (below) */
    a->scale = PICK(r, scales);
    a->lower_bound = a->use_gate_in_kernel || (opts & 2) ? PICK(r, bounds) : 0.0f;
    a->safe_gate = (opts >> 2) & 1;
    /* intra-card context parallelism: checked on every backend, ignored by the CPU ones */
    a->cp_mode = cp_modes[(r->lcg >> 40) & 7];
    a->cp_piece_len = cp_lens[(r->lcg >> 43) & 7];
    if (a->cp_mode == KDA_CP_AUTO && ((r->lcg >> 46) & 3) != 0) a->cp_piece_len = 0; /* mostly valid */
    if ((opts & 0x38) == 0x38) a->struct_size = (misc & 0x80) ? sizeof(kda_args_t) + 8 : 16;
}

/* The sequences: varlen offsets (now and then not monotone, or a wrong start or end), or B rows of T tokens. */
static void draw_sequences(fz_t *f) {
    static const int64_t seq_lens[] = {1, 2, 3, 5, 7, 16, 17, 0, 4, 9, 33, 65, -1, (int64_t)1 << 62, 2, 1};
    reader_t *r = &f->r;
    kda_args_t *a = &f->a;
    f->num_seqs = a->batch;
    if (f->varlen) {
        f->num_seqs = (int64_t)(r8(r) % 6) - ((f->opts & 0xc0) == 0xc0 ? 2 : 0); /* -2..5 */
        a->num_seqs = f->num_seqs;
        a->cu_seqlens_dtype = (f->opts & 0x40) ? KDA_INT64 : KDA_INT32;
        if ((f->misc & 0x70) == 0x70) a->cu_seqlens_dtype = KDA_FLOAT32;
        int64_t total = 0;
        if (f->num_seqs >= 0) {
            const size_t es = a->cu_seqlens_dtype == KDA_INT64 ? 8 : 4;
            void *cu = fuzz_alloc(&f->b, B_CU, f->num_seqs + 1, es);
            for (int64_t n = 0; n <= f->num_seqs; n++) {
                int64_t len = n == 0 ? 0 : PICK(r, seq_lens);
                if (len < 0 || len > 70) len = (r8(r) & 1) ? -1 : 0; /* occasionally not monotone */
                total = n == 0 ? 0 : total + len;
                if (es == 8) ((int64_t *)cu)[n] = total;
                else ((int32_t *)cu)[n] = (int32_t)total;
            }
            if (r8(r) == 0) { /* a wrong start or end */
                if (es == 8) ((int64_t *)cu)[f->num_seqs] += 1;
                else ((int32_t *)cu)[0] = 1;
            }
            a->cu_seqlens = cu;
        }
        a->seq_len = total < 0 ? 0 : total;
    } else {
        a->seq_len = PICK(r, seq_lens);
        if ((f->misc & 0x70) == 0x60) a->num_seqs = 1; /* num_seqs without cu_seqlens */
    }
    f->T = sat_mul(a->batch < 0 ? 0 : a->batch, a->seq_len < 0 ? 0 : a->seq_len);
    f->HQK = a->num_qk_heads > 0 ? a->num_qk_heads : 0, f->HV = a->num_v_heads > 0 ? a->num_v_heads : 0;
    f->K = a->head_dim_k > 0 ? a->head_dim_k : 0, f->V = a->head_dim_v > 0 ? a->head_dim_v : 0;
}

static void draw_inputs(fz_t *f) {
    reader_t *r = &f->r;
    kda_args_t *a = &f->a;
    fuzz_bufs_t *b = &f->b;
    const int tame = f->tame;
    const int64_t nq = sat_mul(sat_mul(f->T, f->HQK), f->K), nv = sat_mul(sat_mul(f->T, f->HV), f->V),
                  ng = sat_mul(sat_mul(f->T, f->HV), f->K), nb = sat_mul(f->T, f->HV);
    f->nv = nv;
    if ((a->q = fuzz_alloc(b, B_Q, nq, dsize(a->dtype)))) fuzz_fill(r, b->p[B_Q], a->dtype, nq, tame, 0);
    if ((a->k = fuzz_alloc(b, B_K, nq, dsize(a->dtype)))) fuzz_fill(r, b->p[B_K], a->dtype, nq, tame, 0);
    if ((a->v = fuzz_alloc(b, B_V, nv, dsize(a->dtype)))) fuzz_fill(r, b->p[B_V], a->dtype, nv, tame, 0);
    if ((a->g = fuzz_alloc(b, B_G, ng, dsize(a->g_dtype)))) {
        fuzz_fill(r, b->p[B_G], a->g_dtype, ng, tame, 0);
        if (tame && !a->use_gate_in_kernel && a->g_dtype == KDA_FLOAT32) /* mostly log decays <= 0 */
            for (int64_t i = 0; i < ng; i++) ((float *)b->p[B_G])[i] = -fabsf(((float *)b->p[B_G])[i]);
    }
    if ((a->beta = fuzz_alloc(b, B_BETA, nb, dsize(a->beta_dtype)))) {
        fuzz_fill(r, b->p[B_BETA], a->beta_dtype, nb, tame, 0);
        if (tame && !a->use_beta_sigmoid && a->beta_dtype == KDA_FLOAT32) /* β in [0, 1] or non-finite */
            for (int64_t i = 0; i < nb; i++) {
                float *x = (float *)b->p[B_BETA] + i;
                if (isfinite(*x)) *x = fminf(fabsf(*x), 1.0f);
            }
    }
    if ((f->opts & 0x18) != 0x18 || r8(r) & 1) { /* most often; occasionally a NULL input */
    } else {
        a->k = NULL;
    }
    if (a->use_gate_in_kernel || (f->misc & 0x7) == 3) {
        if (!(f->opts & 0x20) && fuzz_alloc(b, B_ALOG, f->HV, 4)) {
            fuzz_fill(r, b->p[B_ALOG], KDA_FLOAT32, f->HV, tame, 0);
            a->A_log = (const float *)b->p[B_ALOG];
        }
        if ((f->misc & 1) && fuzz_alloc(b, B_DTB, sat_mul(f->HV, f->K), 4)) {
            fuzz_fill(r, b->p[B_DTB], KDA_FLOAT32, sat_mul(f->HV, f->K), tame, 0);
            a->dt_bias = (const float *)b->p[B_DTB];
        }
    }
}

/* States, the pool and its indices, and o (the sentinel in it). */
static void draw_states(fz_t *f) {
    reader_t *r = &f->r;
    kda_args_t *a = &f->a;
    fuzz_bufs_t *b = &f->b;
    f->slots = f->num_seqs;
    if (f->with_idx && f->num_seqs > 0 && f->num_seqs < 64) {
        f->slots = (int64_t)(r8(r) % 6) + ((f->misc & 0x40) ? 0 : 1); /* 0 slots: refused */
        int32_t *idx = (int32_t *)fuzz_alloc(b, B_IDX, f->num_seqs, 4);
        for (int64_t n = 0; n < f->num_seqs; n++) idx[n] = (int32_t)(r8(r) % (f->slots + 2)) - 1; /* -1 .. slots */
        a->state_indices = idx;
        a->num_state_slots = f->slots;
    }
    f->ns = sat_mul(sat_mul(sat_mul(f->slots, f->HV), f->K), f->V);
    if (f->with_h0 && (a->initial_state = fuzz_alloc(b, B_H0, f->ns, dsize(a->initial_state_dtype))))
        fuzz_fill(r, b->p[B_H0], a->initial_state_dtype, f->ns, f->tame, 0);
    if (f->with_ht && !(f->in_place && a->initial_state)) {
        if ((a->final_state = fuzz_alloc(b, B_HT, f->ns, dsize(a->final_state_dtype))))
            fuzz_fill(r, b->p[B_HT], a->final_state_dtype, f->ns, 0, 0);
    } else if (f->with_ht) {
        a->final_state = (void *)a->initial_state; /* the in-place pool */
        a->final_state_dtype = a->initial_state_dtype;
    }
    if ((a->o = fuzz_alloc(b, B_O, f->nv, dsize(a->o_dtype)))) fuzz_sentinel(b->p[B_O], a->o_dtype, f->nv);
}

/* chunk_states (kda_forward only; kda_decode refuses it), drawn from the hash as the CP fields: rows for the
 * lengths as given, a bad dtype now and then, now and then pointed into q. */
static void draw_chunk_states(fz_t *f) {
    kda_args_t *a = &f->a;
    fuzz_bufs_t *b = &f->b;
    if (((f->r.lcg >> 48) & 3) != 0) return;
    int64_t rows = 0;
    if (f->varlen && a->cu_seqlens) {
        for (int64_t n = 0; n < f->num_seqs; n++) {
            const int64_t lo = a->cu_seqlens_dtype == KDA_INT64 ? ((const int64_t *)a->cu_seqlens)[n]
                                                                : ((const int32_t *)a->cu_seqlens)[n];
            const int64_t hi = a->cu_seqlens_dtype == KDA_INT64 ? ((const int64_t *)a->cu_seqlens)[n + 1]
                                                                : ((const int32_t *)a->cu_seqlens)[n + 1];
            if (hi > lo) rows += (hi - lo + 63) / 64;
        }
    } else if (!f->varlen && a->seq_len >= 0) {
        rows = sat_mul(a->batch, (a->seq_len + 63) / 64);
    }
    const uint64_t h = f->r.lcg >> 50;
    a->chunk_states_dtype = (h & 7) == 7 ? KDA_FLOAT16 : (h & 1) ? KDA_BFLOAT16 : KDA_FLOAT32;
    f->ncs = sat_mul(sat_mul(rows, f->HV), sat_mul(f->K, f->V));
    if ((a->chunk_states = fuzz_alloc(b, B_CS, f->ncs, dsize(a->chunk_states_dtype))))
        fuzz_sentinel(b->p[B_CS], a->chunk_states_dtype, f->ncs);
    if (((h >> 3) & 7) == 0 && b->p[B_Q]) /* aliased into an input (inside it: never past its end) */
        a->chunk_states = (char *)b->p[B_Q] + (b->bytes[B_Q] > 4 ? 4 : 0);
}

/* Aliasing: an output pointed into an input (or a partial overlap of the pool). */
static void draw_alias(fz_t *f) {
    static const int targets[] = {B_Q, B_K, B_V, B_G, B_BETA, B_H0, B_ALOG, B_DTB, B_CU, B_IDX, B_HT, B_O};
    kda_args_t *a = &f->a;
    fuzz_bufs_t *b = &f->b;
    const uint8_t alias = r8(&f->r);
    if (alias >= 24) return;
    const int t = targets[alias % 12];
    if (!b->p[t]) return;
    const size_t off = (alias / 12) ? (b->bytes[t] > 4 ? 4 : 0) : 0;
    if (alias % 2 == 0 || !a->final_state) {
        if (t != B_O) a->o = (char *)b->p[t] + off;
    } else if (t != B_HT) {
        a->final_state = (char *)b->p[t] + off;
    }
}

/* The call: a NULL context or args now and then, the workspace of draw's choice. */
static kda_status_t run_call(fz_t *f, kda_context_t **ctx, const char **fn) {
    const int ws_mode = (f->misc >> 5) == 7 ? (r8(&f->r) % 3) + 1 : 0;
    *ctx = fuzz_context(f->reference);
    if ((f->misc & 0x0f) == 0x0b) *ctx = NULL;
    fuzz_snapshot(&f->b);
    const int args_null = (f->opts & 0xf8) == 0xf8 && (f->misc & 1);
    *fn = f->decode ? "kda_decode" : "kda_forward";
    if (!*ctx) return f->decode ? kda_decode(NULL, &f->a, NULL, 0, NULL) : kda_forward(NULL, &f->a, NULL, 0, NULL);
    if (args_null) return f->decode ? kda_decode(*ctx, NULL, NULL, 0, NULL) : kda_forward(*ctx, NULL, NULL, 0, NULL);
    return call(*ctx, &f->a, f->decode, ws_mode, fn);
}

/* Success: o and chunk_states fully written, inputs unchanged, untouched pool slots unchanged. */
static void check_success(const fz_t *f, const char *fn, int *o_own, int *cs_own) {
    const kda_args_t *a = &f->a;
    const fuzz_bufs_t *b = &f->b;
    *o_own = a->o == b->p[B_O];
    /* o pointed into the final_state buffer while final_state is NULL: not an alias, that memory is o's now */
    const int o_in_unused_ht = !*o_own && b->p[B_HT] && !a->final_state && (char *)a->o >= (char *)b->p[B_HT] &&
                               (char *)a->o < (char *)b->p[B_HT] + b->bytes[B_HT];
    CHECK(*o_own || o_in_unused_ht || f->nv == 0, "%s: success with o aliased into an input", fn);
    if (*o_own)
        for (int64_t i = 0; i < f->nv; i++)
            CHECK(!fuzz_is_sentinel(b->p[B_O], a->o_dtype, i), "%s: o[%lld] unwritten", fn, (long long)i);
    *cs_own = a->chunk_states && a->chunk_states == b->p[B_CS];
    CHECK(!a->chunk_states || *cs_own || f->ncs == 0, "%s: success with chunk_states aliased into an input", fn);
    if (*cs_own)
        for (int64_t i = 0; i < f->ncs; i++)
            CHECK(!fuzz_is_sentinel(b->p[B_CS], a->chunk_states_dtype, i), "%s: chunk_states[%lld] unwritten", fn,
                  (long long)i);
    for (int i = 0; i < NBUF; i++) {
        if (i == B_O || i == B_HT || i == B_CS || !b->p[i]) continue;
        if (i == B_H0 && a->final_state == a->initial_state) continue;
        CHECK(memcmp(b->p[i], b->copy[i], b->bytes[i]) == 0, "%s: input %s written", fn, buf_name[i]);
    }
    void *pool = a->final_state;
    const int pool_buf = pool == b->p[B_HT] ? B_HT : B_H0;
    if (pool && a->state_indices) {
        const size_t slot_bytes = (size_t)(f->HV * f->K * f->V) * dsize(a->final_state_dtype);
        for (int64_t s = 0; s < f->slots; s++) {
            int named = 0;
            for (int64_t n = 0; n < f->num_seqs; n++) named |= a->state_indices[n] == s;
            if (!named)
                CHECK(memcmp((char *)pool + s * slot_bytes, (char *)b->copy[pool_buf] + s * slot_bytes,
                             slot_bytes) == 0,
                      "%s: pool slot %lld written though no sequence names it", fn, (long long)s);
        }
    }
    if (!pool && b->p[B_HT] && !o_in_unused_ht)
        CHECK(memcmp(b->p[B_HT], b->copy[B_HT], b->bytes[B_HT]) == 0, "%s: final_state written", fn);
}

/* Tame values: the NaN pattern of o and of the final state agrees between forward, decode and oracle. */
static void check_agree(fz_t *f, kda_context_t *ctx, const char *fn, int cs_own) {
    kda_args_t *a = &f->a;
    fuzz_bufs_t *b = &f->b;
    void *pool = a->final_state;
    void *o1 = malloc(b->bytes[B_O]), *h1 = pool ? malloc(b->bytes[B_HT]) : NULL;
    void *c1 = cs_own ? malloc(b->bytes[B_CS]) : NULL;
    memcpy(o1, b->p[B_O], b->bytes[B_O]);
    if (h1) memcpy(h1, pool, b->bytes[B_HT]);
    if (c1) memcpy(c1, b->p[B_CS], b->bytes[B_CS]);
    for (int other = 0; other < 3; other++) {
        kda_context_t *c2 = fuzz_context(other == 2);
        const int dec2 = other == 0 ? !f->decode : other == 1 ? f->decode : 0;
        if (c2 == ctx && dec2 == f->decode) continue;
        memcpy(b->p[B_O], b->copy[B_O], b->bytes[B_O]);
        if (pool) memcpy(pool, b->copy[B_HT], b->bytes[B_HT]);
        const char *fn2;
        kda_args_t a2 = *a;
        if (dec2) a2.chunk_states = NULL; /* kda_forward's only */
        CHECK(call(c2, &a2, dec2, 0, &fn2) == KDA_STATUS_SUCCESS, "%s refused what %s took: %s", fn2, fn,
              kda_last_error());
        if (c1 && !dec2)
            for (int64_t i = 0; i < f->ncs; i++)
                CHECK(fuzz_is_nan_at(c1, a->chunk_states_dtype, i) ==
                          fuzz_is_nan_at(b->p[B_CS], a->chunk_states_dtype, i),
                      "chunk_states[%lld]: NaN on one of %s and %s only", (long long)i, fn, fn2);
        for (int64_t i = 0; i < f->nv; i++)
            CHECK(fuzz_is_nan_at(o1, a->o_dtype, i) == fuzz_is_nan_at(b->p[B_O], a->o_dtype, i),
                  "o[%lld]: NaN on one of %s (%s) and %s (%s) only", (long long)i, fn, f->reference ? "ref" : "cpu",
                  fn2, other == 2 ? "ref" : "cpu");
        if (pool)
            for (int64_t i = 0; i < f->ns; i++)
                CHECK(fuzz_is_nan_at(h1, a->final_state_dtype, i) == fuzz_is_nan_at(pool, a->final_state_dtype, i),
                      "final_state[%lld]: NaN on one of %s and %s only", (long long)i, fn, fn2);
    }
    free(o1);
    free(h1);
    free(c1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fz_t f;
    memset(&f, 0, sizeof f);
    f.r = reader(data, size);
    f.b.name = buf_name;
    f.b.n = NBUF;
    draw_sizes_options(&f);
    draw_sequences(&f);
    draw_inputs(&f);
    draw_states(&f);
    draw_chunk_states(&f);
    draw_alias(&f);
    kda_context_t *ctx;
    const char *fn;
    const kda_status_t st = run_call(&f, &ctx, &fn);
    if (st != KDA_STATUS_SUCCESS) {
        fuzz_check_error(st, fn, &f.b);
    } else {
        int o_own, cs_own;
        check_success(&f, fn, &o_own, &cs_own);
        void *pool = f.a.final_state;
        if (f.tame && o_own && ctx && f.nv > 0 && (!pool || pool == f.b.p[B_HT])) check_agree(&f, ctx, fn, cs_own);
    }
    fuzz_free(&f.b);
    return 0;
}
