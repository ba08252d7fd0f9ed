/*
 * chunk_states (kda_args_t): the state before every 64-token chunk of every sequence, written by kda_forward for
 * prefix caching (FLA's return_intermediate_states). The oracle writes it from its token loop; the CPU chunked
 * path from its chunk loop (both schedules); a row must equal the final state of the sequence's prefix.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "test_util.h"

static kda_context_t *cpu_threads(int n) {
    static kda_context_t *ctx[9];
    if (!ctx[n]) {
        if (kda_create(&ctx[n], KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) exit(1);
        if (kda_set_num_threads(ctx[n], n) != KDA_STATUS_SUCCESS) exit(1);
    }
    return ctx[n];
}

static int64_t rows_of(const kda_synth_config_t *c) {
    if (c->num_seqs == 0) return c->batch * ((c->seq_len + 63) / 64);
    int64_t r = 0;
    for (int64_t n = 0; n < c->num_seqs; n++) r += (c->seqlens[n] + 63) / 64;
    return r;
}

static size_t dt_size(kda_dtype_t dt) { return dt == KDA_FLOAT32 ? 4 : 2; }

/* Run `ctx` on a with chunk_states of dtype dt, n elements, poisoned before the call; returns them (malloc'd). */
static void *rows_run(kda_context_t *ctx, kda_args_t *a, kda_dtype_t dt, int64_t n) {
    void *cs = malloc((size_t)(n > 0 ? n : 1) * dt_size(dt));
    kda_synth_poison(cs, dt, n);
    a->chunk_states = cs;
    a->chunk_states_dtype = dt;
    CHECK(kda_run_host(ctx, a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    return cs;
}

/* rows_run on fresh inputs of c, every row (count in *elems) */
static void *run_states(kda_context_t *ctx, const kda_synth_config_t *c, kda_dtype_t dt, int64_t *elems) {
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(c, &s, &a) == 0, "synth");
    *elems = rows_of(c) * c->hv * c->k * c->v;
    void *cs = rows_run(ctx, &a, dt, *elems);
    kda_synth_free(&s);
    return cs;
}

/* The CPU backend's rows against the oracle's, every row written */
static void against_oracle(const kda_synth_config_t *c, kda_dtype_t dt, int threads, double tol) {
    int64_t n1, n2;
    void *got = run_states(cpu_threads(threads), c, dt, &n1);
    void *ref = run_states(kda_test_reference(), c, dt, &n2);
    const int64_t bad_ref = kda_count_nonfinite(ref, dt, n2);
    CHECK(kda_count_nonfinite(got, dt, n1) == bad_ref, "%s: %lld non-finite rows' elements, the oracle %lld",
          kda_describe(c), (long long)kda_count_nonfinite(got, dt, n1), (long long)bad_ref);
    if (bad_ref == 0) {
        const double e = kda_rel_err(got, dt, ref, dt, n1);
        CHECK(e <= tol, "%s (%d threads): chunk_states rel err %.3g > %.3g", kda_describe(c), threads, e, tol);
    }
    free(got);
    free(ref);
}

static kda_synth_config_t base(void) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.hqk = 1;
    c.hv = 2;
    c.k = 64;
    c.v = 48;
    c.initial_state = c.final_state = 1;
    c.decay = 0.05f; /* slow decay: the states carry across chunks */
    c.seed = 11;
    return c;
}

TEST(chunk_states_vs_oracle_varlen) {
    static const int64_t lens[] = {130, 0, 64, 1, 200};
    kda_synth_config_t c = base();
    c.num_seqs = 5;
    c.seqlens = lens;
    for (int g = 0; g < 4; g++) {
        c.gate = (kda_gate_mode_t)g;
        c.l2norm = g % 2;
        c.beta_sigmoid = g >= 2;
        c.state_v_first = g == 1 || g == 3;
        c.initial_state = g != 2;
        against_oracle(&c, KDA_FLOAT32, 1, 1e-5);
        against_oracle(&c, KDA_FLOAT32, 2, 1e-5);
    }
}

TEST(chunk_states_vs_oracle_bf16_gva) {
    kda_synth_config_t c = base();
    c.batch = 2;
    c.seq_len = 150;
    c.hqk = 2;
    c.hv = 8;
    c.k = c.v = 128;
    c.dtype = c.g_dtype = c.o_dtype = KDA_BFLOAT16;
    c.initial_state_dtype = KDA_BFLOAT16;
    c.state_v_first = 1;
    against_oracle(&c, KDA_BFLOAT16, 1, 1e-2);
    against_oracle(&c, KDA_FLOAT32, 3, 1e-2);
}

/* Row rows_n + c is the final state of the first 64 c tokens: one sequence, run again on its prefixes */
TEST(chunk_states_equal_prefix_final_states) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 5 * 64 + 17;
    c.hv = 1;
    for (int threads = 1; threads <= 2; threads++) {
        kda_synth_t s;
        kda_args_t a;
        CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
        const int64_t per = (int64_t)c.k * c.v, rows = rows_of(&c);
        float *cs = (float *)rows_run(cpu_threads(threads), &a, KDA_FLOAT32, rows * per);
        CHECK(kda_rel_err(cs, KDA_FLOAT32, s.h0, KDA_FLOAT32, per) == 0.0, "row 0 is not the initial state");
        for (int64_t r = 1; r < rows; r++) {
            kda_args_t b = a;
            b.chunk_states = NULL;
            b.seq_len = 64 * r; /* batch 1: the prefix is the same memory */
            CHECK(kda_run_host(cpu_threads(threads), &b, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "prefix");
            const double e = kda_rel_err(cs + r * per, KDA_FLOAT32, s.ht, KDA_FLOAT32, per);
            CHECK(e <= 1e-6, "%d threads: row %lld against the final state of %lld tokens: %.3g", threads,
                  (long long)r, (long long)(64 * r), e);
        }
        free(cs);
        kda_synth_free(&s);
    }
}

/* The same bytes for any thread count: many tasks, and one sequence (the flow schedule) */
TEST(chunk_states_threads_bitwise) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 20 * 64 + 9;
    c.hv = 1;
    c.k = c.v = 128;
    for (int shape = 0; shape < 2; shape++) {
        if (shape == 1) {
            c.batch = 3;
            c.seq_len = 300;
            c.hv = 4;
        }
        int64_t n1, n;
        void *one = run_states(cpu_threads(1), &c, KDA_FLOAT32, &n1);
        static const int th[] = {2, 3, 8};
        for (int i = 0; i < 3; i++) {
            void *x = run_states(cpu_threads(th[i]), &c, KDA_FLOAT32, &n);
            CHECK(n == n1 && memcmp(one, x, (size_t)n * 4) == 0, "shape %d: 1 and %d threads differ", shape, th[i]);
            free(x);
        }
        free(one);
    }
}

/* A NaN token: rows up to its chunk's are finite (the state before the chunk), rows after are NaN; the oracle
 * and every schedule agree */
TEST(chunk_states_poisoned_token) {
    kda_synth_config_t c = base();
    c.batch = 1;
    c.seq_len = 10 * 64 + 3;
    c.hv = 1;
    for (int threads = 1; threads <= 2; threads++) {
        kda_synth_t s;
        kda_args_t a;
        CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
        const int64_t per = (int64_t)c.k * c.v, rows = rows_of(&c), tok = 4 * 64 + 10;
        ((float *)s.v)[tok * c.v + 5] = NAN;
        float *cs = (float *)rows_run(cpu_threads(threads), &a, KDA_FLOAT32, rows * per);
        float *ref = (float *)rows_run(kda_test_reference(), &a, KDA_FLOAT32, rows * per);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t bad = kda_count_nonfinite(cs + r * per, KDA_FLOAT32, per);
            CHECK(bad == (r <= tok / 64 ? 0 : per), "%d threads: row %lld has %lld non-finite elements", threads,
                  (long long)r, (long long)bad);
            CHECK(kda_count_nonfinite(ref + r * per, KDA_FLOAT32, per) == bad, "row %lld: oracle differs", (long long)r);
        }
        CHECK(kda_rel_err(cs, KDA_FLOAT32, ref, KDA_FLOAT32, (tok / 64 + 1) * per) <= 1e-5, "finite rows differ");
        free(cs);
        free(ref);
        kda_synth_free(&s);
    }
}

/* A state pool with indices: rows follow the sequences (not the slots); a negative slot starts from zeros */
TEST(chunk_states_state_pool) {
    static const int64_t lens[] = {100, 70};
    kda_synth_config_t c = base();
    c.num_seqs = 2;
    c.seqlens = lens;
    c.initial_state = c.final_state = 0;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    const int64_t per_slot = (int64_t)c.hv * c.k * c.v, rows = rows_of(&c);
    float *pool = (float *)malloc(sizeof(float) * (size_t)(3 * per_slot));
    for (int64_t i = 0; i < 3 * per_slot; i++) pool[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    int32_t idx[2] = {2, -1};
    a.initial_state = pool;
    a.state_indices = idx;
    a.num_state_slots = 3;
    float *cs = (float *)rows_run(cpu_threads(2), &a, KDA_FLOAT32, rows * per_slot);
    float *ref = (float *)rows_run(kda_test_reference(), &a, KDA_FLOAT32, rows * per_slot);
    CHECK(rows == 4, "rows %lld", (long long)rows);
    CHECK(memcmp(cs, pool + 2 * per_slot, sizeof(float) * (size_t)per_slot) == 0, "row 0 is not slot 2");
    for (int64_t i = 0; i < per_slot; i++) CHECK(cs[2 * per_slot + i] == 0.0f, "row 2 (a negative slot) not zero");
    CHECK(kda_rel_err(cs, KDA_FLOAT32, ref, KDA_FLOAT32, rows * per_slot) <= 1e-5, "against the oracle");
    free(pool);
    free(cs);
    free(ref);
    kda_synth_free(&s);
}

/* kda_decode refuses it, naming the argument; nothing is written */
TEST(chunk_states_decode_refused) {
    kda_synth_config_t c = base();
    c.batch = 2;
    c.seq_len = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    float cs[2 * 2 * 64 * 48];
    kda_synth_poison(cs, KDA_FLOAT32, 2 * 2 * 64 * 48);
    kda_synth_poison(s.o, KDA_FLOAT32, (int64_t)(s.o_bytes / 4));
    a.chunk_states = cs;
    const kda_status_t st = kda_run_host(cpu_threads(1), &a, KDA_ALGO_DECODE);
    CHECK(st == KDA_STATUS_INVALID_VALUE, "status %s", kda_status_string(st));
    CHECK(strstr(kda_last_error(), "'chunk_states'") != NULL, "message: %s", kda_last_error());
    CHECK(kda_count_nonfinite(cs, KDA_FLOAT32, 2 * 2 * 64 * 48) == 2 * 2 * 64 * 48, "chunk_states written");
    CHECK(kda_count_nonfinite(s.o, KDA_FLOAT32, (int64_t)(s.o_bytes / 4)) == (int64_t)(s.o_bytes / 4), "o written");
    kda_synth_free(&s);
}
