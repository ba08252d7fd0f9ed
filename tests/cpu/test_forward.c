/*
 * CPU chunked forward (kda_forward on the CPU backend) against the fp64 oracle.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "dtype.h"
#include "test_util.h"

static kda_context_t *cpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) {
        fprintf(stderr, "kda_create(CPU): %s\n", kda_last_error());
        exit(1);
    }
    return ctx;
}

static void expect_close(const kda_synth_config_t *cfg, kda_algo_t algo, double tol) {
    kda_compare_t r = kda_compare_host(cpu(), cfg, algo);
    CHECK(r.status == KDA_STATUS_SUCCESS, "%s: status %s (%s)", kda_describe(cfg), kda_status_string(r.status),
          kda_last_error());
    CHECK(r.o_unwritten == 0, "%s: %lld output elements unwritten or not finite", kda_describe(cfg),
          (long long)r.o_unwritten);
    CHECK(r.state_unwritten == 0, "%s: %lld state elements unwritten or not finite", kda_describe(cfg),
          (long long)r.state_unwritten);
    CHECK(r.o_err <= tol, "%s: o rel err %.3g > %.3g", kda_describe(cfg), r.o_err, tol);
    CHECK(r.state_err <= tol, "%s: state rel err %.3g > %.3g", kda_describe(cfg), r.state_err, tol);
}

/* ---------------------------------------------------------------------------------------------------------
 * The matrix: every shape of the foundation issue; the options rotate over the shapes so that each value of
 * each option meets many shapes.
 * ------------------------------------------------------------------------------------------------------- */
static void matrix(kda_dtype_t dtype, int K, int V, double tol) {
    static const int64_t Bs[] = {1, 3};
    static const int64_t Ts[] = {1, 15, 16, 17, 63, 64, 65, 200};
    static const int HQKs[] = {1, 2};
    static const int Gs[] = {1, 2, 4};
    unsigned i = (unsigned)K * 7u + (unsigned)V;
    int cases = 0;
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 8; t++)
            for (int hq = 0; hq < 2; hq++)
                for (int gi = 0; gi < 3; gi++, i++) {
                    kda_synth_config_t c;
                    kda_synth_defaults(&c);
                    c.batch = Bs[b];
                    c.seq_len = Ts[t];
                    c.hqk = HQKs[hq];
                    c.hv = HQKs[hq] * Gs[gi];
                    c.k = K;
                    c.v = V;
                    c.dtype = c.g_dtype = c.o_dtype = dtype;
                    c.beta_dtype = (i % 2) ? KDA_FLOAT32 : dtype;
                    unsigned h = i * 2654435761u;
                    c.gate = (kda_gate_mode_t)(h % 4);
                    c.l2norm = (h >> 3) % 2;
                    int bmode = (int)((h >> 5) % 3);
                    c.beta_sigmoid = bmode > 0;
                    c.allow_neg_eigval = bmode == 2;
                    int init = (int)((h >> 8) % 3);
                    c.initial_state = init > 0;
                    c.initial_state_dtype = init == 2 ? KDA_BFLOAT16 : KDA_FLOAT32;
                    c.final_state = 1;
                    c.final_state_dtype = (dtype == KDA_FLOAT32 || (h >> 11) % 2) ? KDA_FLOAT32 : KDA_BFLOAT16;
                    c.state_v_first = (h >> 13) % 2;
                    c.seed = i;
                    expect_close(&c, KDA_ALGO_FORWARD, tol);
                    cases++;
                }
    CHECK(cases == 96, "ran %d cases", cases);
}

TEST(fwd_matrix_f32_k64_v64) { matrix(KDA_FLOAT32, 64, 64, 1e-5); }
TEST(fwd_matrix_f32_k128_v128) { matrix(KDA_FLOAT32, 128, 128, 1e-5); }
TEST(fwd_matrix_f32_k128_v64) { matrix(KDA_FLOAT32, 128, 64, 1e-5); }
TEST(fwd_matrix_bf16_k64_v64) { matrix(KDA_BFLOAT16, 64, 64, 1e-2); }
TEST(fwd_matrix_bf16_k128_v128) { matrix(KDA_BFLOAT16, 128, 128, 1e-2); }
TEST(fwd_matrix_bf16_k128_v64) { matrix(KDA_BFLOAT16, 128, 64, 1e-2); }

/* ---------------------------------------------------------------------------------------------------------
 * One option at a time, on a shape with several chunks
 * ------------------------------------------------------------------------------------------------------- */
static kda_synth_config_t base(void) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 150;
    c.hqk = 2;
    c.hv = 4;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    c.seed = 7;
    return c;
}

TEST(fwd_gate_raw) {
    kda_synth_config_t c = base();
    c.gate = KDA_GATE_RAW;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_gate_softplus) {
    kda_synth_config_t c = base();
    c.gate = KDA_GATE_SOFTPLUS;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_gate_lower_bound) {
    kda_synth_config_t c = base();
    c.gate = KDA_GATE_LOWER_BOUND;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
    c.lower_bound = -1.0f;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_gate_lower_bound_no_alog) {
    kda_synth_config_t c = base();
    c.gate = KDA_GATE_LOWER_BOUND_NO_A;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
    c.lower_bound = -12.0f; /* allowed without safe_gate */
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_l2norm) {
    kda_synth_config_t c = base();
    c.l2norm = 1;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_beta_sigmoid) {
    kda_synth_config_t c = base();
    c.beta_sigmoid = 1;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_allow_neg_eigval) {
    kda_synth_config_t c = base();
    c.beta_sigmoid = 1;
    c.allow_neg_eigval = 1;
    c.l2norm = 1;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_initial_state_none) {
    kda_synth_config_t c = base();
    c.initial_state = 0;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_initial_state_bf16) {
    kda_synth_config_t c = base();
    c.initial_state_dtype = KDA_BFLOAT16;
    c.final_state_dtype = KDA_BFLOAT16;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-2);
}

TEST(fwd_state_v_first) {
    kda_synth_config_t c = base();
    c.state_v_first = 1;
    c.k = 128;
    c.v = 64;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_gva_hv_4x_hqk) {
    kda_synth_config_t c = base();
    c.hqk = 2;
    c.hv = 8;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = 1;
    c.beta_sigmoid = 1;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_fp16) {
    kda_synth_config_t c = base();
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT16;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-2);
}

TEST(fwd_bf16_long) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 1000;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_BFLOAT16;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-2);
}

TEST(fwd_f32_long) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 1000;
    c.gate = KDA_GATE_SOFTPLUS;
    c.decay = 0.05f; /* long memory: the state carries across many chunks */
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

/* ---------------------------------------------------------------------------------------------------------
 * Varlen, empty sequences, T = 0
 * ------------------------------------------------------------------------------------------------------- */
TEST(fwd_varlen_empty_seq) {
    static const int64_t lens[] = {0, 5, 0, 70, 1, 130, 0};
    kda_synth_config_t c = base();
    c.num_seqs = 7;
    c.seqlens = lens;
    c.hqk = 2;
    c.hv = 4;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
    c.gate = KDA_GATE_LOWER_BOUND;
    c.dtype = c.g_dtype = c.o_dtype = KDA_BFLOAT16;
    c.state_v_first = 1;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-2);
}

TEST(fwd_varlen_all_empty) {
    static const int64_t lens[] = {0, 0, 0};
    kda_synth_config_t c = base();
    c.num_seqs = 3;
    c.seqlens = lens;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    kda_status_t st = kda_run_host(cpu(), &a, KDA_ALGO_FORWARD);
    CHECK(st == KDA_STATUS_SUCCESS, "status %s: %s", kda_status_string(st), kda_last_error());
    /* every final state equals its initial state */
    CHECK(memcmp(s.h0, s.ht, s.ht_bytes) == 0, "final state of an empty sequence differs from its initial state");
    kda_synth_free(&s);
}

TEST(fwd_t0_batch) {
    kda_synth_config_t c = base();
    c.seq_len = 0;
    c.initial_state = 0;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    kda_status_t st = kda_run_host(cpu(), &a, KDA_ALGO_FORWARD);
    CHECK(st == KDA_STATUS_SUCCESS, "status %s: %s", kda_status_string(st), kda_last_error());
    const int64_t n = s.num_seqs * c.hv * (int64_t)c.k * c.v;
    for (int64_t i = 0; i < n; i++)
        if (kda_load_f32(s.ht, KDA_FLOAT32, i) != 0.0f) {
            CHECK(0, "final state of an empty sequence without initial state is not zero at %lld", (long long)i);
            break;
        }
    kda_synth_free(&s);
}

/* ---------------------------------------------------------------------------------------------------------
 * Strong decay: the diagonal blocks' fallback, gates near -inf
 * ------------------------------------------------------------------------------------------------------- */
TEST(fwd_strong_decay_raw) {
    kda_synth_config_t c = base();
    c.decay = 40.0f; /* raw log decays down to about -100 per token: diagonal blocks fall back */
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_strong_decay_softplus) {
    kda_synth_config_t c = base();
    c.gate = KDA_GATE_SOFTPLUS;
    c.decay = 200.0f; /* large A_log */
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_strong_decay_lower_bound_long) {
    kda_synth_config_t c = base();
    c.gate = KDA_GATE_LOWER_BOUND;
    c.decay = 50.0f; /* gates pinned near the bound -5 over whole chunks */
    c.seq_len = 300;
    expect_close(&c, KDA_ALGO_FORWARD, 1e-5);
}

TEST(fwd_gate_near_minus_inf) {
    kda_synth_config_t c = base();
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    /* every 7th token resets some channels: log decay -1e30, and -inf */
    const int64_t rows = s.num_tokens * c.hv;
    for (int64_t r = 0; r < rows; r += 7)
        for (int d = 0; d < c.k; d += 3) ((float *)s.g)[r * c.k + d] = (r % 2) ? -1e30f : -INFINITY;
    kda_status_t st = kda_run_host(cpu(), &a, KDA_ALGO_FORWARD);
    CHECK(st == KDA_STATUS_SUCCESS, "status %s", kda_status_string(st));
    const int64_t o_elems = s.num_tokens * c.hv * c.v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)o_elems);
    kda_args_t ra = a;
    ra.o = o_ref;
    ra.final_state = NULL;
    CHECK(kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "reference");
    CHECK(kda_count_nonfinite(s.o, KDA_FLOAT32, o_elems) == 0, "non-finite outputs");
    double e = kda_rel_err(s.o, KDA_FLOAT32, o_ref, KDA_FLOAT32, o_elems);
    CHECK(e <= 1e-5, "o rel err %.3g", e);
    free(o_ref);
    kda_synth_free(&s);
}

/* ---------------------------------------------------------------------------------------------------------
 * Chaining: [0, T) equals [0, t) then [t, T) from its final state
 * ------------------------------------------------------------------------------------------------------- */
static void chain(int64_t T, int64_t t, kda_dtype_t dtype, double tol) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = T;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = dtype;
    c.gate = KDA_GATE_SOFTPLUS;
    c.decay = 0.1f;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "full: %s", kda_last_error());

    const size_t es = kda_dtype_size(dtype);
    const int64_t o_elems = T * c.hv * c.v, st_elems = (int64_t)c.hv * c.k * c.v;
    void *o2 = malloc((size_t)o_elems * es);
    float *mid = (float *)malloc(sizeof(float) * (size_t)st_elems), *fin = (float *)malloc(sizeof(float) * (size_t)st_elems);
    kda_synth_poison(o2, dtype, o_elems);

    kda_args_t p1 = a;
    p1.seq_len = t;
    p1.o = o2;
    p1.final_state = mid;
    CHECK(kda_run_host(cpu(), &p1, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "part 1: %s", kda_last_error());
    kda_args_t p2 = a;
    p2.seq_len = T - t;
    p2.q = (const char *)a.q + (size_t)(t * c.hqk * c.k) * es;
    p2.k = (const char *)a.k + (size_t)(t * c.hqk * c.k) * es;
    p2.v = (const char *)a.v + (size_t)(t * c.hv * c.v) * es;
    p2.g = (const char *)a.g + (size_t)(t * c.hv * c.k) * es;
    p2.beta = (const char *)a.beta + (size_t)(t * c.hv) * es;
    p2.o = (char *)o2 + (size_t)(t * c.hv * c.v) * es;
    p2.initial_state = mid;
    p2.initial_state_dtype = KDA_FLOAT32;
    p2.final_state = fin;
    CHECK(kda_run_host(cpu(), &p2, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "part 2: %s", kda_last_error());

    double eo = kda_rel_err(o2, dtype, s.o, dtype, o_elems);
    double es_ = kda_rel_err(fin, KDA_FLOAT32, s.ht, KDA_FLOAT32, st_elems);
    CHECK(eo <= tol, "T=%lld split at %lld: o rel err %.3g", (long long)T, (long long)t, eo);
    CHECK(es_ <= tol, "T=%lld split at %lld: state rel err %.3g", (long long)T, (long long)t, es_);
    free(o2);
    free(mid);
    free(fin);
    kda_synth_free(&s);
}

TEST(fwd_chaining) {
    chain(200, 77, KDA_FLOAT32, 1e-5);
    chain(200, 64, KDA_FLOAT32, 1e-5);
    chain(130, 1, KDA_FLOAT32, 1e-5);
    chain(300, 150, KDA_BFLOAT16, 1e-2);
}

/* ---------------------------------------------------------------------------------------------------------
 * A state pool (state_indices) with the chunked path, and the thread count
 * ------------------------------------------------------------------------------------------------------- */
TEST(fwd_state_indices_pool) {
    static const int64_t lens[] = {40, 0, 100};
    kda_synth_config_t c = base();
    c.num_seqs = 3;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 2;
    c.k = c.v = 64;
    c.initial_state = c.final_state = 0;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int slots = 6;
    const int64_t per_slot = (int64_t)c.hv * c.k * c.v;
    float *pool = (float *)malloc(sizeof(float) * (size_t)(slots * per_slot));
    float *pool_ref = (float *)malloc(sizeof(float) * (size_t)(slots * per_slot));
    for (int64_t i = 0; i < slots * per_slot; i++) pool[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    memcpy(pool_ref, pool, sizeof(float) * (size_t)(slots * per_slot));
    int32_t idx[3] = {4, -1, 1};
    a.initial_state = a.final_state = pool;
    a.state_indices = idx;
    a.num_state_slots = slots;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "cpu: %s", kda_last_error());
    const int64_t o_elems = s.num_tokens * c.hv * c.v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)o_elems);
    kda_args_t ra = a;
    ra.o = o_ref;
    ra.initial_state = ra.final_state = pool_ref;
    CHECK(kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "reference");
    double eo = kda_rel_err(s.o, KDA_FLOAT32, o_ref, KDA_FLOAT32, o_elems);
    double ep = kda_rel_err(pool, KDA_FLOAT32, pool_ref, KDA_FLOAT32, slots * per_slot);
    CHECK(eo <= 1e-5, "o rel err %.3g", eo);
    CHECK(ep <= 1e-5, "pool rel err %.3g", ep);
    free(pool);
    free(pool_ref);
    free(o_ref);
    kda_synth_free(&s);
}

TEST(fwd_threads_bitwise_equal) {
    kda_synth_config_t c = base();
    c.seq_len = 100;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    kda_context_t *one = NULL, *two = NULL;
    CHECK(kda_create(&one, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "create");
    CHECK(kda_create(&two, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "create");
    CHECK(kda_set_num_threads(one, 1) == KDA_STATUS_SUCCESS, "threads");
    CHECK(kda_set_num_threads(two, 3) == KDA_STATUS_SUCCESS, "threads");
    CHECK(kda_run_host(one, &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "one");
    void *o1 = malloc(s.o_bytes);
    memcpy(o1, s.o, s.o_bytes);
    CHECK(kda_run_host(two, &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "two");
    CHECK(memcmp(o1, s.o, s.o_bytes) == 0, "1 and 3 threads differ");
    free(o1);
    kda_destroy(one);
    kda_destroy(two);
    kda_synth_free(&s);
}

/* ---------------------------------------------------------------------------------------------------------
 * The schedules of src/cpu/chunk.c: fewer (sequence, head) tasks than threads take the split schedule (preps in
 * parallel over chunks, recurrence over column slices); its outputs and states must be the bits of the one-task-
 * per-thread schedule (1 thread), for any thread count, across several windows of chunks and a ragged end.
 * ------------------------------------------------------------------------------------------------------- */
static void threads_bitwise_nan(kda_synth_config_t c, const int *threads, int nthreads, int64_t nan_v_token) {
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    if (nan_v_token >= 0) /* a NaN v element at this token of head 0: the head's outputs are NaN from it on */
        kda_synth_poison((char *)s.v + (size_t)nan_v_token * c.hv * c.v * (c.dtype == KDA_FLOAT32 ? 4 : 2), c.dtype, 1);
    void *o1 = malloc(s.o_bytes), *h1 = malloc(s.ht_bytes ? s.ht_bytes : 1);
    for (int i = 0; i < nthreads; i++) {
        kda_context_t *ctx = NULL;
        CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "create");
        CHECK(kda_set_num_threads(ctx, threads[i]) == KDA_STATUS_SUCCESS, "threads");
        kda_synth_poison(s.o, c.o_dtype, (int64_t)(s.o_bytes / (c.o_dtype == KDA_FLOAT32 ? 4 : 2)));
        CHECK(kda_run_host(ctx, &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%d threads: %s", threads[i],
              kda_last_error());
        if (nan_v_token >= 0) { /* head 0: finite before the chunk of the token, NaN from the token on */
            const int64_t row = (int64_t)c.hv * c.v, ob = c.o_dtype == KDA_FLOAT32 ? 4 : 2;
            const int64_t clean = nan_v_token / 64 * 64;
            CHECK(kda_count_nonfinite(s.o, c.o_dtype, clean * row) == 0, "%d threads: NaN before token %lld",
                  threads[i], (long long)clean);
            for (int64_t t = nan_v_token; t < c.seq_len; t++)
                CHECK(kda_count_nonfinite((char *)s.o + (size_t)(t * row * ob), c.o_dtype, c.v) == c.v,
                      "%d threads: token %lld of head 0 not NaN", threads[i], (long long)t);
        }
        if (i == 0) {
            memcpy(o1, s.o, s.o_bytes);
            if (s.ht_bytes) memcpy(h1, s.ht, s.ht_bytes);
        } else {
            CHECK(memcmp(o1, s.o, s.o_bytes) == 0, "%s: o differs between %d and %d threads", kda_describe(&c),
                  threads[0], threads[i]);
            CHECK(!s.ht_bytes || memcmp(h1, s.ht, s.ht_bytes) == 0, "%s: final state differs between %d and %d threads",
                  kda_describe(&c), threads[0], threads[i]);
        }
        kda_destroy(ctx);
    }
    free(o1);
    free(h1);
    kda_synth_free(&s);
}

static void threads_bitwise(kda_synth_config_t c, const int *threads, int nthreads) {
    threads_bitwise_nan(c, threads, nthreads, -1);
}

TEST(fwd_threads_bitwise_single_seq) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 2 * 16 * 64 + 37; /* three windows of 16 chunks, the last chunk partial */
    c.hqk = c.hv = 1;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = 1;
    static const int th[] = {1, 2, 3, 5, 8};
    threads_bitwise(c, th, 5);
    c.k = 64;
    c.v = 96;
    c.seq_len = 300;
    c.dtype = c.g_dtype = c.o_dtype = KDA_BFLOAT16;
    threads_bitwise(c, th, 5);
}

/* A poisoned token in a long single sequence: every thread count stops the recurrence at its chunk and writes
 * the same NaN rows and NaN final state. */
TEST(fwd_threads_bitwise_poisoned) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 40 * 64 + 5;
    c.hqk = c.hv = 1;
    static const int th[] = {1, 2, 3, 9};
    threads_bitwise_nan(c, th, 4, 21 * 64 + 30);
    threads_bitwise_nan(c, th, 4, 3);
    threads_bitwise_nan(c, th, 4, c.seq_len - 1);
}

TEST(fwd_threads_bitwise_few_heads) {
    kda_synth_config_t c = base(); /* 2 sequences x 4 heads: split schedule from 9 threads on */
    c.seq_len = 1100;
    static const int th[] = {1, 2, 9, 16};
    threads_bitwise(c, th, 4);
}

TEST(fwd_split_schedule_vs_oracle) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 1500;
    c.hqk = c.hv = 1;
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "create");
    CHECK(kda_set_num_threads(ctx, 2) == KDA_STATUS_SUCCESS, "threads");
    kda_compare_t r = kda_compare_host(ctx, &c, KDA_ALGO_FORWARD);
    CHECK(r.status == KDA_STATUS_SUCCESS && r.o_unwritten == 0 && r.state_unwritten == 0, "%s", kda_describe(&c));
    CHECK(r.o_err <= 1e-5 && r.state_err <= 1e-5, "%s: o err %.3g, state err %.3g", kda_describe(&c), r.o_err,
          r.state_err);
    kda_destroy(ctx);
}

/* Causality through the chunk's triangular products: a non-finite k at token t (any row of a 4- or 6-row tile,
 * any position in its 16-token block) leaves every earlier output bit-identical to the clean run's. */
TEST(fwd_nonfinite_k_causal) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 128;
    c.hqk = c.hv = 1;
    c.l2norm = 0;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int V = c.v, K = c.k;
    float *clean = (float *)malloc(s.o_bytes);
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "clean");
    memcpy(clean, s.o, s.o_bytes);
    static const int ts[] = {1, 2, 3, 5, 7, 17, 30, 63, 64, 66, 100};
    for (unsigned n = 0; n < sizeof ts / sizeof ts[0]; n++) {
        const int t = ts[n];
        float *k = (float *)s.k + (int64_t)t * K;
        const float saved = k[3];
        k[3] = INFINITY;
        CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "run");
        CHECK(memcmp(clean, s.o, sizeof(float) * (size_t)t * V) == 0, "inf k at token %d changed an earlier output", t);
        k[3] = saved;
    }
    free(clean);
    kda_synth_free(&s);
}
