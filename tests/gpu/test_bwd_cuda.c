/*
 * The CUDA backward against the fp64 oracle (the reference backend's backward, itself checked by finite
 * differences in tests/cpu/test_backward.c). Every case: fresh random inputs, d_o and d_final_state; every
 * gradient output poisoned (NaN) on the device before the call; then per gradient the relative error
 * ‖cuda − oracle‖ / ‖oracle‖ and the count of values left non-finite. One line per case,
 * "bwd <case> dq .. dk .. dv .. dg .. dbeta .. dh0 .. dA_log .. ddt_bias ..", so a run's log is the accuracy
 * table. Skipped (exit 77) where the build or the machine has no usable CUDA device.
 *
 * Run after a CUDA build: ctest --test-dir build -R gpu_bwd --output-on-failure
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "dtype.h"
#include "internal.h"
#include "test_util.h"

#ifdef KDA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "gpu_util.h"

static kda_context_t *gpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CUDA, 0) != KDA_STATUS_SUCCESS) SKIP("no CUDA device: %s", kda_last_error());
    return ctx;
}

/* ---------------------------------------------------------------------------------------------------------
 * A problem on the host and its device mirror, with its loss weights and gradient buffers
 * ------------------------------------------------------------------------------------------------------- */
enum { G_DQ, G_DK, G_DV, G_DG, G_DBETA, G_DH0, G_DA, G_DDT, G_N };
static const char *grad_names[G_N] = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"};

typedef struct {
    int pool;           /* initial state through state_indices: slots reversed, the second sequence none (−1) */
    int with_dht;       /* d_final_state given */
    int grad_f32;       /* gradients in float32 (else in the inputs' dtypes) */
    float scale;        /* 0: the default */
} opts_t;

typedef struct {
    kda_synth_config_t cfg;
    kda_synth_t s;
    kda_args_t host, dev;
    kda_backward_args_t hb, db;      /* the oracle's (host, float32 outputs) and the device's */
    int64_t n[G_N];                  /* elements of each gradient */
    kda_dtype_t dt[G_N];             /* the device gradients' dtypes */
    float *ref[G_N];                 /* the oracle's gradients */
    void *dgrad[G_N];                /* device gradients */
    void *d_o, *dht, *dev_do, *dev_dht;
    int32_t idx[64];
    void *ws;
    size_t ws_bytes;
} bcase_t;

static double urand(uint64_t *r) {
    *r = *r * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*r >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static void bcase_make(bcase_t *c, const kda_synth_config_t *cfg, const opts_t *o) {
    (void)gpu();
    memset(c, 0, sizeof *c);
    c->cfg = *cfg;
    if (kda_synth_make(cfg, &c->s, &c->host) != 0) exit(1);
    kda_args_t *a = &c->host;
    a->final_state = NULL;
    if (o->scale != 0.0f) a->scale = o->scale;
    const int64_t T = c->s.num_tokens, N = c->s.num_seqs, HQK = cfg->hqk, HV = cfg->hv, K = cfg->k, V = cfg->v;
    int64_t nstate = N;
    if (o->pool && a->initial_state) {
        nstate = N + 2;
        for (int64_t n = 0; n < N; n++) c->idx[n] = (int32_t)(nstate - 1 - n);
        if (N > 1) c->idx[1] = -1;
        const int64_t elems = nstate * HV * K * V;
        void *h0 = malloc((size_t)elems * kda_dtype_size(cfg->initial_state_dtype));
        uint64_t r = cfg->seed * 13 + 5;
        for (int64_t i = 0; i < elems; i++) kda_store_f32(h0, cfg->initial_state_dtype, i, (float)(0.5 * urand(&r)));
        free(c->s.h0);
        c->s.h0 = h0;
        c->s.h0_bytes = (size_t)elems * kda_dtype_size(cfg->initial_state_dtype);
        a->initial_state = h0;
        a->state_indices = c->idx;
        a->num_state_slots = nstate;
    }
    c->n[G_DQ] = c->n[G_DK] = T * HQK * K;
    c->n[G_DV] = T * HV * V;
    c->n[G_DG] = T * HV * K;
    c->n[G_DBETA] = T * HV;
    c->n[G_DH0] = a->initial_state ? nstate * HV * K * V : 0;
    c->n[G_DA] = a->use_gate_in_kernel && a->A_log ? HV : 0;
    c->n[G_DDT] = a->use_gate_in_kernel && a->dt_bias ? HV * K : 0;
    const kda_dtype_t in_dt[G_N] = {cfg->dtype, cfg->dtype, cfg->dtype, cfg->g_dtype, cfg->beta_dtype,
                                    KDA_FLOAT32, KDA_FLOAT32, KDA_FLOAT32};
    for (int i = 0; i < G_N; i++) {
        c->dt[i] = o->grad_f32 ? KDA_FLOAT32 : in_dt[i];
        c->ref[i] = (float *)calloc((size_t)c->n[i] + 1, 4);
    }
    /* loss weights */
    uint64_t r = cfg->seed * 7 + 3;
    const int64_t nv = c->n[G_DV], ns = nstate * HV * K * V;
    c->d_o = malloc((size_t)(nv + 1) * 4);
    for (int64_t i = 0; i < nv; i++) kda_store_f32(c->d_o, cfg->o_dtype, i, (float)urand(&r));
    if (o->with_dht) {
        c->dht = malloc((size_t)(ns + 1) * 4);
        for (int64_t i = 0; i < ns; i++) ((float *)c->dht)[i] = (float)urand(&r);
    }
    /* the oracle's call */
    kda_backward_args_init(&c->hb);
    c->hb.problem = &c->host;
    c->hb.d_o = c->d_o;
    c->hb.d_o_dtype = cfg->o_dtype;
    c->hb.d_final_state = c->dht;
    c->hb.d_final_state_dtype = KDA_FLOAT32;
    c->hb.dq = c->ref[G_DQ];
    c->hb.dk = c->ref[G_DK];
    c->hb.dv = c->ref[G_DV];
    c->hb.dg = c->ref[G_DG];
    c->hb.dbeta = c->ref[G_DBETA];
    c->hb.dq_dtype = c->hb.dk_dtype = c->hb.dv_dtype = c->hb.dg_dtype = c->hb.dbeta_dtype = KDA_FLOAT32;
    c->hb.d_initial_state = c->n[G_DH0] ? c->ref[G_DH0] : NULL;
    c->hb.dA_log = c->n[G_DA] ? c->ref[G_DA] : NULL;
    c->hb.ddt_bias = c->n[G_DDT] ? c->ref[G_DDT] : NULL;

    /* the device mirror */
    kda_args_t d = c->host;
    const kda_synth_t *s = &c->s;
    d.q = to_dev(s->q, s->q_bytes);
    d.k = to_dev(s->k, s->q_bytes);
    d.v = to_dev(s->v, s->v_bytes);
    d.g = to_dev(s->g, s->g_bytes);
    d.beta = to_dev(s->beta, s->beta_bytes);
    d.o = NULL;
    d.initial_state = a->initial_state ? to_dev(s->h0, s->h0_bytes) : NULL;
    d.A_log = a->A_log ? (const float *)to_dev(a->A_log, sizeof(float) * (size_t)HV) : NULL;
    d.dt_bias = a->dt_bias ? (const float *)to_dev(a->dt_bias, sizeof(float) * (size_t)(HV * K)) : NULL;
    if (a->cu_seqlens) {
        d.cu_seqlens = to_dev(s->cu_seqlens, sizeof(int64_t) * (size_t)(N + 1));
        d.cu_seqlens_host = s->cu_seqlens;
    }
    if (a->state_indices) d.state_indices = (const int32_t *)to_dev(c->idx, sizeof(int32_t) * (size_t)N);
    c->dev = d;
    c->dev_do = to_dev(c->d_o, (size_t)nv * kda_dtype_size(cfg->o_dtype));
    c->dev_dht = c->dht ? to_dev(c->dht, (size_t)ns * 4) : NULL;
    for (int i = 0; i < G_N; i++) CUDA_OK(cudaMalloc(&c->dgrad[i], (size_t)c->n[i] * 4 + 16));
    kda_backward_args_init(&c->db);
    c->db.problem = &c->dev;
    c->db.d_o = c->dev_do;
    c->db.d_o_dtype = cfg->o_dtype;
    c->db.d_final_state = c->dev_dht;
    c->db.d_final_state_dtype = KDA_FLOAT32;
    c->db.dq = c->dgrad[G_DQ];
    c->db.dk = c->dgrad[G_DK];
    c->db.dv = c->dgrad[G_DV];
    c->db.dg = c->dgrad[G_DG];
    c->db.dbeta = c->dgrad[G_DBETA];
    c->db.dq_dtype = c->dt[G_DQ];
    c->db.dk_dtype = c->dt[G_DK];
    c->db.dv_dtype = c->dt[G_DV];
    c->db.dg_dtype = c->dt[G_DG];
    c->db.dbeta_dtype = c->dt[G_DBETA];
    c->db.d_initial_state = c->n[G_DH0] ? c->dgrad[G_DH0] : NULL;
    c->db.d_initial_state_dtype = KDA_FLOAT32;
    c->db.dA_log = c->n[G_DA] ? (float *)c->dgrad[G_DA] : NULL;
    c->db.ddt_bias = c->n[G_DDT] ? (float *)c->dgrad[G_DDT] : NULL;
}

static void bcase_free(bcase_t *c) {
    cudaFree((void *)c->dev.q);
    cudaFree((void *)c->dev.k);
    cudaFree((void *)c->dev.v);
    cudaFree((void *)c->dev.g);
    cudaFree((void *)c->dev.beta);
    cudaFree((void *)c->dev.initial_state);
    cudaFree((void *)c->dev.A_log);
    cudaFree((void *)c->dev.dt_bias);
    cudaFree((void *)c->dev.cu_seqlens);
    cudaFree((void *)c->dev.state_indices);
    cudaFree(c->dev_do);
    cudaFree(c->dev_dht);
    cudaFree(c->ws);
    for (int i = 0; i < G_N; i++) {
        cudaFree(c->dgrad[i]);
        free(c->ref[i]);
    }
    free(c->d_o);
    free(c->dht);
    kda_synth_free(&c->s);
}

/* Poison every device gradient (all-ones bytes: NaN in float32, float16 and bfloat16), then the CUDA call. */
static kda_status_t bcase_run(bcase_t *c, cudaStream_t stream) {
    for (int i = 0; i < G_N; i++) CUDA_OK(cudaMemset(c->dgrad[i], 0xff, (size_t)c->n[i] * 4 + 16));
    size_t need = 0;
    kda_status_t st = kda_backward_workspace_size(gpu(), &c->db, &need);
    if (st != KDA_STATUS_SUCCESS) return st;
    if (need > c->ws_bytes) {
        cudaFree(c->ws);
        CUDA_OK(cudaMalloc(&c->ws, need));
        c->ws_bytes = need;
    }
    st = kda_backward(gpu(), &c->db, c->ws, c->ws_bytes, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaGetLastError());
    return st;
}

/* A device gradient copied to the host (n elements of its dtype). */
static void *fetch(const bcase_t *c, int i) {
    const size_t bytes = (size_t)c->n[i] * kda_dtype_size(c->dt[i]);
    void *h = malloc(bytes + 16);
    if (bytes) CUDA_OK(cudaMemcpy(h, c->dgrad[i], bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* The oracle's gradients into c->ref */
static void run_oracle(bcase_t *c, const char *name) {
    size_t ws = 0;
    kda_status_t rs = kda_backward_workspace_size(kda_test_reference(), &c->hb, &ws);
    void *w = malloc(ws + 16);
    if (rs == KDA_STATUS_SUCCESS) rs = kda_backward(kda_test_reference(), &c->hb, w, ws, NULL);
    free(w);
    CHECK(rs == KDA_STATUS_SUCCESS, "%s: oracle: %s", name, kda_last_error());
}

/* Each gradient's relative error in the last expect_bwd case (0 where it has none) */
static double last_err[G_N];

/* tol: bound on each gradient's relative error (dA_log, ddt_bias: 3 × tol, sums over every token with
 * cancellation). Returns the worst relative error. */
static double expect_bwd(const char *name, const kda_synth_config_t *cfg, const opts_t *o, double tol) {
    bcase_t c;
    bcase_make(&c, cfg, o);
    const kda_status_t st = bcase_run(&c, 0);
    CHECK(st == KDA_STATUS_SUCCESS, "%s: %s: %s", name, kda_describe(cfg), kda_last_error());
    double worst = 0.0;
    for (int i = 0; i < G_N; i++) last_err[i] = 0.0;
    if (st == KDA_STATUS_SUCCESS) {
        run_oracle(&c, name);
        char line[512];
        int len = snprintf(line, sizeof line, "bwd %-26s", name);
        for (int i = 0; i < G_N; i++) {
            if (c.n[i] == 0) continue;
            void *x = fetch(&c, i);
            const int64_t bad = kda_count_nonfinite(x, c.dt[i], c.n[i]);
            const double e = kda_rel_err(x, c.dt[i], c.ref[i], KDA_FLOAT32, c.n[i]);
            const double t = i >= G_DA ? 3 * tol : tol;
            len += snprintf(line + len, sizeof line - (size_t)len, " %s %.2e", grad_names[i], e);
            CHECK(bad == 0, "%s: %s: %lld values unwritten or not finite (%s)", name, grad_names[i], (long long)bad,
                  kda_describe(cfg));
            CHECK(e <= t, "%s: %s relative error %.3g > %.3g (%s)", name, grad_names[i], e, t, kda_describe(cfg));
            if (e > worst) worst = e;
            last_err[i] = e;
            free(x);
        }
        printf("%s  %s\n", line, kda_describe(cfg));
    }
    bcase_free(&c);
    return worst;
}

static kda_synth_config_t base(int kd) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 150;
    c.hqk = 2;
    c.hv = 4;
    c.k = c.v = kd;
    c.initial_state = 1;
    c.initial_state_dtype = KDA_FLOAT32;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.seed = 17;
    return c;
}

/* base(kd) as one batch row of n sequences of the given lengths (varlen) */
static kda_synth_config_t base_varlen(int kd, const int64_t *lens, int n) {
    kda_synth_config_t c = base(kd);
    c.batch = 1;
    c.num_seqs = n;
    c.seqlens = lens;
    return c;
}

/* bf16 inputs and gradients: the bf16 rounding of the outputs alone is ~3e-3; the states run on the forward's
 * bf16 chunk blocks (as FLA's h and w/u). */
#define TOL_BF16 3e-2
/* float32 inputs and gradients: the same bf16 blocks bound the error */
#define TOL_F32 2e-2

static const opts_t TRAIN = {0, 1, 0, 0.0f};

/* ---------------------------------------------------------------------------------------------------------
 * Cases
 * ------------------------------------------------------------------------------------------------------- */
TEST(gpu_bwd_training_k128) {
    kda_synth_config_t c = base(128);
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("training_k128", &c, &TRAIN, TOL_BF16);
}

TEST(gpu_bwd_training_k64) {
    kda_synth_config_t c = base(64);
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("training_k64", &c, &TRAIN, TOL_BF16);
}

/* case c with each gate form (raw, softplus, lower bound, lower bound without A_log), named prefix + the form */
static void expect_each_gate(const char *prefix, const kda_synth_config_t *c) {
    static const kda_gate_mode_t gates[4] = {KDA_GATE_RAW, KDA_GATE_SOFTPLUS, KDA_GATE_LOWER_BOUND,
                                             KDA_GATE_LOWER_BOUND_NO_A};
    static const char *names[4] = {"raw_gate", "softplus", "lower_bound", "lower_bound_no_alog"};
    for (int g = 0; g < 4; g++) {
        kda_synth_config_t x = *c;
        x.gate = gates[g];
        char name[48];
        snprintf(name, sizeof name, "%s%s", prefix, names[g]);
        expect_bwd(name, &x, &TRAIN, TOL_BF16);
    }
}

/* every gate form, l2norm on and off, β plain / sigmoid / 2·sigmoid, a given scale */
TEST(gpu_bwd_options) {
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        expect_each_gate("", &c);
        c.gate = KDA_GATE_SOFTPLUS;
        c.l2norm = 0;
        expect_bwd("no_l2norm", &c, &TRAIN, TOL_BF16);
        c.beta_sigmoid = 0;
        expect_bwd("no_beta_sigmoid", &c, &TRAIN, TOL_BF16);
        c.beta_sigmoid = c.allow_neg_eigval = 1;
        expect_bwd("neg_eigval", &c, &TRAIN, TOL_BF16);
        opts_t o = TRAIN;
        o.scale = 0.3f;
        expect_bwd("scale_0.3", &c, &o, TOL_BF16);
    }
}

/* the initial state in all four forms (none, dense, pool with a negative index; K-first, V-first, bf16) and
 * d_final_state given or not */
TEST(gpu_bwd_states) {
    static const int64_t lens[] = {70, 5, 130};
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.num_seqs = 3;
        c.seqlens = lens;
        c.batch = 1;
        opts_t o = TRAIN;
        c.initial_state = 0;
        expect_bwd("no_initial_state", &c, &o, TOL_BF16);
        o.with_dht = 0;
        expect_bwd("no_initial_state_no_dht", &c, &o, TOL_BF16);
        c.initial_state = 1;
        expect_bwd("dense_no_dht", &c, &o, TOL_BF16);
        o.with_dht = 1;
        for (int vf = 0; vf < 2; vf++)
            for (int bf = 0; bf < 2; bf++) {
                c.state_v_first = vf;
                c.initial_state_dtype = bf ? KDA_BFLOAT16 : KDA_FLOAT32;
                o.pool = 0;
                expect_bwd(vf ? (bf ? "dense_vfirst_bf16" : "dense_vfirst") : (bf ? "dense_bf16" : "dense"), &c, &o,
                           TOL_BF16);
                o.pool = 1;
                expect_bwd(vf ? (bf ? "pool_vfirst_bf16" : "pool_vfirst") : (bf ? "pool_bf16" : "pool"), &c, &o,
                           TOL_BF16);
            }
    }
}

TEST(gpu_bwd_varlen_empty_seq_gva4) {
    static const int64_t lens[] = {65, 0, 1, 130, 0, 17};
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base_varlen(kd, lens, 6);
        c.hqk = 1;
        c.hv = 4;
        opts_t o = TRAIN;
        expect_bwd("varlen_empty_gva4", &c, &o, TOL_BF16);
        o.pool = 1;
        expect_bwd("varlen_empty_gva4_pool", &c, &o, TOL_BF16);
    }
    /* every sequence empty: d_initial_state = d_final_state, dA_log = ddt_bias = 0 */
    static const int64_t none[] = {0, 0};
    kda_synth_config_t c = base(128);
    c.batch = 1;
    c.num_seqs = 2;
    c.seqlens = none;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("all_empty", &c, &TRAIN, TOL_BF16);
}

TEST(gpu_bwd_t1_and_boundaries) {
    static const int64_t Ts[] = {1, 2, 15, 63, 64, 65, 127, 129};
    for (int kd = 64; kd <= 128; kd *= 2)
        for (int t = 0; t < 8; t++) {
            kda_synth_config_t c = base(kd);
            c.seq_len = Ts[t];
            c.gate = (kda_gate_mode_t)(t % 4);
            c.seed = (uint64_t)(100 + t);
            char name[32];
            snprintf(name, sizeof name, "T%lld_k%d", (long long)Ts[t], kd);
            expect_bwd(name, &c, &TRAIN, TOL_BF16);
        }
}

static void expect_deterministic(const char *name, const kda_synth_config_t *c);

/* G > 1 with more than one query/key head: the pairs kernel's CTA of (chunk, query/key head hq, channel tile) runs
 * the value heads hq·G … hq·G + G − 1 in turn and sums their dq̂, dk̂ in order before the l2norm step
 * (bwd_pairs.cuh). G = 4 and 3: l2norm on and off, K = 100 (channels past K in the last tile) and K = 32 (a tile
 * wholly past K), the K class 64, fp32 and fp16 inputs, varlen with empty sequences, and two calls giving
 * identical bytes. */
TEST(gpu_bwd_gva_4x) {
    kda_synth_config_t c = base(128);
    c.hqk = 2;
    c.hv = 8;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("gva_4x", &c, &TRAIN, TOL_BF16);
    kda_synth_config_t d = c;
    d.l2norm = 0;
    expect_bwd("gva_4x_no_l2norm", &d, &TRAIN, TOL_BF16);
    d = c;
    d.hv = 6;
    expect_bwd("gva_3x", &d, &TRAIN, TOL_BF16);
    d = c;
    d.k = 100;
    d.v = 72;
    d.seq_len = 90;
    expect_bwd("gva_4x_k100_v72", &d, &TRAIN, TOL_BF16);
    d.l2norm = 0;
    expect_bwd("gva_4x_k100_no_l2norm", &d, &TRAIN, TOL_BF16);
    d = c;
    d.k = 32;
    d.v = 48;
    expect_bwd("gva_4x_k32_v48", &d, &TRAIN, TOL_BF16);
    d = base(64);
    d.hqk = 2;
    d.hv = 8;
    expect_bwd("gva_4x_k64_lower_bound", &d, &TRAIN, TOL_BF16);
    d = c;
    d.dtype = d.g_dtype = d.beta_dtype = d.o_dtype = KDA_FLOAT32;
    opts_t o = TRAIN;
    o.grad_f32 = 1;
    expect_bwd("gva_4x_fp32", &d, &o, TOL_F32);
    d = c;
    d.dtype = d.o_dtype = KDA_FLOAT16;
    expect_bwd("gva_4x_fp16", &d, &TRAIN, TOL_BF16);
    static const int64_t lens[] = {300, 0, 7, 129, 0};
    d = base_varlen(128, lens, 5);
    d.hqk = 2;
    d.hv = 8;
    d.gate = KDA_GATE_SOFTPLUS;
    o = TRAIN;
    o.pool = 1;
    expect_bwd("gva_4x_varlen_empty_pool", &d, &o, TOL_BF16);
    expect_deterministic("G = 4, two query/key heads", &d);
}

TEST(gpu_bwd_strong_decay) {
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.decay = 30.0f;
        c.gate = KDA_GATE_SOFTPLUS;
        expect_bwd("strong_decay_softplus", &c, &TRAIN, TOL_BF16);
        c.gate = KDA_GATE_RAW;
        expect_bwd("strong_decay_raw", &c, &TRAIN, TOL_BF16);
    }
}

/* fp16 and fp32 inputs: the state-gradient chain reads QΓ as hi + lo (kda_cuda.h fine blocks), which took
 * d_initial_state from 2.4-2.5e-3 to 5.4-6.4e-4 on these cases: the bound sits between the two */
#define DH0_FINE 1.5e-3

TEST(gpu_bwd_fp32_fp16) {
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
        c.gate = KDA_GATE_SOFTPLUS;
        opts_t o = TRAIN;
        o.grad_f32 = 1;
        expect_bwd("fp32", &c, &o, TOL_F32);
        CHECK(last_err[G_DH0] <= DH0_FINE, "fp32 K %d: d_initial_state %.3g > %.3g (fine blocks' QΓ_lo?)", kd,
              last_err[G_DH0], DH0_FINE);
    }
    /* float16 inputs and gradients */
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.dtype = c.o_dtype = KDA_FLOAT16;
        c.gate = KDA_GATE_SOFTPLUS;
        expect_bwd("fp16", &c, &TRAIN, TOL_BF16);
        CHECK(last_err[G_DH0] <= DH0_FINE, "fp16 K %d: d_initial_state %.3g > %.3g (fine blocks' QΓ_lo?)", kd,
              last_err[G_DH0], DH0_FINE);
    }
    /* bf16 inputs with float32 gradients */
    kda_synth_config_t c = base(128);
    opts_t o = TRAIN;
    o.grad_f32 = 1;
    expect_bwd("bf16_in_f32_grads", &c, &o, TOL_BF16);
    /* bf16 inputs with a float32 / float16 o (and d_o): the split path's dS⁺ from the fallback dstate kernel */
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t b = base(kd);
        b.o_dtype = kd == 64 ? KDA_FLOAT16 : KDA_FLOAT32;
        expect_bwd(kd == 64 ? "bf16_in_f16_do" : "bf16_in_f32_do", &b, &TRAIN, TOL_BF16);
    }
}

/* K and V of other sizes up to 128 (padded to their class), K ≠ V so that a mix-up shows */
TEST(gpu_bwd_head_size_pairs) {
    /* {64, 20}: V not a multiple of 8, so the split path's dS⁺ comes from the fallback dstate kernel */
    static const int kv[][2] = {{64, 128}, {128, 64}, {100, 72}, {32, 48}, {128, 96}, {64, 20}};
    for (int i = 0; i < 6; i++) {
        kda_synth_config_t c = base(128);
        c.k = kv[i][0];
        c.v = kv[i][1];
        c.seq_len = 90;
        c.gate = KDA_GATE_SOFTPLUS;
        char name[32];
        snprintf(name, sizeof name, "k%d_v%d", c.k, c.v);
        expect_bwd(name, &c, &TRAIN, TOL_BF16);
    }
}

/* Two identical calls of case c give identical bytes in every gradient */
static void expect_deterministic(const char *name, const kda_synth_config_t *c) {
    bcase_t x;
    bcase_make(&x, c, &TRAIN);
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *first[G_N];
    for (int i = 0; i < G_N; i++) first[i] = fetch(&x, i);
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    for (int i = 0; i < G_N; i++) {
        void *again = fetch(&x, i);
        CHECK(memcmp(first[i], again, (size_t)x.n[i] * kda_dtype_size(x.dt[i])) == 0, "%s: %s differs between two calls",
              name, grad_names[i]);
        free(again);
        free(first[i]);
    }
    bcase_free(&x);
}

/* Two identical calls give identical bytes (no atomics). */
TEST(gpu_bwd_deterministic) {
    static const int64_t lens[] = {300, 7, 129};
    kda_synth_config_t c = base_varlen(128, lens, 3);
    c.hqk = 1;
    c.hv = 4;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_deterministic("G = 4", &c);
}

/* One value head per query/key head (G = 1): the pairs kernel's loop over the group's value heads runs once (the
 * cases above have G ≥ 2; until v11 they took a scratch and a finish kernel for dq and dk, and G = 1 alone the
 * pairs kernel's stores). Every option again at G = 1: the gate forms, l2norm off, β plain and
 * 2·sigmoid, a scale, T = 1 and T not a multiple of 64, strong decay, the states' forms, varlen with empty
 * sequences, fp32 and fp16 inputs and gradients, K of 100 (channels past K in the last tile), and two calls
 * giving identical bytes. */
TEST(gpu_bwd_one_head_group) {
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.hqk = c.hv = 3;
        expect_each_gate("g1_", &c);
        c.gate = KDA_GATE_SOFTPLUS;
        c.l2norm = 0;
        expect_bwd("g1_no_l2norm", &c, &TRAIN, TOL_BF16);
        c.l2norm = 1;
        c.beta_sigmoid = 0;
        expect_bwd("g1_no_beta_sigmoid", &c, &TRAIN, TOL_BF16);
        c.beta_sigmoid = c.allow_neg_eigval = 1;
        opts_t o = TRAIN;
        o.scale = 0.3f;
        expect_bwd("g1_neg_eigval_scale", &c, &o, TOL_BF16);
        c.allow_neg_eigval = 0;
        static const int64_t Ts[] = {1, 63, 65, 129};
        for (int t = 0; t < 4; t++) {
            kda_synth_config_t b = c;
            b.seq_len = Ts[t];
            b.seed = (uint64_t)(200 + t);
            char name[32];
            snprintf(name, sizeof name, "g1_T%lld_k%d", (long long)Ts[t], kd);
            expect_bwd(name, &b, &TRAIN, TOL_BF16);
        }
        kda_synth_config_t d = c;
        d.decay = 30.0f;
        expect_bwd("g1_strong_decay", &d, &TRAIN, TOL_BF16);
        static const int64_t lens[] = {65, 0, 1, 130, 0, 17};
        d = base_varlen(kd, lens, 6);
        d.hqk = d.hv = 2;
        d.gate = KDA_GATE_SOFTPLUS;
        d.state_v_first = 1;
        d.initial_state_dtype = KDA_BFLOAT16;
        o = TRAIN;
        o.pool = 1;
        expect_bwd("g1_varlen_empty_pool_vfirst", &d, &o, TOL_BF16);
        d = c;
        d.dtype = d.g_dtype = d.beta_dtype = d.o_dtype = KDA_FLOAT32;
        o = TRAIN;
        o.grad_f32 = 1;
        expect_bwd("g1_fp32", &d, &o, TOL_F32);
        d = c;
        d.dtype = d.o_dtype = KDA_FLOAT16;
        expect_bwd("g1_fp16", &d, &TRAIN, TOL_BF16);
    }
    kda_synth_config_t c = base(128);
    c.hqk = c.hv = 2;
    c.k = 100;
    c.v = 72;
    c.seq_len = 90;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("g1_k100_v72", &c, &TRAIN, TOL_BF16);
    /* two identical calls: identical bytes */
    static const int64_t lens[] = {300, 7, 129};
    c = base_varlen(128, lens, 3);
    c.hqk = c.hv = 3;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_deterministic("G = 1", &c);
}

/* Captured in a CUDA graph (no host sync, no allocation inside), replayed: the same bytes as a direct call. */
TEST(gpu_bwd_cuda_graph_capture) {
    static const int64_t lens[] = {100, 0, 64};
    kda_synth_config_t c = base_varlen(128, lens, 3);
    c.gate = KDA_GATE_SOFTPLUS;
    opts_t o = TRAIN;
    o.pool = 1;
    bcase_t x;
    bcase_make(&x, &c, &o);
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *direct[G_N];
    for (int i = 0; i < G_N; i++) direct[i] = fetch(&x, i);
    for (int i = 0; i < G_N; i++) CUDA_OK(cudaMemset(x.dgrad[i], 0xff, (size_t)x.n[i] * 4 + 16));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    const kda_status_t st = kda_backward(gpu(), &x.db, x.ws, x.ws_bytes, s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CHECK(st == KDA_STATUS_SUCCESS, "captured kda_backward: %s", kda_last_error());
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    for (int i = 0; i < G_N; i++) {
        void *g = fetch(&x, i);
        CHECK(memcmp(g, direct[i], (size_t)x.n[i] * kda_dtype_size(x.dt[i])) == 0, "graph replay: %s differs",
              grad_names[i]);
        free(g);
        free(direct[i]);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    bcase_free(&x);
}

/* A non-finite element in column j of the initial state (§7): dv and d_initial_state bit for bit as without
 * it, dg and dβ of that (sequence, head) NaN, the other heads bit for bit as without it. */
TEST(gpu_bwd_nonfinite_initial_state) {
    static const int64_t lens[] = {70, 9};
    kda_synth_config_t c = base_varlen(128, lens, 2);
    c.hqk = 2;
    c.hv = 2;
    c.gate = KDA_GATE_SOFTPLUS;
    bcase_t clean, x;
    bcase_make(&clean, &c, &TRAIN);
    bcase_make(&x, &c, &TRAIN);
    const int64_t K = c.k, V = c.v, HV = c.hv;
    const float inf = INFINITY;
    CUDA_OK(cudaMemcpy((char *)x.dev.initial_state + (3 * V + 7) * 4, &inf, 4, cudaMemcpyHostToDevice)); /* n 0, h 0 */
    CHECK(bcase_run(&clean, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *a = fetch(&clean, G_DV), *b = fetch(&x, G_DV);
    CHECK(memcmp(a, b, (size_t)x.n[G_DV] * kda_dtype_size(x.dt[G_DV])) == 0, "dv changed by the non-finite column");
    free(a);
    free(b);
    a = fetch(&clean, G_DH0);
    b = fetch(&x, G_DH0);
    CHECK(memcmp(a, b, (size_t)x.n[G_DH0] * 4) == 0, "d_initial_state changed by the non-finite column");
    free(a);
    free(b);
    a = fetch(&clean, G_DG);
    b = fetch(&x, G_DG);
    int64_t wrong = 0;
    for (int64_t e = 0; e < x.n[G_DG]; e++) {
        const int64_t t = e / (HV * K), h = e / K % HV;
        const float v = kda_load_f32(b, x.dt[G_DG], e);
        const size_t sz = kda_dtype_size(x.dt[G_DG]);
        wrong += (t < lens[0] && h == 0) ? !isnan(v) : memcmp((char *)a + e * sz, (char *)b + e * sz, sz) != 0;
    }
    CHECK(wrong == 0, "dg: %lld elements neither NaN (sequence 0, head 0) nor as without the column", (long long)wrong);
    free(a);
    free(b);
    bcase_free(&clean);
    bcase_free(&x);
}

/* Issue 11's first benchmark shape (B2 T8192 H32, K = V = 128, training flags): every gradient written and finite
 * over a grid of many waves; prints the backward's time (median of 5 calls, CUDA events) and its workspace. */
TEST(gpu_bwd_large_b2_t8192_h32) {
    kda_synth_config_t c = base(128);
    c.batch = 2;
    c.seq_len = 8192;
    c.hqk = c.hv = 32;
    c.gate = KDA_GATE_SOFTPLUS;
    bcase_t x;
    bcase_make(&x, &c, &TRAIN);
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    for (int i = 0; i < G_N; i++) {
        if (x.n[i] == 0) continue;
        void *h = fetch(&x, i);
        const int64_t bad = kda_count_nonfinite(h, x.dt[i], x.n[i]);
        CHECK(bad == 0, "%s: %lld values unwritten or not finite", grad_names[i], (long long)bad);
        free(h);
    }
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    float ms[5];
    for (int r = 0; r < 5; r++) {
        CUDA_OK(cudaEventRecord(e0, 0));
        CHECK(kda_backward(gpu(), &x.db, x.ws, x.ws_bytes, NULL) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    for (int i = 0; i < 5; i++) /* sort for the median */
        for (int j = i + 1; j < 5; j++)
            if (ms[j] < ms[i]) {
                const float t = ms[i];
                ms[i] = ms[j];
                ms[j] = t;
            }
    printf("bwd B2 T8192 H32 K=V=128: %.3f ms (median of 5), workspace %.1f MB\n", ms[2], x.ws_bytes / 1048576.0);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    bcase_free(&x);
}

/* kda_args_t.saved: the forward keeps its chunk blocks (and with bf16 inputs S at every chunk start), the
 * backward reads them instead of rerunning the prep (and its states stage). The gradients are the same bytes as
 * the backward's own recomputation (the same kernels on the same inputs), the forward's o too; both workspaces
 * shrink (the backward's by at least what is kept); a saved_bytes below the size is refused by name; saved is
 * misaligned. Where the forward keeps S (keeps_s: bf16 inputs, the states stage would fill the card or the chain
 * may split, as with the CP split forced on in the forward, cp_piece) the backward's S is the forward's, made
 * without K̃_lo (and with cp_piece from the pieces' merged fp32 states), while its own states pass adds Δᵀ K̃_lo:
 * each gradient's error against the oracle is then held to 1.2x the recomputing backward's (dA_log and ddt_bias,
 * sums over every token and channel, 3x, as in cp_case). The kept blocks may carry K̃_lo, which the forward's
 * workspace never held (the backward's states pass reads it): C × KC bf16 per chunk and value head. */
static void saved_case(const char *name, const kda_synth_config_t *cfg, const opts_t *o, int cp_piece, int keeps_s) {
    bcase_t x;
    bcase_make(&x, cfg, o);
    const int bitwise = !keeps_s || cfg->dtype != KDA_BFLOAT16;
    if (!bitwise) run_oracle(&x, name);
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s: %s", name, kda_last_error());
    void *ref[G_N];
    for (int i = 0; i < G_N; i++) ref[i] = fetch(&x, i);
    size_t bwd_plain = x.ws_bytes;

    kda_args_t *a = &x.dev;
    const size_t o_bytes = (size_t)x.n[G_DV] * kda_dtype_size(a->o_dtype);
    void *o_dev = NULL;
    CUDA_OK(cudaMalloc(&o_dev, o_bytes + 16));
    a->o = o_dev;
    if (cp_piece) {
        a->cp_mode = KDA_CP_ON;
        a->cp_piece_len = cp_piece;
    }
    size_t n = 0, fws_plain = 0, fws_saved = 0;
    CHECK(kda_forward_saved_size(gpu(), a, &n) == KDA_STATUS_SUCCESS && n > 0, "%s: saved size %zu: %s", name, n,
          kda_last_error());
    CHECK(kda_forward_workspace_size(gpu(), a, &fws_plain) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *fws = NULL, *saved = NULL;
    CUDA_OK(cudaMalloc(&fws, fws_plain + 16));
    CUDA_OK(cudaMalloc(&saved, n + 16));
    /* the forward without saved: o for comparison */
    CHECK(kda_forward(gpu(), a, fws, fws_plain, NULL) == KDA_STATUS_SUCCESS, "%s: %s", name, kda_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    void *o_plain = malloc(o_bytes + 1);
    CUDA_OK(cudaMemcpy(o_plain, o_dev, o_bytes, cudaMemcpyDeviceToHost));
    /* too small: refused by name, o untouched */
    a->saved = (char *)saved + 1;
    a->saved_bytes = n - 1;
    CUDA_OK(cudaMemset(o_dev, 0x5a, o_bytes));
    kda_status_t st = kda_forward(gpu(), a, fws, fws_plain, NULL);
    CHECK(st == KDA_STATUS_INSUFFICIENT_WORKSPACE && strstr(kda_last_error(), "'saved_bytes'"), "%s: status %s: %s",
          name, kda_status_string(st), kda_last_error());
    unsigned char *oh = (unsigned char *)malloc(o_bytes + 1);
    CUDA_OK(cudaMemcpy(oh, o_dev, o_bytes, cudaMemcpyDeviceToHost));
    int same = 1;
    for (size_t e = 0; e < o_bytes; e++) same &= oh[e] == 0x5a;
    CHECK(same, "%s: o written by a refused call", name);
    size_t need = 0;
    st = kda_backward_workspace_size(gpu(), &x.db, &need);
    CHECK(st == KDA_STATUS_INSUFFICIENT_WORKSPACE && strstr(kda_last_error(), "'saved_bytes'"),
          "%s: backward with a short saved: %s: %s", name, kda_status_string(st), kda_last_error());
    /* the forward with saved (misaligned by a byte): a smaller workspace, the same o */
    a->saved_bytes = n;
    CHECK(kda_forward_workspace_size(gpu(), a, &fws_saved) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    /* the forward's workspace loses the kept blocks; with bf16 inputs saved may also hold S, which was never in it,
       and the kept blocks K̃_lo where the backward runs its states pass (K class <= 128) */
    const int64_t chunks = cfg->num_seqs > 0 ? (x.dev.seq_len + 63 * cfg->num_seqs) / 64
                                             : cfg->batch * ((cfg->seq_len + 63) / 64);
    const size_t ktlo = cfg->k <= 128 ? (size_t)chunks * (size_t)cfg->hv * 64 * (cfg->k <= 64 ? 64 : 128) * 2 : 0;
    if (cfg->dtype != KDA_BFLOAT16)
        CHECK(fws_saved + n - 256 <= fws_plain + 512 + ktlo, "%s: forward workspace %zu with saved (%zu bytes), %zu "
              "without", name, fws_saved, n, fws_plain);
    CHECK(fws_saved < fws_plain, "%s: forward workspace %zu with saved (%zu bytes), %zu without", name, fws_saved, n,
          fws_plain);
    CHECK(kda_forward(gpu(), a, fws, fws_saved, NULL) == KDA_STATUS_SUCCESS, "%s: %s", name, kda_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(oh, o_dev, o_bytes, cudaMemcpyDeviceToHost));
    CHECK(memcmp(oh, o_plain, o_bytes) == 0, "%s: o differs with saved", name);
    /* the backward from saved: the same bytes, a smaller workspace */
    a->o = NULL;
    a->cp_mode = KDA_CP_AUTO;
    a->cp_piece_len = 0;
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s: from saved: %s", name, kda_last_error());
    CHECK(kda_backward_workspace_size(gpu(), &x.db, &need) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    /* what the backward needs in all (its workspace and the kept memory) does not grow — but for the forward's
       piece maps, which bf16 inputs keep where a split is possible (+64 KB per slot and value head at K = 128) */
    if (!cp_piece || cfg->dtype != KDA_BFLOAT16)
        CHECK(need + n - 256 <= bwd_plain + 512, "%s: backward workspace %zu with saved, %zu without", name, need,
              bwd_plain);
    double worst = 0.0;
    for (int i = 0; i < G_N; i++) {
        void *g = fetch(&x, i);
        if (bitwise) {
            CHECK(memcmp(g, ref[i], (size_t)x.n[i] * kda_dtype_size(x.dt[i])) == 0, "%s: %s differs from saved",
                  name, grad_names[i]);
        } else if (x.n[i]) {
            const double e = kda_rel_err(g, x.dt[i], x.ref[i], KDA_FLOAT32, x.n[i]);
            const double e0 = kda_rel_err(ref[i], x.dt[i], x.ref[i], KDA_FLOAT32, x.n[i]);
            CHECK(kda_count_nonfinite(g, x.dt[i], x.n[i]) == 0, "%s: %s from saved not finite", name, grad_names[i]);
            CHECK(e <= (i >= G_DA ? 3.0 : 1.2) * e0 + 1e-5, "%s: %s error %.3g from saved, %.3g recomputing", name,
                  grad_names[i], e, e0);
            if (e / (e0 + 1e-30) > worst) worst = e / (e0 + 1e-30);
        }
        free(g);
        free(ref[i]);
    }
    if (!bitwise) printf("bwd saved %-20s errors from saved at most %.2fx the recomputing backward's\n", name, worst);
    printf("bwd saved %-20s %zu bytes kept; workspace forward %zu -> %zu, backward %zu -> %zu\n", name, n,
           fws_plain, fws_saved, bwd_plain, need);
    a->saved = NULL;
    a->saved_bytes = 0;
    free(o_plain);
    free(oh);
    cudaFree(o_dev);
    cudaFree(fws);
    cudaFree(saved);
    bcase_free(&x);
}

TEST(gpu_bwd_saved_blocks) {
    static const int64_t lens[] = {300, 0, 129, 7};
    kda_synth_config_t c = base_varlen(128, lens, 4);
    c.hqk = 4;
    c.hv = 16; /* 4 sequences × 16 heads: the states stage would fill the card, so the forward keeps S too */
    c.gate = KDA_GATE_SOFTPLUS;
    opts_t o = TRAIN;
    o.pool = 1;
    saved_case("varlen_gva4", &c, &o, 0, 1);
    saved_case("varlen_gva4_cp", &c, &o, 128, 1);
    c.hqk = 1;
    c.hv = 4; /* few (sequence, head)s: the blocks alone are kept (on cards of 128 SMs or more) */
    saved_case("varlen_gva4_few", &c, &o, 0, 0);
    kda_synth_config_t f = base(64);
    f.dtype = f.g_dtype = f.beta_dtype = f.o_dtype = KDA_FLOAT32;
    saved_case("fp32_k64", &f, &TRAIN, 0, 0);
}

/* The state-gradient chain split by intra-card CP (bwd_dstate.cuh's modes, forced on through kda_args_t.cp_mode
 * with pieces of `piece` tokens) against the same call with the split off: each gradient's error against the
 * oracle at most 1.1x the unsplit call's (+ 1e-5), nothing left unwritten, two split calls giving identical
 * bytes, and — the inputs decay slowly, so the state gradient carries across pieces — some gradient byte
 * different from the unsplit call's (the split was taken: the merged fp32 dS differs in its last bits). */
static void cp_case(const char *name, const kda_synth_config_t *cfg, const opts_t *o, int64_t piece) {
    bcase_t x;
    bcase_make(&x, cfg, o);
    run_oracle(&x, name);
    double e_off[G_N], e_cp[G_N];
    void *off[G_N], *cp[G_N];
    x.dev.cp_mode = KDA_CP_OFF;
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s: split off: %s", name, kda_last_error());
    for (int i = 0; i < G_N; i++) off[i] = fetch(&x, i);
    x.dev.cp_mode = KDA_CP_ON;
    x.dev.cp_piece_len = piece;
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s: split: %s", name, kda_last_error());
    for (int i = 0; i < G_N; i++) cp[i] = fetch(&x, i);
    CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s: split, again: %s", name, kda_last_error());
    char line[512];
    int len = snprintf(line, sizeof line, "bwd cp %-22s piece %4lld:", name, (long long)piece);
    int differs = 0;
    for (int i = 0; i < G_N; i++) {
        const size_t bytes = (size_t)x.n[i] * kda_dtype_size(x.dt[i]);
        void *again = fetch(&x, i);
        CHECK(memcmp(cp[i], again, bytes) == 0, "%s: %s differs between two split calls", name, grad_names[i]);
        free(again);
        if (x.n[i] == 0) continue;
        differs |= memcmp(cp[i], off[i], bytes) != 0;
        e_off[i] = kda_rel_err(off[i], x.dt[i], x.ref[i], KDA_FLOAT32, x.n[i]);
        e_cp[i] = kda_rel_err(cp[i], x.dt[i], x.ref[i], KDA_FLOAT32, x.n[i]);
        CHECK(kda_count_nonfinite(cp[i], x.dt[i], x.n[i]) == 0, "%s: %s not finite or unwritten", name, grad_names[i]);
        CHECK(e_cp[i] <= 1.1 * e_off[i] + 1e-5, "%s: %s error %.3g split, %.3g unsplit", name, grad_names[i], e_cp[i],
              e_off[i]);
        len += snprintf(line + len, sizeof line - (size_t)len, " %s %.2e/%.2e", grad_names[i], e_cp[i], e_off[i]);
    }
    CHECK(differs, "%s: the split gradients equal the unsplit ones bit for bit: no split was taken", name);
    printf("%s  (split/unsplit) %s\n", line, kda_describe(cfg));
    if (cfg->dtype == KDA_BFLOAT16) { /* the forward keeping its blocks, S and piece maps (kda_args_t.saved), then
                                         the backward walking the forward's pieces with its maps */
        kda_args_t *a = &x.dev;
        const size_t o_bytes = (size_t)x.n[G_DV] * kda_dtype_size(a->o_dtype);
        void *o_dev = NULL, *fws = NULL, *saved = NULL;
        size_t n = 0, fw = 0;
        CUDA_OK(cudaMalloc(&o_dev, o_bytes + 16));
        a->o = o_dev;
        CHECK(kda_forward_saved_size(gpu(), a, &n) == KDA_STATUS_SUCCESS && n > 0, "%s: saved size: %s", name,
              kda_last_error());
        CUDA_OK(cudaMalloc(&saved, n));
        a->saved = saved;
        a->saved_bytes = n;
        CHECK(kda_forward_workspace_size(gpu(), a, &fw) == KDA_STATUS_SUCCESS, "%s: %s", name, kda_last_error());
        CUDA_OK(cudaMalloc(&fws, fw + 16));
        CHECK(kda_forward(gpu(), a, fws, fw, NULL) == KDA_STATUS_SUCCESS, "%s: forward: %s", name, kda_last_error());
        CUDA_OK(cudaDeviceSynchronize());
        a->o = NULL;
        CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "%s: from saved: %s", name, kda_last_error());
        len = snprintf(line, sizeof line, "bwd cp %-22s piece %4lld from saved:", name, (long long)piece);
        for (int i = 0; i < G_N; i++) {
            if (x.n[i] == 0) continue;
            void *g = fetch(&x, i);
            const double e = kda_rel_err(g, x.dt[i], x.ref[i], KDA_FLOAT32, x.n[i]);
            CHECK(kda_count_nonfinite(g, x.dt[i], x.n[i]) == 0, "%s: %s from saved not finite", name, grad_names[i]);
            /* dA_log, ddt_bias: sums over every token and channel, whose error moves by its noise with the kept
               S (bf16, the forward's) against the recomputed one, split or not: a wider bound */
            CHECK(e <= (i >= G_DA ? 3.0 : 1.1) * e_off[i] + 1e-5, "%s: %s error %.3g from saved (the forward's maps), "
                  "%.3g unsplit", name, grad_names[i], e, e_off[i]);
            len += snprintf(line + len, sizeof line - (size_t)len, " %s %.2e", grad_names[i], e);
            free(g);
        }
        printf("%s\n", line);
        a->saved = NULL;
        a->saved_bytes = 0;
        cudaFree(o_dev);
        cudaFree(fws);
        cudaFree(saved);
    }
    for (int i = 0; i < G_N; i++) {
        free(off[i]);
        free(cp[i]);
    }
    bcase_free(&x);
}

TEST(gpu_bwd_cp_state_gradient) {
    kda_synth_config_t c = base(128); /* one long row, K = V = 128: one 128-column tile per piece and head */
    c.batch = 1;
    c.seq_len = 1100;
    c.gate = KDA_GATE_SOFTPLUS;
    c.decay = 0.001f;
    cp_case("row_k128", &c, &TRAIN, 64);
    cp_case("row_k128", &c, &TRAIN, 320);
    /* (the gate's form does not reach this stage, which reads γ from the blocks; the lower-bound gate, whose decay
       is at least lb/2 per token whatever A, would forget dS within a piece and hide the split) */
    c.allow_neg_eigval = 1;
    cp_case("row_k128_neg_eigval", &c, &TRAIN, 192);
    c.allow_neg_eigval = 0;
    c.decay = 30.0f; /* strong decay: the split still exact, the pieces' maps near zero */
    {
        bcase_t x;
        bcase_make(&x, &c, &TRAIN);
        x.dev.cp_mode = KDA_CP_ON;
        x.dev.cp_piece_len = 64;
        run_oracle(&x, "row_k128_strong");
        CHECK(bcase_run(&x, 0) == KDA_STATUS_SUCCESS, "strong decay, split: %s", kda_last_error());
        for (int i = 0; i < G_N; i++) {
            if (x.n[i] == 0) continue;
            void *g = fetch(&x, i);
            const double e = kda_rel_err(g, x.dt[i], x.ref[i], KDA_FLOAT32, x.n[i]);
            CHECK(e <= (i >= G_DA ? 3 : 1) * TOL_BF16 && kda_count_nonfinite(g, x.dt[i], x.n[i]) == 0,
                  "strong decay, split: %s error %.3g", grad_names[i], e);
            free(g);
        }
        bcase_free(&x);
    }
    /* varlen with empty and one-token sequences, GVA 4x, a state pool, K = V = 64 (64-column tiles) */
    static const int64_t lens[] = {700, 0, 129, 1, 260};
    kda_synth_config_t v = base_varlen(64, lens, 5);
    v.hqk = 1;
    v.hv = 4;
    v.gate = KDA_GATE_SOFTPLUS;
    v.decay = 0.001f;
    opts_t o = TRAIN;
    o.pool = 1;
    cp_case("varlen_pool_gva4_k64", &v, &o, 64);
    cp_case("varlen_pool_gva4_k64", &v, &o, 128);
    /* padded classes: K = 100, V = 72 (128-column tiles over 100 and 72 real columns); K = 128, V = 64 (M in two
       64-column tiles) */
    kda_synth_config_t k = base(128);
    k.batch = 1;
    k.seq_len = 600;
    k.k = 100;
    k.v = 72;
    k.gate = KDA_GATE_SOFTPLUS;
    k.decay = 0.001f;
    cp_case("k100_v72", &k, &TRAIN, 128);
    k.k = 128;
    k.v = 64;
    cp_case("k128_v64", &k, &TRAIN, 64);
}

/* Small split cases for compute-sanitizer (memcheck, racecheck): the CP modes of the state-gradient kernel at both
 * tiles (64 and 128 columns) and the merge, on problems that racecheck finishes in seconds */
TEST(gpu_bwd_cp_sanitize) {
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.batch = 1;
        c.seq_len = 260;
        c.hqk = 1;
        c.hv = 2;
        c.gate = KDA_GATE_SOFTPLUS;
        c.decay = 0.001f;
        cp_case(kd == 64 ? "sanitize_k64" : "sanitize_k128", &c, &TRAIN, 64);
    }
}

/* Class 256: the chunk kernel's K split over a cluster of two CTAs and
 * its V halves, the pairs kernel's clusters of 8, the inter kernel at K 256 and V halves, the fallback dstate kernel
 * at K 256, the finish kernel's dβ of the halves. FLA's test_chunk_varlen at D = 256 is the varlen bf16 case. */
TEST(gpu_bwd_head_dim_256) {
    static const int64_t lens[] = {150, 0, 33, 200};
    kda_synth_config_t c = base_varlen(256, lens, 4);
    c.hqk = 1;
    c.hv = 2;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("k256_v256_varlen", &c, &TRAIN, TOL_BF16);           /* the split path (bf16) */
    kda_synth_config_t f = c;
    f.dtype = f.g_dtype = f.beta_dtype = f.o_dtype = KDA_FLOAT32;
    opts_t o = TRAIN;
    o.grad_f32 = 1;
    expect_bwd("k256_v256_fp32", &f, &o, TOL_F32);                  /* the fp32 path: Z's exchange, dQΓ, dK̃, dγ */
    /* one of K, V in class 256, or both padded; the lower-bound gate; G = 2 with l2norm off */
    static const int kv[][2] = {{256, 64}, {256, 128}, {64, 256}, {128, 256}, {200, 150}};
    for (int i = 0; i < 5; i++) {
        kda_synth_config_t d = base(256);
        d.k = kv[i][0];
        d.v = kv[i][1];
        d.seq_len = 90;
        char name[32];
        snprintf(name, sizeof name, "k%d_v%d", d.k, d.v);
        expect_bwd(name, &d, &TRAIN, TOL_BF16);
    }
    kda_synth_config_t g = base(256);
    g.seq_len = 70;
    g.l2norm = 0;
    expect_bwd("k256_gva2_nol2", &g, &TRAIN, TOL_BF16);
    /* bf16 inputs with a float32 d_o: the split path's fallback dstate kernel (as every K 256 case) with fp32 dO */
    kda_synth_config_t b = base(256);
    b.seq_len = 70;
    b.o_dtype = KDA_FLOAT32;
    expect_bwd("k256_f32_do", &b, &TRAIN, TOL_BF16);
    expect_deterministic("k256_v256", &c);
}

/* gpu_bwd_head_dim_256 small enough for compute-sanitizer (memcheck, racecheck: the chunk kernel's two-CTA
 * clusters, the pairs kernel's clusters of 8): K = V = 256, bf16 (split path, dstate recurrence kernel at K 256) and
 * fp32 (fp32 path, fallback dstate kernel), two sequences */
TEST(gpu_bwd_k256_sanitize) {
    static const int64_t lens[] = {70, 20};
    kda_synth_config_t c = base_varlen(256, lens, 2);
    c.hqk = 1;
    c.hv = 1;
    c.gate = KDA_GATE_SOFTPLUS;
    expect_bwd("k256_sanitize_bf16", &c, &TRAIN, TOL_BF16);
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    opts_t o = TRAIN;
    o.grad_f32 = 1;
    expect_bwd("k256_sanitize_fp32", &c, &o, TOL_F32);
}

#else
/* Built without CUDA: every case CTest names from this file is skipped. */
const char *kda_test_skip_missing = "libkda was built without CUDA (no nvcc when CMake configured it, or KDA_WITH_CUDA=OFF)";
#endif
