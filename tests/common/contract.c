/*
 * The non-finite input contract on one backend (see contract.h). The problem: two sequences (70 and 9 tokens),
 * one query/key head shared by two value heads, K = V = head_dim, float32 everywhere, an initial and a final
 * state, in each of four state configurations: K-first or V-first (state_v_first), one state per sequence or a
 * pool of 4 slots named by state_indices = {2, 0} (the unnamed slots of the initial pool hold NaN, so a read of
 * the wrong slot shows; those of the final pool must come back untouched). One element of one input is
 * replaced, at token t of sequence 0 (head 0 for the per-value-head tensors; for the initial state, element
 * (key channel 2, value channel 5) of sequence 0, head 0), by each value of the table; what must hold
 * (docs/ALGORITHM.md §7):
 *   gate +1e30, +inf      -> the results of the gate 0 there          (clamped, finite)
 *   gate -1e30, -inf      -> the results of the gate KDA_GATE_MIN there
 *   gate NaN; q, k, v, β ±inf or NaN
 *                         -> o of that token and every later token of the affected heads NaN, their final
 *                            states NaN
 *   initial state ±inf or NaN
 *                         -> value channel 5 of head 0, sequence 0 NaN: element 5 of o for every token of the
 *                            sequence, column 5 of its final state; every other element of that head exactly
 *                            (bit for bit) the clean run's: the other channels never read column 5
 *   q, k, v, β, initial state ±1e30
 *                         -> later outputs (for the state: every output) of the affected heads unspecified
 * and always: earlier tokens, the unaffected head and the other sequence unchanged against the clean run; the
 * NaN pattern and the finite values as the fp64 oracle's (except where unspecified).
 */
#include "contract.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_util.h"

enum { IN_Q, IN_K, IN_V, IN_G, IN_BETA, IN_H0, NIN };
static const char *in_name[NIN] = {"q", "k", "v", "g", "beta", "initial_state"};

#define NSEQ 2
#define HV 2
static const int64_t lens[NSEQ] = {70, 9};
#define TOK (70 + 9)
#define NSLOT 4                                     /* slots of the pools in the pool configurations */
static const int32_t pool_slots[NSEQ] = {2, 0};     /* slots 1 and 3 are named by no sequence */
#define H0_I 2                                      /* the initial state's injected element: key channel */
#define H0_CH 5                                     /* and value channel (the channel it poisons) */
#define SENTINEL -12345.0f                          /* outputs before a run */

typedef struct {
    float *x[NIN];
    int64_t n[NIN];
    float *o, *ht;
    int64_t no, nht;
    int64_t cu[NSEQ + 1];
    int32_t idx[NSEQ];
    int D, v_first, pool;
    kda_args_t a;
} problem_t;

/* Offset of (sequence n, value head h)'s state block in the initial and final state tensors (its slot's, in
 * a pool), and of element (key channel i, value channel j) within a block. */
static int64_t state_base(const problem_t *p, int n, int h) {
    const int64_t slot = p->pool ? pool_slots[n] : n;
    return (slot * HV + h) * (int64_t)p->D * p->D;
}
static int64_t state_el(const problem_t *p, int i, int j) { return p->v_first ? (int64_t)j * p->D + i : (int64_t)i * p->D + j; }
/* The value channel of element e of a state block. */
static int state_channel(const problem_t *p, int64_t e) { return (int)(p->v_first ? e / p->D : e % p->D); }

static float urand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffffff) / 16777216.0f; /* [0, 1) */
}

static void make(problem_t *p, int D, int v_first, int pool) {
    memset(p, 0, sizeof *p);
    p->D = D;
    p->v_first = v_first;
    p->pool = pool;
    p->n[IN_Q] = p->n[IN_K] = (int64_t)TOK * D;
    p->n[IN_V] = p->n[IN_G] = (int64_t)TOK * HV * D;
    p->n[IN_BETA] = (int64_t)TOK * HV;
    p->n[IN_H0] = (int64_t)(pool ? NSLOT : NSEQ) * HV * D * D;
    p->no = (int64_t)TOK * HV * D;
    p->nht = p->n[IN_H0];
    uint64_t s = 15;
    for (int i = 0; i < NIN; i++) p->x[i] = (float *)malloc(sizeof(float) * (size_t)p->n[i]);
    for (int64_t i = 0; i < p->n[IN_Q]; i++) p->x[IN_Q][i] = (2.0f * urand(&s) - 1.0f) / sqrtf((float)D);
    for (int64_t t = 0; t < TOK; t++) { /* unit-norm keys, as models give them */
        float *k = p->x[IN_K] + t * D, ss = 0.0f;
        for (int d = 0; d < D; d++) {
            k[d] = 2.0f * urand(&s) - 1.0f;
            ss += k[d] * k[d];
        }
        for (int d = 0; d < D; d++) k[d] /= sqrtf(ss);
    }
    for (int64_t i = 0; i < p->n[IN_V]; i++) p->x[IN_V][i] = 2.0f * urand(&s) - 1.0f;
    for (int64_t i = 0; i < p->n[IN_G]; i++) p->x[IN_G][i] = -0.02f - 0.5f * urand(&s);
    for (int64_t i = 0; i < p->n[IN_BETA]; i++) p->x[IN_BETA][i] = 0.2f + 0.7f * urand(&s);
    for (int64_t i = 0; i < p->n[IN_H0]; i++) p->x[IN_H0][i] = 0.2f * urand(&s) - 0.1f;
    if (pool) /* the slots no sequence names: NaN, which a read of the wrong slot would spread */
        for (int slot = 1; slot < NSLOT; slot += 2)
            for (int64_t i = 0; i < (int64_t)HV * D * D; i++) p->x[IN_H0][slot * (int64_t)HV * D * D + i] = NAN;
    p->o = (float *)malloc(sizeof(float) * (size_t)p->no);
    p->ht = (float *)malloc(sizeof(float) * (size_t)p->nht);
    p->cu[0] = 0;
    for (int n = 0; n < NSEQ; n++) p->cu[n + 1] = p->cu[n] + lens[n];

    kda_args_t *a = &p->a;
    kda_args_init(a);
    a->batch = 1;
    a->seq_len = TOK;
    a->num_qk_heads = 1;
    a->num_v_heads = HV;
    a->head_dim_k = a->head_dim_v = D;
    a->cu_seqlens = p->cu;
    a->cu_seqlens_dtype = KDA_INT64;
    a->num_seqs = NSEQ;
    a->dtype = a->g_dtype = a->beta_dtype = a->o_dtype = KDA_FLOAT32;
    a->q = p->x[IN_Q];
    a->k = p->x[IN_K];
    a->v = p->x[IN_V];
    a->g = p->x[IN_G];
    a->beta = p->x[IN_BETA];
    a->initial_state = p->x[IN_H0];
    a->o = p->o;
    a->final_state = p->ht;
    a->state_v_first = v_first;
    if (pool) {
        memcpy(p->idx, pool_slots, sizeof p->idx);
        a->state_indices = p->idx;
        a->num_state_slots = NSLOT;
    }
}

static const char *config_name(const problem_t *p) {
    static const char *names[4] = {"K-first", "V-first", "K-first, pool", "V-first, pool"};
    return names[p->v_first + 2 * p->pool];
}

static void release(problem_t *p) {
    for (int i = 0; i < NIN; i++) free(p->x[i]);
    free(p->o);
    free(p->ht);
}

/* The element of input `in` that is replaced: token t, head 0, channel 3 (the state: sequence 0, head 0, key
 * channel H0_I, value channel H0_CH). */
static int64_t site(const problem_t *p, int in, int t) {
    const int D = p->D;
    switch (in) {
    case IN_Q:
    case IN_K: return (int64_t)t * D + 3;
    case IN_V:
    case IN_G: return ((int64_t)t * HV + 0) * D + 3;
    case IN_BETA: return (int64_t)t * HV + 0;
    default: return state_base(p, 0, 0) + state_el(p, H0_I, H0_CH);
    }
}

/* Results of one run: o and the final state, copied. */
typedef struct {
    float *o, *ht;
} result_t;

static result_t run(const kda_contract_backend_t *be, problem_t *p, kda_algo_t algo, int use_oracle) {
    result_t r;
    for (int64_t i = 0; i < p->no; i++) p->o[i] = SENTINEL;
    for (int64_t i = 0; i < p->nht; i++) p->ht[i] = SENTINEL;
    kda_status_t st = use_oracle ? kda_run_host(kda_test_reference(), &p->a, KDA_ALGO_FORWARD)
                                 : be->run(be->user, &p->a, algo);
    CHECK(st == KDA_STATUS_SUCCESS, "%s: %s", be->name, kda_last_error());
    r.o = (float *)malloc(sizeof(float) * (size_t)p->no);
    r.ht = (float *)malloc(sizeof(float) * (size_t)p->nht);
    memcpy(r.o, p->o, sizeof(float) * (size_t)p->no);
    memcpy(r.ht, p->ht, sizeof(float) * (size_t)p->nht);
    return r;
}

static void result_free(result_t *r) {
    free(r->o);
    free(r->ht);
}

/* What a class does to the outputs of a (sequence 0) head: nothing, clamp (compare with a substituted run),
 * poison from a token, poison value channel H0_CH from the first token, or unspecified from a token. */
typedef enum { FX_SAME, FX_POISON, FX_CHANNEL, FX_UNSPEC } effect_t;

typedef struct {
    const kda_contract_backend_t *be;
    const problem_t *p;
    int D, t;
    const char *what; /* "v = inf at token 30 (kda_forward, K-first)" */
} ctx_t;

/* x against ref over n_el elements: NaN exactly where ref has NaN, else within tol · max(1, max |ref|). */
static void expect_close(const ctx_t *c, const float *x, const float *ref, int64_t n_el, double tol, const char *part) {
    double dmax = 0.0, rmax = 0.0;
    int64_t bad = -1;
    for (int64_t i = 0; i < n_el; i++) {
        if (isnan(ref[i]) || isnan(x[i])) {
            if (!(isnan(ref[i]) && isnan(x[i])) && bad < 0) bad = i;
            continue;
        }
        const double d = fabs((double)x[i] - (double)ref[i]);
        dmax = d > dmax ? d : dmax;
        rmax = fabs(ref[i]) > rmax ? fabs(ref[i]) : rmax;
        if (!isfinite(x[i]) && bad < 0) bad = i;
    }
    CHECK(bad < 0, "%s on %s: %s: element %lld is %g where the reference has %g", c->what, c->be->name, part,
          (long long)bad, bad >= 0 ? (double)x[bad] : 0.0, bad >= 0 ? (double)ref[bad] : 0.0);
    CHECK(dmax <= tol * (rmax > 1.0 ? rmax : 1.0), "%s on %s: %s: differs by %.3g (largest |ref| %.3g, tol %.1g)",
          c->what, c->be->name, part, dmax, rmax, tol);
}

static void expect_nan(const ctx_t *c, const float *x, int64_t n_el, const char *part) {
    int64_t finite = 0;
    for (int64_t i = 0; i < n_el; i++) finite += !isnan(x[i]);
    CHECK(finite == 0, "%s on %s: %s: %lld elements are not NaN", c->what, c->be->name, part, (long long)finite);
}

/* A row of o (is_state 0) or a state block (1) of a head whose value channel H0_CH is poisoned: NaN in every
 * element of that channel, every other element bit for bit the clean run's (they never read the channel). */
static void expect_channel(const ctx_t *c, const float *x, const float *clean, int is_state, const char *part) {
    const int64_t n_el = is_state ? (int64_t)c->D * c->D : c->D;
    int64_t finite = 0, changed = 0, first = -1;
    for (int64_t e = 0; e < n_el; e++) {
        if ((is_state ? state_channel(c->p, e) : (int)e) == H0_CH) {
            finite += !isnan(x[e]);
        } else if (memcmp(x + e, clean + e, sizeof(float)) != 0) {
            changed++;
            if (first < 0) first = e;
        }
    }
    CHECK(finite == 0, "%s on %s: %s: %lld elements of value channel %d are not NaN", c->what, c->be->name, part,
          (long long)finite, H0_CH);
    CHECK(changed == 0, "%s on %s: %s: %lld elements of the other channels differ from the clean run (element "
          "%lld: %g, clean %g)", c->what, c->be->name, part, (long long)changed, (long long)first,
          first >= 0 ? (double)x[first] : 0.0, first >= 0 ? (double)clean[first] : 0.0);
}

/* The outputs of `x` for the class's effect on (sequence 0, head h), against `clean` (and `subst` for a clamp). */
static void check_head(const ctx_t *c, const result_t *x, const result_t *clean, int h, effect_t fx, int from) {
    const int D = c->D;
    char part[96];
    for (int64_t t = 0; t < TOK; t++) {
        const float *xo = x->o + (t * HV + h) * D, *co = clean->o + (t * HV + h) * D;
        snprintf(part, sizeof part, "o of token %lld, head %d", (long long)t, h);
        const int seq0 = t < lens[0];
        if (!seq0 || fx == FX_SAME || t < from) expect_close(c, xo, co, D, c->be->same_tol, part);
        else if (fx == FX_POISON) expect_nan(c, xo, D, part);
        else if (fx == FX_CHANNEL) expect_channel(c, xo, co, 0, part);
    }
    for (int n = 0; n < NSEQ; n++) {
        const int64_t off = state_base(c->p, n, h);
        snprintf(part, sizeof part, "final state of sequence %d, head %d", n, h);
        if (n == 1 || fx == FX_SAME) expect_close(c, x->ht + off, clean->ht + off, (int64_t)D * D, c->be->same_tol, part);
        else if (fx == FX_POISON) expect_nan(c, x->ht + off, (int64_t)D * D, part);
        else if (fx == FX_CHANNEL) expect_channel(c, x->ht + off, clean->ht + off, 1, part);
    }
}

/* In a pool configuration, the slots of the final pool that no sequence names are as before the call. */
static void check_unnamed_slots(const ctx_t *c, const result_t *x) {
    if (!c->p->pool) return;
    const int64_t per_slot = (int64_t)HV * c->D * c->D;
    for (int slot = 1; slot < NSLOT; slot += 2) {
        int64_t changed = 0;
        for (int64_t i = 0; i < per_slot; i++) changed += x->ht[slot * per_slot + i] != SENTINEL;
        CHECK(changed == 0, "%s on %s: %lld elements of final_state slot %d (named by no sequence) were written",
              c->what, c->be->name, (long long)changed, slot);
    }
}

/* Everything but the unspecified parts, against the oracle: NaN where it has NaN, close elsewhere. */
static void check_oracle(const ctx_t *c, const result_t *x, const result_t *oracle, const effect_t fx[HV], int from) {
    const int D = c->D;
    char part[96];
    for (int h = 0; h < HV; h++) {
        for (int64_t t = 0; t < TOK; t++) {
            if (fx[h] == FX_UNSPEC && t < lens[0] && t >= from) continue;
            snprintf(part, sizeof part, "o of token %lld, head %d against the oracle", (long long)t, h);
            expect_close(c, x->o + (t * HV + h) * D, oracle->o + (t * HV + h) * D, D, c->be->tol, part);
        }
        for (int n = 0; n < NSEQ; n++) {
            if (fx[h] == FX_UNSPEC && n == 0) continue;
            snprintf(part, sizeof part, "final state of sequence %d, head %d against the oracle", n, h);
            const int64_t off = state_base(c->p, n, h);
            expect_close(c, x->ht + off, oracle->ht + off, (int64_t)D * D, c->be->tol, part);
        }
    }
}

/* Every class of the table in one state configuration. */
static void check_config(const kda_contract_backend_t *be, int t, int v_first, int pool) {
    const int D = be->head_dim;
    problem_t p;
    make(&p, D, v_first, pool);
    static const float values[] = {1e30f, -1e30f, INFINITY, -INFINITY, NAN};
    static const char *value_name[] = {"1e30", "-1e30", "inf", "-inf", "NaN"};
    result_t clean[2];
    for (int algo = 0; algo < 2; algo++) clean[algo] = run(be, &p, (kda_algo_t)algo, 0);
    result_t oracle_clean = run(be, &p, KDA_ALGO_FORWARD, 1);
    {
        char what[64];
        snprintf(what, sizeof what, "clean inputs (%s)", config_name(&p));
        ctx_t c = {be, &p, D, t, what};
        const effect_t same[HV] = {FX_SAME, FX_SAME};
        for (int algo = 0; algo < 2; algo++) {
            check_oracle(&c, &clean[algo], &oracle_clean, same, TOK);
            check_unnamed_slots(&c, &clean[algo]);
        }
    }
    result_free(&oracle_clean);

    for (int in = 0; in < NIN; in++) {
        for (int vi = 0; vi < 5; vi++) {
            const float x = values[vi];
            const int64_t at = site(&p, in, t);
            const float keep = p.x[in][at];
            const int huge = isfinite(x), is_state = in == IN_H0;
            /* the effect on head 0 and head 1 of sequence 0, from token `from` */
            effect_t fx[HV];
            const int from = is_state ? 0 : t;
            int substitute = 0;
            float subst_value = 0.0f;
            if (in == IN_G && !isnan(x)) {
                substitute = 1;
                subst_value = x > 0.0f ? 0.0f : KDA_GATE_MIN;
                fx[0] = fx[1] = FX_SAME;
            } else {
                fx[0] = huge ? FX_UNSPEC : is_state ? FX_CHANNEL : FX_POISON;
                fx[1] = (in == IN_Q || in == IN_K) ? fx[0] : FX_SAME;
            }
            result_t subst[2] = {{0}, {0}};
            if (substitute) {
                p.x[in][at] = subst_value;
                for (int algo = 0; algo < 2; algo++) subst[algo] = run(be, &p, (kda_algo_t)algo, 0);
            }
            p.x[in][at] = x;
            result_t oracle = run(be, &p, KDA_ALGO_FORWARD, 1);
            for (int algo = 0; algo < 2; algo++) {
                char what[128];
                snprintf(what, sizeof what, "%s = %s at token %d (%s, %s)", in_name[in], value_name[vi], t,
                         algo ? "kda_decode" : "kda_forward", config_name(&p));
                if (algo == KDA_ALGO_FORWARD && (be->known_gaps & (is_state ? 4 : 2))) {
                    printf("known gap, not checked: %s on %s\n", what, be->name);
                    continue;
                }
                ctx_t c = {be, &p, D, t, what};
                result_t r = run(be, &p, (kda_algo_t)algo, 0);
                const result_t *base = substitute ? &subst[algo] : &clean[algo];
                for (int h = 0; h < HV; h++) check_head(&c, &r, base, h, fx[h], from);
                check_oracle(&c, &r, &oracle, fx, from);
                check_unnamed_slots(&c, &r);
                result_free(&r);
            }
            result_free(&oracle);
            for (int algo = 0; algo < 2; algo++)
                if (substitute) result_free(&subst[algo]);
            p.x[in][at] = keep;
        }
    }
    for (int algo = 0; algo < 2; algo++) result_free(&clean[algo]);
    release(&p);
}

void kda_contract_check(const kda_contract_backend_t *be, int t) {
    for (int pool = 0; pool < 2; pool++)
        for (int v_first = 0; v_first < 2; v_first++) check_config(be, t, v_first, pool);
}
