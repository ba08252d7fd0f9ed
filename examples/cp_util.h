/*
 * cp_util.h — what examples/cp_mpi.c and examples/cp_nccl.c share: context parallelism across ranks
 * (docs/API.md §14, docs/ALGORITHM.md §4a) with everything but the transport.
 *
 *   - the problem: every rank builds the same synthetic packed batch (cu_seqlens), deterministically;
 *   - the split: rank r of R holds the contiguous slice [r T / R, (r + 1) T / R) of the packed tokens, as FLA's
 *     context parallelism splits them; its local cu_seqlens are the global boundaries clamped to the slice, and
 *     cp_pre_ranks / cp_post_ranks count the ranks its first / last local sequence chains to;
 *   - a rank's buffers where its backend reads them, and its kda_args_t / kda_backward_args_t over its slice;
 *   - cp_step, one training step of a rank: the summaries, their all-gathers, kda_forward and kda_backward, the
 *     all-reduce of dA_log and ddt_bias; the collectives are the caller's (cp_transport_t: MPI, NCCL, ...);
 *   - the check: the rank's o, final states and gradients against the unsplit run of the whole problem.
 *
 * Every function here returns a cp_code_t and prints what failed (the rank, the call, kda_last_error()).
 */
#ifndef KDA_CP_UTIL_H
#define KDA_CP_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kda.h>

#include "example_util.h" /* mem_alloc, mem_free, mem_upload, mem_download; uniform */

/* A rank's outcome; every rank of a step agrees on the worst (cp_transport_t.agree). */
typedef enum { CP_OK = 0, CP_SKIP = 1, CP_FAIL = 2 } cp_code_t;

/* The program's exit status for a code: 77 is CTest's "skipped" (SKIP_RETURN_CODE). */
static int cp_exit_status(int code) { return code == CP_OK ? 0 : code == CP_SKIP ? 77 : 1; }

/* ---------------------------------------------------------------------------------------------------------
 * The problem: one packed batch of CP_N sequences, GVA (HV = 2 HQK), the in-kernel options of a Kimi-Linear
 * layer. With 2 or 4 ranks the long sequences span several ranks, and with 4 a rank holds only the middle of
 * one (cp_pre_ranks and cp_post_ranks both > 0).
 * ------------------------------------------------------------------------------------------------------- */
enum { CP_HQK = 2, CP_HV = 4, CP_K = 32, CP_V = 32, CP_N = 4 };
static const int64_t cp_seq_lens[CP_N] = {150, 37, 300, 13}; /* 500 tokens; no sequence is empty */

/* The tensors, each a number of rows of float32 (per token, per sequence, or one row): the inputs, the loss
 * weights d_o and d_final_state, and the outputs of a forward and backward. */
enum { CP_QK_ROW = CP_HQK * CP_K, CP_V_ROW = CP_HV * CP_V, CP_G_ROW = CP_HV * CP_K, CP_STATE = CP_HV * CP_K * CP_V };
typedef enum { CP_PER_TOKEN, CP_PER_SEQ, CP_PARAM } cp_rows_t;
enum {
    CP_Q, /* the inputs */
    CP_KEY,
    CP_VAL,
    CP_G,
    CP_BETA,
    CP_H0,
    CP_A_LOG,
    CP_DT_BIAS,
    CP_DO,
    CP_DHT,
    CP_O, /* the outputs */
    CP_HT,
    CP_DQ,
    CP_DK,
    CP_DV,
    CP_DG,
    CP_DBETA,
    CP_DH0,
    CP_DA_LOG,
    CP_DDT_BIAS,
    CP_TENSORS,
    CP_FIRST_OUTPUT = CP_O
};
static const struct {
    const char *name;
    cp_rows_t rows;
    int64_t width; /* elements per row */
} cp_tensor[CP_TENSORS] = {
    [CP_Q] = {"q", CP_PER_TOKEN, CP_QK_ROW},              /* [T, HQK, K] */
    [CP_KEY] = {"k", CP_PER_TOKEN, CP_QK_ROW},            /* [T, HQK, K] */
    [CP_VAL] = {"v", CP_PER_TOKEN, CP_V_ROW},             /* [T, HV, V] */
    [CP_G] = {"g", CP_PER_TOKEN, CP_G_ROW},               /* [T, HV, K] the raw gate (use_gate_in_kernel) */
    [CP_BETA] = {"beta", CP_PER_TOKEN, CP_HV},            /* [T, HV] logits (use_beta_sigmoid) */
    [CP_H0] = {"initial_state", CP_PER_SEQ, CP_STATE},    /* [N, HV, K, V] */
    [CP_A_LOG] = {"A_log", CP_PARAM, CP_HV},              /* [HV] */
    [CP_DT_BIAS] = {"dt_bias", CP_PARAM, CP_G_ROW},       /* [HV * K] */
    [CP_DO] = {"d_o", CP_PER_TOKEN, CP_V_ROW},            /* [T, HV, V] */
    [CP_DHT] = {"d_final_state", CP_PER_SEQ, CP_STATE},   /* [N, HV, K, V] */
    [CP_O] = {"o", CP_PER_TOKEN, CP_V_ROW},               /* [T, HV, V] */
    [CP_HT] = {"final_state", CP_PER_SEQ, CP_STATE},      /* [N, HV, K, V] */
    [CP_DQ] = {"dq", CP_PER_TOKEN, CP_QK_ROW},            /* [T, HQK, K] */
    [CP_DK] = {"dk", CP_PER_TOKEN, CP_QK_ROW},            /* [T, HQK, K] */
    [CP_DV] = {"dv", CP_PER_TOKEN, CP_V_ROW},             /* [T, HV, V] */
    [CP_DG] = {"dg", CP_PER_TOKEN, CP_G_ROW},             /* [T, HV, K] */
    [CP_DBETA] = {"dbeta", CP_PER_TOKEN, CP_HV},          /* [T, HV] */
    [CP_DH0] = {"d_initial_state", CP_PER_SEQ, CP_STATE}, /* [N, HV, K, V] */
    [CP_DA_LOG] = {"dA_log", CP_PARAM, CP_HV},            /* [HV], summed over the ranks */
    [CP_DDT_BIAS] = {"ddt_bias", CP_PARAM, CP_G_ROW},     /* [HV * K], summed over the ranks */
};

static int64_t cp_elems(int i, int64_t T, int64_t N) {
    const cp_rows_t r = cp_tensor[i].rows;
    return (r == CP_PER_TOKEN ? T : r == CP_PER_SEQ ? N : 1) * cp_tensor[i].width;
}

typedef struct {
    int64_t T, N;            /* tokens, sequences */
    int64_t cu[CP_N + 1];    /* cu_seqlens */
    float *host[CP_TENSORS]; /* the inputs; the outputs of the unsplit run after cp_unsplit */
} cp_problem_t;

static void cp_problem_free(cp_problem_t *p) {
    for (int i = 0; i < CP_TENSORS; i++) free(p->host[i]);
    memset(p, 0, sizeof *p);
}

static int cp_problem_make(cp_problem_t *p) {
    memset(p, 0, sizeof *p);
    p->N = CP_N;
    for (int n = 0; n < CP_N; n++) p->cu[n + 1] = p->cu[n] + cp_seq_lens[n];
    p->T = p->cu[CP_N];
    unsigned seed = 2024;
    for (int i = 0; i < CP_TENSORS; i++) {
        const int64_t n = cp_elems(i, p->T, p->N);
        if (!(p->host[i] = calloc((size_t)n, sizeof(float)))) {
            fprintf(stderr, "out of host memory\n");
            cp_problem_free(p);
            return CP_FAIL;
        }
        if (i >= CP_FIRST_OUTPUT) continue;
        for (int64_t j = 0; j < n; j++) {
            const float u = uniform(&seed); /* in [-1, 1) */
            float x = u;
            if (i == CP_H0) x = 0.1f * u;                 /* a small initial state */
            else if (i == CP_A_LOG) x = -0.5f + 0.5f * u; /* exp(A_log) in [0.37, 1) */
            else if (i == CP_DT_BIAS) x = -3.0f + 0.5f * u;
            else if (i == CP_BETA) x = 2.0f * u; /* logits */
            p->host[i][j] = x;
        }
    }
    /* the gate -exp(A_log) softplus(g + dt_bias) is then in (-0.2, 0): a state remembers tens of tokens, so what
       crosses a rank boundary shows in the next rank's outputs and gradients */
    return CP_OK;
}

/* ---------------------------------------------------------------------------------------------------------
 * The split
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t t0, t1;       /* the rank's tokens [t0, t1) of the packed batch */
    int64_t N;            /* its local sequences: the parts of the global ones in its slice */
    int64_t seq[CP_N];    /* their global indices */
    int64_t cu[CP_N + 1]; /* its cu_seqlens, from 0 */
    int32_t pre, post;    /* cp_pre_ranks, cp_post_ranks */
} cp_slice_t;

/* The parts of the sequences that meet [t0, t1): the global boundaries clamped to the slice. An empty slice
 * holds one empty part, of the sequence at t0 (the one that starts there on a boundary; the last one at T):
 * a slice that a sequence passes through. */
static void cp_parts(const cp_problem_t *p, int64_t t0, int64_t t1, cp_slice_t *s) {
    memset(s, 0, sizeof *s);
    s->t0 = t0;
    s->t1 = t1;
    for (int64_t n = 0; n < p->N; n++) {
        const int64_t lo = p->cu[n] > t0 ? p->cu[n] : t0, hi = p->cu[n + 1] < t1 ? p->cu[n + 1] : t1;
        if (lo < hi) {
            s->seq[s->N] = n;
            s->cu[s->N + 1] = hi - t0;
            s->N++;
        }
    }
    if (s->N == 0) {
        s->seq[0] = p->N - 1;
        for (int64_t n = p->N - 1; n >= 0; n--)
            if (p->cu[n] <= t0 && t0 < p->cu[n + 1]) s->seq[0] = n;
        s->N = 1;
    }
}

static int64_t cp_cut(const cp_problem_t *p, int R, int r) { return p->T * r / R; }

/* Rank r's slice; the chain counts from the neighbours' slices: the consecutive ranks before r whose last part
 * is r's first sequence, and those after r whose first part is its last. */
static void cp_slice(const cp_problem_t *p, int R, int r, cp_slice_t *s) {
    cp_parts(p, cp_cut(p, R, r), cp_cut(p, R, r + 1), s);
    cp_slice_t o;
    for (int j = r - 1; j >= 0; j--, s->pre++) {
        cp_parts(p, cp_cut(p, R, j), cp_cut(p, R, j + 1), &o);
        if (o.seq[o.N - 1] != s->seq[0]) break;
    }
    for (int j = r + 1; j < R; j++, s->post++) {
        cp_parts(p, cp_cut(p, R, j), cp_cut(p, R, j + 1), &o);
        if (o.seq[0] != s->seq[s->N - 1]) break;
    }
}

/* The part m of a slice continues from an earlier rank / on a later one */
static int cp_continued(const cp_slice_t *s, int64_t m) { return m == 0 && s->pre > 0; }
static int cp_continues(const cp_slice_t *s, int64_t m) { return m == s->N - 1 && s->post > 0; }

/* ---------------------------------------------------------------------------------------------------------
 * A run: the buffers of a slice where the backend reads them, and its arguments
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    kda_backend_t be;
    cp_slice_t s;
    int64_t T;
    void *cu;              /* s.cu where the backend reads it */
    void *dev[CP_TENSORS]; /* the slice's tensors where the backend reads them */
    kda_args_t a;
    kda_backward_args_t b;
} cp_run_t;

static void cp_run_close(cp_run_t *run) {
    mem_free(run->be, run->cu);
    for (int i = 0; i < CP_TENSORS; i++) mem_free(run->be, run->dev[i]);
    memset(run, 0, sizeof *run);
}

/* The slice's rows of the problem's inputs on the backend (its own tokens; its sequences' states, the whole
 * parameters), room for the outputs, and the forward's and backward's arguments, not yet split. */
static int cp_run_open(cp_run_t *run, kda_backend_t be, const cp_problem_t *p, const cp_slice_t *s) {
    memset(run, 0, sizeof *run);
    run->be = be;
    run->s = *s;
    run->T = s->t1 - s->t0;
    if (!(run->cu = mem_upload(be, s->cu, sizeof(int64_t) * (size_t)(s->N + 1)))) goto nomem;
    for (int i = 0; i < CP_TENSORS; i++) {
        const int64_t w = cp_tensor[i].width, n = cp_elems(i, run->T, s->N);
        const size_t bytes = sizeof(float) * (size_t)(n > 0 ? n : 1);
        if (i >= CP_FIRST_OUTPUT) {
            if (!(run->dev[i] = mem_alloc(be, bytes))) goto nomem;
            continue;
        }
        float *rows = malloc(bytes);
        if (!rows) goto nomem;
        if (cp_tensor[i].rows == CP_PER_TOKEN) memcpy(rows, p->host[i] + s->t0 * w, sizeof(float) * (size_t)n);
        else if (cp_tensor[i].rows == CP_PARAM) memcpy(rows, p->host[i], sizeof(float) * (size_t)n);
        else
            for (int64_t m = 0; m < s->N; m++) {
                /* the initial state of a continued part and the d_final_state of a continuing one are not read
                   (the folds replace them): NaN here, so that a read would show in the check */
                const int unread = (i == CP_H0 && cp_continued(s, m)) || (i == CP_DHT && cp_continues(s, m));
                for (int64_t j = 0; j < w; j++) rows[m * w + j] = unread ? NAN : p->host[i][s->seq[m] * w + j];
            }
        run->dev[i] = mem_upload(be, rows, bytes);
        free(rows);
        if (!run->dev[i]) goto nomem;
    }

    kda_args_t *a = &run->a;
    kda_args_init(a);
    a->batch = 1;
    a->seq_len = run->T;
    a->num_qk_heads = CP_HQK;
    a->num_v_heads = CP_HV;
    a->head_dim_k = CP_K;
    a->head_dim_v = CP_V;
    a->cu_seqlens = run->cu;
    a->cu_seqlens_dtype = KDA_INT64;
    a->num_seqs = s->N;
    if (be == KDA_BACKEND_CUDA) a->cu_seqlens_host = run->s.cu; /* validated by the call: no device read */
    a->dtype = a->g_dtype = a->beta_dtype = a->o_dtype = KDA_FLOAT32;
    a->q = run->dev[CP_Q];
    a->k = run->dev[CP_KEY];
    a->v = run->dev[CP_VAL];
    a->g = run->dev[CP_G];
    a->beta = run->dev[CP_BETA];
    a->initial_state = run->dev[CP_H0];
    a->A_log = run->dev[CP_A_LOG];
    a->dt_bias = run->dev[CP_DT_BIAS];
    a->o = run->dev[CP_O];
    a->final_state = run->dev[CP_HT];
    a->use_qk_l2norm = 1;
    a->use_gate_in_kernel = 1;
    a->use_beta_sigmoid = 1;

    kda_backward_args_t *b = &run->b;
    kda_backward_args_init(b);
    b->problem = a;
    b->d_o = run->dev[CP_DO];
    b->d_o_dtype = KDA_FLOAT32;
    b->d_final_state = run->dev[CP_DHT];
    b->dq = run->dev[CP_DQ];
    b->dk = run->dev[CP_DK];
    b->dv = run->dev[CP_DV];
    b->dg = run->dev[CP_DG];
    b->dbeta = run->dev[CP_DBETA];
    b->dq_dtype = b->dk_dtype = b->dv_dtype = b->dg_dtype = b->dbeta_dtype = KDA_FLOAT32;
    b->d_initial_state = run->dev[CP_DH0];
    b->dA_log = run->dev[CP_DA_LOG];
    b->ddt_bias = run->dev[CP_DDT_BIAS];
    return CP_OK;
nomem:
    fprintf(stderr, "could not allocate or copy the buffers of tokens [%lld, %lld) on the %s backend\n",
            (long long)s->t0, (long long)s->t1, kda_backend_name(be));
    cp_run_close(run);
    return CP_FAIL;
}

/* ---------------------------------------------------------------------------------------------------------
 * Calls and their failures
 * ------------------------------------------------------------------------------------------------------- */
/* The code of a call's status: NOT_SUPPORTED is a skip where the backend may lack what the step needs on this
 * build or device (CUDA), a failure on the CPU backends, which have every part of it. */
static int cp_code(kda_backend_t be, kda_status_t st) {
    if (st == KDA_STATUS_SUCCESS) return CP_OK;
    return st == KDA_STATUS_NOT_SUPPORTED && be == KDA_BACKEND_CUDA ? CP_SKIP : CP_FAIL;
}

static int cp_report(int rank, kda_backend_t be, const char *call, kda_status_t st) {
    const int code = cp_code(be, st);
    if (code == CP_SKIP)
        printf("SKIPPED: rank %d: the %s backend answers %s to %s: %s\n", rank, kda_backend_name(be),
               kda_status_string(st), call, kda_last_error());
    else if (code == CP_FAIL)
        fprintf(stderr, "rank %d: %s failed: %s: %s\n", rank, call, kda_status_string(st), kda_last_error());
    return code;
}

/* Runs `call` while `code` is CP_OK, and records its outcome there */
#define CP_CALL(code, rank, be, call)                                                                                  \
    do {                                                                                                               \
        if ((code) == CP_OK) (code) = cp_report((rank), (be), #call, (call));                                          \
    } while (0)

static int cp_alloc(kda_backend_t be, size_t bytes, void **p) {
    if (!bytes) return CP_OK; /* a workspace of 0 bytes stays NULL */
    if ((*p = mem_alloc(be, bytes))) return CP_OK;
    fprintf(stderr, "could not allocate %zu bytes on the %s backend\n", bytes, kda_backend_name(be));
    return CP_FAIL;
}

/* ---------------------------------------------------------------------------------------------------------
 * One training step of a rank, with the caller's collectives
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    void *self; /* the transport's own state: its communicator, stream */
    /* Every rank's `bytes` at buf + r * bytes, into every rank's buf (this rank's block is already in place) */
    int (*allgather)(void *self, void *buf, size_t bytes);
    /* The sum over the ranks of n float32 at buf, in place */
    int (*allreduce_sum)(void *self, float *buf, size_t n);
    /* The worst code of all ranks. A collective that some ranks skip would wait for them forever, so before each
     * one the ranks agree whether all of them got there. */
    int (*agree)(void *self, int code);
} cp_transport_t;

/* Rank `rank` of R runs its slice (run): kda_forward and kda_backward, split, the ranks' summaries exchanged
 * through `tr`; `stream` is the kda calls' (CUDA; the transport's collectives run on it too). Returns the code
 * all ranks agree on. Afterwards run's outputs hold o, the final states and every gradient of its own tokens,
 * and dA_log and ddt_bias summed over the ranks. */
static int cp_step(kda_context_t *ctx, cp_run_t *run, int R, int rank, void *stream, const cp_transport_t *tr) {
    const kda_backend_t be = run->be;
    kda_args_t *a = &run->a;
    kda_backward_args_t *b = &run->b;
    char *fwd_sums = NULL, *bwd_sums = NULL;
    void *ws = NULL;
    size_t sb = 0, ws_bytes = 0, n = 0;
    int code = CP_OK;

    /* the split: which rank this is, and how its first and last sequences chain to its neighbours' */
    a->cp_num_ranks = R;
    a->cp_rank = rank;
    a->cp_pre_ranks = run->s.pre;
    a->cp_post_ranks = run->s.post;
    /* fp64 summaries on the fp64 oracle reproduce the unsplit run to fp64 rounding; CUDA takes float32 */
    a->cp_summary_dtype = be == KDA_BACKEND_REFERENCE ? KDA_FLOAT64 : KDA_FLOAT32;

    /* the gathered summaries, R blocks of sb bytes, one for the forward and one for the backward */
    CP_CALL(code, rank, be, kda_cp_summary_size(ctx, a, &sb));
    if (code == CP_OK) code = cp_alloc(be, (size_t)R * sb, (void **)&fwd_sums);
    if (code == CP_OK) code = cp_alloc(be, (size_t)R * sb, (void **)&bwd_sums);
    a->cp_summaries = fwd_sums;
    a->cp_summaries_bytes = (size_t)R * sb;
    b->cp_summaries = bwd_sums;
    b->cp_summaries_bytes = (size_t)R * sb;

    /* one workspace for the four calls */
    CP_CALL(code, rank, be, kda_cp_forward_summary_workspace_size(ctx, a, &n));
    ws_bytes = n > ws_bytes ? n : ws_bytes;
    CP_CALL(code, rank, be, kda_forward_workspace_size(ctx, a, &n));
    ws_bytes = n > ws_bytes ? n : ws_bytes;
    CP_CALL(code, rank, be, kda_cp_backward_summary_workspace_size(ctx, b, &n));
    ws_bytes = n > ws_bytes ? n : ws_bytes;
    CP_CALL(code, rank, be, kda_backward_workspace_size(ctx, b, &n));
    ws_bytes = n > ws_bytes ? n : ws_bytes;
    if (code == CP_OK) code = cp_alloc(be, ws_bytes, &ws);

    /* forward: this rank's summary into its own block of the gather, then the all-gather, in place */
    CP_CALL(code, rank, be, kda_cp_forward_summary(ctx, a, fwd_sums + (size_t)rank * sb, sb, ws, ws_bytes, stream));
    if ((code = tr->agree(tr->self, code)) != CP_OK) goto done;
    if ((code = tr->agree(tr->self, tr->allgather(tr->self, fwd_sums, sb))) != CP_OK) goto done;
    /* the ranks before this one fold into its first sequence's initial state */
    CP_CALL(code, rank, be, kda_forward(ctx, a, ws, ws_bytes, stream));

    /* backward: the summary of this rank's first sequence part from d_o and d_final_state, the all-gather */
    CP_CALL(code, rank, be, kda_cp_backward_summary(ctx, b, bwd_sums + (size_t)rank * sb, sb, ws, ws_bytes, stream));
    if ((code = tr->agree(tr->self, code)) != CP_OK) goto done;
    if ((code = tr->agree(tr->self, tr->allgather(tr->self, bwd_sums, sb))) != CP_OK) goto done;
    /* the ranks after this one fold into its last sequence's d_final_state */
    CP_CALL(code, rank, be, kda_backward(ctx, b, ws, ws_bytes, stream));

    /* dA_log and ddt_bias are this rank's sums: the parameters' gradients are their sum over the ranks */
    if ((code = tr->agree(tr->self, code)) != CP_OK) goto done;
    code = tr->allreduce_sum(tr->self, b->dA_log, CP_HV);
    if (code == CP_OK) code = tr->allreduce_sum(tr->self, b->ddt_bias, (size_t)CP_HV * CP_K);
    code = tr->agree(tr->self, code);
done:
    a->cp_summaries = b->cp_summaries = NULL;
    mem_free(be, ws);
    mem_free(be, fwd_sums);
    mem_free(be, bwd_sums);
    return code;
}

/* The whole problem in one call each, on the same backend: what the split must reproduce. Its outputs go to
 * p->host. */
static int cp_unsplit(kda_context_t *ctx, kda_backend_t be, cp_problem_t *p, int rank, void *stream) {
    cp_slice_t all;
    cp_parts(p, 0, p->T, &all);
    cp_run_t run;
    int code = cp_run_open(&run, be, p, &all);
    if (code != CP_OK) return code;
    void *ws = NULL;
    size_t nf = 0, nb = 0;
    CP_CALL(code, rank, be, kda_forward_workspace_size(ctx, &run.a, &nf));
    CP_CALL(code, rank, be, kda_backward_workspace_size(ctx, &run.b, &nb));
    if (code == CP_OK) code = cp_alloc(be, nf > nb ? nf : nb, &ws);
    CP_CALL(code, rank, be, kda_forward(ctx, &run.a, ws, nf, stream));
    CP_CALL(code, rank, be, kda_backward(ctx, &run.b, ws, nb, stream));
    for (int i = CP_FIRST_OUTPUT; i < CP_TENSORS && code == CP_OK; i++)
        if (mem_download(be, p->host[i], run.dev[i], sizeof(float) * (size_t)cp_elems(i, p->T, p->N))) {
            fprintf(stderr, "rank %d: could not copy the unsplit run's %s back\n", rank, cp_tensor[i].name);
            code = CP_FAIL;
        }
    mem_free(be, ws);
    cp_run_close(&run);
    return code;
}

/* ---------------------------------------------------------------------------------------------------------
 * The check: a rank's outputs against the unsplit run's, as max |x − ref| / max |ref| per tensor
 * ------------------------------------------------------------------------------------------------------- */
/* The tolerances of the tensors of one rank, and of dA_log and ddt_bias (sums over every token of every rank).
 * The reference backend with fp64 summaries reproduces its unsplit run to fp64 rounding, i.e. within one float32
 * unit of the outputs, with a factor 2 for the two roundings of a sum. The CPU backend stays within its usual
 * error against the oracle (tests/cpu/test_backward.c: 2e-5, 10x for the sums). On CUDA both runs are within the
 * chunked kernels' tf32/bf16 error of the oracle (~2e-2 of the largest |o|, examples/forward.c), and the split's
 * maps carry the chunk pipeline's state precision into the tokens next to each cut (docs/ALGORITHM.md §4a): the
 * two runs may differ by both errors. */
static void cp_tolerance(kda_backend_t be, double *tol, double *sum_tol) {
    *tol = be == KDA_BACKEND_REFERENCE ? 2.5e-7 : be == KDA_BACKEND_CPU ? 2e-5 : 5e-2;
    *sum_tol = be == KDA_BACKEND_REFERENCE ? 2.5e-7 : be == KDA_BACKEND_CPU ? 10 * *tol : *tol;
}

typedef struct {
    double diff, max; /* max |x − ref|, max |ref| (diff infinite at a NaN) */
} cp_err_t;

static void cp_err_add(cp_err_t *e, const float *x, const float *ref, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)x[i] - ref[i]);
        e->diff = isnan(d) ? INFINITY : fmax(e->diff, d);
        e->max = fmax(e->max, fabs((double)ref[i]));
    }
}

static double cp_err_rel(const cp_err_t *e) { return e->max > 0 ? e->diff / e->max : e->diff; }

/* Compare rank `rank`'s outputs (run, after cp_step) with the unsplit run's (p->host, after cp_unsplit): its
 * tokens' rows of o and of the gradients; the final state of each sequence that ends in its slice, the
 * d_initial_state of each that starts there (zero for a first part continued from an earlier rank: its
 * gradient went to that rank through the summary); dA_log and ddt_bias, summed over the ranks. The verdict is
 * one line in `line`. */
static int cp_check(const cp_problem_t *p, const cp_run_t *run, int rank, int R, char *line, size_t line_size) {
    const cp_slice_t *s = &run->s;
    double tol, sum_tol;
    cp_tolerance(run->be, &tol, &sum_tol);
    float *got[CP_TENSORS] = {0};
    int code = CP_OK;
    for (int i = CP_FIRST_OUTPUT; i < CP_TENSORS && code == CP_OK; i++) {
        const size_t bytes = sizeof(float) * (size_t)cp_elems(i, run->T, s->N);
        if (!(got[i] = malloc(bytes ? bytes : 1)) || mem_download(run->be, got[i], run->dev[i], bytes)) code = CP_FAIL;
    }
    if (code != CP_OK) {
        snprintf(line, line_size, "rank %d of %d: could not copy its results back", rank, R);
        goto done;
    }
    double worst = -1, worst_sum = 0;
    const char *worst_name = "-";
    int nonzero = 0;
    for (int i = CP_FIRST_OUTPUT; i < CP_TENSORS; i++) {
        const int64_t w = cp_tensor[i].width;
        const float *ref = p->host[i];
        cp_err_t e = {0, 0};
        if (cp_tensor[i].rows == CP_PER_TOKEN) cp_err_add(&e, got[i], ref + s->t0 * w, run->T * w);
        else if (cp_tensor[i].rows == CP_PARAM) cp_err_add(&e, got[i], ref, w);
        else
            for (int64_t m = 0; m < s->N; m++) {
                const float *x = got[i] + m * w, *r = ref + s->seq[m] * w;
                if (i == CP_HT && !cp_continues(s, m)) cp_err_add(&e, x, r, w);
                if (i == CP_DH0 && !cp_continued(s, m)) cp_err_add(&e, x, r, w);
                for (int64_t j = 0; i == CP_DH0 && cp_continued(s, m) && j < w; j++) nonzero += x[j] != 0.0f;
            }
        const double rel = cp_err_rel(&e);
        if (cp_tensor[i].rows == CP_PARAM) worst_sum = fmax(worst_sum, rel);
        else if (!(rel <= worst)) {
            worst = rel;
            worst_name = cp_tensor[i].name;
        }
    }
    code = worst <= tol && worst_sum <= sum_tol && !nonzero ? CP_OK : CP_FAIL;
    snprintf(line, line_size,
             "rank %d of %d: tokens [%lld, %lld), %lld sequence part%s, cp_pre_ranks %d, cp_post_ranks %d: max "
             "relative error %.2e (%s), dA_log/ddt_bias %.2e; tolerance %.1e, %.1e%s: %s",
             rank, R, (long long)s->t0, (long long)s->t1, (long long)s->N, s->N == 1 ? "" : "s", (int)s->pre,
             (int)s->post, worst, worst_name, worst_sum, tol, sum_tol,
             nonzero ? "; d_initial_state of the continued part is not zero" : "",
             code == CP_OK ? "agrees with the unsplit run" : "DISAGREES with the unsplit run");
done:
    for (int i = 0; i < CP_TENSORS; i++) free(got[i]);
    return code;
}

#endif /* KDA_CP_UTIL_H */
