/*
 * The oracle of intra-card context parallelism (src/reference/reference_cp.c): the pieces' affine maps, composed from
 * the initial state by the merge, reproduce the oracle forward's state before every piece and its final state
 * (fp64, to ~1e-12), for several piece splits, GVA, varlen with empty sequences, state pools, every gate mode,
 * β sigmoid and allow_neg_eigval; composition is associative; poisoning propagates.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "reference/reference_cp.h"
#include "test_util.h"

#define TOL 1e-12

/* max |x − ref| / max(1, max |ref|) over n elements; NaN in either (not both) counts as infinite. */
static double err(const double *x, const double *ref, int64_t n) {
    double d = 0.0, m = 1.0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i]) != isnan(ref[i])) return INFINITY;
        if (isnan(x[i])) continue;
        d = fmax(d, fabs(x[i] - ref[i]));
        m = fmax(m, fabs(ref[i]));
    }
    return d / m;
}

typedef struct {
    kda_synth_t s;
    kda_args_t a;
    kda_problem_t p;
    int32_t idx[8];
} fixture_t;

static void make(fixture_t *f, const kda_synth_config_t *c) {
    memset(f, 0, sizeof *f);
    if (kda_synth_make(c, &f->s, &f->a) != 0) exit(1);
}

static void check(fixture_t *f) {
    if (kda_check_args(NULL, &f->a, "test", 1, &f->p) != KDA_STATUS_SUCCESS) {
        fprintf(stderr, "kda_check_args: %s\n", kda_last_error());
        exit(1);
    }
}

static kda_cp_seqs_t seqs_of(const kda_problem_t *p) {
    kda_cp_seqs_t s = {p->a.cu_seqlens, p->a.cu_seqlens_dtype == KDA_INT64, p->num_seqs, p->a.seq_len,
                       p->num_tokens};
    return s;
}

/* Pieces of P chunks from the planner's table: pre-scan and merge against the oracle's state at each piece's
 * start and at the end of each split sequence. Returns the number of pieces checked. */
static int64_t pieces_vs_forward(const char *what, const kda_problem_t *p, int64_t P) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads;
    kda_cp_seqs_t s = seqs_of(p);
    kda_cp_plan_t r = kda_cp_fill_table(&s, P, NULL, 0);
    kda_cp_piece_t *t = malloc(sizeof *t * (size_t)r.num_pieces);
    r = kda_cp_fill_table(&s, P, t, r.num_pieces);
    const size_t nm = (size_t)(r.num_slots * HV) * K * K, ne = (size_t)(r.num_slots * HV) * K * V;
    double *M = malloc(sizeof(double) * (nm + 1)), *E = malloc(sizeof(double) * (ne + 1)),
           *S_in = malloc(sizeof(double) * (ne + 1));
    double *want = malloc(sizeof(double) * K * V), *got = malloc(sizeof(double) * K * V);
    CHECK(kda_ref_cp_prescan(p, t, r.num_pieces, M, E) == KDA_STATUS_SUCCESS, "prescan");
    CHECK(kda_ref_cp_merge(p, t, r.num_pieces, M, E, S_in) == KDA_STATUS_SUCCESS, "merge");
    int64_t checked = 0;
    for (int64_t e = 0; e < r.num_pieces; e++) {
        const kda_cp_piece_t *x = &t[e];
        if (x->slot < 0) continue;
        for (int h = 0; h < HV; h++) {
            const int64_t sh = x->slot * HV + h;
            kda_ref_state_at(p, x->seq, h, x->bos, want);
            double d = err(S_in + sh * K * V, want, (int64_t)K * V);
            CHECK(d <= TOL, "%s, P %lld: seq %lld piece %lld head %d: incoming state err %.3g", what, (long long)P,
                  (long long)x->seq, (long long)x->index, h, d);
            if (x->flags & KDA_CP_LAST) {
                kda_ref_cp_apply(K, V, M + sh * K * K, E + sh * K * V, S_in + sh * K * V, got);
                kda_ref_state_at(p, x->seq, h, x->eos, want);
                d = err(got, want, (int64_t)K * V);
                CHECK(d <= TOL, "%s, P %lld: seq %lld head %d: final state err %.3g", what, (long long)P,
                      (long long)x->seq, h, d);
            }
            checked++;
        }
    }
    free(t);
    free(M);
    free(E);
    free(S_in);
    free(want);
    free(got);
    return checked;
}

/* Arbitrary token ranges (not chunk-aligned): sequence n cut every `step` tokens, maps composed left to right
 * with kda_ref_cp_compose, applied to the initial state, against the oracle's final state. */
static void ranges_vs_forward(const char *what, const kda_problem_t *p, int64_t step) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    double *Ma = malloc(sizeof(double) * K * K), *Ea = malloc(sizeof(double) * K * V);
    double *Mb = malloc(sizeof(double) * K * K), *Eb = malloc(sizeof(double) * K * V);
    double *Mc = malloc(sizeof(double) * K * K), *Ec = malloc(sizeof(double) * K * V);
    double *S0 = malloc(sizeof(double) * K * V), *got = malloc(sizeof(double) * K * V),
           *want = malloc(sizeof(double) * K * V);
    for (int64_t n = 0; n < p->num_seqs; n++) {
        int64_t bos, eos;
        kda_seq_bounds(p, n, &bos, &eos);
        for (int h = 0; h < p->a.num_v_heads; h++) {
            kda_ref_cp_map(p, n, h, bos, bos, Ma, Ea); /* identity */
            for (int64_t t0 = bos; t0 < eos; t0 += step) {
                const int64_t t1 = t0 + step < eos ? t0 + step : eos;
                kda_ref_cp_map(p, n, h, t0, t1, Mb, Eb);
                kda_ref_cp_compose(K, V, Ma, Ea, Mb, Eb, Mc, Ec);
                memcpy(Ma, Mc, sizeof(double) * K * K);
                memcpy(Ea, Ec, sizeof(double) * K * V);
            }
            kda_ref_initial_state(p, n, h, S0);
            kda_ref_cp_apply(K, V, Ma, Ea, S0, got);
            kda_ref_state_at(p, n, h, eos, want);
            const double d = err(got, want, (int64_t)K * V);
            CHECK(d <= TOL, "%s: ranges of %lld tokens, seq %lld head %d: final state err %.3g", what, (long long)step,
                  (long long)n, h, d);
        }
    }
    free(Ma);
    free(Ea);
    free(Mb);
    free(Eb);
    free(Mc);
    free(Ec);
    free(S0);
    free(got);
    free(want);
}

static void splits_vs_forward(const char *what, fixture_t *f) {
    check(f);
    int64_t n = 0;
    static const int64_t Ps[] = {1, 2, 3};
    for (int i = 0; i < 3; i++) n += pieces_vs_forward(what, &f->p, Ps[i]);
    CHECK(n > 0, "%s: no split piece was checked", what);
    ranges_vs_forward(what, &f->p, 37);
    ranges_vs_forward(what, &f->p, 1);
}

/* The oracle's fp64 state at the end is the one the reference forward writes (float32 final state). */
static void state_at_is_forward(fixture_t *f) {
    check(f);
    kda_context_t *ref = NULL;
    CHECK(kda_create(&ref, KDA_BACKEND_REFERENCE, 0) == KDA_STATUS_SUCCESS, "create");
    CHECK(kda_run_host(ref, &f->a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    const int K = f->a.head_dim_k, V = f->a.head_dim_v, HV = f->a.num_v_heads;
    double *S = malloc(sizeof(double) * K * V);
    for (int64_t n = 0; n < f->p.num_seqs; n++) {
        int64_t bos, eos;
        kda_seq_bounds(&f->p, n, &bos, &eos);
        const int64_t slot = kda_state_slot(&f->p, n);
        if (slot < 0) continue;
        for (int h = 0; h < HV; h++) {
            kda_ref_state_at(&f->p, n, h, eos, S);
            double d = 0.0, m = 1.0;
            for (int i = 0; i < K; i++)
                for (int j = 0; j < V; j++) {
                    const int64_t at = (slot * HV + h) * (int64_t)K * V +
                                       (f->a.state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j);
                    const double x = ((const float *)f->a.final_state)[at];
                    d = fmax(d, fabs(x - S[i * V + j]));
                    m = fmax(m, fabs(S[i * V + j]));
                }
            CHECK(d / m <= 1e-6, "seq %lld head %d: state_at and the forward's final state differ by %.3g",
                  (long long)n, h, d / m);
        }
    }
    free(S);
    kda_destroy(ref);
}

TEST(cp_oracle_equal_rows_raw_gate) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 300;
    c.k = c.v = 32;
    c.dtype = c.g_dtype = c.o_dtype = KDA_FLOAT32;
    c.gate = KDA_GATE_RAW;
    c.initial_state = c.final_state = 1;
    fixture_t f;
    make(&f, &c);
    splits_vs_forward("B2 T300 raw gate", &f);
    state_at_is_forward(&f);
    kda_synth_free(&f.s);
}

/* GVA, varlen with an empty and a one-token sequence, lower-bound gate, l2norm, β sigmoid, bf16 initial state
 * stored V-first, K != V. */
TEST(cp_oracle_gva_varlen) {
    static const int64_t lens[] = {200, 0, 1, 130, 64, 129};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 6;
    c.seqlens = lens;
    c.hqk = 2;
    c.hv = 4;
    c.k = 16;
    c.v = 24;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = 1;
    c.beta_sigmoid = 1;
    c.initial_state = 1;
    c.initial_state_dtype = KDA_BFLOAT16;
    c.final_state = 1;
    c.state_v_first = 1;
    fixture_t f;
    make(&f, &c);
    splits_vs_forward("GVA varlen", &f);
    state_at_is_forward(&f);
    kda_synth_free(&f.s);
}

/* Strong softplus decay with allow_neg_eigval (eigenvalues of I − βkkᵀ down to −1). */
TEST(cp_oracle_strong_decay_neg_eigval) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.seq_len = 257;
    c.k = c.v = 16;
    c.gate = KDA_GATE_SOFTPLUS;
    c.decay = 30.0f;
    c.beta_sigmoid = c.allow_neg_eigval = 1;
    c.initial_state = c.final_state = 1;
    fixture_t f;
    make(&f, &c);
    splits_vs_forward("strong decay, neg eigval", &f);
    state_at_is_forward(&f);
    /* and weak decay: the maps then carry the initial state far */
    kda_synth_free(&f.s);
    c.decay = 0.05f;
    c.gate = KDA_GATE_LOWER_BOUND_NO_A;
    make(&f, &c);
    splits_vs_forward("weak decay, neg eigval", &f);
    kda_synth_free(&f.s);
}

/* A state pool: sequences read their slots through state_indices (one of them none: zeros). */
TEST(cp_oracle_state_pool) {
    static const int64_t lens[] = {150, 90, 200};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 3;
    c.seqlens = lens;
    c.hv = 2;
    c.k = c.v = 16;
    c.initial_state = c.final_state = 1;
    fixture_t f;
    make(&f, &c);
    f.idx[0] = 2;
    f.idx[1] = -1;
    f.idx[2] = 0;
    f.a.state_indices = f.idx;
    f.a.num_state_slots = 3;
    splits_vs_forward("state pool", &f);
    state_at_is_forward(&f);
    kda_synth_free(&f.s);
}

/* map(t0, t2) = map(t1, t2) ∘ map(t0, t1) for every cut t1; the empty range is the identity. */
TEST(cp_oracle_compose_associative) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.seq_len = 90;
    c.k = 8;
    c.v = 12;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.beta_sigmoid = 1;
    fixture_t f;
    make(&f, &c);
    check(&f);
    const int K = 8, V = 12;
    double Ma[64], Ea[96], Mb[64], Eb[96], M[64], E[96], Mw[64], Ew[96];
    kda_ref_cp_map(&f.p, 0, 0, 5, 5, M, E);
    for (int i = 0; i < K; i++)
        for (int j = 0; j < K; j++) CHECK(M[i * K + j] == (i == j), "empty range: M not the identity");
    for (int i = 0; i < K * V; i++) CHECK(E[i] == 0.0, "empty range: E not zero");
    kda_ref_cp_map(&f.p, 0, 0, 3, 80, Mw, Ew);
    for (int64_t t1 = 3; t1 <= 80; t1 += 7) {
        kda_ref_cp_map(&f.p, 0, 0, 3, t1, Ma, Ea);
        kda_ref_cp_map(&f.p, 0, 0, t1, 80, Mb, Eb);
        kda_ref_cp_compose(K, V, Ma, Ea, Mb, Eb, M, E);
        CHECK(err(M, Mw, K * K) <= TOL && err(E, Ew, K * V) <= TOL, "cut at %lld: composed map differs (%.3g, %.3g)",
              (long long)t1, err(M, Mw, K * K), err(E, Ew, K * V));
    }
    kda_synth_free(&f.s);
}

/* A NaN v at token 100: maps of ranges before it are finite, those containing it NaN, and the merged states
 * from there on are NaN as the oracle's are. A headwise β has no map. */
TEST(cp_oracle_poison_and_headwise) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.seq_len = 256;
    c.k = c.v = 8;
    c.dtype = c.g_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    fixture_t f;
    make(&f, &c);
    ((float *)f.s.v)[100 * 8 + 3] = NAN;
    check(&f);
    double M[64], E[64];
    CHECK(kda_ref_cp_map(&f.p, 0, 0, 0, 100, M, E) == 0 && isfinite(M[0]) && isfinite(E[5]), "before: finite");
    CHECK(kda_ref_cp_map(&f.p, 0, 0, 64, 128, M, E) == 1 && isnan(M[0]) && isnan(E[5]), "containing: NaN");
    CHECK(kda_ref_cp_map(&f.p, 0, 0, 101, 200, M, E) == 0 && isfinite(M[9]), "after: finite (the map alone)");
    CHECK(pieces_vs_forward("poisoned", &f.p, 1) == 4, "4 pieces");
    kda_synth_free(&f.s);

    c.beta_sigmoid = 1;
    make(&f, &c);
    f.a.beta_headwise = 1;
    f.a.beta = f.s.v; /* [T, HV, V] logits */
    f.a.beta_dtype = KDA_FLOAT32;
    check(&f);
    CHECK(kda_ref_cp_map(&f.p, 0, 0, 0, 10, M, E) == -1, "headwise beta: a map");
    CHECK(kda_ref_cp_prescan(&f.p, NULL, 0, M, E) == KDA_STATUS_NOT_SUPPORTED, "headwise beta: prescan");
    kda_synth_free(&f.s);
}

/* docs/ALGORITHM.md §4's chunk form, which the CUDA pre-scan computes from the chunk's prepared blocks: a chunk
 * maps its incoming state by M = Diag(γ) − K̃ᵀ W and S_ext = K̃ᵀ U (§3's W = T Diag(β) KΓ, U = T Diag(β) V,
 * T = (I + A)⁻¹, K̃ rows k_j ⊙ e^{G_last − G_j}, γ = e^{G_last}). Built here in fp64 from those definitions and
 * checked against the token-by-token map of every chunk (the last one short), every head. */
static void chunk_form_vs_token_map(const char *what, const kda_problem_t *p) {
    enum { C = KDA_CHUNK };
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    double *kk = malloc(sizeof(double) * C * K), *vv = malloc(sizeof(double) * C * V);
    double *G = malloc(sizeof(double) * C * K), *b = malloc(sizeof(double) * C), *A = malloc(sizeof(double) * C * C);
    double *W = malloc(sizeof(double) * C * K), *U = malloc(sizeof(double) * C * V);
    double *M = malloc(sizeof(double) * K * K), *E = malloc(sizeof(double) * K * V);
    double *Mt = malloc(sizeof(double) * K * K), *Et = malloc(sizeof(double) * K * V);
    double q[256], gate[256], beta[256];
    int chunks = 0;
    for (int64_t n = 0; n < p->num_seqs; n++) {
        int64_t bos, eos;
        kda_seq_bounds(p, n, &bos, &eos);
        for (int h = 0; h < p->a.num_v_heads; h++)
            for (int64_t t0 = bos; t0 < eos; t0 += C) {
                const int L = (int)(eos - t0 < C ? eos - t0 : C);
                for (int i = 0; i < L; i++) { /* inputs and the cumulative log decay G */
                    kda_ref_token(p, t0 + i, h, q, kk + i * K, vv + i * V, gate, beta);
                    b[i] = beta[0];
                    for (int d = 0; d < K; d++) G[i * K + d] = gate[d] + (i ? G[(i - 1) * K + d] : 0.0);
                }
                for (int i = 0; i < L; i++) /* A, strictly lower */
                    for (int j = 0; j < L; j++) {
                        double s = 0.0;
                        if (j < i)
                            for (int d = 0; d < K; d++) s += kk[i * K + d] * kk[j * K + d] * exp(G[i * K + d] - G[j * K + d]);
                        A[i * C + j] = b[i] * s;
                    }
                for (int i = 0; i < L; i++) { /* (I + A) [W | U] = Diag(β) [KΓ | V], forward substitution */
                    for (int d = 0; d < K; d++) {
                        double s = b[i] * kk[i * K + d] * exp(G[i * K + d]);
                        for (int j = 0; j < i; j++) s -= A[i * C + j] * W[j * K + d];
                        W[i * K + d] = s;
                    }
                    for (int d = 0; d < V; d++) {
                        double s = b[i] * vv[i * V + d];
                        for (int j = 0; j < i; j++) s -= A[i * C + j] * U[j * V + d];
                        U[i * V + d] = s;
                    }
                }
                const double *Gl = G + (L - 1) * K;
                for (int r = 0; r < K; r++) { /* M = Diag(γ) − K̃ᵀ W, E = K̃ᵀ U */
                    for (int c = 0; c < K; c++) {
                        double s = r == c ? exp(Gl[r]) : 0.0;
                        for (int j = 0; j < L; j++) s -= kk[j * K + r] * exp(Gl[r] - G[j * K + r]) * W[j * K + c];
                        M[r * K + c] = s;
                    }
                    for (int c = 0; c < V; c++) {
                        double s = 0.0;
                        for (int j = 0; j < L; j++) s += kk[j * K + r] * exp(Gl[r] - G[j * K + r]) * U[j * V + c];
                        E[r * V + c] = s;
                    }
                }
                kda_ref_cp_map(p, n, h, t0, t0 + L, Mt, Et);
                const double dm = err(M, Mt, (int64_t)K * K), de = err(E, Et, (int64_t)K * V);
                CHECK(dm <= TOL && de <= TOL, "%s: seq %lld head %d chunk at %lld (%d tokens): M err %.3g, S_ext err "
                      "%.3g", what, (long long)n, h, (long long)t0, L, dm, de);
                chunks++;
            }
    }
    CHECK(chunks > 0, "%s: no chunk", what);
    free(kk);
    free(vv);
    free(G);
    free(b);
    free(A);
    free(W);
    free(U);
    free(M);
    free(E);
    free(Mt);
    free(Et);
}

TEST(cp_oracle_chunk_form_matches_token_map) {
    static const int64_t lens[] = {130, 1, 64};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 3;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 2;
    c.k = 16;
    c.v = 8;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    fixture_t f;
    make(&f, &c);
    check(&f);
    chunk_form_vs_token_map("lower-bound gate", &f.p);
    kda_synth_free(&f.s);
    c.gate = KDA_GATE_RAW;
    c.decay = 30.0f;
    c.allow_neg_eigval = 1;
    make(&f, &c);
    check(&f);
    chunk_form_vs_token_map("strong raw decay, neg eigval", &f.p);
    kda_synth_free(&f.s);
}
