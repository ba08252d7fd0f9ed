/*
 * The backward: the fp64 oracle (reference backend) against central finite differences of an fp64 forward
 * written here from the definition, for every input and every option; the CPU backend against the oracle.
 *
 * The loss is L = Σ d_o · o + Σ d_final_state · S_T, so ∂L/∂x is what kda_backward returns for d_o and
 * d_final_state. The oracle writes float32 gradients, so a gradient matches its finite difference to float32
 * rounding (≤ 6e-8 relative); the differences themselves (step 1e-5, fp64) are good to ~1e-10.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "dtype.h"
#include "test_util.h"

/* ---------------------------------------------------------------------------------------------------------
 * An fp64 forward from the definition: L(inputs)
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    const kda_args_t *a;
    int64_t T, N, nstate;
    double scale;
    double *q, *k, *v, *g, *beta, *h0, *A_log, *dt_bias; /* fp64 copies of the inputs, perturbed in place */
    double *d_o, *dht;                                     /* the loss weights */
    const int64_t *cu;                                     /* N + 1 offsets */
} problem64_t;

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double softplus(double x) { return x > 0 ? x + log1p(exp(-x)) : log1p(exp(x)); }

static int64_t sidx(const kda_args_t *a, int64_t slot, int h, int i, int j) {
    const int K = a->head_dim_k, V = a->head_dim_v;
    return (slot * a->num_v_heads + h) * (int64_t)K * V + (a->state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j);
}

static void norm_copy(double *dst, const double *src, int n, int l2) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += src[i] * src[i];
    const double r = l2 ? 1.0 / sqrt(ss + 1e-6) : 1.0;
    for (int i = 0; i < n; i++) dst[i] = src[i] * r;
}

static double loss64(const problem64_t *P) {
    const kda_args_t *a = P->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads, G = HV / HQK;
    double *S = calloc((size_t)K * V, sizeof(double)), q[256], k[256], u[256];
    double L = 0.0;
    for (int64_t n = 0; n < P->N; n++) {
        const int64_t slot = a->state_indices ? a->state_indices[n] : n;
        for (int h = 0; h < HV; h++) {
            const int hq = h / G;
            for (int i = 0; i < K; i++)
                for (int j = 0; j < V; j++)
                    S[i * V + j] = P->h0 && slot >= 0 ? P->h0[sidx(a, slot, h, i, j)] : 0.0;
            for (int64_t t = P->cu[n]; t < P->cu[n + 1]; t++) {
                norm_copy(q, P->q + (t * HQK + hq) * K, K, a->use_qk_l2norm);
                norm_copy(k, P->k + (t * HQK + hq) * K, K, a->use_qk_l2norm);
                double b = P->beta[t * HV + h];
                if (a->use_beta_sigmoid) b = (a->allow_neg_eigval ? 2 : 1) * sigmoid(b);
                for (int i = 0; i < K; i++) {
                    double lam = P->g[(t * HV + h) * K + i];
                    if (a->use_gate_in_kernel) {
                        const double x = lam + (P->dt_bias ? P->dt_bias[h * K + i] : 0.0);
                        const double A = P->A_log ? exp(P->A_log[h]) : 1.0;
                        lam = a->lower_bound != 0.0f ? a->lower_bound * sigmoid(A * x) : -A * softplus(x);
                    }
                    lam = lam > 0 ? 0 : (lam < -80 ? -80 : lam);
                    for (int j = 0; j < V; j++) S[i * V + j] *= exp(lam);
                }
                const double *v = P->v + (t * HV + h) * V;
                for (int j = 0; j < V; j++) {
                    u[j] = v[j];
                    for (int i = 0; i < K; i++) u[j] -= k[i] * S[i * V + j];
                }
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < V; j++) S[i * V + j] += b * k[i] * u[j];
                for (int j = 0; j < V; j++) {
                    double o = 0;
                    for (int i = 0; i < K; i++) o += q[i] * S[i * V + j];
                    L += P->scale * o * P->d_o[(t * HV + h) * V + j];
                }
            }
            if (P->dht && slot >= 0)
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < V; j++) L += P->dht[sidx(a, slot, h, i, j)] * S[i * V + j];
        }
    }
    free(S);
    return L;
}

/* ---------------------------------------------------------------------------------------------------------
 * A problem with its loss weights and gradient buffers
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    kda_synth_t s;
    kda_args_t a;
    kda_backward_args_t b;
    int64_t T, N, nstate, nq, nv, ng, nb, ns;
    void *d_o, *dht;
    float *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA, *ddt; /* float32 gradients */
    int64_t cu[64];
    int32_t idx[64];
} case_t;

static double urand(uint64_t *r) {
    *r = *r * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*r >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* Build cfg, random d_o (cfg->o_dtype) and d_final_state (when with_dht), float32 gradient buffers. `pool`:
 * states through state_indices, slots in reverse order with one sequence (the second) given none. */
static void make_case(case_t *c, const kda_synth_config_t *cfg, int with_dht, int pool) {
    memset(c, 0, sizeof *c);
    CHECK(kda_synth_make(cfg, &c->s, &c->a) == 0, "synth failed");
    c->T = c->s.num_tokens;
    c->N = c->s.num_seqs;
    c->nstate = c->N + (pool ? 2 : 0);
    const kda_args_t *a = &c->a;
    for (int64_t n = 0; n <= c->N; n++)
        c->cu[n] = a->cu_seqlens ? c->s.cu_seqlens[n] : n * a->seq_len;
    if (pool) {
        for (int64_t n = 0; n < c->N; n++) c->idx[n] = (int32_t)(c->nstate - 1 - n);
        if (c->N > 1) c->idx[1] = -1;
        /* the pool needs nstate slots: re-make the state buffer larger */
        const int64_t elems = c->nstate * a->num_v_heads * (int64_t)a->head_dim_k * a->head_dim_v;
        void *h0 = malloc((size_t)elems * kda_dtype_size(cfg->initial_state_dtype));
        uint64_t r = 99;
        for (int64_t i = 0; i < elems; i++) kda_store_f32(h0, cfg->initial_state_dtype, i, (float)(0.5 * urand(&r)));
        free(c->s.h0);
        c->s.h0 = h0;
        c->a.initial_state = h0;
        c->a.state_indices = c->idx;
        c->a.num_state_slots = c->nstate;
        c->a.final_state = NULL;
    }
    const int K = a->head_dim_k, V = a->head_dim_v;
    c->nq = c->T * a->num_qk_heads * K;
    c->nv = c->T * a->num_v_heads * V;
    c->ng = c->T * a->num_v_heads * K;
    c->nb = c->T * a->num_v_heads;
    c->ns = c->nstate * a->num_v_heads * (int64_t)K * V;
    uint64_t r = cfg->seed * 7 + 1;
    c->d_o = malloc((size_t)(c->nv + 1) * 4);
    for (int64_t i = 0; i < c->nv; i++) kda_store_f32(c->d_o, cfg->o_dtype, i, (float)urand(&r));
    if (with_dht) {
        c->dht = malloc((size_t)(c->ns + 1) * 4);
        for (int64_t i = 0; i < c->ns; i++) kda_store_f32(c->dht, KDA_FLOAT32, i, (float)urand(&r));
    }
    c->dq = calloc((size_t)c->nq + 1, 4);
    c->dk = calloc((size_t)c->nq + 1, 4);
    c->dv = calloc((size_t)c->nv + 1, 4);
    c->dg = calloc((size_t)c->ng + 1, 4);
    c->dbeta = calloc((size_t)c->nb + 1, 4);
    c->dh0 = calloc((size_t)c->ns + 1, 4);
    c->dA = calloc((size_t)a->num_v_heads, 4);
    c->ddt = calloc((size_t)a->num_v_heads * K, 4);

    kda_backward_args_init(&c->b);
    c->b.problem = &c->a;
    c->b.d_o = c->d_o;
    c->b.d_o_dtype = cfg->o_dtype;
    c->b.d_final_state = c->dht;
    c->b.d_final_state_dtype = KDA_FLOAT32;
    c->b.dq = c->dq;
    c->b.dk = c->dk;
    c->b.dv = c->dv;
    c->b.dg = c->dg;
    c->b.dbeta = c->dbeta;
    c->b.dq_dtype = c->b.dk_dtype = c->b.dv_dtype = c->b.dg_dtype = c->b.dbeta_dtype = KDA_FLOAT32;
    if (a->initial_state) c->b.d_initial_state = c->dh0;
    c->b.d_initial_state_dtype = KDA_FLOAT32;
    if (a->use_gate_in_kernel && a->A_log) c->b.dA_log = c->dA;
    if (a->use_gate_in_kernel && a->dt_bias) c->b.ddt_bias = c->ddt;
}

static void free_case(case_t *c) {
    kda_synth_free(&c->s);
    free(c->d_o);
    free(c->dht);
    free(c->dq);
    free(c->dk);
    free(c->dv);
    free(c->dg);
    free(c->dbeta);
    free(c->dh0);
    free(c->dA);
    free(c->ddt);
}

static kda_status_t run_backward(kda_context_t *ctx, const kda_backward_args_t *b) {
    size_t ws = 0;
    kda_status_t st = kda_backward_workspace_size(ctx, b, &ws);
    if (st != KDA_STATUS_SUCCESS) return st;
    void *w = malloc(ws + 1);
    st = kda_backward(ctx, b, w, ws, NULL);
    free(w);
    return st;
}

static double *to64(const void *x, kda_dtype_t dt, int64_t n) {
    double *y = malloc(sizeof(double) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++) y[i] = x ? kda_load_f32(x, dt, i) : 0.0;
    return y;
}

/* ||grad − fd|| / ||fd|| over one input, by central differences of loss64 at every element. */
static double fd_err(problem64_t *P, double *x, int64_t n, const float *grad, double *max_abs) {
    const double h = 1e-5;
    double num = 0, den = 0;
    *max_abs = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x0 = x[i];
        x[i] = x0 + h;
        const double lp = loss64(P);
        x[i] = x0 - h;
        const double lm = loss64(P);
        x[i] = x0;
        const double fd = (lp - lm) / (2 * h), e = grad[i] - fd;
        num += e * e;
        den += fd * fd;
        if (fabs(e) > *max_abs) *max_abs = fabs(e);
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define FD_TOL 3e-7

static void fd_case(const kda_synth_config_t *cfg, int with_dht, int pool, float scale) {
    case_t c;
    make_case(&c, cfg, with_dht, pool);
    if (scale != 0.0f) c.a.scale = scale;
    kda_status_t st = run_backward(kda_test_reference(), &c.b);
    CHECK(st == KDA_STATUS_SUCCESS, "%s: %s", kda_describe(cfg), kda_last_error());
    if (st != KDA_STATUS_SUCCESS) {
        free_case(&c);
        return;
    }
    const kda_args_t *a = &c.a;
    problem64_t P = {a, c.T, c.N, c.nstate, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, c.cu};
    P.scale = a->scale != 0.0f ? (double)a->scale : 1.0 / sqrt((double)a->head_dim_k);
    P.q = to64(a->q, a->dtype, c.nq);
    P.k = to64(a->k, a->dtype, c.nq);
    P.v = to64(a->v, a->dtype, c.nv);
    P.g = to64(a->g, a->g_dtype, c.ng);
    P.beta = to64(a->beta, a->beta_dtype, c.nb);
    if (a->initial_state) P.h0 = to64(a->initial_state, a->initial_state_dtype, c.ns);
    if (a->A_log) P.A_log = to64(a->A_log, KDA_FLOAT32, a->num_v_heads);
    if (a->dt_bias) P.dt_bias = to64(a->dt_bias, KDA_FLOAT32, (int64_t)a->num_v_heads * a->head_dim_k);
    P.d_o = to64(c.d_o, cfg->o_dtype, c.nv);
    if (c.dht) P.dht = to64(c.dht, KDA_FLOAT32, c.ns);

    struct {
        const char *name;
        double *x;
        int64_t n;
        const float *grad;
    } in[] = {{"dq", P.q, c.nq, c.dq},          {"dk", P.k, c.nq, c.dk},       {"dv", P.v, c.nv, c.dv},
              {"dg", P.g, c.ng, c.dg},          {"dbeta", P.beta, c.nb, c.dbeta},
              {"d_initial_state", P.h0, c.ns, c.dh0},
              {"dA_log", P.A_log, a->num_v_heads, c.dA},
              {"ddt_bias", P.dt_bias, (int64_t)a->num_v_heads * a->head_dim_k, c.ddt}};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
        if (!in[i].x) continue;
        double max_abs;
        const double e = fd_err(&P, in[i].x, in[i].n, in[i].grad, &max_abs);
        CHECK(e <= FD_TOL || max_abs <= 1e-9, "%s: %s relative error %.3g against finite differences (max |err| %.3g)",
              kda_describe(cfg), in[i].name, e, max_abs);
    }
    free(P.q);
    free(P.k);
    free(P.v);
    free(P.g);
    free(P.beta);
    free(P.h0);
    free(P.A_log);
    free(P.dt_bias);
    free(P.d_o);
    free(P.dht);
    free_case(&c);
}

/* Small float32 problems: K = 8, V = 6 (unequal, so that a K/V mix-up shows). */
static kda_synth_config_t small(int64_t T) {
    kda_synth_config_t cfg;
    kda_synth_defaults(&cfg);
    cfg.batch = 1;
    cfg.seq_len = T;
    cfg.hqk = cfg.hv = 1;
    cfg.k = 8;
    cfg.v = 6;
    cfg.dtype = cfg.g_dtype = cfg.beta_dtype = cfg.o_dtype = KDA_FLOAT32;
    cfg.initial_state = 1;
    cfg.initial_state_dtype = KDA_FLOAT32;
    cfg.final_state = 1;
    cfg.final_state_dtype = KDA_FLOAT32;
    cfg.seed = 11;
    return cfg;
}

TEST(bwd_ref_fd_plain) {
    kda_synth_config_t cfg = small(7);
    cfg.batch = 2;
    fd_case(&cfg, 1, 0, 0.0f);
}

TEST(bwd_ref_fd_no_states) {
    kda_synth_config_t cfg = small(9);
    cfg.initial_state = 0;
    cfg.final_state = 0;
    fd_case(&cfg, 0, 0, 0.0f);
}

TEST(bwd_ref_fd_l2norm_softplus_sigmoid_scale) {
    kda_synth_config_t cfg = small(10);
    cfg.l2norm = 1;
    cfg.gate = KDA_GATE_SOFTPLUS;
    cfg.beta_sigmoid = 1;
    fd_case(&cfg, 1, 0, 0.37f);
}

TEST(bwd_ref_fd_lower_bound_neg_eigval) {
    kda_synth_config_t cfg = small(10);
    cfg.gate = KDA_GATE_LOWER_BOUND;
    cfg.beta_sigmoid = 1;
    cfg.allow_neg_eigval = 1;
    fd_case(&cfg, 1, 0, 0.0f);
}

TEST(bwd_ref_fd_lower_bound_no_a_log) {
    kda_synth_config_t cfg = small(8);
    cfg.gate = KDA_GATE_LOWER_BOUND_NO_A;
    cfg.l2norm = 1;
    fd_case(&cfg, 1, 0, 0.0f);
}

TEST(bwd_ref_fd_gva_varlen_empty_vfirst_bf16_state) {
    static const int64_t lens[] = {5, 0, 9, 0, 3};
    kda_synth_config_t cfg = small(0);
    cfg.num_seqs = 5;
    cfg.seqlens = lens;
    cfg.hqk = 1;
    cfg.hv = 3;
    cfg.state_v_first = 1;
    cfg.initial_state_dtype = KDA_BFLOAT16;
    cfg.l2norm = 1;
    cfg.gate = KDA_GATE_SOFTPLUS;
    fd_case(&cfg, 1, 0, 0.0f);
}

TEST(bwd_ref_fd_kfirst_bf16_state_gva2) {
    kda_synth_config_t cfg = small(6);
    cfg.hqk = 2;
    cfg.hv = 4;
    cfg.initial_state_dtype = KDA_BFLOAT16;
    fd_case(&cfg, 1, 0, 0.0f);
}

TEST(bwd_ref_fd_vfirst_fp32_state) {
    kda_synth_config_t cfg = small(6);
    cfg.state_v_first = 1;
    cfg.beta_sigmoid = 1;
    fd_case(&cfg, 1, 0, 0.0f);
}

TEST(bwd_ref_fd_state_pool) {
    static const int64_t lens[] = {4, 6, 3};
    kda_synth_config_t cfg = small(0);
    cfg.num_seqs = 3;
    cfg.seqlens = lens;
    cfg.hv = 2;
    fd_case(&cfg, 1, 1, 0.0f);
}

TEST(bwd_ref_fd_long_strong_decay) {
    kda_synth_config_t cfg = small(150); /* three checkpoint blocks of 64 */
    cfg.k = 4;
    cfg.v = 3;
    cfg.decay = 30.0f;
    cfg.gate = KDA_GATE_SOFTPLUS;
    fd_case(&cfg, 1, 0, 0.0f);
}

/* A positive raw gate is clamped to 0: no gradient reaches g there, and the finite difference agrees. */
TEST(bwd_ref_fd_clamped_gate) {
    kda_synth_config_t cfg = small(5);
    case_t c;
    make_case(&c, &cfg, 1, 0);
    float *g = (float *)c.a.g;
    for (int i = 0; i < 8; i += 2) g[i] = 0.5f; /* token 0, every other channel */
    CHECK(run_backward(kda_test_reference(), &c.b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    for (int i = 0; i < 8; i += 2) CHECK(c.dg[i] == 0.0f, "dg[%d] = %g, expected 0 (clamped)", i, c.dg[i]);
    CHECK(c.dg[1] != 0.0f, "dg[1] = 0: the unclamped channel has no gradient");
    free_case(&c);
}

/* ---------------------------------------------------------------------------------------------------------
 * The CPU backend against the oracle
 * ------------------------------------------------------------------------------------------------------- */
static kda_context_t *cpu_ctx(int threads) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) return NULL;
    kda_set_num_threads(ctx, threads);
    return ctx;
}

#define CPU_TOL 2e-5

static void cpu_case(const kda_synth_config_t *cfg, int with_dht, int pool, kda_dtype_t grad_dtype, int threads) {
    case_t ref, cpu;
    make_case(&ref, cfg, with_dht, pool);
    make_case(&cpu, cfg, with_dht, pool);
    if (grad_dtype != KDA_FLOAT32) { /* gradients in the inputs' dtype */
        cpu.b.dq_dtype = cpu.b.dk_dtype = cpu.b.dv_dtype = cfg->dtype;
        cpu.b.dg_dtype = cfg->g_dtype;
        cpu.b.dbeta_dtype = cfg->beta_dtype;
    }
    /* poison: every gradient element must be written */
    kda_synth_poison(cpu.dq, cpu.b.dq_dtype, cpu.nq);
    kda_synth_poison(cpu.dk, cpu.b.dk_dtype, cpu.nq);
    kda_synth_poison(cpu.dv, cpu.b.dv_dtype, cpu.nv);
    kda_synth_poison(cpu.dg, cpu.b.dg_dtype, cpu.ng);
    kda_synth_poison(cpu.dbeta, cpu.b.dbeta_dtype, cpu.nb);
    kda_synth_poison(cpu.dh0, KDA_FLOAT32, cpu.ns);
    kda_context_t *ctx = cpu_ctx(threads);
    CHECK(ctx != NULL, "no CPU context");
    kda_status_t st1 = run_backward(kda_test_reference(), &ref.b), st2 = run_backward(ctx, &cpu.b);
    CHECK(st1 == KDA_STATUS_SUCCESS && st2 == KDA_STATUS_SUCCESS, "%s: %s", kda_describe(cfg), kda_last_error());
    const double tol = grad_dtype == KDA_FLOAT32 && cfg->dtype == KDA_FLOAT32 ? CPU_TOL : 1e-2;
    struct {
        const char *name;
        const void *x;
        kda_dtype_t dt;
        const float *r;
        int64_t n;
    } out[] = {{"dq", cpu.dq, cpu.b.dq_dtype, ref.dq, cpu.nq},
               {"dk", cpu.dk, cpu.b.dk_dtype, ref.dk, cpu.nq},
               {"dv", cpu.dv, cpu.b.dv_dtype, ref.dv, cpu.nv},
               {"dg", cpu.dg, cpu.b.dg_dtype, ref.dg, cpu.ng},
               {"dbeta", cpu.dbeta, cpu.b.dbeta_dtype, ref.dbeta, cpu.nb},
               {"d_initial_state", cpu.b.d_initial_state ? cpu.dh0 : NULL, KDA_FLOAT32, ref.dh0, cpu.ns},
               {"dA_log", cpu.b.dA_log, KDA_FLOAT32, ref.dA, cfg->hv},
               {"ddt_bias", cpu.b.ddt_bias, KDA_FLOAT32, ref.ddt, (int64_t)cfg->hv * cfg->k}};
    for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) {
        if (!out[i].x || out[i].n == 0) continue;
        const double e = kda_rel_err(out[i].x, out[i].dt, out[i].r, KDA_FLOAT32, out[i].n);
        /* dA_log and ddt_bias sum dg (times λ) over every token, with cancellation: under strong decay dg is
           good to ~1e-5 and these sums to ~1e-4 (measured 8.9e-5 on bwd_cpu_t1_strong_decay) */
        const double t = i >= 6 ? 10 * tol : tol;
        CHECK(e <= t, "%s: %s relative error %.3g against the oracle (tolerance %.1g)", kda_describe(cfg),
              out[i].name, e, t);
    }
    free_case(&ref);
    free_case(&cpu);
}

static kda_synth_config_t medium(int64_t T) {
    kda_synth_config_t cfg = small(T);
    cfg.k = 32;
    cfg.v = 48;
    cfg.hqk = 2;
    cfg.hv = 2;
    cfg.seed = 5;
    return cfg;
}

TEST(bwd_cpu_plain) {
    kda_synth_config_t cfg = medium(130);
    cpu_case(&cfg, 1, 0, KDA_FLOAT32, 2);
}

TEST(bwd_cpu_training_flags) {
    kda_synth_config_t cfg = medium(100);
    cfg.batch = 2;
    cfg.l2norm = 1;
    cfg.gate = KDA_GATE_SOFTPLUS;
    cfg.beta_sigmoid = 1;
    cpu_case(&cfg, 1, 0, KDA_FLOAT32, 2);
}

TEST(bwd_cpu_lower_bound_neg_eigval_vfirst) {
    kda_synth_config_t cfg = medium(70);
    cfg.gate = KDA_GATE_LOWER_BOUND;
    cfg.beta_sigmoid = 1;
    cfg.allow_neg_eigval = 1;
    cfg.state_v_first = 1;
    cfg.initial_state_dtype = KDA_BFLOAT16;
    cpu_case(&cfg, 1, 0, KDA_FLOAT32, 3);
}

TEST(bwd_cpu_gva4_varlen_empty) {
    static const int64_t lens[] = {65, 0, 1, 130, 0, 17};
    kda_synth_config_t cfg = medium(0);
    cfg.num_seqs = 6;
    cfg.seqlens = lens;
    cfg.hqk = 1;
    cfg.hv = 4;
    cfg.l2norm = 1;
    cfg.gate = KDA_GATE_LOWER_BOUND_NO_A;
    cpu_case(&cfg, 1, 0, KDA_FLOAT32, 2);
}

TEST(bwd_cpu_state_pool_no_dht) {
    static const int64_t lens[] = {40, 3, 77};
    kda_synth_config_t cfg = medium(0);
    cfg.num_seqs = 3;
    cfg.seqlens = lens;
    cpu_case(&cfg, 0, 1, KDA_FLOAT32, 2);
}

TEST(bwd_cpu_t1_strong_decay) {
    kda_synth_config_t cfg = medium(1);
    cfg.decay = 30.0f;
    cpu_case(&cfg, 1, 0, KDA_FLOAT32, 1);
    cfg = medium(93);
    cfg.decay = 30.0f;
    cfg.gate = KDA_GATE_SOFTPLUS;
    cpu_case(&cfg, 1, 0, KDA_FLOAT32, 2);
}

TEST(bwd_cpu_bf16_inputs_and_gradients) {
    kda_synth_config_t cfg = medium(80);
    cfg.dtype = cfg.g_dtype = cfg.beta_dtype = cfg.o_dtype = KDA_BFLOAT16;
    cfg.l2norm = 1;
    cfg.gate = KDA_GATE_SOFTPLUS;
    cfg.beta_sigmoid = 1;
    cpu_case(&cfg, 1, 0, KDA_BFLOAT16, 2);
}

/* Head sizes: the largest (256), K = V = 128 as models use, and K = V = 1. */
TEST(bwd_cpu_head_sizes) {
    static const int kv[3][3] = {{256, 32, 40}, {128, 128, 70}, {1, 1, 20}};
    for (int i = 0; i < 3; i++) {
        kda_synth_config_t cfg = medium(kv[i][2]);
        cfg.k = kv[i][0];
        cfg.v = kv[i][1];
        cfg.l2norm = cfg.k > 1;
        cfg.gate = KDA_GATE_SOFTPLUS;
        cfg.beta_sigmoid = 1;
        cpu_case(&cfg, 1, 0, KDA_FLOAT32, 2);
    }
}

/* Two identical calls give identical bytes, whatever the thread count. */
TEST(bwd_cpu_deterministic) {
    kda_synth_config_t cfg = medium(90);
    cfg.batch = 3;
    cfg.hqk = 1;
    cfg.hv = 3;
    cfg.gate = KDA_GATE_SOFTPLUS;
    case_t x, y;
    make_case(&x, &cfg, 1, 0);
    make_case(&y, &cfg, 1, 0);
    CHECK(run_backward(cpu_ctx(3), &x.b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(run_backward(cpu_ctx(2), &y.b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(memcmp(x.dq, y.dq, (size_t)x.nq * 4) == 0, "dq differs between two calls");
    CHECK(memcmp(x.dg, y.dg, (size_t)x.ng * 4) == 0, "dg differs between two calls");
    CHECK(memcmp(x.dA, y.dA, (size_t)cfg.hv * 4) == 0, "dA_log differs between two calls");
    CHECK(memcmp(x.ddt, y.ddt, (size_t)cfg.hv * cfg.k * 4) == 0, "ddt_bias differs between two calls");
    free_case(&x);
    free_case(&y);
}

/* ---------------------------------------------------------------------------------------------------------
 * The non-finite contract in the backward (docs/ALGORITHM.md §7): both backward backends set a column of the
 * initial state holding an inf or NaN to NaN, as the forward does, then differentiate. Column j of every S_t
 * is then NaN, so the gradients that pass through S — dq, dk, dg, dβ of every token of that (sequence, head),
 * and its dA_log, ddt_bias — are NaN, while dv and d_initial_state (the backward's dS never reads S) and every
 * other head and sequence are exactly the clean run's; +inf, −inf and NaN give the same bytes.
 * ------------------------------------------------------------------------------------------------------- */
static void nonfinite_state_case(int v_first, int pool) {
    static const int64_t lens[] = {70, 9};
    kda_synth_config_t cfg = medium(0);
    cfg.num_seqs = 2;
    cfg.seqlens = lens;
    cfg.state_v_first = v_first;
    cfg.gate = KDA_GATE_SOFTPLUS;
    cfg.l2norm = 1;
    const int K = cfg.k, V = cfg.v, HQK = cfg.hqk, HV = cfg.hv, G = HV / HQK;
    static const float values[] = {INFINITY, -INFINITY, NAN};
    for (int be = 0; be < 2; be++) {
        kda_context_t *ctx = be ? cpu_ctx(2) : kda_test_reference();
        const char *name = be ? "cpu" : "reference";
        case_t clean, first;
        make_case(&clean, &cfg, 1, pool);
        CHECK(run_backward(ctx, &clean.b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        for (int vi = 0; vi < 3; vi++) {
            case_t x;
            make_case(&x, &cfg, 1, pool);
            const int64_t slot = pool ? x.idx[0] : 0, i = 3, j = 7; /* sequence 0, head 0, element (3, 7) */
            const int64_t at = slot * HV * K * V + (v_first ? j * K + i : i * V + j);
            kda_store_f32((void *)x.a.initial_state, cfg.initial_state_dtype, at, values[vi]);
            CHECK(run_backward(ctx, &x.b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
            const int64_t T0 = lens[0]; /* the tokens of sequence 0 */
            struct {
                const char *name;
                const float *x, *c;
                int64_t n, per_tok, heads, width; /* per token: heads × width; per_tok 0: not per token */
                int qk;                           /* indexed by query/key head */
            } out[] = {{"dq", x.dq, clean.dq, x.nq, 1, HQK, K, 1},    {"dk", x.dk, clean.dk, x.nq, 1, HQK, K, 1},
                       {"dv", x.dv, clean.dv, x.nv, 1, HV, V, 0},     {"dg", x.dg, clean.dg, x.ng, 1, HV, K, 0},
                       {"dbeta", x.dbeta, clean.dbeta, x.nb, 1, HV, 1, 0},
                       {"d_initial_state", x.dh0, clean.dh0, x.ns, 0, 0, 0, 0},
                       {"dA_log", x.dA, clean.dA, HV, 0, 0, 0, 0},   {"ddt_bias", x.ddt, clean.ddt, (int64_t)HV * K, 0, 0, 0, 0}};
            for (size_t o = 0; o < sizeof out / sizeof out[0]; o++) {
                int64_t wrong = 0, first_bad = -1;
                for (int64_t e = 0; e < out[o].n; e++) {
                    int want_nan;
                    if (out[o].per_tok) {
                        const int64_t t = e / (out[o].heads * out[o].width), hh = e / out[o].width % out[o].heads;
                        /* value head 0 reads query/key head 0 */
                        want_nan = o != 2 && t < T0 && (out[o].qk ? hh == 0 / G : hh == 0);
                    } else {
                        want_nan = o == 6 ? e == 0 : o == 7 ? e < K : 0; /* dA_log[0], ddt_bias[0, :] */
                    }
                    const int ok = want_nan ? isnan(out[o].x[e]) : memcmp(out[o].x + e, out[o].c + e, 4) == 0;
                    if (!ok && first_bad < 0) first_bad = e;
                    wrong += !ok;
                }
                CHECK(wrong == 0, "%s, initial state %g at (3, 7) of head 0 (%s%s): %s: %lld elements wrong (element "
                      "%lld: %g, clean %g)", name, (double)values[vi], v_first ? "V-first" : "K-first",
                      pool ? ", pool" : "", out[o].name, (long long)wrong, (long long)first_bad,
                      first_bad >= 0 ? (double)out[o].x[first_bad] : 0.0,
                      first_bad >= 0 ? (double)out[o].c[first_bad] : 0.0);
            }
            if (vi == 0) {
                first = x;
                continue;
            }
            /* ±inf and NaN: the same bytes (the column is NaN before anything is computed) */
            CHECK(memcmp(x.dq, first.dq, (size_t)x.nq * 4) == 0 && memcmp(x.dk, first.dk, (size_t)x.nq * 4) == 0 &&
                      memcmp(x.dg, first.dg, (size_t)x.ng * 4) == 0 && memcmp(x.dA, first.dA, (size_t)HV * 4) == 0,
                  "%s: initial state %g and inf give different gradients", name, (double)values[vi]);
            free_case(&x);
        }
        free_case(&first);
        free_case(&clean);
    }
}

TEST(bwd_nonfinite_initial_state_kfirst) { nonfinite_state_case(0, 0); }
TEST(bwd_nonfinite_initial_state_vfirst_pool) { nonfinite_state_case(1, 1); }

/* ---------------------------------------------------------------------------------------------------------
 * Bad input: one argument broken; the status, the message names the argument, no gradient byte written
 * ------------------------------------------------------------------------------------------------------- */
static void expect_bad(void (*mutate)(case_t *), kda_status_t want, const char *arg) {
    static const int64_t lens[] = {5, 0, 20};
    kda_synth_config_t cfg = small(0);
    cfg.num_seqs = 3;
    cfg.seqlens = lens;
    cfg.hqk = 1;
    cfg.hv = 2;
    cfg.gate = KDA_GATE_SOFTPLUS;
    kda_context_t *ctxs[2] = {cpu_ctx(2), kda_test_reference()};
    for (int i = 0; i < 2; i++) {
        case_t c;
        make_case(&c, &cfg, 1, 0);
        float *outs[] = {c.dq, c.dk, c.dv, c.dg, c.dbeta, c.dh0, c.dA, c.ddt};
        const int64_t ns[] = {c.nq, c.nq, c.nv, c.ng, c.nb, c.ns, cfg.hv, (int64_t)cfg.hv * cfg.k};
        for (int j = 0; j < 8; j++) memset(outs[j], 0x5a, (size_t)ns[j] * 4);
        size_t ws = 0;
        CHECK(kda_backward_workspace_size(ctxs[i], &c.b, &ws) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        char *w = malloc(ws + 64);
        size_t ws_bytes = ws;
        mutate(&c);
        if (c.b.struct_size == 1) { /* the workspace case */
            c.b.struct_size = sizeof(kda_backward_args_t);
            ws_bytes = ws - 1;
        }
        const kda_status_t st = kda_backward(ctxs[i], &c.b, w, ws_bytes, NULL);
        CHECK(st == want, "%s backend: status %s, expected %s (%s)", i ? "reference" : "cpu",
              kda_status_string(st), kda_status_string(want), kda_last_error());
        char quoted[64];
        snprintf(quoted, sizeof quoted, "'%s'", arg);
        CHECK(strstr(kda_last_error(), quoted) != NULL, "message does not name %s: %s", quoted, kda_last_error());
        for (int j = 0; j < 8; j++) {
            int same = 1;
            for (int64_t e = 0; e < ns[j] * 4; e++) same &= ((unsigned char *)outs[j])[e] == 0x5a;
            CHECK(same, "output %d was written on error", j);
        }
        free(w);
        free_case(&c);
    }
}

#define BAD(name, status, arg, ...)                                                                         \
    static void mutate_##name(case_t *c) { __VA_ARGS__; }                                                   \
    TEST(name) { expect_bad(mutate_##name, status, arg); }
#define INVALID KDA_STATUS_INVALID_VALUE

BAD(bad_bwd_problem_null, INVALID, "problem", c->b.problem = NULL)
BAD(bad_bwd_forward_argument, INVALID, "head_dim_k", c->a.head_dim_k = 0)
BAD(bad_bwd_d_o_null, INVALID, "d_o", c->b.d_o = NULL)
BAD(bad_bwd_d_o_dtype, INVALID, "d_o_dtype", c->b.d_o_dtype = KDA_INT32)
BAD(bad_bwd_d_final_state_dtype, INVALID, "d_final_state_dtype", c->b.d_final_state_dtype = KDA_FLOAT16)
BAD(bad_bwd_dq_null, INVALID, "dq", c->b.dq = NULL)
BAD(bad_bwd_dk_null, INVALID, "dk", c->b.dk = NULL)
BAD(bad_bwd_dv_null, INVALID, "dv", c->b.dv = NULL)
BAD(bad_bwd_dg_null, INVALID, "dg", c->b.dg = NULL)
BAD(bad_bwd_dbeta_null, INVALID, "dbeta", c->b.dbeta = NULL)
BAD(bad_bwd_dq_dtype, INVALID, "dq_dtype", c->b.dq_dtype = KDA_BFLOAT16)
BAD(bad_bwd_dg_dtype, INVALID, "dg_dtype", c->b.dg_dtype = KDA_INT64)
BAD(bad_bwd_d_initial_state_dtype, INVALID, "d_initial_state_dtype", c->b.d_initial_state_dtype = KDA_FLOAT16)
BAD(bad_bwd_d_initial_state_without_initial_state, INVALID, "d_initial_state", c->a.initial_state = NULL)
BAD(bad_bwd_da_log_without_a_log, INVALID, "dA_log", {
    c->a.use_gate_in_kernel = 0;
    c->a.A_log = NULL;
    c->a.dt_bias = NULL;
})
BAD(bad_bwd_ddt_bias_without_dt_bias, INVALID, "ddt_bias", c->a.dt_bias = NULL)
BAD(bad_bwd_dv_is_v, INVALID, "dv", c->b.dv = (void *)c->a.v)
BAD(bad_bwd_dk_overlaps_dq, INVALID, "dk", c->b.dk = (char *)c->b.dq + 4)
BAD(bad_bwd_dg_overlaps_d_o, INVALID, "dg", c->b.dg = (char *)c->d_o + 8)
BAD(bad_bwd_dbeta_overlaps_saved, INVALID, "dbeta", { c->a.saved = c->b.dbeta; c->a.saved_bytes = 8; })
BAD(bad_bwd_saved_bytes_without_saved, INVALID, "saved_bytes", c->a.saved_bytes = 64)
BAD(bad_bwd_d_initial_state_is_initial_state, INVALID, "d_initial_state",
    c->b.d_initial_state = (void *)c->a.initial_state)
BAD(bad_bwd_struct_size_newer, KDA_STATUS_NOT_SUPPORTED, "struct_size", c->b.struct_size += 8)
BAD(bad_bwd_struct_size_zero, INVALID, "struct_size", c->b.struct_size = 0)
BAD(bad_bwd_workspace_too_small, KDA_STATUS_INSUFFICIENT_WORKSPACE, "workspace_bytes", c->b.struct_size = 1)

/* No tokens: nothing is required but the problem; d_initial_state = d_final_state. */
TEST(bwd_empty_sequences_only) {
    static const int64_t lens[] = {0, 0};
    kda_synth_config_t cfg = small(0);
    cfg.num_seqs = 2;
    cfg.seqlens = lens;
    case_t c;
    make_case(&c, &cfg, 1, 0);
    c.b.d_o = c.b.dq = c.b.dk = c.b.dv = c.b.dg = c.b.dbeta = NULL;
    for (int i = 0; i < 2; i++) {
        memset(c.dh0, 0, (size_t)c.ns * 4);
        CHECK(run_backward(i ? kda_test_reference() : cpu_ctx(2), &c.b) == KDA_STATUS_SUCCESS, "%s",
              kda_last_error());
        CHECK(memcmp(c.dh0, c.dht, (size_t)c.ns * 4) == 0, "d_initial_state != d_final_state with no tokens");
    }
    free_case(&c);
}
