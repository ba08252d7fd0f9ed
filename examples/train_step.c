/*
 * train_step.c — one training step through the public API: kda_forward keeping what kda_backward reuses
 * (kda_args_t.saved), then kda_backward for the gradients of every input, checked against the fp64 reference
 * backend's backward.
 *
 *   train_step [cpu|cuda]        (default cpu; cuda needs a build with KDA_EXAMPLE_CUDA and a GPU: without one
 *                                 it says why and exits with 77, CTest's "skipped")
 *
 * What it shows, beyond examples/forward.c:
 *   - the backward has its own struct, kda_backward_args_t, which points at the forward's kda_args_t: the same
 *     sizes, inputs and options (its o and final_state are not read);
 *   - kda_forward_saved_size says how much the forward keeps for the backward (the CUDA backend: its chunk blocks,
 *     ~1.1 KB per token and value head at K = V = 128; the CPU backends: nothing, 0 bytes). Give the forward that
 *     memory in args.saved, leave it unchanged, and the backward, reading the same args, skips recomputing it;
 *   - every gradient the options make: dq, dk, dv, dg (of the raw gate input with use_gate_in_kernel), dbeta (of
 *     the logit with use_beta_sigmoid), d_initial_state, dA_log, ddt_bias.
 *
 * Build it as examples/forward.c (see examples/CMakeLists.txt); CTest runs it: example_train_step.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kda.h>

#include "example_util.h" /* CHECK_KDA; mem_alloc, mem_free, mem_upload, mem_download; uniform */

/* The problem: B sequences of T tokens, HQK query/key heads, HV value heads (GVA: HV a multiple of HQK). */
enum { B = 2, T = 100, HQK = 2, HV = 4, K = 64, V = 64 };

/* Host data: the inputs (q k v g beta h0 A_log dt_bias), the loss weights (d_o, d_final_state) and, after a
 * step, the gradients (dq dk dv dg dbeta dh0 dA_log ddt_bias), all float32. */
enum { IN_N = 8, W_N = 2, G_N = 8 };
static const size_t in_n[IN_N] = {(size_t)B * T * HQK * K, (size_t)B * T * HQK * K, (size_t)B * T * HV * V,
                                  (size_t)B * T * HV * K,  (size_t)B * T * HV,       (size_t)B * HV * K * V,
                                  HV,                      (size_t)HV * K};
static const size_t w_n[W_N] = {(size_t)B * T * HV * V, (size_t)B * HV * K * V};
static const size_t g_n[G_N] = {(size_t)B * T * HQK * K, (size_t)B * T * HQK * K, (size_t)B * T * HV * V,
                                (size_t)B * T * HV * K,  (size_t)B * T * HV,       (size_t)B * HV * K * V,
                                HV,                      (size_t)HV * K};
static const char *g_name[G_N] = {"dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias"};

/* One step on `ctx` (backend `be`): forward, backward; the gradients copied back into grad[]. */
static int run_step(kda_context_t *ctx, kda_backend_t be, float *const in[IN_N], float *const w[W_N],
                    float *grad[G_N]) {
    int rc = 1;
    void *d_in[IN_N] = {0}, *d_w[W_N] = {0}, *d_g[G_N] = {0};
    void *o = NULL, *ht = NULL, *saved = NULL, *ws = NULL;
    for (int i = 0; i < IN_N; i++)
        if (!(d_in[i] = mem_upload(be, in[i], in_n[i] * sizeof(float)))) goto nomem;
    for (int i = 0; i < W_N; i++)
        if (!(d_w[i] = mem_upload(be, w[i], w_n[i] * sizeof(float)))) goto nomem;
    for (int i = 0; i < G_N; i++)
        if (!(d_g[i] = mem_alloc(be, g_n[i] * sizeof(float)))) goto nomem;
    if (!(o = mem_alloc(be, w_n[0] * sizeof(float))) || !(ht = mem_alloc(be, w_n[1] * sizeof(float)))) goto nomem;

    /* ---- the forward, as in examples/forward.c, with the in-kernel options a Kimi-Linear layer uses ---- */
    kda_args_t a;
    kda_args_init(&a);
    a.batch = B;
    a.seq_len = T;
    a.num_qk_heads = HQK;
    a.num_v_heads = HV;
    a.head_dim_k = K;
    a.head_dim_v = V;
    a.dtype = a.g_dtype = a.beta_dtype = a.o_dtype = KDA_FLOAT32;
    a.q = d_in[0];
    a.k = d_in[1];
    a.v = d_in[2];
    a.g = d_in[3]; /* the raw gate input: use_gate_in_kernel below */
    a.beta = d_in[4];
    a.initial_state = d_in[5]; /* [B, HV, K, V] float32 */
    a.A_log = (const float *)d_in[6];
    a.dt_bias = (const float *)d_in[7];
    a.o = o;
    a.final_state = ht;
    a.use_qk_l2norm = 1;
    a.use_gate_in_kernel = 1; /* log decay = -exp(A_log[h]) * softplus(g + dt_bias[h, :]) */
    a.use_beta_sigmoid = 1;

    size_t saved_bytes = 0, ws_bytes = 0;
    CHECK_KDA(kda_forward_saved_size(ctx, &a, &saved_bytes));
    if (saved_bytes) { /* kept from the forward to the backward; per training step, not per call */
        if (!(saved = mem_alloc(be, saved_bytes))) goto nomem;
        a.saved = saved;
        a.saved_bytes = saved_bytes;
    }
    CHECK_KDA(kda_forward_workspace_size(ctx, &a, &ws_bytes));
    if (ws_bytes && !(ws = mem_alloc(be, ws_bytes))) goto nomem;
    CHECK_KDA(kda_forward(ctx, &a, ws, ws_bytes, NULL));
    mem_free(be, ws); /* the workspace is scratch: nothing in it survives the call */
    ws = NULL;

    /* ---- the backward: d_o = ∂L/∂o, d_final_state = ∂L/∂final_state; the same args (saved included) ---- */
    kda_backward_args_t b;
    kda_backward_args_init(&b);
    b.problem = &a;
    b.d_o = d_w[0];
    b.d_o_dtype = KDA_FLOAT32;
    b.d_final_state = d_w[1];
    b.dq = d_g[0];
    b.dk = d_g[1];
    b.dv = d_g[2];
    b.dg = d_g[3];
    b.dbeta = d_g[4];
    b.dq_dtype = b.dk_dtype = b.dv_dtype = b.dg_dtype = b.dbeta_dtype = KDA_FLOAT32;
    b.d_initial_state = d_g[5];
    b.dA_log = (float *)d_g[6];
    b.ddt_bias = (float *)d_g[7];
    CHECK_KDA(kda_backward_workspace_size(ctx, &b, &ws_bytes));
    if (ws_bytes && !(ws = mem_alloc(be, ws_bytes))) goto nomem;
    CHECK_KDA(kda_backward(ctx, &b, ws, ws_bytes, NULL));
    printf("%-9s kept %zu bytes from the forward for the backward (workspace of the backward %zu bytes)\n",
           kda_backend_name(be), saved_bytes, ws_bytes);
    for (int i = 0; i < G_N; i++)
        if (mem_download(be, grad[i], d_g[i], g_n[i] * sizeof(float))) goto done;
    rc = 0;
    goto done;
nomem:
    fprintf(stderr, "could not allocate or copy a buffer on the %s backend\n", kda_backend_name(be));
done:
    mem_free(be, ws);
    mem_free(be, saved);
    mem_free(be, o);
    mem_free(be, ht);
    for (int i = 0; i < IN_N; i++) mem_free(be, d_in[i]);
    for (int i = 0; i < W_N; i++) mem_free(be, d_w[i]);
    for (int i = 0; i < G_N; i++) mem_free(be, d_g[i]);
    return rc;
}

int main(int argc, char **argv) {
    kda_backend_t want = KDA_BACKEND_CPU;
    if (argc > 1 && !strcmp(argv[1], "cuda")) want = KDA_BACKEND_CUDA;
    else if (argc > 1 && strcmp(argv[1], "cpu")) {
        fprintf(stderr, "usage: %s [cpu|cuda]\n", argv[0]);
        return 2;
    }
#ifndef KDA_EXAMPLE_CUDA
    if (want == KDA_BACKEND_CUDA) {
        fprintf(stderr, "this build of the example cannot allocate GPU memory (build it with KDA_EXAMPLE_CUDA)\n");
        return 2;
    }
#endif
    int rc = 1;
    kda_context_t *ctx = NULL, *ref = NULL;
    float *in[IN_N] = {0}, *w[W_N] = {0}, *grad[G_N] = {0}, *want_g[G_N] = {0};
    unsigned seed = 7;
    for (int i = 0; i < IN_N; i++) {
        if (!(in[i] = malloc(in_n[i] * sizeof(float)))) goto oom;
        for (size_t j = 0; j < in_n[i]; j++) in[i][j] = uniform(&seed);
    }
    for (size_t j = 0; j < in_n[5]; j++) in[5][j] *= 0.1f; /* a small initial state */
    for (int i = 0; i < W_N; i++) {
        if (!(w[i] = malloc(w_n[i] * sizeof(float)))) goto oom;
        for (size_t j = 0; j < w_n[i]; j++) w[i][j] = uniform(&seed);
    }
    for (int i = 0; i < G_N; i++)
        if (!(grad[i] = malloc(g_n[i] * sizeof(float))) || !(want_g[i] = malloc(g_n[i] * sizeof(float)))) goto oom;

    if (kda_create(&ctx, want, 0) != KDA_STATUS_SUCCESS) { /* no usable GPU, or a build without CUDA */
        printf("skipped: the %s backend is not available: %s\n", kda_backend_name(want), kda_last_error());
        rc = 77;
        goto done;
    }
    CHECK_KDA(kda_create(&ref, KDA_BACKEND_REFERENCE, 0));
    if (run_step(ctx, want, in, w, grad) || run_step(ref, KDA_BACKEND_REFERENCE, in, w, want_g)) goto done;

    /* each gradient's relative error ‖x − ref‖ / ‖ref‖ against the fp64 oracle; CUDA: tf32 and bf16 products */
    const double tol = want == KDA_BACKEND_CUDA ? 3e-2 : 1e-3;
    rc = 0;
    for (int i = 0; i < G_N; i++) {
        double e = 0, r = 0;
        for (size_t j = 0; j < g_n[i]; j++) {
            e += ((double)grad[i][j] - want_g[i][j]) * ((double)grad[i][j] - want_g[i][j]);
            r += (double)want_g[i][j] * want_g[i][j];
        }
        const double rel = sqrt(e / fmax(r, 1e-300));
        printf("%-16s relative error %.2e%s\n", g_name[i], rel, rel <= tol ? "" : "  (above the tolerance)");
        if (!(rel <= tol)) rc = 1;
    }
    printf("B %d T %d HQK %d HV %d K %d V %d on %s: %s (tolerance %g)\n", B, T, HQK, HV, K, V,
           kda_backend_name(want), rc ? "gradients disagree with the reference" : "gradients agree", tol);
    goto done;
oom:
    fprintf(stderr, "out of host memory\n");
done:
    for (int i = 0; i < IN_N; i++) free(in[i]);
    for (int i = 0; i < W_N; i++) free(w[i]);
    for (int i = 0; i < G_N; i++) {
        free(grad[i]);
        free(want_g[i]);
    }
    kda_destroy(ref);
    kda_destroy(ctx);
    return rc;
}
