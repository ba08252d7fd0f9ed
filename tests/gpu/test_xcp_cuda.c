/*
 * Context parallelism across ranks on the CUDA backend (docs/API.md §14), R ranks simulated on one device: one
 * problem cut into R contiguous slices of its packed tokens, each run as a rank (its own cu_seqlens and states),
 * the summaries exchanged by copying, against the unsplit CUDA run and the fp64 oracle (the reference backend):
 * o, the final states and every gradient. The split's error against the oracle must stay within 1.1x the unsplit
 * run's for o and the final states (plus a floor of 1e-4 of the norm, the scale of the fold's fp32 rounding), 4x
 * for the gradients: a rank's maps carry the chunk pipeline's state precision (~3e-3), and the gradients of the
 * tokens next to a cut take it from them (R = 7 with a 1-token rank and empty ones: dg at 3.1x). Every buffer is
 * CUDA managed
 * memory, so that the reference backend and the checks read what the device wrote after a synchronise.
 * Skipped (exit 77) without a usable CUDA device.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "test_util.h"

#ifdef KDA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "gpu_util.h"

#define MAX_RANKS 8
#define MAX_LOCAL 16

static kda_context_t *gpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CUDA, 0) != KDA_STATUS_SUCCESS) SKIP("no CUDA device: %s", kda_last_error());
    return ctx;
}

static void *managed(size_t bytes) {
    void *p = NULL;
    CUDA_OK(cudaMallocManaged(&p, bytes ? bytes : 16, cudaMemAttachGlobal));
    memset(p, 0, bytes ? bytes : 16);
    return p;
}
static void *managed_copy(const void *h, size_t bytes) {
    if (!h) return NULL;
    void *p = managed(bytes);
    memcpy(p, h, bytes);
    return p;
}
static float *mfloats(int64_t n) { return (float *)managed((size_t)(n > 0 ? n : 1) * sizeof(float)); }

static void fill(float *x, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(seed >> 11) / 9007199254740992.0 - 0.5);
    }
}

static kda_status_t forward(kda_context_t *ctx, const kda_args_t *a) {
    size_t b = 0;
    kda_status_t st = kda_forward_workspace_size(ctx, a, &b);
    if (st != KDA_STATUS_SUCCESS) return st;
    void *ws = managed(b);
    st = kda_forward(ctx, a, ws, b, NULL);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(ws));
    return st;
}

static kda_status_t backward(kda_context_t *ctx, const kda_backward_args_t *b) {
    size_t n = 0;
    kda_status_t st = kda_backward_workspace_size(ctx, b, &n);
    if (st != KDA_STATUS_SUCCESS) return st;
    void *ws = managed(n);
    st = kda_backward(ctx, b, ws, n, NULL);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(ws));
    return st;
}

/* ---------------------------------------------------------------------------------------------------------
 * The problem: its inputs in managed memory, and one run's results (unsplit or assembled from the ranks)
 * ------------------------------------------------------------------------------------------------------- */
enum { R_O, R_HT, R_DQ, R_DK, R_DV, R_DG, R_DBETA, R_DH0, R_DA, R_DDT, R_N };
static const char *names[R_N] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log",
                                 "ddt_bias"};

typedef struct {
    kda_synth_t s;
    kda_args_t a; /* over the managed inputs */
    int64_t T, N, n[R_N];
    int K, V, HQK, HV;
    float *d_o, *dht;
} whole_t;

typedef struct {
    float *x[R_N];
} result_t;

static void result_make(const whole_t *w, result_t *r) {
    for (int i = 0; i < R_N; i++) r->x[i] = mfloats(w->n[i]);
}
static void result_free(result_t *r) {
    for (int i = 0; i < R_N; i++) CUDA_OK(cudaFree(r->x[i]));
}

static void bwd_args(kda_backward_args_t *b, const kda_args_t *a) {
    kda_backward_args_init(b);
    b->problem = a;
    b->d_o_dtype = b->d_final_state_dtype = KDA_FLOAT32;
    b->dq_dtype = b->dk_dtype = b->dv_dtype = b->dg_dtype = b->dbeta_dtype = b->d_initial_state_dtype = KDA_FLOAT32;
}

static void whole_make(whole_t *w, const kda_synth_config_t *cfg) {
    memset(w, 0, sizeof *w);
    if (kda_synth_make(cfg, &w->s, &w->a) != 0) exit(1);
    w->T = w->s.num_tokens;
    w->N = w->s.num_seqs;
    w->K = cfg->k, w->V = cfg->v, w->HQK = cfg->hqk, w->HV = cfg->hv;
    const int64_t ns = w->N * w->HV * w->K * w->V;
    const int64_t n[R_N] = {w->T * w->HV * w->V, ns, w->T * w->HQK * w->K, w->T * w->HQK * w->K, w->T * w->HV * w->V,
                            w->T * w->HV * w->K, w->T * w->HV, ns, w->HV, (int64_t)w->HV * w->K};
    memcpy(w->n, n, sizeof n);
    kda_args_t *a = &w->a;
    a->q = managed_copy(w->s.q, w->s.q_bytes);
    a->k = managed_copy(w->s.k, w->s.q_bytes);
    a->v = managed_copy(w->s.v, w->s.v_bytes);
    a->g = managed_copy(w->s.g, w->s.g_bytes);
    a->beta = managed_copy(w->s.beta, w->s.beta_bytes);
    a->initial_state = managed_copy(w->s.h0, w->s.h0_bytes);
    a->A_log = managed_copy(w->s.A_log, (size_t)w->HV * 4);
    a->dt_bias = managed_copy(w->s.dt_bias, (size_t)w->HV * w->K * 4);
    a->cu_seqlens = managed_copy(w->s.cu_seqlens, (size_t)(w->N + 1) * 8);
    w->d_o = mfloats(n[R_O]);
    w->dht = mfloats(ns);
    fill(w->d_o, n[R_O], cfg->seed + 101);
    fill(w->dht, ns, cfg->seed + 202);
}

/* The unsplit run of w on ctx into r */
static void run_whole(kda_context_t *ctx, const whole_t *w, result_t *r) {
    kda_args_t a = w->a;
    a.o = r->x[R_O];
    a.final_state = r->x[R_HT];
    CHECK(forward(ctx, &a) == KDA_STATUS_SUCCESS, "unsplit forward: %s", kda_last_error());
    kda_backward_args_t b;
    bwd_args(&b, &a);
    b.d_o = w->d_o;
    b.d_final_state = w->dht;
    b.dq = r->x[R_DQ], b.dk = r->x[R_DK], b.dv = r->x[R_DV], b.dg = r->x[R_DG], b.dbeta = r->x[R_DBETA];
    b.d_initial_state = a.initial_state ? r->x[R_DH0] : NULL;
    if (a.use_gate_in_kernel) {
        b.dA_log = a.A_log ? r->x[R_DA] : NULL;
        b.ddt_bias = a.dt_bias ? r->x[R_DDT] : NULL;
    }
    CHECK(backward(ctx, &b) == KDA_STATUS_SUCCESS, "unsplit backward: %s", kda_last_error());
}

/* ---------------------------------------------------------------------------------------------------------
 * The split (as tests/cpu/test_xcp.c: rank r holds tokens [cut[r], cut[r + 1]); an empty slice holds the empty
 * part of the sequence at its position)
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t t0, t1, N, seq[MAX_LOCAL];
    int64_t *cu; /* managed */
    int pre, post;
    kda_args_t a;
    kda_backward_args_t b;
    float *h0, *ht, *dht, *dh0, *dA, *ddt;
} rank_t;

static void split(const whole_t *w, int R, const int64_t *cut, rank_t *rk) {
    const int64_t *gcu = w->s.cu_seqlens;
    for (int r = 0; r < R; r++) {
        rank_t *x = &rk[r];
        memset(x, 0, sizeof *x);
        x->t0 = cut[r], x->t1 = cut[r + 1];
        x->cu = (int64_t *)managed((MAX_LOCAL + 1) * 8);
        for (int64_t n = 0; n < w->N; n++) {
            const int64_t lo = gcu[n] > x->t0 ? gcu[n] : x->t0, hi = gcu[n + 1] < x->t1 ? gcu[n + 1] : x->t1;
            if (lo < hi && x->N < MAX_LOCAL) {
                x->seq[x->N] = n;
                x->cu[++x->N] = hi - x->t0;
            }
        }
        if (x->N == 0) {
            int64_t n = w->N - 1;
            for (int64_t m = 0; m < w->N; m++)
                if (gcu[m] <= x->t0 && x->t0 < gcu[m + 1]) n = m;
            x->seq[0] = n;
            x->N = 1;
        }
    }
    for (int r = 0; r < R; r++) {
        rank_t *x = &rk[r];
        for (int j = r - 1; j >= 0 && rk[j].seq[rk[j].N - 1] == x->seq[0]; j--) x->pre++;
        for (int j = r + 1; j < R && rk[j].seq[0] == x->seq[x->N - 1]; j++) x->post++;
    }
}

static void rank_args(const whole_t *w, rank_t *x, int R, int r, result_t *out) {
    const int64_t e = (int64_t)w->HV * w->K * w->V, t0 = x->t0;
    x->a = w->a;
    x->a.seq_len = x->t1 - x->t0;
    x->a.cu_seqlens = x->cu;
    x->a.cu_seqlens_dtype = KDA_INT64;
    x->a.num_seqs = x->N;
    x->a.q = (const float *)w->a.q + t0 * w->HQK * w->K;
    x->a.k = (const float *)w->a.k + t0 * w->HQK * w->K;
    x->a.v = (const float *)w->a.v + t0 * w->HV * w->V;
    x->a.g = (const float *)w->a.g + t0 * w->HV * w->K;
    x->a.beta = (const float *)w->a.beta + t0 * w->HV;
    x->a.o = out->x[R_O] + t0 * w->HV * w->V;
    x->h0 = mfloats(x->N * e), x->ht = mfloats(x->N * e), x->dht = mfloats(x->N * e), x->dh0 = mfloats(x->N * e);
    x->dA = mfloats(w->HV), x->ddt = mfloats((int64_t)w->HV * w->K);
    for (int64_t m = 0; m < x->N; m++) {
        const int64_t n = x->seq[m];
        const int continued = m == 0 && x->pre > 0, continues = m == x->N - 1 && x->post > 0;
        for (int64_t i = 0; i < e; i++) { /* entries the rank must not read are NaN: the folds replace them */
            const float h0 = w->a.initial_state ? ((const float *)w->a.initial_state)[n * e + i] : 0.0f;
            x->h0[m * e + i] = continued ? NAN : h0;
            x->dht[m * e + i] = continues ? NAN : w->dht[n * e + i];
        }
    }
    x->a.initial_state = w->a.initial_state ? x->h0 : NULL;
    x->a.final_state = x->ht;
    x->a.cp_num_ranks = R, x->a.cp_rank = r, x->a.cp_pre_ranks = x->pre, x->a.cp_post_ranks = x->post;
    bwd_args(&x->b, &x->a);
    x->b.d_o = w->d_o + t0 * w->HV * w->V;
    x->b.d_final_state = x->dht;
    x->b.dq = out->x[R_DQ] + t0 * w->HQK * w->K;
    x->b.dk = out->x[R_DK] + t0 * w->HQK * w->K;
    x->b.dv = out->x[R_DV] + t0 * w->HV * w->V;
    x->b.dg = out->x[R_DG] + t0 * w->HV * w->K;
    x->b.dbeta = out->x[R_DBETA] + t0 * w->HV;
    x->b.d_initial_state = w->a.initial_state ? x->dh0 : NULL;
    if (w->a.use_gate_in_kernel) {
        x->b.dA_log = w->a.A_log ? x->dA : NULL;
        x->b.ddt_bias = w->a.dt_bias ? x->ddt : NULL;
    }
}

/* The R-way split of w on the GPU, assembled into out. primed: every rank's forward summary and forward share one
 * workspace with cp_primed (pieces of one chunk, the lengths on the host too, so that a rank holding one sequence
 * part of two chunks or more takes the primed path) */
static void run_split(const char *what, kda_context_t *ctx, const whole_t *w, int R, const int64_t *cut, int primed,
                      result_t *out) {
    rank_t rk[MAX_RANKS];
    void *ws_keep[MAX_RANKS] = {NULL};
    size_t ws_keep_bytes[MAX_RANKS] = {0};
    split(w, R, cut, rk);
    for (int r = 0; r < R; r++) {
        rank_args(w, &rk[r], R, r, out);
        if (primed) {
            rk[r].a.cp_mode = KDA_CP_ON;
            rk[r].a.cp_piece_len = 64;
            rk[r].a.cu_seqlens_host = rk[r].cu;
            rk[r].a.cp_primed = 1;
        }
    }
    size_t sb = 0;
    CHECK(kda_cp_summary_size(ctx, &rk[0].a, &sb) == KDA_STATUS_SUCCESS, "%s: summary size: %s", what,
          kda_last_error());
    char *fwd = managed((size_t)R * sb), *bwd = managed((size_t)R * sb);
    for (int r = 0; r < R; r++) {
        size_t wsb = 0;
        CHECK(kda_cp_forward_summary_workspace_size(ctx, &rk[r].a, &wsb) == KDA_STATUS_SUCCESS, "%s: %s", what,
              kda_last_error());
        if (primed) { /* one workspace for the summary and the forward (which needs the gather to be sized) */
            size_t fb = 0;
            kda_args_t fa = rk[r].a;
            fa.cp_summaries = fwd;
            fa.cp_summaries_bytes = (size_t)R * sb;
            CHECK(kda_forward_workspace_size(ctx, &fa, &fb) == KDA_STATUS_SUCCESS, "%s: %s", what, kda_last_error());
            wsb = fb > wsb ? fb : wsb;
        }
        void *ws = managed(wsb);
        CHECK(kda_cp_forward_summary(ctx, &rk[r].a, fwd + r * sb, sb, ws, wsb, NULL) == KDA_STATUS_SUCCESS,
              "%s: rank %d forward summary: %s", what, r, kda_last_error());
        CUDA_OK(cudaDeviceSynchronize());
        if (primed) {
            ws_keep[r] = ws;
            ws_keep_bytes[r] = wsb;
        } else {
            CUDA_OK(cudaFree(ws));
        }
        if (primed) continue; /* the forward's path alone (the backward's is the unprimed run's) */
        CHECK(kda_cp_backward_summary_workspace_size(ctx, &rk[r].b, &wsb) == KDA_STATUS_SUCCESS, "%s: %s", what,
              kda_last_error());
        ws = managed(wsb);
        CHECK(kda_cp_backward_summary(ctx, &rk[r].b, bwd + r * sb, sb, ws, wsb, NULL) == KDA_STATUS_SUCCESS,
              "%s: rank %d backward summary: %s", what, r, kda_last_error());
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaFree(ws));
    }
    for (int r = 0; r < R; r++) {
        rk[r].a.cp_summaries = fwd;
        rk[r].a.cp_summaries_bytes = (size_t)R * sb;
        rk[r].b.cp_summaries = bwd;
        rk[r].b.cp_summaries_bytes = (size_t)R * sb;
        if (primed) {
            CHECK(kda_forward(ctx, &rk[r].a, ws_keep[r], ws_keep_bytes[r], NULL) == KDA_STATUS_SUCCESS,
                  "%s: rank %d primed forward: %s", what, r, kda_last_error());
            CUDA_OK(cudaDeviceSynchronize());
            CUDA_OK(cudaFree(ws_keep[r]));
            continue;
        }
        CHECK(forward(ctx, &rk[r].a) == KDA_STATUS_SUCCESS, "%s: rank %d forward: %s", what, r, kda_last_error());
        CHECK(backward(ctx, &rk[r].b) == KDA_STATUS_SUCCESS, "%s: rank %d backward: %s", what, r, kda_last_error());
    }
    const int64_t e = (int64_t)w->HV * w->K * w->V;
    int zero_ok = 1;
    for (int r = 0; r < R; r++) {
        for (int64_t m = 0; m < rk[r].N; m++) {
            const int64_t n = rk[r].seq[m];
            if (!(m == rk[r].N - 1 && rk[r].post > 0)) memcpy(out->x[R_HT] + n * e, rk[r].ht + m * e, 4 * (size_t)e);
            if (!(m == 0 && rk[r].pre > 0)) memcpy(out->x[R_DH0] + n * e, rk[r].dh0 + m * e, 4 * (size_t)e);
            else
                for (int64_t i = 0; w->a.initial_state && i < e; i++) zero_ok &= rk[r].dh0[m * e + i] == 0.0f;
        }
        for (int h = 0; h < w->HV; h++) out->x[R_DA][h] += rk[r].dA[h];
        for (int i = 0; i < w->HV * w->K; i++) out->x[R_DDT][i] += rk[r].ddt[i];
        float *f[] = {rk[r].h0, rk[r].ht, rk[r].dht, rk[r].dh0, rk[r].dA, rk[r].ddt};
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) CUDA_OK(cudaFree(f[i]));
        CUDA_OK(cudaFree(rk[r].cu));
    }
    CHECK(zero_ok || primed, "%s: d_initial_state of a continued sequence is not zero", what);
    CUDA_OK(cudaFree(fwd));
    CUDA_OK(cudaFree(bwd));
}

/* ---------------------------------------------------------------------------------------------------------
 * The cases
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int R;
    int64_t cut[MAX_RANKS + 1];
} split_t;

static int used(const whole_t *w, int i) {
    if (i == R_DH0) return w->a.initial_state != NULL;
    if (i == R_DA) return w->a.use_gate_in_kernel && w->a.A_log;
    if (i == R_DDT) return w->a.use_gate_in_kernel && w->a.dt_bias;
    return 1;
}

static void run_case(const char *tag, const kda_synth_config_t *c, const split_t *splits, int nsplits) {
    kda_context_t *ctx = gpu();
    whole_t w;
    whole_make(&w, c);
    result_t ref, one;
    result_make(&w, &ref);
    result_make(&w, &one);
    run_whole(kda_test_reference(), &w, &ref);
    run_whole(ctx, &w, &one);
    for (int s = 0; s < 2 * nsplits; s++) {
        result_t sp;
        result_make(&w, &sp);
        char what[96];
        const int primed = s >= nsplits, k = s % nsplits;
        snprintf(what, sizeof what, "%s R=%d split %d%s", tag, splits[k].R, k, primed ? " primed" : "");
        run_split(what, ctx, &w, splits[k].R, splits[k].cut, primed, &sp);
        printf("%s:", what);
        for (int i = 0; i < R_N; i++) {
            if (!used(&w, i) || (primed && i > R_HT)) continue;
            const double e1 = kda_rel_err(one.x[i], KDA_FLOAT32, ref.x[i], KDA_FLOAT32, w.n[i]);
            const double es = kda_rel_err(sp.x[i], KDA_FLOAT32, ref.x[i], KDA_FLOAT32, w.n[i]);
            printf(" %s %.2e/%.2e", names[i], es, e1);
            const double bound = i <= R_HT ? 1.1 * e1 + 1e-4 : 4.0 * e1 + 2e-4;
            CHECK(es <= bound, "%s: %s error %.3g against the oracle, the unsplit run's %.3g", what, names[i], es, e1);
        }
        printf("\n");
        result_free(&sp);
    }
    result_free(&ref);
    result_free(&one);
    kda_synth_free(&w.s);
}

static const int64_t LENS[] = {300, 37, 200};
static const split_t SPLITS[] = {
    {1, {0, 537}},
    {2, {0, 150, 537}},                          /* the first sequence over two ranks */
    {2, {0, 300, 537}},                          /* a cut on a sequence boundary */
    {3, {0, 200, 400, 537}},                     /* 300 over two ranks, the last from rank 1 to 2 */
    {4, {0, 64, 64, 337, 537}},                  /* an empty slice inside a sequence, a cut on a boundary */
    {7, {0, 0, 100, 200, 300, 300, 536, 537}},   /* empty first slice, 300 over 3, empty on a boundary, 1-token last */
};

static kda_synth_config_t base_cfg(void) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.num_seqs = 3;
    c.seqlens = LENS;
    c.hqk = c.hv = 2;
    c.k = c.v = 64;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    c.initial_state_dtype = c.final_state_dtype = KDA_FLOAT32;
    c.gate = KDA_GATE_SOFTPLUS;
    c.l2norm = 1;
    c.seed = 11;
    return c;
}

/* The shape: T = 4 x 32768 over R = 4 ranks, H8, K = V = 128, bf16, against the CPU backend (fp32, ~1e-5
 * here: a stand-in for the fp64 oracle at this size), and the costs on one rank of 32768 tokens that continues
 * from an earlier one: its summary and its folding forward against its plain forward (medians of CUDA events) */
/* Medians of CUDA events over a call: what 0 the forward, 1 the summary (into a scratch summary: the gathered ones
 * the forward folds stay as they are), 2 the primed pair on one workspace (the summary, then the forward) */
static float time_ms(kda_context_t *ctx, const kda_args_t *a, int what) {
    size_t b = 0, sb = 0;
    if (what) {
        CHECK(kda_cp_forward_summary_workspace_size(ctx, a, &b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        CHECK(kda_cp_summary_size(ctx, a, &sb) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    }
    if (what != 1) {
        size_t fb = 0;
        CHECK(kda_forward_workspace_size(ctx, a, &fb) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        CHECK(what != 2 || b == fb, "a primed summary's workspace (%zu bytes) is not the forward's (%zu)", b, fb);
        b = fb;
    }
    void *ws = NULL, *sum = NULL;
    CUDA_OK(cudaMalloc(&ws, b + 16));
    CUDA_OK(cudaMalloc(&sum, sb + 16));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    float t[15];
    for (int i = -3; i < 15; i++) {
        CUDA_OK(cudaEventRecord(e0, 0));
        kda_status_t st = what ? kda_cp_forward_summary(ctx, a, sum, sb, ws, b, NULL) : KDA_STATUS_SUCCESS;
        if (st == KDA_STATUS_SUCCESS && what != 1) st = kda_forward(ctx, a, ws, b, NULL);
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CHECK(st == KDA_STATUS_SUCCESS, "timed call: %s", kda_last_error());
        if (i >= 0) CUDA_OK(cudaEventElapsedTime(&t[i], e0, e1));
    }
    for (int i = 0; i < 15; i++) /* insertion sort for the median */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const float x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    CUDA_OK(cudaFree(ws));
    CUDA_OK(cudaFree(sum));
    return t[7];
}

static void xcp_perf(void) {
    kda_context_t *ctx = gpu(), *cpu = NULL;
    CHECK(kda_create(&cpu, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "cpu context: %s", kda_last_error());
    static const int64_t lens[] = {4 * 32768};
    kda_synth_config_t c = base_cfg();
    c.num_seqs = 1;
    c.seqlens = lens;
    c.hqk = c.hv = 8;
    c.k = c.v = 128;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_BFLOAT16;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.beta_sigmoid = 1;
    whole_t w;
    whole_make(&w, &c);
    const int64_t no = w.n[R_O], ns = w.n[R_HT];
    void *o_ref = managed((size_t)no * 2), *o_one = managed((size_t)no * 2), *o_sp = managed((size_t)no * 2);
    float *ht_ref = mfloats(ns), *ht_one = mfloats(ns), *ht_sp = mfloats(ns);
    kda_args_t a = w.a;
    a.o = o_ref, a.final_state = ht_ref;
    CHECK(forward(cpu, &a) == KDA_STATUS_SUCCESS, "cpu forward: %s", kda_last_error());
    a.o = o_one, a.final_state = ht_one;
    CHECK(forward(ctx, &a) == KDA_STATUS_SUCCESS, "cuda forward: %s", kda_last_error());
    /* the split, forward only: every summary, then every rank's forward */
    const int R = 4;
    const int64_t L = 32768, HV = w.HV, K = w.K, V = w.V, es = 2;
    size_t sb = 0;
    kda_args_t rk[4];
    for (int r = 0; r < R; r++) {
        kda_args_t *x = &rk[r];
        *x = w.a;
        x->cu_seqlens = NULL;
        x->num_seqs = 0;
        x->batch = 1;
        x->seq_len = L;
        x->q = (const char *)w.a.q + (size_t)(r * L * w.HQK * K) * es;
        x->k = (const char *)w.a.k + (size_t)(r * L * w.HQK * K) * es;
        x->v = (const char *)w.a.v + (size_t)(r * L * HV * V) * es;
        x->g = (const char *)w.a.g + (size_t)(r * L * HV * K) * es;
        x->beta = (const char *)w.a.beta + (size_t)(r * L * HV) * es;
        x->o = (char *)o_sp + (size_t)(r * L * HV * V) * es;
        x->initial_state = r == 0 ? w.a.initial_state : NULL;
        x->final_state = r == R - 1 ? (void *)ht_sp : NULL;
        x->cp_num_ranks = R, x->cp_rank = r, x->cp_pre_ranks = r, x->cp_post_ranks = R - 1 - r;
    }
    CHECK(kda_cp_summary_size(ctx, &rk[0], &sb) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    char *sums = managed((size_t)R * sb);
    for (int r = 0; r < R; r++) {
        size_t b = 0;
        CHECK(kda_cp_forward_summary_workspace_size(ctx, &rk[r], &b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        void *ws = managed(b);
        CHECK(kda_cp_forward_summary(ctx, &rk[r], sums + r * sb, sb, ws, b, NULL) == KDA_STATUS_SUCCESS, "%s",
              kda_last_error());
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaFree(ws));
    }
    for (int r = 0; r < R; r++) {
        rk[r].cp_summaries = sums;
        rk[r].cp_summaries_bytes = (size_t)R * sb;
        CHECK(forward(ctx, &rk[r]) == KDA_STATUS_SUCCESS, "rank %d forward: %s", r, kda_last_error());
    }
    const double eo1 = kda_rel_err(o_one, KDA_BFLOAT16, o_ref, KDA_BFLOAT16, no),
                 eos = kda_rel_err(o_sp, KDA_BFLOAT16, o_ref, KDA_BFLOAT16, no),
                 eh1 = kda_rel_err(ht_one, KDA_FLOAT32, ht_ref, KDA_FLOAT32, ns),
                 ehs = kda_rel_err(ht_sp, KDA_FLOAT32, ht_ref, KDA_FLOAT32, ns);
    printf("T 4x32768 H8 K=V=128 R=4: o error %.3e split / %.3e unsplit (%.3fx), final state %.3e / %.3e (%.3fx)\n",
           eos, eo1, eos / eo1, ehs, eh1, ehs / eh1);
    CHECK(eos <= 1.1 * eo1 && ehs <= 1.1 * eh1, "the split's error beyond 1.1x the unsplit run's");
    /* the same split primed: each rank's summary and forward on one workspace */
    char *sums_p = managed((size_t)R * sb);
    void *wsp[4];
    size_t wspb[4];
    kda_args_t rkp[4];
    for (int r = 0; r < R; r++) {
        rkp[r] = rk[r];
        rkp[r].cp_summaries = NULL;
        rkp[r].cp_summaries_bytes = 0;
        rkp[r].cp_primed = 1;
        size_t b = 0;
        CHECK(kda_cp_forward_summary_workspace_size(ctx, &rkp[r], &b) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        wsp[r] = managed(b), wspb[r] = b;
        CHECK(kda_cp_forward_summary(ctx, &rkp[r], sums_p + r * sb, sb, wsp[r], b, NULL) == KDA_STATUS_SUCCESS,
              "rank %d primed summary: %s", r, kda_last_error());
    }
    CUDA_OK(cudaDeviceSynchronize());
    const double dsum = kda_rel_err(sums_p, KDA_FLOAT32, sums, KDA_FLOAT32, (int64_t)(R * sb / 4));
    memset(o_sp, 0, (size_t)no * 2);
    memset(ht_sp, 0, (size_t)ns * 4);
    for (int r = 0; r < R; r++) {
        rkp[r].cp_summaries = sums_p;
        rkp[r].cp_summaries_bytes = (size_t)R * sb;
        CHECK(kda_forward(ctx, &rkp[r], wsp[r], wspb[r], NULL) == KDA_STATUS_SUCCESS, "rank %d primed forward: %s", r,
              kda_last_error());
    }
    CUDA_OK(cudaDeviceSynchronize());
    /* a primed forward takes its summary's work once: a second one is refused, naming cp_primed */
    const kda_status_t again = kda_forward(ctx, &rkp[2], wsp[2], wspb[2], NULL);
    CHECK(again == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "cp_primed"),
          "a second primed forward: status %d, '%s'", (int)again, kda_last_error());
    for (int r = 0; r < R; r++) CUDA_OK(cudaFree(wsp[r]));
    const double epo = kda_rel_err(o_sp, KDA_BFLOAT16, o_ref, KDA_BFLOAT16, no),
                 eph = kda_rel_err(ht_sp, KDA_FLOAT32, ht_ref, KDA_FLOAT32, ns);
    printf("primed: o error %.3e (%.3fx the unsplit run's), final state %.3e (%.3fx); summaries %.2e from the "
           "unprimed ones\n",
           epo, epo / eo1, eph, eph / eh1, dsum);
    CHECK(epo <= 1.1 * eo1 && eph <= 1.1 * eh1, "the primed split's error beyond 1.1x the unsplit run's");
    kda_args_t plain = rk[2];
    plain.cp_num_ranks = plain.cp_rank = plain.cp_pre_ranks = plain.cp_post_ranks = 0;
    plain.cp_summaries = NULL;
    plain.cp_summaries_bytes = 0;
    plain.initial_state = w.a.initial_state;
    const float t_plain = time_ms(ctx, &plain, 0), t_fold = time_ms(ctx, &rk[2], 0), t_sum = time_ms(ctx, &rk[2], 1);
    printf("rank 2 of 4 (32768 tokens, H8): plain forward %.4f ms, folding forward %.4f ms (+%.1f%%), summary "
           "%.4f ms (%.1f%% of the plain forward); all-gather %zu bytes (R x HV x K x (K+V) x 4)\n",
           t_plain, t_fold, 100.0 * (t_fold - t_plain) / t_plain, t_sum, 100.0 * t_sum / t_plain, (size_t)R * sb);
    /* primed: the pair's time over the plain forward's is what the split costs a rank that makes a summary (ranks
       0 .. 2; rank 1 folds one map, which is a copy, and rank 2 two) */
    for (int r = 0; r < R - 1; r++) {
        kda_args_t pl = rk[r];
        pl.cp_num_ranks = pl.cp_rank = pl.cp_pre_ranks = pl.cp_post_ranks = 0;
        pl.cp_summaries = NULL;
        pl.cp_summaries_bytes = 0;
        pl.initial_state = w.a.initial_state;
        const float tp = time_ms(ctx, &pl, 0), ts = time_ms(ctx, &rkp[r], 1), tpair = time_ms(ctx, &rkp[r], 2);
        printf("rank %d of 4 primed: plain forward %.4f ms, summary %.4f + forward %.4f = %.4f ms: +%.1f%% of the "
               "plain forward\n",
               r, tp, ts, tpair - ts, tpair, 100.0 * (tpair - tp) / tp);
    }
    kda_destroy(cpu);
}

/* case 0: plain, K = V = 64; 1: GVA 4x, strong decay, the sigmoid gate with its lower bound, β sigmoid, K = V = 128;
 * 2: states V-first, K = 100, V = 48 */
static void xcp_case(int which) {
    if (which == 3) {
        xcp_perf();
        return;
    }
    kda_synth_config_t c = base_cfg();
    if (which == 1) {
        c.hqk = 1;
        c.hv = 4;
        c.k = c.v = 128;
        c.decay = 30.0f;
        c.gate = KDA_GATE_LOWER_BOUND;
        c.beta_sigmoid = 1;
    } else if (which == 2) {
        c.k = 100;
        c.v = 48;
        c.state_v_first = 1;
    }
    static const char *tags[] = {"cuda", "cuda gva4 strong k128", "cuda v-first k100 v48"};
    run_case(tags[which], &c, SPLITS, (int)(sizeof SPLITS / sizeof SPLITS[0]));
}
#else
static void xcp_case(int which) {
    (void)which;
    SKIP("built without CUDA");
}
#endif

TEST(gpu_xcp_plain) { xcp_case(0); }
TEST(gpu_xcp_gva4_strong_lower_bound_k128) { xcp_case(1); }
TEST(gpu_xcp_vfirst_k100_v48) { xcp_case(2); }
TEST(gpu_xcp_t4x32768_h8_cost) { xcp_case(3); }
