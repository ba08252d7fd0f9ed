/*
 * CPU recurrent decode (kda_decode) against the fp64 oracle, with state pools updated in place.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "test_util.h"

static kda_context_t *cpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) exit(1);
    return ctx;
}

static void expect_close(const kda_synth_config_t *cfg, double tol) {
    kda_compare_t r = kda_compare_host(cpu(), cfg, KDA_ALGO_DECODE);
    CHECK(r.status == KDA_STATUS_SUCCESS, "%s: %s", kda_describe(cfg), kda_last_error());
    CHECK(r.o_unwritten == 0 && r.state_unwritten == 0, "%s: unwritten outputs", kda_describe(cfg));
    CHECK(r.o_err <= tol, "%s: o rel err %.3g", kda_describe(cfg), r.o_err);
    CHECK(r.state_err <= tol, "%s: state rel err %.3g", kda_describe(cfg), r.state_err);
}

TEST(decode_one_token_batch) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 8;
    c.seq_len = 1;
    c.hqk = 2;
    c.hv = 8;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    expect_close(&c, 1e-5);
    c.dtype = c.g_dtype = c.o_dtype = KDA_BFLOAT16;
    c.state_v_first = 1;
    expect_close(&c, 1e-2);
}

TEST(decode_multi_token_varlen) {
    static const int64_t lens[] = {3, 0, 1, 5};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 4;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 4;
    c.k = 64;
    c.v = 128;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_close(&c, 1e-5);
    c.gate = KDA_GATE_RAW;
    c.beta_sigmoid = c.allow_neg_eigval = 1;
    expect_close(&c, 1e-5);
}

/* vLLM's decode step: a pool of slots, sequences pick theirs; the pool is updated in place and every slot no
 * sequence names stays bit-identical. A negative index means no slot (start from zeros, write nothing). */
TEST(decode_state_indices_inplace_untouched_slots) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 5;
    c.seq_len = 1;
    c.hqk = 2;
    c.hv = 4;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_BFLOAT16;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int slots = 11;
    const int64_t per_slot = (int64_t)c.hv * c.k * c.v;
    const size_t pool_bytes = sizeof(float) * (size_t)(slots * per_slot);
    float *pool = (float *)malloc(pool_bytes), *before = (float *)malloc(pool_bytes), *ref = (float *)malloc(pool_bytes);
    for (int64_t i = 0; i < slots * per_slot; i++) pool[i] = sinf((float)i * 0.37f);
    memcpy(before, pool, pool_bytes);
    memcpy(ref, pool, pool_bytes);
    int32_t idx[5] = {9, 2, -1, 0, 5};
    a.initial_state = a.final_state = pool;
    a.state_indices = idx;
    a.num_state_slots = slots;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "decode: %s", kda_last_error());

    const int64_t o_elems = s.num_tokens * c.hv * c.v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)o_elems);
    kda_args_t ra = a;
    ra.o = o_ref;
    ra.o_dtype = KDA_FLOAT32;
    ra.initial_state = ra.final_state = ref;
    CHECK(kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "reference");
    double eo = kda_rel_err(s.o, KDA_BFLOAT16, o_ref, KDA_FLOAT32, o_elems);
    CHECK(eo <= 1e-2, "o rel err %.3g", eo);
    for (int sl = 0; sl < slots; sl++) {
        const float *p = pool + sl * per_slot;
        int used = sl == 9 || sl == 2 || sl == 0 || sl == 5;
        if (used) {
            double e = kda_rel_err(p, KDA_FLOAT32, ref + sl * per_slot, KDA_FLOAT32, per_slot);
            CHECK(e <= 1e-5, "slot %d rel err %.3g", sl, e);
        } else {
            CHECK(memcmp(p, before + sl * per_slot, sizeof(float) * (size_t)per_slot) == 0,
                  "slot %d was not named but changed", sl);
        }
    }
    free(pool);
    free(before);
    free(ref);
    free(o_ref);
    kda_synth_free(&s);
}

TEST(decode_matches_forward) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 70;
    c.hqk = 1;
    c.hv = 2;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    expect_close(&c, 1e-5);
}

/* ---------------------------------------------------------------------------------------------------------
 * Speculative decoding (2-D state_indices, num_accepted_tokens), headwise β, the non-finite contract
 * ------------------------------------------------------------------------------------------------------- */

/* FLA's spec decoding, spelled out with one-token calls of the oracle: sequence n starts from slot
 * idx[n][nat[n] - 1] (zeros if negative), and after its token t the state goes to slot idx[n][t] (nothing if
 * negative). All fp32. Fills o_ref and pool_ref (a copy of the pool before the call). */
static void spec_by_token_steps(const kda_args_t *a, const kda_synth_config_t *c, const int32_t *idx, int64_t cols,
                                const int32_t *nat, float *pool_ref, float *o_ref) {
    const int64_t per_slot = (int64_t)c->hv * c->k * c->v;
    float *S = (float *)malloc(sizeof(float) * (size_t)per_slot);
    const int64_t *cu = (const int64_t *)a->cu_seqlens;
    const int nb = a->beta_headwise ? c->v : 1;
    for (int64_t n = 0; n < a->num_seqs; n++) {
        const int32_t r = idx[n * cols + (nat ? nat[n] - 1 : 0)];
        if (r >= 0) memcpy(S, pool_ref + r * per_slot, sizeof(float) * (size_t)per_slot);
        else memset(S, 0, sizeof(float) * (size_t)per_slot);
        for (int64_t t = cu[n]; t < cu[n + 1]; t++) {
            kda_args_t s = *a;
            s.cu_seqlens = NULL;
            s.num_seqs = 0;
            s.batch = 1;
            s.seq_len = 1;
            s.q = (const float *)a->q + t * c->hqk * c->k;
            s.k = (const float *)a->k + t * c->hqk * c->k;
            s.v = (const float *)a->v + t * c->hv * c->v;
            s.g = (const float *)a->g + t * c->hv * c->k;
            s.beta = (const float *)a->beta + t * c->hv * nb;
            s.o = o_ref + t * c->hv * c->v;
            s.o_dtype = KDA_FLOAT32;
            s.initial_state = s.final_state = S;
            s.state_indices = NULL;
            s.num_state_slots = 0;
            s.state_indices_cols = 0;
            s.num_accepted_tokens = NULL;
            CHECK(kda_run_host(kda_test_reference(), &s, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "step: %s",
                  kda_last_error());
            const int32_t w = idx[n * cols + (t - cu[n])];
            if (w >= 0) memcpy(pool_ref + w * per_slot, S, sizeof(float) * (size_t)per_slot);
        }
    }
    free(S);
}

/* One spec-decoding call on `ctx` (in place on a pool) against spec_by_token_steps; untouched slots must stay
 * bit-identical. */
static void check_spec(kda_context_t *ctx, kda_algo_t algo, int headwise, double tol) {
    static const int64_t lens[] = {3, 1, 4, 0, 2};
    enum { N = 5, COLS = 4, SLOTS = 24 };
    /* row 0 writes 3 slots, reads its 2nd; row 1 reads slot -1 (zeros); row 2 skips the write of token 1;
       row 3 has no tokens; row 4 reads a slot it does not write. Column COLS-1 of row 0 is never touched. */
    static const int32_t idx[N * COLS] = {5, 11, 2, 23, -1, 7, 8, 9, 14, -1, 3, 20, 13, 12, 1, 0, 4, 6, 10, 17};
    static const int32_t nat[N] = {2, 1, 3, 4, 4};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = N;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 2;
    c.k = 32;
    c.v = 48;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.gate = KDA_GATE_SOFTPLUS;
    c.l2norm = c.beta_sigmoid = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int64_t per_slot = (int64_t)c.hv * c.k * c.v;
    const size_t pool_bytes = sizeof(float) * (size_t)(SLOTS * per_slot);
    float *pool = (float *)malloc(pool_bytes), *before = (float *)malloc(pool_bytes);
    float *ref = (float *)malloc(pool_bytes);
    for (int64_t i = 0; i < SLOTS * per_slot; i++) pool[i] = 0.5f * sinf((float)i * 0.37f);
    memcpy(before, pool, pool_bytes);
    memcpy(ref, pool, pool_bytes);
    float *bh = NULL;
    if (headwise) {
        bh = (float *)malloc(sizeof(float) * (size_t)(s.num_tokens * c.hv * c.v));
        for (int64_t i = 0; i < s.num_tokens * c.hv * c.v; i++) bh[i] = sinf((float)i * 1.3f) * 2.0f;
        a.beta = bh;
        a.beta_headwise = 1;
    }
    a.initial_state = a.final_state = pool;
    a.state_indices = idx;
    a.state_indices_cols = COLS;
    a.num_accepted_tokens = nat;
    a.num_state_slots = SLOTS;
    CHECK(kda_run_host(ctx, &a, algo) == KDA_STATUS_SUCCESS, "spec call: %s", kda_last_error());

    const int64_t o_elems = s.num_tokens * c.hv * c.v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)o_elems);
    spec_by_token_steps(&a, &c, idx, COLS, nat, ref, o_ref);
    double eo = kda_rel_err(s.o, KDA_FLOAT32, o_ref, KDA_FLOAT32, o_elems);
    CHECK(eo <= tol, "o rel err %.3g", eo);
    for (int sl = 0; sl < SLOTS; sl++) {
        int written = 0;
        for (int n = 0; n < N; n++)
            for (int t = 0; t < lens[n]; t++) written |= idx[n * COLS + t] == sl;
        const float *p = pool + sl * per_slot;
        if (written) {
            double e = kda_rel_err(p, KDA_FLOAT32, ref + sl * per_slot, KDA_FLOAT32, per_slot);
            CHECK(e <= tol, "slot %d rel err %.3g", sl, e);
        } else {
            CHECK(memcmp(p, before + sl * per_slot, sizeof(float) * (size_t)per_slot) == 0,
                  "slot %d was not written by any token but changed", sl);
        }
    }
    free(pool);
    free(before);
    free(ref);
    free(o_ref);
    free(bh);
    kda_synth_free(&s);
}

TEST(decode_spec_2d_indices_reference) { check_spec(kda_test_reference(), KDA_ALGO_DECODE, 0, 1e-6); }
TEST(decode_spec_2d_indices_cpu) { check_spec(cpu(), KDA_ALGO_DECODE, 0, 1e-5); }
TEST(decode_spec_2d_indices_cpu_forward) { check_spec(cpu(), KDA_ALGO_FORWARD, 0, 1e-5); }
TEST(decode_spec_2d_headwise_beta_cpu) { check_spec(cpu(), KDA_ALGO_DECODE, 1, 1e-5); }

/* 2-D indices with a row stride (a column slice of a wider index buffer) and no num_accepted_tokens (every
 * sequence reads column 0): the same as the contiguous call. */
TEST(decode_spec_2d_row_stride_no_accepted) {
    static const int64_t lens[] = {2, 2};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 2;
    c.seqlens = lens;
    c.k = c.v = 16;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int64_t per_slot = 16 * 16;
    float pool_a[6 * 256], pool_b[6 * 256];
    for (int i = 0; i < 6 * 256; i++) pool_a[i] = pool_b[i] = cosf((float)i);
    const int32_t wide[2 * 5] = {0, 1, 99, 99, 99, 2, 3, 99, 99, 99};
    const int32_t tight[2 * 2] = {0, 1, 2, 3};
    a.initial_state = a.final_state = pool_a;
    a.state_indices = wide;
    a.state_indices_cols = 2;
    a.state_indices_row_stride = 5;
    a.num_state_slots = 6;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "strided: %s", kda_last_error());
    float *o1 = (float *)malloc(s.o_bytes);
    memcpy(o1, s.o, s.o_bytes);
    a.initial_state = a.final_state = pool_b;
    a.state_indices = tight;
    a.state_indices_row_stride = 0;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "tight: %s", kda_last_error());
    CHECK(memcmp(o1, s.o, s.o_bytes) == 0, "o differs between strided and contiguous indices");
    CHECK(memcmp(pool_a, pool_b, sizeof pool_a) == 0, "pools differ between strided and contiguous indices");
    (void)per_slot;
    free(o1);
    kda_synth_free(&s);
}

/* Headwise β whose V entries are all the scalar β gives the scalar result: bit for bit on the recurrence,
 * within fp32 rounding on the chunked forward it is checked against. */
TEST(decode_beta_headwise_equals_scalar) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 5;
    c.hqk = 1;
    c.hv = 2;
    c.k = 64;
    c.v = 40;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    c.beta_sigmoid = c.allow_neg_eigval = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int64_t rows = s.num_tokens * c.hv;
    float *bh = (float *)malloc(sizeof(float) * (size_t)(rows * c.v));
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < c.v; j++) bh[r * c.v + j] = ((const float *)s.beta)[r];
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "scalar: %s", kda_last_error());
    void *o1 = malloc(s.o_bytes), *h1 = malloc(s.ht_bytes);
    memcpy(o1, s.o, s.o_bytes);
    memcpy(h1, s.ht, s.ht_bytes);
    a.beta = bh;
    a.beta_headwise = 1;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "headwise: %s", kda_last_error());
    CHECK(memcmp(o1, s.o, s.o_bytes) == 0, "decode o differs");
    CHECK(memcmp(h1, s.ht, s.ht_bytes) == 0, "decode final state differs");
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "forward: %s", kda_last_error());
    double e = kda_rel_err(s.o, KDA_FLOAT32, o1, KDA_FLOAT32, s.num_tokens * c.hv * c.v);
    CHECK(e <= 1e-5, "forward o rel err %.3g", e);
    free(o1);
    free(h1);
    free(bh);
    kda_synth_free(&s);
}

/* Distinct β per value channel against the oracle, both CPU entry points, bf16 inputs, V-first states. */
TEST(decode_beta_headwise_vs_oracle) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 3;
    c.seq_len = 7;
    c.hqk = 2;
    c.hv = 4;
    c.k = 48;
    c.v = 64;
    c.initial_state = c.final_state = 1;
    c.state_v_first = 1;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int64_t n = s.num_tokens * c.hv * c.v;
    float *bh = (float *)malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) bh[i] = 3.0f * sinf((float)i * 0.71f);
    a.beta = bh;
    a.beta_dtype = KDA_FLOAT32;
    a.beta_headwise = 1;
    a.o_dtype = KDA_FLOAT32;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)n), *o = (float *)malloc(sizeof(float) * (size_t)n);
    const int64_t st = (int64_t)c.batch * c.hv * c.k * c.v;
    float *h_ref = (float *)malloc(sizeof(float) * (size_t)st);
    kda_args_t r = a;
    r.o = o_ref;
    r.final_state = h_ref;
    CHECK(kda_run_host(kda_test_reference(), &r, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "ref: %s", kda_last_error());
    a.o = o;
    for (int algo = 0; algo < 2; algo++) {
        CHECK(kda_run_host(cpu(), &a, (kda_algo_t)algo) == KDA_STATUS_SUCCESS, "cpu: %s", kda_last_error());
        double eo = kda_rel_err(o, KDA_FLOAT32, o_ref, KDA_FLOAT32, n);
        double eh = kda_rel_err(s.ht, KDA_FLOAT32, h_ref, KDA_FLOAT32, st);
        CHECK(eo <= 1e-5 && eh <= 1e-5, "algo %d: o %.3g state %.3g", algo, eo, eh);
    }
    free(bh);
    free(o_ref);
    free(o);
    free(h_ref);
    kda_synth_free(&s);
}

/* The non-finite contract on the decode paths: a NaN or inf input of token 2 makes o from that token on and the
 * final state NaN; tokens before are exactly the clean run's. An inf in the initial state (key channel 0, value
 * channel 7 of head 0) makes value channel 7 of head 0 NaN (o of every token, column 7 of the final state), and
 * every other element exactly the clean run's. A +inf gate clamps to 0 (no decay) and stays finite. */
static void check_poison(kda_context_t *ctx, int what) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.seq_len = 4;
    c.hqk = 1;
    c.hv = 2;
    c.k = c.v = 16;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    c.l2norm = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    CHECK(!a.state_v_first, "the synthesiser's default layout is K-first");
    CHECK(kda_run_host(ctx, &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "clean: %s", kda_last_error());
    float *clean = (float *)malloc(s.o_bytes), *clean_ht = (float *)malloc(sizeof(float) * 2 * 16 * 16);
    memcpy(clean, s.o, s.o_bytes);
    memcpy(clean_ht, s.ht, sizeof(float) * 2 * 16 * 16);
    const int per_tok = c.hv * c.v;
    switch (what) {
    case 0: ((float *)s.v)[2 * per_tok + 3] = NAN; break;                 /* v of token 2, head 0 */
    case 1: ((float *)s.q)[2 * c.k + 1] = INFINITY; break;                /* q of token 2 */
    case 2: ((float *)s.g)[2 * c.hv * c.k + 5] = NAN; break;              /* gate of token 2, head 0 */
    case 3: ((float *)s.h0)[7] = INFINITY; break;                         /* initial state of head 0: (0, 7) */
    case 4: ((float *)s.g)[2 * c.hv * c.k + 5] = INFINITY; break;         /* +inf gate: clamped to 0 */
    }
    CHECK(kda_run_host(ctx, &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "poisoned: %s", kda_last_error());
    const float *o = (const float *)s.o;
    const int first = what == 3 ? 0 : 2, hp = what == 1 ? c.hv : 1; /* q is shared by both value heads */
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < c.hv; h++)
            for (int j = 0; j < c.v; j++) {
                const float x = o[(t * c.hv + h) * c.v + j], y = clean[(t * c.hv + h) * c.v + j];
                if (what == 4) CHECK(isfinite(x), "+inf gate: o[%d][%d][%d] = %g", t, h, j, x);
                else if (h < hp && t >= first && (what != 3 || j == 7))
                    CHECK(isnan(x), "o[%d][%d][%d] = %g, expected NaN", t, h, j, x);
                else
                    CHECK(memcmp(&x, &y, 4) == 0, "o[%d][%d][%d] = %g changed (clean %g)", t, h, j, x, y);
            }
    const float *ht = (const float *)s.ht;
    for (int i = 0; i < c.k * c.v; i++) {
        if (what == 4) CHECK(isfinite(ht[i]), "+inf gate: final state not finite");
        else if (what == 3)
            CHECK(i % c.v == 7 ? isnan(ht[i]) : memcmp(ht + i, clean_ht + i, 4) == 0,
                  "final state element %d of head 0: %g (clean %g; NaN exactly in column 7)", i, ht[i], clean_ht[i]);
        else CHECK(isnan(ht[i]) && (hp == 2 ? isnan(ht[c.k * c.v + i]) : isfinite(ht[c.k * c.v + i])),
                   "final state element %d: %g / %g", i, ht[i], ht[c.k * c.v + i]);
        if (what == 3)
            CHECK(memcmp(ht + c.k * c.v + i, clean_ht + c.k * c.v + i, 4) == 0, "final state of head 1 changed");
    }
    free(clean);
    free(clean_ht);
    kda_synth_free(&s);
}

TEST(decode_nonfinite_v_poisons_later_tokens) { check_poison(cpu(), 0); check_poison(kda_test_reference(), 0); }
TEST(decode_nonfinite_q_poisons_state) { check_poison(cpu(), 1); check_poison(kda_test_reference(), 1); }
TEST(decode_nan_gate_poisons) { check_poison(cpu(), 2); check_poison(kda_test_reference(), 2); }
TEST(decode_nonfinite_initial_state_poisons_its_channel) { check_poison(cpu(), 3); check_poison(kda_test_reference(), 3); }
TEST(decode_inf_gate_clamped) { check_poison(cpu(), 4); check_poison(kda_test_reference(), 4); }

/* The distinct-slot check is linear, for any N: 20000 one-token sequences, a duplicate at the two ends. */
TEST(decode_bad_state_indices_duplicate_large_n) {
    enum { N = 20000 };
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = N;
    c.seq_len = 1;
    c.k = c.v = 2;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * N);
    float *pool = (float *)calloc((size_t)300000 * 4, sizeof(float));
    for (int i = 0; i < N; i++) idx[i] = 299999 - 13 * i;
    a.initial_state = a.final_state = pool;
    a.state_indices = idx;
    a.num_state_slots = 300000;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "distinct: %s", kda_last_error());
    idx[N - 1] = idx[0];
    void *o_before = malloc(s.o_bytes);
    memcpy(o_before, s.o, s.o_bytes);
    kda_status_t st = kda_run_host(cpu(), &a, KDA_ALGO_DECODE);
    CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "'state_indices'") &&
              strstr(kda_last_error(), "state_indices[0] and state_indices[19999]"),
          "duplicate: %s", kda_last_error());
    CHECK(memcmp(o_before, s.o, s.o_bytes) == 0, "o written on error");
    free(o_before);
    free(idx);
    free(pool);
    kda_synth_free(&s);
}
