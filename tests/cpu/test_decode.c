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
