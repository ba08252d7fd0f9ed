/*
 * Context parallelism across ranks (docs/ALGORITHM.md §4a, docs/API.md §14), in one process: one problem cut into
 * R contiguous slices of its packed tokens, each run as a rank (its own cu_seqlens, states of its own sequences),
 * the summaries exchanged by copying into the gathered buffer, against the unsplit call: o, the final states,
 * and every gradient of the backward. The reference backend with fp64 summaries must reproduce its unsplit run
 * to fp64 rounding (outputs are float32: at most one unit in their last place); the CPU backend stays within its
 * usual tolerance of the oracle. Then bad inputs: a status naming the argument, outputs unchanged.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "test_util.h"

#define MAX_RANKS 8
#define MAX_LOCAL 16

/* ---------------------------------------------------------------------------------------------------------
 * A problem and its unsplit results
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    kda_synth_t s;
    kda_args_t a;
    int64_t T, N, nq, nv, ng, nb, ns;
    int K, V, HQK, HV;
    float *d_o, *dht;                                    /* the loss weights */
    float *o, *ht, *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA, *ddt; /* unsplit results */
} whole_t;

static float *falloc(int64_t n) { return (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

static void fill(float *x, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(seed >> 11) / 9007199254740992.0 - 0.5);
    }
}

static size_t workspace_fwd(kda_context_t *ctx, const kda_args_t *a) {
    size_t b = 0;
    CHECK(kda_forward_workspace_size(ctx, a, &b) == KDA_STATUS_SUCCESS, "workspace: %s", kda_last_error());
    return b;
}

static kda_status_t forward(kda_context_t *ctx, const kda_args_t *a) {
    const size_t b = workspace_fwd(ctx, a);
    void *ws = malloc(b + 1);
    const kda_status_t st = kda_forward(ctx, a, ws, b, NULL);
    free(ws);
    return st;
}

static kda_status_t backward(kda_context_t *ctx, const kda_backward_args_t *b) {
    size_t n = 0;
    kda_status_t st = kda_backward_workspace_size(ctx, b, &n);
    if (st != KDA_STATUS_SUCCESS) return st;
    void *ws = malloc(n + 1);
    st = kda_backward(ctx, b, ws, n, NULL);
    free(ws);
    return st;
}

static void bwd_args(kda_backward_args_t *b, const kda_args_t *a) {
    kda_backward_args_init(b);
    b->problem = a;
    b->d_o_dtype = b->d_final_state_dtype = KDA_FLOAT32;
    b->dq_dtype = b->dk_dtype = b->dv_dtype = b->dg_dtype = b->dbeta_dtype = b->d_initial_state_dtype = KDA_FLOAT32;
}

static void whole_make(whole_t *w, const kda_synth_config_t *cfg, kda_context_t *ctx) {
    memset(w, 0, sizeof *w);
    if (kda_synth_make(cfg, &w->s, &w->a) != 0) exit(1);
    w->T = w->s.num_tokens;
    w->N = w->s.num_seqs;
    w->K = cfg->k;
    w->V = cfg->v;
    w->HQK = cfg->hqk;
    w->HV = cfg->hv;
    w->nq = w->T * w->HQK * w->K;
    w->nv = w->T * w->HV * w->V;
    w->ng = w->T * w->HV * w->K;
    w->nb = w->T * w->HV;
    w->ns = w->N * w->HV * w->K * w->V;
    w->d_o = falloc(w->nv);
    w->dht = falloc(w->ns);
    fill(w->d_o, w->nv, cfg->seed + 101);
    fill(w->dht, w->ns, cfg->seed + 202);
    w->o = (float *)w->s.o;
    w->ht = (float *)w->s.ht;
    CHECK(forward(ctx, &w->a) == KDA_STATUS_SUCCESS, "unsplit forward: %s", kda_last_error());
    w->dq = falloc(w->nq);
    w->dk = falloc(w->nq);
    w->dv = falloc(w->nv);
    w->dg = falloc(w->ng);
    w->dbeta = falloc(w->nb);
    w->dh0 = falloc(w->ns);
    w->dA = falloc(w->HV);
    w->ddt = falloc((int64_t)w->HV * w->K);
    kda_backward_args_t b;
    bwd_args(&b, &w->a);
    b.d_o = w->d_o;
    b.d_final_state = w->dht;
    b.dq = w->dq;
    b.dk = w->dk;
    b.dv = w->dv;
    b.dg = w->dg;
    b.dbeta = w->dbeta;
    b.d_initial_state = w->dh0;
    if (w->a.use_gate_in_kernel) {
        b.dA_log = w->a.A_log ? w->dA : NULL;
        b.ddt_bias = w->a.dt_bias ? w->ddt : NULL;
    }
    CHECK(backward(ctx, &b) == KDA_STATUS_SUCCESS, "unsplit backward: %s", kda_last_error());
}

static void whole_free(whole_t *w) {
    float *f[] = {w->d_o, w->dht, w->dq, w->dk, w->dv, w->dg, w->dbeta, w->dh0, w->dA, w->ddt};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) free(f[i]);
    kda_synth_free(&w->s);
}

/* ---------------------------------------------------------------------------------------------------------
 * The split: rank r holds tokens [cut[r], cut[r + 1]); its local sequences are the parts of the global ones that
 * meet its slice, or, for an empty slice, the one empty part of the sequence at that position (the sequence that
 * contains token cut[r], else the last one).
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t t0, t1;               /* the slice */
    int64_t N;                    /* local sequences */
    int64_t seq[MAX_LOCAL];       /* their global index */
    int64_t cu[MAX_LOCAL + 1];    /* local cu_seqlens */
    int pre, post;
    kda_args_t a;
    kda_backward_args_t b;
    float *h0, *ht, *dht, *dh0, *dA, *ddt; /* local state buffers */
} rank_t;

static int64_t gbos(const whole_t *w, int64_t n) { return w->s.cu_seqlens[n]; }
static int64_t geos(const whole_t *w, int64_t n) { return w->s.cu_seqlens[n + 1]; }

/* the ranks' local sequences and chain counts */
static void split(const whole_t *w, int R, const int64_t *cut, rank_t *rk) {
    for (int r = 0; r < R; r++) {
        rank_t *x = &rk[r];
        memset(x, 0, sizeof *x);
        x->t0 = cut[r];
        x->t1 = cut[r + 1];
        for (int64_t n = 0; n < w->N; n++) {
            const int64_t lo = gbos(w, n) > x->t0 ? gbos(w, n) : x->t0, hi = geos(w, n) < x->t1 ? geos(w, n) : x->t1;
            if (lo < hi && x->N < MAX_LOCAL) {
                x->seq[x->N] = n;
                x->cu[x->N + 1] = hi - x->t0;
                x->N++;
            }
        }
        if (x->N == 0) { /* an empty slice: the sequence at its position */
            int64_t n = w->N - 1;
            for (int64_t m = 0; m < w->N; m++)
                if (gbos(w, m) <= x->t0 && x->t0 < geos(w, m)) n = m;
            x->seq[0] = n;
            x->cu[1] = 0;
            x->N = 1;
        }
    }
    for (int r = 0; r < R; r++) { /* chain counts: the consecutive ranks listing the same sequence */
        rank_t *x = &rk[r];
        for (int j = r - 1; j >= 0 && rk[j].seq[rk[j].N - 1] == x->seq[0]; j--) x->pre++;
        for (int j = r + 1; j < R && rk[j].seq[0] == x->seq[x->N - 1]; j++) x->post++;
    }
}

/* Rank r's kda_args_t and kda_backward_args_t over the whole problem's buffers (rows of the slice) and its own
 * states; outputs into the split result arrays at the same rows. */
static int g_primed; /* every rank's calls with cp_primed (the CPU backends compute in full either way) */

static void rank_args(const whole_t *w, rank_t *x, int R, int r, kda_dtype_t sdt, float *o, float *dq, float *dk,
                      float *dv, float *dg, float *dbeta) {
    const int64_t KV = (int64_t)w->K * w->V, t0 = x->t0;
    x->a = w->a;
    x->a.cp_primed = g_primed;
    x->a.batch = 1;
    x->a.seq_len = x->t1 - x->t0;
    x->a.cu_seqlens = x->cu;
    x->a.cu_seqlens_dtype = KDA_INT64;
    x->a.num_seqs = x->N;
    x->a.q = (const float *)w->a.q + t0 * w->HQK * w->K;
    x->a.k = (const float *)w->a.k + t0 * w->HQK * w->K;
    x->a.v = (const float *)w->a.v + t0 * w->HV * w->V;
    x->a.g = (const float *)w->a.g + t0 * w->HV * w->K;
    x->a.beta = (const float *)w->a.beta + t0 * w->HV;
    x->a.o = o + t0 * w->HV * w->V;
    x->h0 = falloc(x->N * w->HV * KV);
    x->ht = falloc(x->N * w->HV * KV);
    x->dht = falloc(x->N * w->HV * KV);
    x->dh0 = falloc(x->N * w->HV * KV);
    x->dA = falloc(w->HV);
    x->ddt = falloc((int64_t)w->HV * w->K);
    for (int64_t m = 0; m < x->N; m++) {
        const int64_t n = x->seq[m], e = w->HV * KV;
        const int continued = m == 0 && x->pre > 0, continues = m == x->N - 1 && x->post > 0;
        for (int64_t i = 0; i < e; i++) {
            /* an entry the rank must not read is NaN: the fold replaces it */
            const float h0 = w->a.initial_state ? ((const float *)w->a.initial_state)[n * e + i] : 0.0f;
            x->h0[m * e + i] = continued ? NAN : h0;
            x->dht[m * e + i] = continues ? NAN : w->dht[n * e + i];
        }
    }
    x->a.initial_state = w->a.initial_state ? x->h0 : NULL;
    x->a.final_state = x->ht;
    x->a.cp_num_ranks = R;
    x->a.cp_rank = r;
    x->a.cp_pre_ranks = x->pre;
    x->a.cp_post_ranks = x->post;
    x->a.cp_summary_dtype = sdt;
    bwd_args(&x->b, &x->a);
    x->b.d_o = w->d_o + t0 * w->HV * w->V;
    x->b.d_final_state = x->dht;
    x->b.dq = dq + t0 * w->HQK * w->K;
    x->b.dk = dk + t0 * w->HQK * w->K;
    x->b.dv = dv + t0 * w->HV * w->V;
    x->b.dg = dg + t0 * w->HV * w->K;
    x->b.dbeta = dbeta + t0 * w->HV;
    x->b.d_initial_state = w->a.initial_state ? x->dh0 : NULL;
    if (w->a.use_gate_in_kernel) {
        x->b.dA_log = w->a.A_log ? x->dA : NULL;
        x->b.ddt_bias = w->a.dt_bias ? x->ddt : NULL;
    }
}

static void rank_free(rank_t *x) {
    float *f[] = {x->h0, x->ht, x->dht, x->dh0, x->dA, x->ddt};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) free(f[i]);
}

/* max |x − ref| / max |ref| (NaN anywhere: infinite); with g_norm, ||x − ref|| / ||ref|| (the CPU tests' measure) */
static int g_norm;
static double max_rel(const float *x, const float *ref, int64_t n) {
    if (g_norm) return kda_rel_err(x, KDA_FLOAT32, ref, KDA_FLOAT32, n);
    double d = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i]) || isnan(ref[i])) return INFINITY;
        d = fmax(d, fabs((double)x[i] - ref[i]));
        m = fmax(m, fabs((double)ref[i]));
    }
    return m > 0 ? d / m : d;
}

static void check_result(const char *what, const char *name, const float *x, const float *ref, int64_t n, double tol) {
    if (n == 0) return;
    const double e = max_rel(x, ref, n);
    CHECK(e <= tol, "%s: %s max relative error %.3g > %.3g", what, name, e, tol);
}

/* Run the R-way split of w on ctx (summaries in sdt) and compare it with `ref` (the unsplit run). */
static void run_split(const char *what, kda_context_t *ctx, const whole_t *w, const whole_t *ref, int R,
                      const int64_t *cut, kda_dtype_t sdt, double tol, double sum_tol) {
    rank_t rk[MAX_RANKS];
    split(w, R, cut, rk);
    float *o = falloc(w->nv), *dq = falloc(w->nq), *dk = falloc(w->nq), *dv = falloc(w->nv), *dg = falloc(w->ng),
          *dbeta = falloc(w->nb);
    for (int r = 0; r < R; r++) rank_args(w, &rk[r], R, r, sdt, o, dq, dk, dv, dg, dbeta);
    size_t sb = 0;
    CHECK(kda_cp_summary_size(ctx, &rk[0].a, &sb) == KDA_STATUS_SUCCESS, "%s: summary size: %s", what,
          kda_last_error());
    char *fwd = calloc((size_t)R, sb), *bwd = calloc((size_t)R, sb);
    /* every summary first (neither needs another rank's), then the exchange, then the calls */
    for (int r = 0; r < R; r++) {
        size_t wsb = 0;
        CHECK(kda_cp_forward_summary_workspace_size(ctx, &rk[r].a, &wsb) == KDA_STATUS_SUCCESS, "%s: %s", what,
              kda_last_error());
        void *ws = malloc(wsb + 1);
        CHECK(kda_cp_forward_summary(ctx, &rk[r].a, fwd + r * sb, sb, ws, wsb, NULL) == KDA_STATUS_SUCCESS,
              "%s: rank %d forward summary: %s", what, r, kda_last_error());
        free(ws);
        CHECK(kda_cp_backward_summary_workspace_size(ctx, &rk[r].b, &wsb) == KDA_STATUS_SUCCESS, "%s: %s", what,
              kda_last_error());
        ws = malloc(wsb + 1);
        CHECK(kda_cp_backward_summary(ctx, &rk[r].b, bwd + r * sb, sb, ws, wsb, NULL) == KDA_STATUS_SUCCESS,
              "%s: rank %d backward summary: %s", what, r, kda_last_error());
        free(ws);
    }
    for (int r = 0; r < R; r++) {
        char *gf = malloc((size_t)R * sb), *gb = malloc((size_t)R * sb); /* each rank's own copy of the gather */
        memcpy(gf, fwd, (size_t)R * sb);
        memcpy(gb, bwd, (size_t)R * sb);
        rk[r].a.cp_summaries = gf;
        rk[r].a.cp_summaries_bytes = (size_t)R * sb;
        rk[r].b.cp_summaries = gb;
        rk[r].b.cp_summaries_bytes = (size_t)R * sb;
        CHECK(forward(ctx, &rk[r].a) == KDA_STATUS_SUCCESS, "%s: rank %d forward: %s", what, r, kda_last_error());
        CHECK(backward(ctx, &rk[r].b) == KDA_STATUS_SUCCESS, "%s: rank %d backward: %s", what, r, kda_last_error());
    }
    check_result(what, "o", o, ref->o, w->nv, tol);
    check_result(what, "dq", dq, ref->dq, w->nq, tol);
    check_result(what, "dk", dk, ref->dk, w->nq, tol);
    check_result(what, "dv", dv, ref->dv, w->nv, tol);
    check_result(what, "dg", dg, ref->dg, w->ng, tol);
    check_result(what, "dbeta", dbeta, ref->dbeta, w->nb, tol);
    /* states: the final state from the rank of each sequence's last part, d_initial_state from its first; the
       other parts' d_initial_state is zero */
    const int64_t e = w->HV * (int64_t)w->K * w->V;
    float *ht = falloc(w->ns), *dh0 = falloc(w->ns);
    int zero_ok = 1;
    for (int r = 0; r < R; r++)
        for (int64_t m = 0; m < rk[r].N; m++) {
            const int64_t n = rk[r].seq[m];
            if (!(m == rk[r].N - 1 && rk[r].post > 0)) memcpy(ht + n * e, rk[r].ht + m * e, sizeof(float) * e);
            if (!(m == 0 && rk[r].pre > 0)) memcpy(dh0 + n * e, rk[r].dh0 + m * e, sizeof(float) * e);
            else if (w->a.initial_state)
                for (int64_t i = 0; i < e; i++) zero_ok &= rk[r].dh0[m * e + i] == 0.0f;
        }
    check_result(what, "final_state", ht, ref->ht, w->ns, tol);
    if (w->a.initial_state) {
        check_result(what, "d_initial_state", dh0, ref->dh0, w->ns, tol);
        CHECK(zero_ok, "%s: d_initial_state of a continued sequence is not zero", what);
    }
    if (w->a.use_gate_in_kernel) {
        float *dA = falloc(w->HV), *ddt = falloc((int64_t)w->HV * w->K);
        for (int r = 0; r < R; r++) {
            for (int h = 0; h < w->HV; h++) dA[h] += rk[r].dA[h];
            for (int i = 0; i < w->HV * w->K; i++) ddt[i] += rk[r].ddt[i];
        }
        if (w->a.A_log) check_result(what, "dA_log", dA, ref->dA, w->HV, sum_tol);
        if (w->a.dt_bias) check_result(what, "ddt_bias", ddt, ref->ddt, (int64_t)w->HV * w->K, sum_tol);
        free(dA);
        free(ddt);
    }
    for (int r = 0; r < R; r++) {
        free((void *)rk[r].a.cp_summaries);
        free((void *)rk[r].b.cp_summaries);
        rank_free(&rk[r]);
    }
    free(ht);
    free(dh0);
    free(fwd);
    free(bwd);
    free(o);
    free(dq);
    free(dk);
    free(dv);
    free(dg);
    free(dbeta);
}

/* ---------------------------------------------------------------------------------------------------------
 * The cases
 * ------------------------------------------------------------------------------------------------------- */
static kda_synth_config_t base_cfg(const int64_t *lens, int64_t n) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.num_seqs = n;
    c.seqlens = lens;
    c.hqk = c.hv = 2;
    c.k = 16;
    c.v = 12;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = 1;
    c.initial_state_dtype = KDA_FLOAT32;
    c.final_state = 1;
    c.final_state_dtype = KDA_FLOAT32;
    c.gate = KDA_GATE_SOFTPLUS;
    c.seed = 7;
    return c;
}

static kda_context_t *cpu_ctx(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS) kda_set_num_threads(ctx, 2);
    return ctx;
}

/* The splits of a 200-token problem of sequences 90, 37, 73: R in {1, 2, 3, 4, 7}; cuts inside sequences
 * (several ranks per sequence), exactly on sequence boundaries, and empty slices (repeated cuts, at 0 and T). */
static const int64_t LENS[] = {90, 37, 73};
typedef struct {
    int R;
    int64_t cut[MAX_RANKS + 1];
} split_t;
static const split_t SPLITS[] = {
    {1, {0, 200}},
    {2, {0, 45, 200}},                         /* the first sequence over two ranks */
    {2, {0, 90, 200}},                         /* a cut on a sequence boundary */
    {3, {0, 100, 150, 200}},                   /* the last sequence from rank 1 to 2 */
    {4, {0, 20, 60, 127, 200}},                /* 90 over three ranks; 127 = a boundary */
    {4, {0, 50, 50, 170, 200}},                /* an empty slice inside a sequence */
    {7, {0, 0, 30, 60, 90, 90, 199, 200}},     /* empty first slice, 90 over 3, empty on a boundary, 1-token last */
    {7, {0, 10, 20, 30, 40, 200, 200, 200}},   /* the last ranks empty at the end */
};

static void all_splits(const char *tag, kda_context_t *ctx, const kda_synth_config_t *c, const whole_t *oracle,
                       kda_dtype_t sdt, double tol, double sum_tol) {
    whole_t w;
    whole_make(&w, c, ctx);
    for (size_t i = 0; i < sizeof SPLITS / sizeof SPLITS[0]; i++) {
        char what[96];
        snprintf(what, sizeof what, "%s R=%d split %zu", tag, SPLITS[i].R, i);
        run_split(what, ctx, &w, oracle ? oracle : &w, SPLITS[i].R, SPLITS[i].cut, sdt, tol, sum_tol);
    }
    whole_free(&w);
}

/* fp64 summaries: the split differs from the unsplit oracle by fp64 rounding, i.e. by at most one float32 unit
 * of an output (2^-23 of the largest |value|, with a factor 2 of margin for the two roundings of a sum) */
#define REF_TOL 2.5e-7

TEST(xcp_reference_exact) {
    kda_synth_config_t c = base_cfg(LENS, 3);
    all_splits("reference", kda_test_reference(), &c, NULL, KDA_FLOAT64, REF_TOL, REF_TOL);
}

TEST(xcp_reference_gva4_strong_decay_l2norm) {
    kda_synth_config_t c = base_cfg(LENS, 3);
    c.hqk = 1;
    c.hv = 4;
    c.decay = 30.0f;
    c.l2norm = 1;
    c.beta_sigmoid = 1;
    all_splits("reference gva4 strong", kda_test_reference(), &c, NULL, KDA_FLOAT64, REF_TOL, REF_TOL);
}

TEST(xcp_reference_fp32_summaries_vfirst_lower_bound) {
    kda_synth_config_t c = base_cfg(LENS, 3);
    c.state_v_first = 1;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.beta_sigmoid = 1;
    c.allow_neg_eigval = 1;
    all_splits("reference fp32 summaries", kda_test_reference(), &c, NULL, KDA_FLOAT32, 2e-6, 2e-6);
}

/* The CPU backend's usual bounds against the oracle (tests/cpu/test_backward.c: 2e-5, 10x for the sums over every
 * token), here as max-norm errors of the split CPU run against the unsplit oracle. */
static void cpu_vs_oracle(const char *tag, const kda_synth_config_t *c, double tol) {
    kda_context_t *ctx = cpu_ctx();
    CHECK(ctx != NULL, "no CPU context");
    whole_t oracle;
    whole_make(&oracle, c, kda_test_reference());
    g_norm = 1;
    all_splits(tag, ctx, c, &oracle, KDA_FLOAT32, tol, 10 * tol);
    all_splits(tag, ctx, c, &oracle, KDA_FLOAT64, tol, 10 * tol);
    g_norm = 0;
    whole_free(&oracle);
}

TEST(xcp_cpu_plain) {
    kda_synth_config_t c = base_cfg(LENS, 3);
    cpu_vs_oracle("cpu", &c, 2e-5);
}

TEST(xcp_cpu_primed_computes_in_full) {
    kda_synth_config_t c = base_cfg(LENS, 3);
    g_primed = 1;
    cpu_vs_oracle("cpu primed", &c, 2e-5);
    all_splits("reference primed", kda_test_reference(), &c, NULL, KDA_FLOAT64, REF_TOL, REF_TOL);
    g_primed = 0;
}

TEST(xcp_cpu_gva4_strong_decay) {
    kda_synth_config_t c = base_cfg(LENS, 3);
    c.hqk = 1;
    c.hv = 4;
    c.decay = 30.0f;
    c.l2norm = 1;
    cpu_vs_oracle("cpu gva4 strong", &c, 2e-5);
}

/* ---------------------------------------------------------------------------------------------------------
 * Bad inputs: each a status naming the argument, and no output changed (every output poisoned beforehand)
 * ------------------------------------------------------------------------------------------------------- */
typedef enum { CALL_FWD_SUMMARY, CALL_BWD_SUMMARY, CALL_FORWARD, CALL_BACKWARD, CALL_DECODE, CALL_SIZE } call_t;

typedef struct {
    const char *name;
    call_t call;
    int rank;                 /* which rank's arguments to break */
    kda_status_t status;
    const char *arg;          /* the name the message must hold */
    void (*edit)(kda_args_t *a, kda_backward_args_t *b, size_t *summary_bytes, void **summary);
} bad_case_t;

static void e_dtype(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_summary_dtype = KDA_FLOAT16;
}
static void e_short_summary(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)a, (void)b, (void)s;
    *n -= 4;
}
static void e_null_summary(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)a, (void)b, (void)n;
    *s = NULL;
}
static void e_pre_beyond(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_pre_ranks = a->cp_rank + 1;
}
static void e_post_beyond(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_post_ranks = a->cp_num_ranks - a->cp_rank;
}
static void e_rank_beyond(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_rank = a->cp_num_ranks;
}
static void e_negative_ranks(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_num_ranks = -2;
}
static void e_rank_without_ranks(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_num_ranks = 0;
    a->cp_pre_ranks = a->cp_post_ranks = 0;
    a->cp_summaries = NULL;
}
static void e_no_ranks(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_num_ranks = a->cp_rank = a->cp_pre_ranks = a->cp_post_ranks = 0;
    a->cp_summaries = NULL;
}
static void e_null_gathered(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_summaries = NULL;
}
static void e_short_gathered(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_summaries_bytes -= 1;
}
static void e_short_gathered_f64(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_summary_dtype = KDA_FLOAT64; /* the gather was made of float32 summaries: half the bytes */
}
static void e_null_gathered_bwd(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)a, (void)n, (void)s;
    b->cp_summaries = NULL;
}
static void e_short_gathered_bwd(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)a, (void)n, (void)s;
    b->cp_summaries_bytes /= 2;
}
static void e_headwise(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->beta_headwise = 1; /* refused before beta (a scalar β buffer here) is read */
}
static void e_gathered_over_o(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_summaries = a->o;
}
static void e_chunk_states_over_gathered(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->chunk_states = (void *)a->cp_summaries;
}
static void e_dq_over_gathered_bwd(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)a, (void)n, (void)s;
    b->dq = (void *)b->cp_summaries;
}
static void e_dv_over_gathered_fwd(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)n, (void)s;
    b->dv = (void *)a->cp_summaries;
}
static void e_summary_over_q(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n;
    *s = (void *)a->q;
}

static void e_primed_two(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    (void)b, (void)n, (void)s;
    a->cp_primed = 2;
}
static void e_primed_without_ranks(kda_args_t *a, kda_backward_args_t *b, size_t *n, void **s) {
    e_no_ranks(a, b, n, s);
    a->cp_primed = 1;
}

static const bad_case_t BAD_CASES[] = {
    {"primed_two", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_primed'", e_primed_two},
    {"primed_two_summary", CALL_FWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'cp_primed'", e_primed_two},
    {"primed_without_ranks", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_primed'", e_primed_without_ranks},
    {"summary_dtype_f16", CALL_FWD_SUMMARY, 1, KDA_STATUS_INVALID_VALUE, "'cp_summary_dtype'", e_dtype},
    {"summary_dtype_f16_size", CALL_SIZE, 1, KDA_STATUS_INVALID_VALUE, "'cp_summary_dtype'", e_dtype},
    {"summary_dtype_f16_fwd", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summary_dtype'", e_dtype},
    {"summary_short", CALL_FWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'summary_bytes'", e_short_summary},
    {"summary_short_bwd", CALL_BWD_SUMMARY, 1, KDA_STATUS_INVALID_VALUE, "'summary_bytes'", e_short_summary},
    {"summary_null", CALL_FWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'summary'", e_null_summary},
    {"summary_null_bwd", CALL_BWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'summary'", e_null_summary},
    {"summary_over_q", CALL_FWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'summary'", e_summary_over_q},
    {"pre_beyond_rank", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_pre_ranks'", e_pre_beyond},
    {"pre_beyond_rank_summary", CALL_FWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'cp_pre_ranks'", e_pre_beyond},
    {"post_beyond_ranks", CALL_BACKWARD, 0, KDA_STATUS_INVALID_VALUE, "'cp_post_ranks'", e_post_beyond},
    {"post_beyond_ranks_summary", CALL_BWD_SUMMARY, 1, KDA_STATUS_INVALID_VALUE, "'cp_post_ranks'", e_post_beyond},
    {"rank_beyond", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_rank'", e_rank_beyond},
    {"negative_ranks", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_num_ranks'", e_negative_ranks},
    {"rank_without_num_ranks", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_rank'", e_rank_without_ranks},
    {"summary_without_num_ranks", CALL_FWD_SUMMARY, 0, KDA_STATUS_INVALID_VALUE, "'cp_num_ranks'", e_no_ranks},
    {"gathered_null", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summaries'", e_null_gathered},
    {"gathered_null_bwd_problem", CALL_BACKWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summaries'", e_null_gathered},
    {"gathered_short", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summaries_bytes'", e_short_gathered},
    {"gathered_wrong_dtype", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summaries_bytes'",
     e_short_gathered_f64},
    {"gathered_bwd_null", CALL_BACKWARD, 0, KDA_STATUS_INVALID_VALUE, "'cp_summaries'", e_null_gathered_bwd},
    {"gathered_bwd_short", CALL_BACKWARD, 0, KDA_STATUS_INVALID_VALUE, "'cp_summaries_bytes'",
     e_short_gathered_bwd},
    {"gathered_over_o", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summaries'", e_gathered_over_o},
    {"decode_refuses", CALL_DECODE, 1, KDA_STATUS_INVALID_VALUE, "'cp_num_ranks'", NULL},
    {"headwise_beta", CALL_FWD_SUMMARY, 1, KDA_STATUS_NOT_SUPPORTED, "'beta_headwise'", e_headwise},
    {"chunk_states_over_gathered", CALL_FORWARD, 1, KDA_STATUS_INVALID_VALUE, "'cp_summaries'",
     e_chunk_states_over_gathered},
    {"dq_over_gathered_bwd", CALL_BACKWARD, 0, KDA_STATUS_INVALID_VALUE, "'dq'", e_dq_over_gathered_bwd},
    {"dv_over_gathered_fwd", CALL_BACKWARD, 1, KDA_STATUS_INVALID_VALUE, "'dv'", e_dv_over_gathered_fwd},
};

/* Bytes of a float32 buffer, for the unchanged check */
typedef struct {
    void *p;
    size_t n;
    void *copy;
} watch_t;

static void watch(watch_t *w, void *p, size_t n) {
    w->p = p;
    w->n = n;
    w->copy = malloc(n ? n : 1);
    if (p) memcpy(w->copy, p, n);
}

static void bad_case(kda_context_t *ctx, const bad_case_t *bc) {
    static const int64_t lens[] = {40, 20};
    kda_synth_config_t c = base_cfg(lens, 2);
    whole_t w;
    whole_make(&w, &c, kda_test_reference());
    const int64_t cut[] = {0, 30, 60};
    rank_t rk[2];
    split(&w, 2, cut, rk);
    float *o = falloc(w.nv), *dq = falloc(w.nq), *dk = falloc(w.nq), *dv = falloc(w.nv), *dg = falloc(w.ng),
          *dbeta = falloc(w.nb);
    for (int r = 0; r < 2; r++) rank_args(&w, &rk[r], 2, r, KDA_FLOAT32, o, dq, dk, dv, dg, dbeta);
    size_t sb = 0;
    CHECK(kda_cp_summary_size(ctx, &rk[0].a, &sb) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    float *gf = falloc((int64_t)(2 * sb / 4)), *gb = falloc((int64_t)(2 * sb / 4)), *sum = falloc((int64_t)sb / 4);
    for (int r = 0; r < 2; r++) {
        rk[r].a.cp_summaries = gf;
        rk[r].a.cp_summaries_bytes = 2 * sb;
        rk[r].b.cp_summaries = gb;
        rk[r].b.cp_summaries_bytes = 2 * sb;
    }
    rank_t *x = &rk[bc->rank];
    size_t n = sb;
    void *summary = sum;
    if (bc->edit) bc->edit(&x->a, &x->b, &n, &summary);
    /* poison every output */
    const int64_t e = x->N * w.HV * (int64_t)w.K * w.V;
    kda_synth_poison(o, KDA_FLOAT32, w.nv);
    kda_synth_poison(dq, KDA_FLOAT32, w.nq);
    kda_synth_poison(dv, KDA_FLOAT32, w.nv);
    kda_synth_poison(sum, KDA_FLOAT32, (int64_t)sb / 4);
    kda_synth_poison(x->ht, KDA_FLOAT32, e);
    kda_synth_poison(x->dh0, KDA_FLOAT32, e);
    watch_t wt[7];
    watch(&wt[0], o, sizeof(float) * (size_t)w.nv);
    watch(&wt[1], dq, sizeof(float) * (size_t)w.nq);
    watch(&wt[2], dv, sizeof(float) * (size_t)w.nv);
    watch(&wt[3], sum, sb);
    watch(&wt[4], x->ht, sizeof(float) * (size_t)e);
    watch(&wt[5], x->dh0, sizeof(float) * (size_t)e);
    watch(&wt[6], dbeta, sizeof(float) * (size_t)w.nb);
    void *ws = malloc(1 << 22);
    size_t wsb = 1 << 22, got = 0;
    kda_status_t st = KDA_STATUS_SUCCESS;
    switch (bc->call) {
    case CALL_FWD_SUMMARY: st = kda_cp_forward_summary(ctx, &x->a, summary, n, ws, wsb, NULL); break;
    case CALL_BWD_SUMMARY: st = kda_cp_backward_summary(ctx, &x->b, summary, n, ws, wsb, NULL); break;
    case CALL_FORWARD: st = kda_forward(ctx, &x->a, ws, wsb, NULL); break;
    case CALL_BACKWARD: st = kda_backward(ctx, &x->b, ws, wsb, NULL); break;
    case CALL_DECODE: st = kda_decode(ctx, &x->a, ws, wsb, NULL); break;
    case CALL_SIZE: st = kda_cp_summary_size(ctx, &x->a, &got); break;
    }
    CHECK(st == bc->status, "%s: status %s, expected %s (%s)", bc->name, kda_status_string(st),
          kda_status_string(bc->status), kda_last_error());
    CHECK(strstr(kda_last_error(), bc->arg) != NULL, "%s: the message does not name %s: %s", bc->name, bc->arg,
          kda_last_error());
    CHECK(got == 0, "%s: the size was written", bc->name);
    for (int i = 0; i < 7; i++)
        CHECK(memcmp(wt[i].p, wt[i].copy, wt[i].n) == 0, "%s: output %d changed by a failing call", bc->name, i);
    for (int i = 0; i < 7; i++) free(wt[i].copy);
    free(ws);
    free(gf);
    free(gb);
    free(sum);
    for (int r = 0; r < 2; r++) rank_free(&rk[r]);
    free(o);
    free(dq);
    free(dk);
    free(dv);
    free(dg);
    free(dbeta);
    whole_free(&w);
}

TEST(xcp_bad_inputs) {
    kda_context_t *ctxs[2] = {kda_test_reference(), cpu_ctx()};
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < sizeof BAD_CASES / sizeof BAD_CASES[0]; i++) bad_case(ctxs[k], &BAD_CASES[i]);
}
