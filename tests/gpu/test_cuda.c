/*
 * CUDA backend against the fp64 oracle. Every case: fresh random inputs, outputs poisoned (NaN) on the device
 * before the call, relative error of o and of the final state, and a count of unwritten / non-finite values.
 * Skipped (exit 77) where the build or the machine has no usable CUDA device.
 *
 * Each case prints one line "case ... o_err ... state_err ..." so that a run's log is the accuracy table.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "contract.h"
#include "dtype.h"
#include "internal.h"
#include "test_util.h"

#ifdef KDA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "gpu_util.h"

/* The CUDA context of every case. KDA_TEST_BV (a setting of this test program, not of the library) forces the
 * recurrence's tile width through the internal tuning, e.g. for sanitizer runs of each tiling. */
static kda_context_t *gpu(void) {
    static kda_context_t *ctx;
    if (!ctx) {
        if (kda_create(&ctx, KDA_BACKEND_CUDA, 0) != KDA_STATUS_SUCCESS) SKIP("no CUDA device: %s", kda_last_error());
        const char *bv = getenv("KDA_TEST_BV");
        if (bv) {
            kda_tuning_t t = {0};
            t.bv = atoi(bv);
            kda_set_tuning(ctx, &t);
        }
    }
    return ctx;
}


/* A synthetic problem mirrored on the device. */
typedef struct {
    kda_synth_t s;
    kda_args_t host, dev;
    size_t ws_bytes;
    void *ws;
} dproblem_t;

static void dproblem_make(dproblem_t *d, const kda_synth_config_t *c) {
    (void)gpu(); /* skips the case where no device is usable */
    memset(d, 0, sizeof *d);
    if (kda_synth_make(c, &d->s, &d->host) != 0) exit(1);
    kda_args_t a = d->host;
    const kda_synth_t *s = &d->s;
    a.q = to_dev(s->q, s->q_bytes);
    a.k = to_dev(s->k, s->q_bytes);
    a.v = to_dev(s->v, s->v_bytes);
    a.g = to_dev(s->g, s->g_bytes);
    a.beta = to_dev(s->beta, s->beta_bytes);
    a.o = to_dev(s->o, s->o_bytes); /* poisoned by the synthesiser */
    if (d->host.initial_state) a.initial_state = to_dev(s->h0, s->h0_bytes);
    if (d->host.final_state) a.final_state = to_dev(s->ht, s->ht_bytes);
    if (d->host.A_log) a.A_log = (const float *)to_dev(s->A_log, sizeof(float) * (size_t)c->hv);
    if (d->host.dt_bias) a.dt_bias = (const float *)to_dev(s->dt_bias, sizeof(float) * (size_t)c->hv * (size_t)c->k);
    if (d->host.cu_seqlens) {
        a.cu_seqlens = to_dev(s->cu_seqlens, sizeof(int64_t) * (size_t)(s->num_seqs + 1));
        a.cu_seqlens_host = s->cu_seqlens;
    }
    d->dev = a;
}

static void dproblem_free(dproblem_t *d) {
    cudaFree((void *)d->dev.q);
    cudaFree((void *)d->dev.k);
    cudaFree((void *)d->dev.v);
    cudaFree((void *)d->dev.g);
    cudaFree((void *)d->dev.beta);
    cudaFree(d->dev.o);
    cudaFree((void *)d->dev.initial_state);
    cudaFree(d->dev.final_state);
    cudaFree((void *)d->dev.A_log);
    cudaFree((void *)d->dev.dt_bias);
    cudaFree((void *)d->dev.cu_seqlens);
    cudaFree(d->ws);
    kda_synth_free(&d->s);
}

static kda_status_t dproblem_run(dproblem_t *d, cudaStream_t stream) {
    size_t need = 0;
    kda_status_t st = kda_forward_workspace_size(gpu(), &d->dev, &need);
    if (st != KDA_STATUS_SUCCESS) return st;
    if (need > d->ws_bytes) {
        cudaFree(d->ws);
        CUDA_OK(cudaMalloc(&d->ws, need));
        d->ws_bytes = need;
    }
    st = kda_forward(gpu(), &d->dev, d->ws, d->ws_bytes, stream);
    if (st == KDA_STATUS_SUCCESS) CUDA_OK(cudaStreamSynchronize(stream));
    return st;
}

/* Compare the device results (copied into the host buffers) with the oracle on the host inputs. */
static kda_compare_t dproblem_check(dproblem_t *d, const kda_synth_config_t *c) {
    kda_compare_t r;
    memset(&r, 0, sizeof r);
    kda_synth_t *s = &d->s;
    CUDA_OK(cudaMemcpy(s->o, d->dev.o, s->o_bytes, cudaMemcpyDeviceToHost));
    if (d->host.final_state) CUDA_OK(cudaMemcpy(s->ht, d->dev.final_state, s->ht_bytes, cudaMemcpyDeviceToHost));
    const int64_t o_elems = s->num_tokens * c->hv * c->v, st_elems = s->num_seqs * c->hv * (int64_t)c->k * c->v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)(o_elems ? o_elems : 1));
    float *ht_ref = (float *)malloc(sizeof(float) * (size_t)(st_elems ? st_elems : 1));
    kda_args_t ra = d->host;
    ra.o = o_ref;
    ra.o_dtype = KDA_FLOAT32;
    if (ra.final_state) {
        ra.final_state = ht_ref;
        ra.final_state_dtype = KDA_FLOAT32;
    }
    r.status = kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD);
    r.o_unwritten = kda_count_nonfinite(s->o, c->o_dtype, o_elems);
    r.o_err = kda_rel_err(s->o, c->o_dtype, o_ref, KDA_FLOAT32, o_elems);
    if (d->host.final_state) {
        r.state_unwritten = kda_count_nonfinite(s->ht, c->final_state_dtype, st_elems);
        r.state_err = kda_rel_err(s->ht, c->final_state_dtype, ht_ref, KDA_FLOAT32, st_elems);
    }
    free(o_ref);
    free(ht_ref);
    return r;
}

static double worst_o, worst_state;

static void expect_gpu(const char *name, const kda_synth_config_t *c, double tol) {
    dproblem_t d;
    dproblem_make(&d, c);
    kda_status_t st = dproblem_run(&d, 0);
    CHECK(st == KDA_STATUS_SUCCESS, "%s: %s: %s", name, kda_describe(c), kda_last_error());
    if (st == KDA_STATUS_SUCCESS) {
        kda_compare_t r = dproblem_check(&d, c);
        printf("case %-28s o_err %.3e state_err %.3e  %s\n", name, r.o_err, r.state_err, kda_describe(c));
        CHECK(r.o_unwritten == 0, "%s: %lld o values unwritten or not finite", name, (long long)r.o_unwritten);
        CHECK(r.state_unwritten == 0, "%s: %lld state values unwritten or not finite", name,
              (long long)r.state_unwritten);
        CHECK(r.o_err <= tol, "%s: o rel err %.3g > %.3g (%s)", name, r.o_err, tol, kda_describe(c));
        CHECK(r.state_err <= tol, "%s: state rel err %.3g > %.3g (%s)", name, r.state_err, tol, kda_describe(c));
        if (r.o_err > worst_o) worst_o = r.o_err;
        if (r.state_err > worst_state) worst_state = r.state_err;
    }
    dproblem_free(&d);
}

static kda_synth_config_t base(int kd) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 200;
    c.hqk = 2;
    c.hv = 4;
    c.k = c.v = kd;
    c.initial_state = c.final_state = 1;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.seed = 11;
    return c;
}

/* The foundation matrix on the sizes CUDA supports, options rotating over the shapes. */
static void matrix(int kd) {
    static const int64_t Bs[] = {1, 3};
    static const int64_t Ts[] = {1, 15, 16, 17, 63, 64, 65, 200};
    static const int HQKs[] = {1, 2};
    static const int Gs[] = {1, 2, 4};
    unsigned i = (unsigned)kd;
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 8; t++)
            for (int hq = 0; hq < 2; hq++)
                for (int gi = 0; gi < 3; gi++, i++) {
                    kda_synth_config_t c = base(kd);
                    c.batch = Bs[b];
                    c.seq_len = Ts[t];
                    c.hqk = HQKs[hq];
                    c.hv = HQKs[hq] * Gs[gi];
                    unsigned h = i * 2654435761u;
                    c.gate = (kda_gate_mode_t)(h % 4);
                    c.l2norm = (h >> 3) % 2;
                    int bmode = (int)((h >> 5) % 3);
                    c.beta_sigmoid = bmode > 0;
                    c.allow_neg_eigval = bmode == 2;
                    int init = (int)((h >> 8) % 3);
                    c.initial_state = init > 0;
                    c.initial_state_dtype = init == 2 ? KDA_BFLOAT16 : KDA_FLOAT32;
                    c.final_state_dtype = (h >> 11) % 2 ? KDA_FLOAT32 : KDA_BFLOAT16;
                    c.state_v_first = (h >> 13) % 2;
                    c.beta_dtype = (h >> 15) % 2 ? KDA_FLOAT32 : KDA_BFLOAT16;
                    c.g_dtype = (h >> 17) % 2 ? KDA_FLOAT32 : KDA_BFLOAT16;
                    c.seed = i;
                    char name[64];
                    snprintf(name, sizeof name, "matrix_k%d_%u", kd, i);
                    expect_gpu(name, &c, 1e-2);
                }
    printf("worst o_err %.3e, worst state_err %.3e\n", worst_o, worst_state);
}

TEST(gpu_fwd_matrix_k128) { matrix(128); }
TEST(gpu_fwd_matrix_k64) { matrix(64); }

TEST(gpu_fwd_options) {
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        expect_gpu("lower_bound", &c, 1e-2);
        c.gate = KDA_GATE_SOFTPLUS;
        expect_gpu("softplus", &c, 1e-2);
        c.gate = KDA_GATE_RAW;
        expect_gpu("raw_gate", &c, 1e-2);
        c.gate = KDA_GATE_LOWER_BOUND_NO_A;
        expect_gpu("lower_bound_no_alog", &c, 1e-2);
        c.l2norm = 0;
        expect_gpu("no_l2norm", &c, 1e-2);
        c.beta_sigmoid = 0;
        expect_gpu("no_beta_sigmoid", &c, 1e-2);
        c.beta_sigmoid = c.allow_neg_eigval = 1;
        expect_gpu("neg_eigval", &c, 1e-2);
        c.initial_state = 0;
        expect_gpu("no_initial_state", &c, 1e-2);
        c.initial_state = 1;
        c.initial_state_dtype = c.final_state_dtype = KDA_BFLOAT16;
        expect_gpu("bf16_states", &c, 1e-2);
        c.state_v_first = 1;
        expect_gpu("v_first_bf16_states", &c, 1e-2);
        c.initial_state_dtype = c.final_state_dtype = KDA_FLOAT32;
        expect_gpu("v_first", &c, 1e-2);
        c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
        expect_gpu("fp32_io", &c, 1e-2);
        c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT16;
        expect_gpu("fp16_io", &c, 1e-2);
    }
}

TEST(gpu_fwd_varlen_empty_seq) {
    static const int64_t lens[] = {0, 5, 0, 70, 1, 130, 0, 64, 129};
    for (int kd = 64; kd <= 128; kd *= 2) {
        kda_synth_config_t c = base(kd);
        c.num_seqs = 9;
        c.seqlens = lens;
        expect_gpu("varlen_empty", &c, 1e-2);
        c.state_v_first = 1;
        c.gate = KDA_GATE_SOFTPLUS;
        expect_gpu("varlen_empty_vfirst", &c, 1e-2);
    }
}

TEST(gpu_fwd_gva_4x) {
    kda_synth_config_t c = base(128);
    c.hqk = 2;
    c.hv = 8;
    c.seq_len = 300;
    expect_gpu("gva_4x", &c, 1e-2);
}

TEST(gpu_fwd_t1_and_boundaries) {
    static const int64_t Ts[] = {1, 2, 63, 64, 65, 127, 128, 129};
    for (int i = 0; i < 8; i++) {
        kda_synth_config_t c = base(128);
        c.batch = 1;
        c.seq_len = Ts[i];
        char name[32];
        snprintf(name, sizeof name, "T%lld", (long long)Ts[i]);
        expect_gpu(name, &c, 1e-2);
    }
}

TEST(gpu_fwd_strong_decay) {
    kda_synth_config_t c = base(128);
    c.gate = KDA_GATE_RAW;
    c.decay = 40.0f;
    expect_gpu("strong_raw", &c, 1e-2);
    c.gate = KDA_GATE_SOFTPLUS;
    c.decay = 200.0f;
    expect_gpu("strong_softplus", &c, 1e-2);
    c.gate = KDA_GATE_LOWER_BOUND;
    c.decay = 50.0f;
    c.seq_len = 600;
    expect_gpu("lower_bound_pinned_long", &c, 1e-2);
}

TEST(gpu_fwd_gate_minus_inf) {
    kda_synth_config_t c = base(128);
    c.gate = KDA_GATE_RAW;
    c.g_dtype = KDA_FLOAT32;
    dproblem_t d;
    dproblem_make(&d, &c);
    const int64_t rows = d.s.num_tokens * c.hv;
    for (int64_t r = 0; r < rows; r += 7)
        for (int k = 0; k < c.k; k += 3) ((float *)d.s.g)[r * c.k + k] = (r % 2) ? -1e30f : -INFINITY;
    CUDA_OK(cudaMemcpy((void *)d.dev.g, d.s.g, d.s.g_bytes, cudaMemcpyHostToDevice));
    CHECK(dproblem_run(&d, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    kda_compare_t r = dproblem_check(&d, &c);
    printf("case %-28s o_err %.3e state_err %.3e\n", "gate_minus_inf", r.o_err, r.state_err);
    CHECK(r.o_unwritten == 0 && r.state_unwritten == 0, "non-finite outputs");
    CHECK(r.o_err <= 1e-2 && r.state_err <= 1e-2, "errors %.3g %.3g", r.o_err, r.state_err);
    dproblem_free(&d);
}

/* A state pool: state_indices, in place, untouched slots bit-identical; negative index = no slot. */
TEST(gpu_fwd_state_pool_inplace) {
    static const int64_t lens[] = {40, 0, 100, 1};
    kda_synth_config_t c = base(128);
    c.num_seqs = 4;
    c.seqlens = lens;
    c.initial_state = c.final_state = 0;
    dproblem_t d;
    dproblem_make(&d, &c);
    const int slots = 7;
    const int64_t per = (int64_t)c.hv * c.k * c.v;
    const size_t bytes = sizeof(float) * (size_t)(slots * per);
    float *pool = (float *)malloc(bytes), *ref = (float *)malloc(bytes), *got = (float *)malloc(bytes);
    for (int64_t i = 0; i < slots * per; i++) pool[i] = sinf((float)i * 0.11f) * 0.5f;
    memcpy(ref, pool, bytes);
    int32_t idx[4] = {5, 2, -1, 0};
    void *dpool = to_dev(pool, bytes), *didx = to_dev(idx, sizeof idx);
    d.dev.initial_state = d.dev.final_state = dpool;
    d.dev.state_indices = (const int32_t *)didx;
    d.dev.num_state_slots = slots;
    CHECK(dproblem_run(&d, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CUDA_OK(cudaMemcpy(got, dpool, bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(d.s.o, d.dev.o, d.s.o_bytes, cudaMemcpyDeviceToHost));
    kda_args_t ra = d.host;
    const int64_t o_elems = d.s.num_tokens * c.hv * c.v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)o_elems);
    ra.o = o_ref;
    ra.o_dtype = KDA_FLOAT32;
    ra.initial_state = ra.final_state = ref;
    ra.state_indices = idx;
    ra.num_state_slots = slots;
    CHECK(kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "reference");
    double eo = kda_rel_err(d.s.o, c.o_dtype, o_ref, KDA_FLOAT32, o_elems);
    printf("case %-28s o_err %.3e\n", "state_pool_inplace", eo);
    CHECK(eo <= 1e-2, "o rel err %.3g", eo);
    for (int sl = 0; sl < slots; sl++) {
        const int used = sl == 5 || sl == 2 || sl == 0;
        if (used) {
            double e = kda_rel_err(got + sl * per, KDA_FLOAT32, ref + sl * per, KDA_FLOAT32, per);
            CHECK(e <= 1e-2, "slot %d rel err %.3g", sl, e);
        } else {
            CHECK(memcmp(got + sl * per, pool + sl * per, sizeof(float) * (size_t)per) == 0, "slot %d changed", sl);
        }
    }
    cudaFree(dpool);
    cudaFree(didx);
    d.dev.initial_state = d.dev.final_state = NULL; /* freed above */
    free(pool);
    free(ref);
    free(got);
    free(o_ref);
    dproblem_free(&d);
}

/* kda_forward of d captured on stream s and instantiated (the caller destroys graph and exec). */
static void capture_forward(dproblem_t *d, cudaStream_t s, cudaGraph_t *graph, cudaGraphExec_t *exec) {
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    kda_status_t st = kda_forward(gpu(), &d->dev, d->ws, d->ws_bytes, s);
    CUDA_OK(cudaStreamEndCapture(s, graph));
    CHECK(st == KDA_STATUS_SUCCESS, "capture: %s", kda_last_error());
    CUDA_OK(cudaGraphInstantiate(exec, *graph, 0));
}

/* The forward captured in a CUDA graph and replayed gives the same bits as the direct call. */
TEST(gpu_fwd_cuda_graph_capture) {
    static const int64_t lens[] = {300, 17, 0, 129};
    kda_synth_config_t c = base(128);
    c.num_seqs = 4;
    c.seqlens = lens;
    dproblem_t d;
    dproblem_make(&d, &c);
    d.dev.cu_seqlens_host = NULL; /* as a graph would see it: device offsets only */
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(dproblem_run(&d, s) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *o1 = malloc(d.s.o_bytes);
    CUDA_OK(cudaMemcpy(o1, d.dev.o, d.s.o_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(d.dev.o, 0xff, d.s.o_bytes));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    capture_forward(&d, s, &graph, &exec);
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    void *o2 = malloc(d.s.o_bytes);
    CUDA_OK(cudaMemcpy(o2, d.dev.o, d.s.o_bytes, cudaMemcpyDeviceToHost));
    CHECK(memcmp(o1, o2, d.s.o_bytes) == 0, "graph replay differs from the direct call");
    kda_compare_t r = dproblem_check(&d, &c);
    printf("case %-28s o_err %.3e state_err %.3e\n", "graph_replay", r.o_err, r.state_err);
    CHECK(r.o_err <= 1e-2, "o rel err %.3g", r.o_err);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    free(o1);
    free(o2);
    dproblem_free(&d);
}

/* Any head size: K and V from 1 to 256, independently, padded to their size classes (64, 128, 256). Each size
 * gets varlen with empty sequences, GVA 4x, both state layouts and dtypes, every gate mode, fp32 inputs (the
 * element-by-element load path for sizes that are not a multiple of 8) and fp32 output. */
static void head_size_cases(int k, int v) {
    static const int64_t lens[] = {0, 5, 70, 1, 130, 0, 129};
    char name[64];
    for (int i = 0; i < 4; i++) {
        kda_synth_config_t c = base(128);
        c.k = k;
        c.v = v;
        c.gate = (kda_gate_mode_t)i;
        c.state_v_first = i & 1;
        c.initial_state_dtype = i == 2 ? KDA_BFLOAT16 : KDA_FLOAT32;
        c.final_state_dtype = i == 3 ? KDA_BFLOAT16 : KDA_FLOAT32;
        c.seed = (uint64_t)(k * 1000 + v * 10 + i);
        if (i == 0) { /* varlen with empty sequences */
            c.num_seqs = 7;
            c.seqlens = lens;
        } else if (i == 1) { /* GVA 4x */
            c.hqk = 1;
            c.hv = 4;
            c.seq_len = 150;
        } else if (i == 2) { /* fp32 inputs and output */
            c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
            c.allow_neg_eigval = 1;
        } else { /* fp16 inputs, no l2norm */
            c.dtype = c.o_dtype = KDA_FLOAT16;
            c.l2norm = 0;
        }
        snprintf(name, sizeof name, "k%d_v%d_%d", k, v, i);
        expect_gpu(name, &c, 1e-2);
    }
}

TEST(gpu_fwd_head_sizes) {
    static const int sizes[] = {16, 32, 60, 64, 100, 128, 192, 256};
    for (int i = 0; i < 8; i++) head_size_cases(sizes[i], sizes[i]);
    printf("worst o_err %.3e, worst state_err %.3e\n", worst_o, worst_state);
}

TEST(gpu_fwd_head_size_pairs) {
    static const int pairs[][2] = {{64, 128}, {128, 64}, {100, 60}, {1, 7},     {256, 64},
                                   {64, 256}, {200, 130}, {128, 256}, {256, 128}};
    for (int i = 0; i < 9; i++) head_size_cases(pairs[i][0], pairs[i][1]);
    printf("worst o_err %.3e, worst state_err %.3e\n", worst_o, worst_state);
}

/* The recurrence's tilings: BV = 128 and 64 (warpgroup MMA on sm_90), forced through the context's internal
 * tuning (kda_set_tuning), on the cases above, whose small shapes alone make the host pick BV = 32 (mma.sync). */
TEST(gpu_fwd_rec_tilings) {
    static const int bvs[] = {128, 64};
    for (int i = 0; i < 2; i++) {
        kda_tuning_t t = {0};
        t.bv = bvs[i];
        kda_set_tuning(gpu(), &t);
        printf("tuning: bv %d\n", bvs[i]);
        matrix(128);
        matrix(64);
        test_gpu_fwd_options();
        test_gpu_fwd_varlen_empty_seq();
        test_gpu_fwd_gva_4x();
        test_gpu_fwd_t1_and_boundaries();
        test_gpu_fwd_strong_decay();
        test_gpu_fwd_state_pool_inplace();
        test_gpu_fwd_cuda_graph_capture();
        test_gpu_fwd_head_sizes();
        test_gpu_fwd_head_size_pairs();
    }
    kda_set_tuning(gpu(), NULL);
}

/* Head sizes outside [1, 256] are refused by name, before anything runs. */
TEST(gpu_head_size_out_of_range) {
    kda_synth_config_t c = base(128);
    dproblem_t d;
    dproblem_make(&d, &c);
    size_t need = 0;
    d.dev.head_dim_k = 257;
    kda_status_t st = kda_forward_workspace_size(gpu(), &d.dev, &need);
    CHECK(st == KDA_STATUS_INVALID_VALUE, "status %s", kda_status_string(st));
    CHECK(strstr(kda_last_error(), "'head_dim_k'") != NULL, "%s", kda_last_error());
    d.dev.head_dim_k = 128;
    d.dev.head_dim_v = 0;
    st = kda_forward_workspace_size(gpu(), &d.dev, &need);
    CHECK(st == KDA_STATUS_INVALID_VALUE, "status %s", kda_status_string(st));
    CHECK(strstr(kda_last_error(), "'head_dim_v'") != NULL, "%s", kda_last_error());
    dproblem_free(&d);
}

/* ---------------------------------------------------------------------------------------------------------
 * The same contract through the chunked kernels at bf16 and across CP pieces (the contract test below runs
 * float32 and 79 tokens): one element of q (query/key head 0, so value heads 0 and 1), v, β or the raw gate
 * (value head 0) at token 300 of a 1000-token sequence (chunk 4, row 44) set to NaN, +∞ or 1e30. Against the
 * clean run with the same split setting: o of every earlier token, and every output of the unaffected heads,
 * within 1e-3; o from token 300 on and the final state of the affected heads all NaN (for 1e30: unspecified,
 * not checked). Split off, and forced on with pieces of 128 tokens (the poisoned piece's NaN state reaches the
 * later pieces through the pre-scan's maps and the merge).
 * ------------------------------------------------------------------------------------------------------- */
static float elem_get(const void *x, kda_dtype_t dt, int64_t i) {
    if (dt == KDA_FLOAT32) return ((const float *)x)[i];
    uint32_t b = (uint32_t)((const uint16_t *)x)[i] << 16; /* bf16 */
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static void elem_set(void *x, kda_dtype_t dt, int64_t i, float v) {
    if (dt == KDA_FLOAT32) {
        ((float *)x)[i] = v;
        return;
    }
    uint32_t b;
    memcpy(&b, &v, 4);
    ((uint16_t *)x)[i] = (uint16_t)(b >> 16); /* exact for NaN, ±inf and 1e30's leading bits */
}

TEST(gpu_fwd_poison_bf16_cp) {
    kda_synth_config_t c = base(128);
    c.batch = 1;
    c.seq_len = 1000;
    c.hqk = 2;
    c.hv = 4; /* value heads 0, 1 read query/key head 0 */
    c.g_dtype = KDA_BFLOAT16;
    const int64_t T = 1000, at = 300, HV = 4, V = 128, K = 128;
    enum { P_Q, P_V, P_BETA, P_G };
    static const char *pname[] = {"q", "v", "beta", "g"};
    static const float vals[] = {NAN, INFINITY, 1e30f};
    static const char *vname[] = {"NaN", "inf", "1e30"};
    for (int cp = 0; cp < 2; cp++) {
        dproblem_t d;
        dproblem_make(&d, &c);
        d.dev.cp_mode = cp ? KDA_CP_ON : KDA_CP_OFF;
        d.dev.cp_piece_len = cp ? 128 : 0;
        CHECK(dproblem_run(&d, 0) == KDA_STATUS_SUCCESS, "clean: %s", kda_last_error());
        const kda_compare_t clean_err = dproblem_check(&d, &c); /* copies o and the final state to the host */
        CHECK(clean_err.o_unwritten == 0 && clean_err.o_err < 2e-2, "clean run (cp %d): o err %.3g", cp, clean_err.o_err);
        float *o0 = (float *)malloc(sizeof(float) * T * HV * V), *h0 = (float *)malloc(sizeof(float) * HV * K * V);
        for (int64_t i = 0; i < T * HV * V; i++) o0[i] = elem_get(d.s.o, c.o_dtype, i);
        for (int64_t i = 0; i < HV * K * V; i++) h0[i] = elem_get(d.s.ht, c.final_state_dtype, i);
        float omax = 1.0f;
        for (int64_t i = 0; i < T * HV * V; i++) omax = fmaxf(omax, fabsf(o0[i]));
        for (int in = P_Q; in <= P_G; in++) {
            for (int vi = 0; vi < 3; vi++) {
                /* ±inf and 1e30 gates are clamped, and β's sigmoid maps ±inf and 1e30 to finite values: not poisoning */
                if ((in == P_G || in == P_BETA) && vi > 0) continue;
                void *buf = in == P_Q ? d.s.q : in == P_V ? d.s.v : in == P_BETA ? d.s.beta : d.s.g;
                const void *dbuf = in == P_Q ? d.dev.q : in == P_V ? d.dev.v : in == P_BETA ? d.dev.beta : d.dev.g;
                const kda_dtype_t dt = in == P_BETA ? c.beta_dtype : in == P_G ? c.g_dtype : c.dtype;
                const size_t bytes = in == P_Q ? d.s.q_bytes : in == P_V ? d.s.v_bytes : in == P_BETA ? d.s.beta_bytes : d.s.g_bytes;
                const int64_t idx = in == P_Q ? (at * 2 + 0) * K + 5 : in == P_BETA ? at * HV + 0 : (at * HV + 0) * K + 5;
                const float keep = elem_get(buf, dt, idx);
                elem_set(buf, dt, idx, vals[vi]);
                CUDA_OK(cudaMemcpy((void *)dbuf, buf, bytes, cudaMemcpyHostToDevice));
                CUDA_OK(cudaMemset(d.dev.o, 0, d.s.o_bytes));
                CHECK(dproblem_run(&d, 0) == KDA_STATUS_SUCCESS, "%s = %s: %s", pname[in], vname[vi], kda_last_error());
                CUDA_OK(cudaMemcpy(d.s.o, d.dev.o, d.s.o_bytes, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(d.s.ht, d.dev.final_state, d.s.ht_bytes, cudaMemcpyDeviceToHost));
                int64_t bad_early = 0, not_nan = 0, bad_other = 0;
                for (int64_t t = 0; t < T; t++)
                    for (int64_t h = 0; h < HV; h++) {
                        const int hit = in == P_Q ? h < 2 : h == 0;
                        for (int64_t j = 0; j < V; j++) {
                            const int64_t i = (t * HV + h) * V + j;
                            const float x = elem_get(d.s.o, c.o_dtype, i);
                            if (!hit || t < at) {
                                if (!(fabsf(x - o0[i]) <= 1e-3f * omax)) {
                                    if (hit) bad_early++;
                                    else bad_other++;
                                }
                            } else if (vi < 2 && !isnan(x)) {
                                not_nan++;
                            }
                        }
                    }
                for (int64_t h = 0; h < HV; h++) {
                    const int hit = in == P_Q ? h < 2 : h == 0;
                    for (int64_t e = 0; e < K * V; e++) {
                        const float x = elem_get(d.s.ht, c.final_state_dtype, h * K * V + e);
                        if (!hit) bad_other += !(fabsf(x - h0[h * K * V + e]) <= 1e-3f * fmaxf(1.0f, fabsf(h0[h * K * V + e])));
                        else if (vi < 2) not_nan += !isnan(x);
                    }
                }
                printf("cp %d  %-4s = %-4s: earlier tokens off %lld, not NaN from t %lld, other heads off %lld\n", cp,
                       pname[in], vname[vi], (long long)bad_early, (long long)not_nan, (long long)bad_other);
                CHECK(bad_early == 0 && not_nan == 0 && bad_other == 0, "cp %d, %s = %s at token %lld: %lld earlier "
                      "elements differ, %lld later/final-state elements not NaN, %lld elements of other heads differ",
                      cp, pname[in], vname[vi], (long long)at, (long long)bad_early, (long long)not_nan,
                      (long long)bad_other);
                elem_set(buf, dt, idx, keep);
                CUDA_OK(cudaMemcpy((void *)dbuf, buf, bytes, cudaMemcpyHostToDevice));
            }
        }
        free(o0);
        free(h0);
        dproblem_free(&d);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The non-finite input contract (docs/ALGORITHM.md, "Non-finite and out-of-range inputs") on CUDA: kda_forward
 * and kda_decode on every input class of the table, in both state layouts and with a state pool, against their
 * own clean runs and the fp64 oracle (tests/common/contract.c; the CPU backends run the same check in
 * contract_cpu_forward_decode_agree). No known gaps left on CUDA.
 * ------------------------------------------------------------------------------------------------------- */
static kda_status_t run_cuda(void *user, const kda_args_t *h, kda_algo_t algo) {
    (void)user;
    const int64_t T = h->batch * h->seq_len, HQK = h->num_qk_heads, HV = h->num_v_heads, K = h->head_dim_k,
                  V = h->head_dim_v, N = h->cu_seqlens ? h->num_seqs : h->batch; /* float32 tensors only */
    const int64_t slots = h->state_indices ? h->num_state_slots : N; /* 1-D state_indices only */
    const size_t qb = (size_t)(T * HQK * K) * 4, vb = (size_t)(T * HV * V) * 4, gb = (size_t)(T * HV * K) * 4,
                 bb = (size_t)(T * HV) * 4, sb = (size_t)(slots * HV * K * V) * 4;
    kda_args_t d = *h;
    d.q = to_dev(h->q, qb);
    d.k = to_dev(h->k, qb);
    d.v = to_dev(h->v, vb);
    d.g = to_dev(h->g, gb);
    d.beta = to_dev(h->beta, bb);
    d.o = to_dev(h->o, vb);
    d.initial_state = to_dev(h->initial_state, sb);
    d.final_state = to_dev(h->final_state, sb);
    if (h->state_indices) d.state_indices = (const int32_t *)to_dev(h->state_indices, (size_t)N * sizeof(int32_t));
    if (h->cu_seqlens) {
        d.cu_seqlens = to_dev(h->cu_seqlens, (size_t)(N + 1) * kda_dtype_size(h->cu_seqlens_dtype));
        d.cu_seqlens_host = h->cu_seqlens;
    }
    size_t need = 0;
    void *ws = NULL;
    kda_status_t st = algo == KDA_ALGO_DECODE ? kda_decode_workspace_size(gpu(), &d, &need)
                                              : kda_forward_workspace_size(gpu(), &d, &need);
    if (st == KDA_STATUS_SUCCESS) {
        CUDA_OK(cudaMalloc(&ws, need ? need : 16));
        st = algo == KDA_ALGO_DECODE ? kda_decode(gpu(), &d, ws, need, NULL) : kda_forward(gpu(), &d, ws, need, NULL);
        CUDA_OK(cudaDeviceSynchronize());
    }
    if (st == KDA_STATUS_SUCCESS) {
        CUDA_OK(cudaMemcpy(h->o, d.o, vb, cudaMemcpyDeviceToHost));
        if (h->final_state) CUDA_OK(cudaMemcpy(h->final_state, d.final_state, sb, cudaMemcpyDeviceToHost));
    }
    cudaFree(ws);
    cudaFree((void *)d.q);
    cudaFree((void *)d.k);
    cudaFree((void *)d.v);
    cudaFree((void *)d.g);
    cudaFree((void *)d.beta);
    cudaFree(d.o);
    cudaFree((void *)d.initial_state);
    cudaFree(d.final_state);
    cudaFree((void *)d.cu_seqlens);
    cudaFree((void *)d.state_indices);
    return st;
}

TEST(gpu_contract_forward_decode_agree) {
    (void)gpu();
    for (int kd = 64; kd <= 128; kd += 64) {
        kda_contract_backend_t be = {kd == 64 ? "cuda K=64" : "cuda K=128", run_cuda, NULL, kd, 2e-2, 1e-3, 0};
        kda_contract_check(&be, 30);
        kda_contract_check(&be, 66);
    }
}

/* Causality in g on CUDA (docs/ALGORITHM.md §7 item 6; tests/common/causal.c, as harden_fwd_causal_in_g on
 * the CPU): a gate of any class at token t0 leaves earlier 16-token blocks bit-identical and the block's earlier
 * rows within KDA_CAUSAL_TOL_CUDA of the head's largest |o| (the chunked kernels' 16-bit operands round them);
 * kda_decode on 80 tokens is held to the same rule (it may take the chunked kernels). */
TEST(gpu_fwd_causal_in_g) {
    (void)gpu();
    double worst = 0.0;
    for (int kd = 64; kd <= 128; kd += 64)
        for (int algo = 0; algo < 2; algo++) {
            const kda_contract_backend_t be = {algo ? "cuda decode" : "cuda forward", run_cuda, NULL, kd, 0.0, 0.0,
                                               0};
            const kda_algo_t a = algo ? KDA_ALGO_DECODE : KDA_ALGO_FORWARD;
            worst = fmax(worst, kda_contract_causal_g(&be, a, KDA_CAUSAL_TOL_CUDA, kd));
        }
    printf("largest move of an earlier output of t0's block (CUDA): %.3g of the head's max |o|\n", worst);
}

/* ---------------------------------------------------------------------------------------------------------
 * Intra-card context parallelism (issue 9): the acceptance checks, written before the kernels. Forced on with
 * pieces of 1 to many chunks (and auto), every case's relative errors of o and of the final state against the
 * oracle must stay within 1.1x those of the same call with the split off. Until the CUDA backend splits, both
 * calls take the same path and this only checks that the backend accepts the fields.
 * ------------------------------------------------------------------------------------------------------- */
static void cp_slow_decay(dproblem_t *d);

static void cp_case(const char *name, const kda_synth_config_t *c, void (*edit)(dproblem_t *)) {
    static const int64_t piece_lens[] = {64, 128, 640, 4096};
    dproblem_t d;
    dproblem_make(&d, c);
    if (edit) edit(&d);
    d.dev.cp_mode = KDA_CP_OFF;
    CHECK(dproblem_run(&d, 0) == KDA_STATUS_SUCCESS, "%s off: %s", name, kda_last_error());
    const kda_compare_t off = dproblem_check(&d, c);
    void *o_off = malloc(d.s.o_bytes);
    memcpy(o_off, d.s.o, d.s.o_bytes);
    int64_t longest = 0; /* chunks of the longest sequence */
    for (int64_t n = 0; n < d.s.num_seqs; n++) {
        const int64_t len = c->seqlens ? c->seqlens[n] : c->seq_len;
        if ((len + 63) / 64 > longest) longest = (len + 63) / 64;
    }
    for (int i = 0; i <= 4; i++) {
        d.dev.cp_mode = i < 4 ? KDA_CP_ON : KDA_CP_AUTO;
        d.dev.cp_piece_len = i < 4 ? piece_lens[i] : 0;
        CUDA_OK(cudaMemset(d.dev.o, 0xff, d.s.o_bytes));
        CHECK(dproblem_run(&d, 0) == KDA_STATUS_SUCCESS, "%s piece %lld: %s", name, (long long)d.dev.cp_piece_len,
              kda_last_error());
        const kda_compare_t on = dproblem_check(&d, c);
        /* the split rounds differently (the merge's fp32 products), so where the state carries across pieces o
           differs in some bit exactly when it was taken: a forced piece shorter than the longest sequence must be */
        const int split = memcmp(o_off, d.s.o, d.s.o_bytes) != 0;
        printf("case %-22s piece %5lld  o_err %.3e (off %.3e)  state_err %.3e (off %.3e)  %s\n", name,
               (long long)d.dev.cp_piece_len, on.o_err, off.o_err, on.state_err, off.state_err,
               split ? "split" : "not split");
        if (edit == cp_slow_decay && i < 4 && d.dev.cp_piece_len / 64 < longest - 1)
            CHECK(split, "%s piece %lld: the split was not taken", name, (long long)d.dev.cp_piece_len);
        CHECK(on.o_unwritten == 0 && on.state_unwritten == 0, "%s piece %lld: non-finite outputs", name,
              (long long)d.dev.cp_piece_len);
        CHECK(on.o_err <= 1.1 * off.o_err + 1e-7, "%s piece %lld: o rel err %.3g > 1.1 x %.3g", name,
              (long long)d.dev.cp_piece_len, on.o_err, off.o_err);
        CHECK(on.state_err <= 1.1 * off.state_err + 1e-7, "%s piece %lld: state rel err %.3g > 1.1 x %.3g", name,
              (long long)d.dev.cp_piece_len, on.state_err, off.state_err);
    }
    free(o_off);
    dproblem_free(&d);
}

static void cp_gates_near_minus_inf(dproblem_t *d) {
    const int64_t rows = d->s.num_tokens * d->host.num_v_heads, K = d->host.head_dim_k;
    for (int64_t r = 0; r < rows; r += 7)
        for (int64_t k = 0; k < K; k += 3) ((float *)d->s.g)[r * K + k] = (r % 2) ? -1e30f : -INFINITY;
    CUDA_OK(cudaMemcpy((void *)d->dev.g, d->s.g, d->s.g_bytes, cudaMemcpyHostToDevice));
}

/* Slow decay (raw log-gate −1e-3 per token and channel: e^{−0.064} a chunk): the state carries across many
 * pieces, so every piece's incoming state really comes from the merge. (Typical and lower-bound gates forget a
 * state within a chunk or two: there the split reproduces the unsplit output bit for bit.) */
static void cp_slow_decay(dproblem_t *d) {
    const int64_t n = d->s.num_tokens * d->host.num_v_heads * d->host.head_dim_k;
    for (int64_t i = 0; i < n; i++) ((float *)d->s.g)[i] = -1e-3f * (float)(1 + i % 3);
    CUDA_OK(cudaMemcpy((void *)d->dev.g, d->s.g, d->s.g_bytes, cudaMemcpyHostToDevice));
}

TEST(gpu_fwd_cp_forced_accuracy) {
    kda_synth_config_t c = base(128);
    c.batch = 1;
    c.seq_len = 4096 + 37; /* not a multiple of the chunk */
    c.hqk = 1;
    c.hv = 2;
    cp_case("single_T4133", &c, NULL);
    static const int64_t lens[] = {3000, 0, 65, 1, 2000};
    kda_synth_config_t v = base(128);
    v.num_seqs = 5;
    v.seqlens = lens;
    v.hqk = 1;
    v.hv = 4;
    v.state_v_first = 1;
    cp_case("varlen_gva", &v, NULL);
    v.k = v.v = 64;
    cp_case("varlen_gva_k64", &v, NULL);
    kda_synth_config_t s = c;
    s.gate = KDA_GATE_SOFTPLUS;
    s.decay = 200.0f;
    cp_case("strong_softplus", &s, NULL);
    s.gate = KDA_GATE_LOWER_BOUND;
    s.decay = 0.05f; /* weak decay: the initial state travels far */
    s.allow_neg_eigval = 1;
    cp_case("weak_decay_neg_eigval", &s, NULL);
    kda_synth_config_t m = c;
    m.gate = KDA_GATE_RAW;
    m.g_dtype = KDA_FLOAT32;
    cp_case("gate_minus_inf", &m, cp_gates_near_minus_inf);
    cp_case("slow_decay", &m, cp_slow_decay);
    kda_synth_config_t w = v; /* varlen, GVA, K = V = 64, V-first states */
    w.gate = KDA_GATE_RAW;
    w.g_dtype = KDA_FLOAT32;
    cp_case("slow_decay_varlen_k64", &w, cp_slow_decay);
    w.k = w.v = 128;
    w.allow_neg_eigval = 1;
    cp_case("slow_decay_varlen_neg", &w, cp_slow_decay);
}

/* The CP kernels at sizes compute-sanitizer's racecheck finishes in seconds (gpu_fwd_cp_forced_accuracy takes
 * minutes under it): every kernel of the split path — plan, pre-scan (M's and E's tiles), merge, pieces — at both
 * K classes, a varlen batch with an empty and a one-token sequence, the state carried across pieces. */
TEST(gpu_fwd_cp_sanitize) {
    kda_synth_config_t c = base(128);
    c.batch = 1;
    c.seq_len = 5 * 64 + 17;
    c.hqk = c.hv = 1;
    c.gate = KDA_GATE_RAW;
    c.g_dtype = KDA_FLOAT32;
    cp_case("san_single_k128", &c, cp_slow_decay);
    static const int64_t lens[] = {300, 0, 1, 200};
    kda_synth_config_t v = base(64);
    v.num_seqs = 4;
    v.seqlens = lens;
    v.hqk = 1;
    v.hv = 2;
    v.state_v_first = 1;
    v.gate = KDA_GATE_RAW;
    v.g_dtype = KDA_FLOAT32;
    cp_case("san_varlen_k64", &v, cp_slow_decay);
}

/* Captured once with device-only offsets and the split forced on, replayed after the offsets were changed to
 * other lengths of the same total: the replay equals a direct call on the new lengths, bit for bit. */
TEST(gpu_fwd_cp_graph_other_lengths) {
    static const int64_t lens[] = {3000, 17, 0, 1079};
    static const int64_t other[] = {0, 1000, 2000, 1096};
    kda_synth_config_t c = base(128);
    c.num_seqs = 4;
    c.seqlens = lens;
    dproblem_t d;
    dproblem_make(&d, &c);
    d.dev.cu_seqlens_host = NULL;
    d.dev.cp_mode = KDA_CP_ON;
    d.dev.cp_piece_len = 256;
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(dproblem_run(&d, s) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    capture_forward(&d, s, &graph, &exec);
    int64_t cu[5] = {0};
    for (int i = 0; i < 4; i++) cu[i + 1] = cu[i] + other[i];
    CUDA_OK(cudaMemcpy((void *)d.dev.cu_seqlens, cu, sizeof cu, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d.dev.o, 0xff, d.s.o_bytes));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    void *o_graph = malloc(d.s.o_bytes), *h_graph = malloc(d.s.ht_bytes);
    CUDA_OK(cudaMemcpy(o_graph, d.dev.o, d.s.o_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h_graph, d.dev.final_state, d.s.ht_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(d.dev.o, 0xff, d.s.o_bytes));
    CHECK(dproblem_run(&d, s) == KDA_STATUS_SUCCESS, "direct: %s", kda_last_error());
    void *o_direct = malloc(d.s.o_bytes), *h_direct = malloc(d.s.ht_bytes);
    CUDA_OK(cudaMemcpy(o_direct, d.dev.o, d.s.o_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h_direct, d.dev.final_state, d.s.ht_bytes, cudaMemcpyDeviceToHost));
    CHECK(memcmp(o_graph, o_direct, d.s.o_bytes) == 0, "o: graph replay on new lengths differs from a direct call");
    CHECK(memcmp(h_graph, h_direct, d.s.ht_bytes) == 0, "final state: graph replay differs from a direct call");
    /* and the new lengths against the oracle */
    memcpy(d.s.cu_seqlens, cu, sizeof cu);
    kda_synth_config_t c2 = c;
    c2.seqlens = other;
    kda_compare_t r = dproblem_check(&d, &c2);
    printf("case %-28s o_err %.3e state_err %.3e\n", "cp_graph_other_lengths", r.o_err, r.state_err);
    CHECK(r.o_err <= 1e-2 && r.state_err <= 1e-2, "errors %.3g %.3g", r.o_err, r.state_err);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    free(o_graph);
    free(h_graph);
    free(o_direct);
    free(h_direct);
    dproblem_free(&d);
}

/* ---------------------------------------------------------------------------------------------------------
 * chunk_states: the state before every 64-token chunk (prefix caching), by the recurrence kernel's
 * KDA_REC_STATES pass before the forward's own recurrence; against the oracle's rows.
 * ------------------------------------------------------------------------------------------------------- */
static int64_t cs_rows(const kda_synth_config_t *c) {
    if (!c->seqlens) return c->batch * ((c->seq_len + 63) / 64);
    int64_t r = 0;
    for (int64_t n = 0; n < c->num_seqs; n++) r += (c->seqlens[n] + 63) / 64;
    return r;
}

/* cp_piece: 0 auto, else forced pieces of that many tokens; pool: the states in a pool of 6 slots, updated in
 * place (initial_state == final_state) through indices {4, -1, 1, ...}: each sequence's first row must be its
 * slot's state from before the call */
static void chunk_states_case(const char *name, const kda_synth_config_t *c, kda_dtype_t dt, int64_t cp_piece,
                              int pool, int64_t nan_token) {
    dproblem_t d;
    dproblem_make(&d, c);
    const int64_t per = (int64_t)c->hv * c->k * c->v, rows = cs_rows(c), n = rows * per;
    const size_t es = dt == KDA_FLOAT32 ? 4 : 2;
    void *dcs = NULL, *dpool = NULL, *didx = NULL;
    float *pool_h = NULL;
    int32_t idx[8] = {4, -1, 1, 5, 0, 2, 3, -1};
    CUDA_OK(cudaMalloc(&dcs, (size_t)(n > 0 ? n : 1) * es));
    CUDA_OK(cudaMemset(dcs, 0xff, (size_t)(n > 0 ? n : 1) * es));
    if (nan_token >= 0) { /* a NaN v element of value head 0 at this row */
        kda_synth_poison((char *)d.s.v + (size_t)(nan_token * c->hv * c->v) * kda_dtype_size(c->dtype), c->dtype, 1);
        CUDA_OK(cudaMemcpy((void *)d.dev.v, d.s.v, d.s.v_bytes, cudaMemcpyHostToDevice));
    }
    if (pool) {
        pool_h = (float *)malloc(sizeof(float) * (size_t)(6 * per));
        for (int64_t i = 0; i < 6 * per; i++) pool_h[i] = sinf((float)i * 0.37f) * 0.3f;
        dpool = to_dev(pool_h, sizeof(float) * (size_t)(6 * per));
        didx = to_dev(idx, sizeof idx);
        cudaFree((void *)d.dev.initial_state);
        cudaFree(d.dev.final_state);
        d.dev.initial_state = d.dev.final_state = dpool;
        d.dev.initial_state_dtype = d.dev.final_state_dtype = KDA_FLOAT32;
        d.dev.state_indices = (const int32_t *)didx;
        d.dev.num_state_slots = 6;
    }
    d.dev.chunk_states = dcs;
    d.dev.chunk_states_dtype = dt;
    if (cp_piece) {
        d.dev.cp_mode = KDA_CP_ON;
        d.dev.cp_piece_len = cp_piece;
    }
    kda_status_t st = dproblem_run(&d, 0);
    CHECK(st == KDA_STATUS_SUCCESS, "%s: %s", name, kda_last_error());
    void *got = malloc((size_t)(n > 0 ? n : 1) * es);
    float *ref = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    CUDA_OK(cudaMemcpy(got, dcs, (size_t)n * es, cudaMemcpyDeviceToHost));
    kda_args_t ra = d.host;
    const int64_t o_elems = d.s.num_tokens * c->hv * c->v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)(o_elems ? o_elems : 1));
    ra.o = o_ref;
    ra.o_dtype = KDA_FLOAT32;
    ra.final_state = NULL;
    ra.chunk_states = ref;
    ra.chunk_states_dtype = KDA_FLOAT32;
    if (pool) {
        ra.initial_state = pool_h;
        ra.initial_state_dtype = KDA_FLOAT32;
        ra.state_indices = idx;
        ra.num_state_slots = 6;
    }
    CHECK(kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "reference: %s",
          kda_last_error());
    const int64_t bad = kda_count_nonfinite(got, dt, n), bad_ref = kda_count_nonfinite(ref, KDA_FLOAT32, n);
    double e = 0.0;
    if (nan_token < 0) e = kda_rel_err(got, dt, ref, KDA_FLOAT32, n);
    else { /* rows up to the token's chunk are finite and close; later rows NaN, as the oracle's */
        const int64_t clean = (nan_token / 64 + 1) * per;
        e = kda_rel_err(got, dt, ref, KDA_FLOAT32, clean);
        CHECK(kda_count_nonfinite(got, dt, clean) == 0, "%s: NaN in the rows before the token", name);
    }
    printf("case %-28s rows %lld  chunk_states err %.3e  non-finite %lld (oracle %lld)  %s\n", name, (long long)rows,
           e, (long long)bad, (long long)bad_ref, kda_describe(c));
    CHECK(bad == bad_ref, "%s: %lld non-finite chunk_states elements, the oracle %lld", name, (long long)bad,
          (long long)bad_ref);
    CHECK(e <= 1e-2, "%s: chunk_states rel err %.3g", name, e);
    if (pool && dt == KDA_FLOAT32) { /* each sequence's first row is its slot's state from before the call */
        int64_t row = 0;
        for (int64_t q = 0; q < d.s.num_seqs; q++) {
            const int64_t len = c->seqlens ? c->seqlens[q] : c->seq_len;
            if (len == 0) continue;
            const float *r0 = (const float *)got + row * per;
            if (idx[q] >= 0)
                CHECK(memcmp(r0, pool_h + idx[q] * per, sizeof(float) * (size_t)per) == 0,
                      "%s: sequence %lld's first row is not slot %d's state before the call", name, (long long)q, idx[q]);
            else
                for (int64_t i = 0; i < per; i++) CHECK(r0[i] == 0.0f, "%s: a negative slot's first row not zero", name);
            row += (len + 63) / 64;
        }
    }
    if (pool) d.dev.initial_state = d.dev.final_state = NULL; /* dpool, freed below */
    cudaFree(dcs);
    cudaFree(dpool);
    cudaFree(didx);
    free(pool_h);
    free(got);
    free(ref);
    free(o_ref);
    dproblem_free(&d);
}

TEST(gpu_fwd_chunk_states) {
    static const int64_t lens[] = {130, 0, 64, 1, 200};
    kda_synth_config_t c = base(128);
    c.num_seqs = 5;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 4;
    c.decay = 0.05f; /* states carry across chunks */
    chunk_states_case("varlen_gva_f32", &c, KDA_FLOAT32, 0, 0, -1);
    chunk_states_case("varlen_gva_cp64", &c, KDA_FLOAT32, 64, 0, -1);
    c.state_v_first = 1;
    chunk_states_case("varlen_vfirst_bf16", &c, KDA_BFLOAT16, 0, 0, -1);
    chunk_states_case("varlen_pool_inplace", &c, KDA_FLOAT32, 128, 1, -1);
    kda_synth_config_t g = base(64);
    g.v = 100; /* the masked (general) instance */
    g.seq_len = 333;
    g.gate = KDA_GATE_SOFTPLUS;
    chunk_states_case("k64_v100", &g, KDA_FLOAT32, 0, 0, -1);
    g.batch = 1;
    g.hqk = g.hv = 1;
    chunk_states_case("nan_token", &g, KDA_FLOAT32, 0, 0, 2 * 64 + 9);
}

TEST(gpu_fwd_chunk_states_k256_not_supported) {
    kda_synth_config_t c = base(128);
    c.k = 256;
    c.seq_len = 64;
    dproblem_t d;
    dproblem_make(&d, &c);
    void *dcs = NULL;
    CUDA_OK(cudaMalloc(&dcs, sizeof(float) * (size_t)(c.batch * c.hv * 256 * 128)));
    d.dev.chunk_states = dcs;
    size_t need = 0;
    const kda_status_t st = kda_forward_workspace_size(gpu(), &d.dev, &need);
    CHECK(st == KDA_STATUS_NOT_SUPPORTED, "status %s", kda_status_string(st));
    CHECK(strstr(kda_last_error(), "'chunk_states'") != NULL, "message: %s", kda_last_error());
    cudaFree(dcs);
    dproblem_free(&d);
}

#else
/* Built without CUDA: every case CTest names from this file is skipped. */
const char *kda_test_skip_missing = "libkda was built without CUDA (no nvcc when CMake configured it, or KDA_WITH_CUDA=OFF)";
#endif
