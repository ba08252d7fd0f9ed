/*
 * forward.c — the README's C example as a whole program: one chunked KDA forward pass through the public API,
 * checked against the fp64 reference backend.
 *
 *   forward [auto|cpu|cuda]      (default auto: CUDA device 0 when usable, else the CPU)
 *
 * What it shows:
 *   - every call's status is checked, and kda_last_error() printed on failure (it names the argument at fault);
 *   - where the pointers live: host memory for the CPU and reference backends, device memory for CUDA. With
 *     KDA_BACKEND_AUTO, kda_get_backend() says which backend was chosen, and the buffers are allocated there
 *     (this program copies its host data to the GPU when AUTO chose CUDA);
 *   - the workspace is asked for first, allocated by the caller, and reused across calls;
 *   - everything is freed, on every path.
 *
 * Build it against an installed libkda (see examples/CMakeLists.txt for CMake):
 *   cc forward.c $(pkg-config --cflags --libs kda) -o forward                      (libkda.so; see README: RPATH)
 *   cc forward.c -DKDA_EXAMPLE_CUDA $(pkg-config --cflags --libs kda) -lcudart ...  (to run on CUDA too)
 * Without KDA_EXAMPLE_CUDA the program cannot allocate GPU memory, so when AUTO chooses CUDA it creates a CPU
 * context instead and says so.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kda.h>

#include "example_util.h" /* CHECK_KDA; mem_alloc, mem_free, mem_upload, mem_download; uniform */

/* The problem: B sequences of T tokens, HQK query/key heads, HV value heads (GVA: HV a multiple of HQK). */
enum { B = 2, T = 100, HQK = 2, HV = 4, K = 64, V = 64 };

/* One forward pass on `ctx` (backend `be`) over host inputs; the output is copied back into o_host. */
static int run_forward(kda_context_t *ctx, kda_backend_t be, const float *const host[5], const size_t bytes[5],
                       float *o_host, size_t o_bytes, float *ht_host, size_t ht_bytes) {
    int rc = 1;
    void *dev[5] = {NULL, NULL, NULL, NULL, NULL};
    void *o = NULL, *ht = NULL, *ws = NULL;
    for (int i = 0; i < 5; i++)
        if (!(dev[i] = mem_upload(be, host[i], bytes[i]))) {
            fprintf(stderr, "could not allocate or copy input %d on the %s backend\n", i, kda_backend_name(be));
            goto done;
        }
    o = mem_alloc(be, o_bytes);
    ht = mem_alloc(be, ht_bytes);
    if (!o || !ht) {
        fprintf(stderr, "could not allocate the outputs\n");
        goto done;
    }

    kda_args_t a;
    kda_args_init(&a); /* the defaults; sets a.struct_size */
    a.batch = B;
    a.seq_len = T;
    a.num_qk_heads = HQK;
    a.num_v_heads = HV;
    a.head_dim_k = K;
    a.head_dim_v = V;
    a.dtype = KDA_FLOAT32; /* q, k, v (KDA_BFLOAT16 and KDA_FLOAT16 too) */
    a.q = dev[0];          /* [B, T, HQK, K] */
    a.k = dev[1];          /* [B, T, HQK, K] */
    a.v = dev[2];          /* [B, T, HV, V] */
    a.g = dev[3];          /* [B, T, HV, K]: log decay (natural log, <= 0) */
    a.g_dtype = KDA_FLOAT32;
    a.beta = dev[4]; /* [B, T, HV]: logits, through the in-kernel sigmoid below */
    a.beta_dtype = KDA_FLOAT32;
    a.o = o; /* [B, T, HV, V] */
    a.o_dtype = KDA_FLOAT32;
    a.final_state = ht; /* [B, HV, K, V] float32; initial_state NULL: start from zeros */
    a.use_qk_l2norm = 1;
    a.use_beta_sigmoid = 1;

    size_t ws_bytes = 0;
    CHECK_KDA(kda_forward_workspace_size(ctx, &a, &ws_bytes));
    if (ws_bytes && !(ws = mem_alloc(be, ws_bytes))) { /* on CUDA: device memory; keep it across calls */
        fprintf(stderr, "could not allocate %zu bytes of workspace\n", ws_bytes);
        goto done;
    }
    CHECK_KDA(kda_forward(ctx, &a, ws, ws_bytes, NULL)); /* stream NULL: CUDA's default stream */
    if (mem_download(be, o_host, o, o_bytes) || mem_download(be, ht_host, ht, ht_bytes)) {
        fprintf(stderr, "could not copy the results back\n");
        goto done;
    }
    rc = 0;
done:
    mem_free(be, ws);
    mem_free(be, o);
    mem_free(be, ht);
    for (int i = 0; i < 5; i++) mem_free(be, dev[i]);
    return rc;
}

int main(int argc, char **argv) {
    kda_backend_t want = KDA_BACKEND_AUTO;
    if (argc > 1) {
        if (!strcmp(argv[1], "cpu")) want = KDA_BACKEND_CPU;
        else if (!strcmp(argv[1], "cuda")) want = KDA_BACKEND_CUDA;
        else if (strcmp(argv[1], "auto")) {
            fprintf(stderr, "usage: %s [auto|cpu|cuda]\n", argv[0]);
            return 2;
        }
    }
    printf("libkda %d.%d.%d (header %d.%d.%d)\n", kda_version() / 10000, kda_version() / 100 % 100,
           kda_version() % 100, KDA_VERSION_MAJOR, KDA_VERSION_MINOR, KDA_VERSION_PATCH);

    int rc = 1;
    kda_context_t *ctx = NULL, *ref = NULL;
    float *host[5] = {NULL, NULL, NULL, NULL, NULL};
    float *o = NULL, *ht = NULL, *o_ref = NULL, *ht_ref = NULL;
    const size_t n[5] = {(size_t)B * T * HQK * K, (size_t)B * T * HQK * K, (size_t)B * T * HV * V,
                         (size_t)B * T * HV * K, (size_t)B * T * HV};
    size_t bytes[5];
    const size_t o_bytes = sizeof(float) * B * T * HV * V, ht_bytes = sizeof(float) * B * HV * K * V;

    CHECK_KDA(kda_create(&ctx, want, 0));
    kda_backend_t be;
    CHECK_KDA(kda_get_backend(ctx, &be)); /* AUTO: which one, so the buffers go where it reads them */
    if (want == KDA_BACKEND_AUTO && be != KDA_BACKEND_CUDA)
        printf("AUTO chose %s (CUDA not used: %s)\n", kda_backend_name(be), kda_last_error());
#ifndef KDA_EXAMPLE_CUDA
    if (be == KDA_BACKEND_CUDA) { /* this build of the example cannot allocate GPU memory */
        printf("AUTO chose cuda, but this program was built without KDA_EXAMPLE_CUDA: using the CPU instead\n");
        CHECK_KDA(kda_destroy(ctx));
        ctx = NULL;
        CHECK_KDA(kda_create(&ctx, KDA_BACKEND_CPU, 0));
        be = KDA_BACKEND_CPU;
    }
#endif
    printf("backend %s: pointers are %s memory\n", kda_backend_name(be), be == KDA_BACKEND_CUDA ? "device" : "host");

    unsigned seed = 1;
    for (int i = 0; i < 5; i++) {
        bytes[i] = sizeof(float) * n[i];
        if (!(host[i] = malloc(bytes[i]))) goto oom;
        for (size_t j = 0; j < n[i]; j++) host[i][j] = uniform(&seed);
    }
    for (size_t j = 0; j < n[3]; j++) host[3][j] = -0.05f - 0.1f * (host[3][j] + 1.0f); /* g in (-0.25, -0.05] */
    o = malloc(o_bytes);
    ht = malloc(ht_bytes);
    o_ref = malloc(o_bytes);
    ht_ref = malloc(ht_bytes);
    if (!o || !ht || !o_ref || !ht_ref) goto oom;

    if (run_forward(ctx, be, (const float *const *)host, bytes, o, o_bytes, ht, ht_bytes)) goto done;

    /* the same problem on the fp64 oracle (host memory) */
    CHECK_KDA(kda_create(&ref, KDA_BACKEND_REFERENCE, 0));
    if (run_forward(ref, KDA_BACKEND_REFERENCE, (const float *const *)host, bytes, o_ref, o_bytes, ht_ref, ht_bytes))
        goto done;
    /* error relative to the largest reference value, of o and of the final state; CUDA computes with bf16
     * tensor-core products, hence its wider tolerance (a wrong result is off by ~100%) */
    double err_o = 0, max_o = 0, err_h = 0, max_h = 0;
    for (size_t j = 0; j < o_bytes / sizeof(float); j++) {
        err_o = fmax(err_o, fabs((double)o[j] - o_ref[j]));
        max_o = fmax(max_o, fabs((double)o_ref[j]));
    }
    for (size_t j = 0; j < ht_bytes / sizeof(float); j++) {
        err_h = fmax(err_h, fabs((double)ht[j] - ht_ref[j]));
        max_h = fmax(max_h, fabs((double)ht_ref[j]));
    }
    const double tol = be == KDA_BACKEND_CUDA ? 2e-2 : 1e-4;
    err_o /= fmax(max_o, 1e-30);
    err_h /= fmax(max_h, 1e-30);
    printf("B %d T %d HQK %d HV %d K %d V %d: o[0] = %.6f; max error / max |ref|: o %.3g, final state %.3g "
           "(tolerance %g)\n", B, T, HQK, HV, K, V, o[0], err_o, err_h, tol);
    rc = err_o <= tol && err_h <= tol ? 0 : 1;
    if (rc) fprintf(stderr, "the %s backend disagrees with the reference\n", kda_backend_name(be));
    goto done;
oom:
    fprintf(stderr, "out of host memory\n");
done:
    for (int i = 0; i < 5; i++) free(host[i]);
    free(o);
    free(ht);
    free(o_ref);
    free(ht_ref);
    kda_destroy(ref);
    kda_destroy(ctx);
    return rc;
}
