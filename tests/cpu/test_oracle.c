/*
 * The oracle against results derived by hand (K = V = 2), worked out in the comments from the definition
 *     S_t = (I − β k kᵀ) Diag(α) S_{t−1} + β k vᵀ,   o_t = scale · S_tᵀ q_t.
 */
#include <math.h>
#include <string.h>

#include "compare.h"
#include "test_util.h"

/* Token 1: q = (1, 2), k = (0.6, 0.8), v = (1, -1), α = (1/2, 1/4), β = 1/2, S0 = [[1, 2], [3, 4]], scale 1.
 *   Diag(α) S0            = [[0.5, 1], [0.75, 1]]
 *   kᵀ Diag(α) S0         = 0.6 (0.5, 1) + 0.8 (0.75, 1) = (0.9, 1.4)
 *   δ = β (v − that)      = 0.5 ((1, -1) − (0.9, 1.4)) = (0.05, -1.2)
 *   S1 = Diag(α) S0 + k δᵀ = [[0.53, 0.28], [0.79, 0.04]]
 *   o1 = S1ᵀ q            = (0.53 + 1.58, 0.28 + 0.08) = (2.11, 0.36)
 * Token 2: q = (0, 1), k = (1, 0), v = (2, 0), α = (1, 1), β = 1:
 *   (I − k kᵀ) replaces row 0 of S1 by v: S2 = [[2, 0], [0.79, 0.04]];  o2 = S2ᵀ q = (0.79, 0.04)      */
static const float q_in[2][2] = {{1, 2}, {0, 1}};
static const float k_in[2][2] = {{0.6f, 0.8f}, {1, 0}};
static const float v_in[2][2] = {{1, -1}, {2, 0}};
static const float S0[4] = {1, 2, 3, 4};
static const double o_expect[2][2] = {{2.11, 0.36}, {0.79, 0.04}};
static const double S1_expect[4] = {0.53, 0.28, 0.79, 0.04};
static const double S2_expect[4] = {2, 0, 0.79, 0.04};

static void setup(kda_args_t *a, int T, float *q, float *k, float *v, float *g, float *beta, float *o, float *ht) {
    kda_args_init(a);
    a->batch = 1;
    a->seq_len = T;
    a->head_dim_k = a->head_dim_v = 2;
    a->dtype = a->g_dtype = a->beta_dtype = a->o_dtype = KDA_FLOAT32;
    a->q = q;
    a->k = k;
    a->v = v;
    a->g = g;
    a->beta = beta;
    a->o = o;
    a->initial_state = S0;
    a->final_state = ht;
    a->scale = 1.0f;
}

static void expect_vec(const float *got, const double *want, int n, double tol, const char *what) {
    for (int i = 0; i < n; i++)
        CHECK(fabs(got[i] - want[i]) <= tol, "%s[%d] = %.9g, expected %.9g", what, i, got[i], want[i]);
}

TEST(oracle_t1_hand) {
    float g[2] = {logf(0.5f), logf(0.25f)}, beta[1] = {0.5f}, o[2], ht[4];
    kda_args_t a;
    setup(&a, 1, (float *)q_in[0], (float *)k_in[0], (float *)v_in[0], g, beta, o, ht);
    CHECK(kda_run_host(kda_test_reference(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    expect_vec(o, o_expect[0], 2, 1e-6, "o1");
    expect_vec(ht, S1_expect, 4, 1e-6, "S1");
}

TEST(oracle_t2_hand) {
    float q[4] = {1, 2, 0, 1}, k[4] = {0.6f, 0.8f, 1, 0}, v[4] = {1, -1, 2, 0};
    float g[4] = {logf(0.5f), logf(0.25f), 0, 0}, beta[2] = {0.5f, 1.0f}, o[4], ht[4];
    kda_args_t a;
    setup(&a, 2, q, k, v, g, beta, o, ht);
    CHECK(kda_run_host(kda_test_reference(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    expect_vec(o, o_expect[0], 2, 1e-6, "o1");
    expect_vec(o + 2, o_expect[1], 2, 1e-6, "o2");
    expect_vec(ht, S2_expect, 4, 1e-6, "S2");
}

/* Token 1 again, through the in-kernel options:
 *   k = (3, 4) and q = (1, 2) with l2norm: k → (0.6, 0.8), q → (1, 2)/√5, so o1 = (2.11, 0.36)/√5;
 *   softplus gate with A_log = 0 (exp(A_log) = 1): g = 0 gives −log 2 (α = 1/2), g = log 3 gives −log 4;
 *   beta logit 0 with the sigmoid: β = 1/2. */
TEST(oracle_t1_in_kernel_options) {
    float q[2] = {1, 2}, k[2] = {3, 4}, g[2] = {0.0f, logf(3.0f)}, beta[1] = {0.0f}, o[2], ht[4];
    float A_log[1] = {0.0f};
    kda_args_t a;
    setup(&a, 1, q, k, (float *)v_in[0], g, beta, o, ht);
    a.use_qk_l2norm = 1;
    a.use_gate_in_kernel = 1;
    a.A_log = A_log;
    a.use_beta_sigmoid = 1;
    CHECK(kda_run_host(kda_test_reference(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    const double r5 = 1.0 / sqrt(5.0);
    const double want[2] = {2.11 * r5, 0.36 * r5};
    expect_vec(o, want, 2, 1e-6, "o1");
    expect_vec(ht, S1_expect, 4, 1e-6, "S1");
}

/* The lower-bound gate without A_log: gate = lb · sigmoid(g). With lb = −4 log 2: g = log(1/3) gives
 * sigmoid = 1/4, gate = −log 2 (α = 1/2); g = 0 gives sigmoid = 1/2, gate = −2 log 2 (α = 1/4).
 * allow_neg_eigval: β = 2 sigmoid(beta); beta = log(1/3) gives 2 · 1/4 = 1/2. Same S1, o1. */
TEST(oracle_t1_lower_bound_and_neg_eigval) {
    float g[2] = {logf(1.0f / 3.0f), 0.0f}, beta[1] = {logf(1.0f / 3.0f)}, o[2], ht[4];
    kda_args_t a;
    setup(&a, 1, (float *)q_in[0], (float *)k_in[0], (float *)v_in[0], g, beta, o, ht);
    a.use_gate_in_kernel = 1;
    a.lower_bound = -4.0f * logf(2.0f);
    a.use_beta_sigmoid = 1;
    a.allow_neg_eigval = 1;
    CHECK(kda_run_host(kda_test_reference(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    expect_vec(o, o_expect[0], 2, 1e-6, "o1");
    expect_vec(ht, S1_expect, 4, 1e-6, "S1");
}

/* V-first state layout: S0 and S1 transposed; default scale K^-1/2 = 1/√2 on o. */
TEST(oracle_t1_state_v_first_default_scale) {
    float g[2] = {logf(0.5f), logf(0.25f)}, beta[1] = {0.5f}, o[2], ht[4];
    float S0t[4] = {1, 3, 2, 4};
    kda_args_t a;
    setup(&a, 1, (float *)q_in[0], (float *)k_in[0], (float *)v_in[0], g, beta, o, ht);
    a.initial_state = S0t;
    a.state_v_first = 1;
    a.scale = 0.0f;
    CHECK(kda_run_host(kda_test_reference(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    const double r2 = 1.0 / sqrt(2.0);
    const double want[2] = {2.11 * r2, 0.36 * r2};
    const double S1t[4] = {0.53, 0.79, 0.28, 0.04};
    expect_vec(o, want, 2, 1e-6, "o1");
    expect_vec(ht, S1t, 4, 1e-6, "S1 (V-first)");
}
