/*
 * Synthetic KDA problems: see synth.h. Deterministic for a seed (splitmix64 + Box-Muller).
 */
#include "synth.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"

static uint64_t next_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s) { return ((next_u64(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static double normal(uint64_t *s) {
    double u1 = uniform(s), u2 = uniform(s);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static double logsigmoid(double x) { return x >= 0 ? -log1p(exp(-x)) : x - log1p(exp(x)); }

void kda_synth_defaults(kda_synth_config_t *c) {
    memset(c, 0, sizeof *c);
    c->batch = 1;
    c->seq_len = 64;
    c->hqk = c->hv = 1;
    c->k = c->v = 128;
    c->dtype = c->g_dtype = c->beta_dtype = c->o_dtype = KDA_BFLOAT16;
    c->initial_state_dtype = c->final_state_dtype = KDA_FLOAT32;
    c->gate = KDA_GATE_RAW;
    c->decay = 1.0f;
    c->seed = 1;
}

/* n elements of dt (at least one element's bytes), or NULL when the bytes overflow size_t or malloc fails. */
static void *alloc_tensor(int64_t n, kda_dtype_t dt, size_t *bytes) {
    const size_t es = kda_dtype_size(dt), count = (size_t)(n > 0 ? n : 1);
    if ((uint64_t)(n > 0 ? n : 1) > SIZE_MAX / es) return NULL;
    if (bytes) *bytes = count * es;
    return malloc(count * es);
}

/* a · b, or -1 (every caller's sizes are >= 0) when it overflows int64 or an operand is already -1 */
static int64_t mul_or_neg(int64_t a, int64_t b) {
    int64_t r;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return -1;
    return r;
}

/* The element counts of every tensor of cfg; -1 in a count that overflows int64. */
typedef struct {
    int64_t qk, v, g, beta, state;
} synth_counts_t;

/* cu_seqlens (varlen), num_tokens, num_seqs and the counts: 0, -1 out of memory, -2 a size overflows int64. */
static int synth_sizes(const kda_synth_config_t *c, kda_synth_t *s, int64_t *B, int64_t *T, synth_counts_t *n) {
    *T = c->seq_len;
    *B = c->batch;
    int64_t N = *B;
    if (c->num_seqs > 0) {
        N = c->num_seqs;
        *B = 1;
        if ((uint64_t)N >= SIZE_MAX / sizeof(int64_t)) return -2;
        s->cu_seqlens = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N + 1));
        if (!s->cu_seqlens) return -1;
        s->cu_seqlens[0] = 0;
        for (int64_t i = 0; i < N; i++) {
            const int64_t len = c->seqlens[i], at = s->cu_seqlens[i];
            if (len < 0 || len > INT64_MAX - at) return -2;
            s->cu_seqlens[i + 1] = at + len;
        }
        *T = s->cu_seqlens[N];
    }
    s->num_tokens = *B >= 0 && *T >= 0 ? mul_or_neg(*B, *T) : 0;
    s->num_seqs = N;
    /* negative sizes count as 0 here: the library refuses them, naming the argument */
    const int64_t NT = s->num_tokens, hqk = c->hqk > 0 ? c->hqk : 0, hv = c->hv > 0 ? c->hv : 0;
    const int64_t K = c->k > 0 ? c->k : 0, V = c->v > 0 ? c->v : 0;
    n->qk = mul_or_neg(mul_or_neg(NT, hqk), K);
    n->v = mul_or_neg(mul_or_neg(NT, hv), V);
    n->g = mul_or_neg(mul_or_neg(NT, hv), K);
    n->beta = mul_or_neg(NT, hv);
    n->state = mul_or_neg(mul_or_neg(mul_or_neg(N > 0 ? N : 0, hv), K), V);
    if (NT < 0 || n->qk < 0 || n->v < 0 || n->g < 0 || n->beta < 0 || n->state < 0) return -2;
    return 0;
}

static int synth_alloc(const kda_synth_config_t *c, kda_synth_t *s, const synth_counts_t *n) {
    s->q = alloc_tensor(n->qk, c->dtype, &s->q_bytes);
    s->k = alloc_tensor(n->qk, c->dtype, NULL);
    s->v = alloc_tensor(n->v, c->dtype, &s->v_bytes);
    s->g = alloc_tensor(n->g, c->g_dtype, &s->g_bytes);
    s->beta = alloc_tensor(n->beta, c->beta_dtype, &s->beta_bytes);
    s->o = alloc_tensor(n->v, c->o_dtype, &s->o_bytes);
    if (c->initial_state) s->h0 = alloc_tensor(n->state, c->initial_state_dtype, &s->h0_bytes);
    if (c->final_state) s->ht = alloc_tensor(n->state, c->final_state_dtype, &s->ht_bytes);
    s->A_log = (float *)alloc_tensor(c->hv, KDA_FLOAT32, NULL);
    s->dt_bias = (float *)alloc_tensor(c->hv > 0 && c->k > 0 ? (int64_t)c->hv * c->k : 0, KDA_FLOAT32, NULL);
    return !s->q || !s->k || !s->v || !s->g || !s->beta || !s->o || !s->A_log || !s->dt_bias ||
                   (c->initial_state && !s->h0) || (c->final_state && !s->ht)
               ? -1
               : 0;
}

/* q: noise. k: noise, unit-norm per token unless the kernel normalises it (as models feed it). v: noise. */
static int synth_fill_qkv(const kda_synth_config_t *c, kda_synth_t *s, uint64_t *rng) {
    const int K = c->k;
    const int64_t NT = s->num_tokens;
    for (int64_t i = 0; i < NT * c->hqk * K; i++) kda_store_f32(s->q, c->dtype, i, (float)normal(rng));
    float *row = (float *)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
    if (!row) return -1;
    for (int64_t r = 0; r < NT * c->hqk; r++) {
        double ss = 0.0;
        for (int d = 0; d < K; d++) {
            row[d] = (float)normal(rng);
            ss += (double)row[d] * row[d];
        }
        const float f = c->l2norm ? 1.0f : (float)(1.0 / sqrt(ss));
        for (int d = 0; d < K; d++) kda_store_f32(s->k, c->dtype, r * K + d, row[d] * f);
    }
    free(row);
    for (int64_t i = 0; i < NT * c->hv * c->v; i++) kda_store_f32(s->v, c->dtype, i, (float)normal(rng));
    return 0;
}

/* The gate parameters, g, beta, the initial state; o and the final state poisoned. */
static void synth_fill_rest(const kda_synth_config_t *c, kda_synth_t *s, const synth_counts_t *n, uint64_t *rng) {
    const int K = c->k;
    const double decay = c->decay > 0 ? c->decay : 1.0;
    for (int h = 0; h < c->hv; h++) {
        s->A_log[h] = (float)(log(0.3 * decay) + 0.3 * normal(rng));
        for (int d = 0; d < K; d++) s->dt_bias[h * K + d] = (float)(0.5 * normal(rng));
    }
    for (int64_t i = 0; i < n->g; i++) {
        double x = normal(rng);
        if (c->gate == KDA_GATE_RAW) x = decay * logsigmoid(x + 2.0); /* log decay, mostly mild */
        kda_store_f32(s->g, c->g_dtype, i, (float)x);
    }
    for (int64_t i = 0; i < n->beta; i++) {
        double x = c->beta_sigmoid ? normal(rng) : uniform(rng);
        kda_store_f32(s->beta, c->beta_dtype, i, (float)x);
    }
    kda_synth_poison(s->o, c->o_dtype, n->v);
    if (s->h0)
        for (int64_t i = 0; i < n->state; i++)
            kda_store_f32(s->h0, c->initial_state_dtype, i, (float)(0.5 * normal(rng)));
    if (s->ht) kda_synth_poison(s->ht, c->final_state_dtype, n->state);
}

static void synth_set_args(const kda_synth_config_t *c, const kda_synth_t *s, int64_t B, int64_t T, kda_args_t *a) {
    a->batch = B;
    a->seq_len = T;
    a->num_qk_heads = c->hqk;
    a->num_v_heads = c->hv;
    a->head_dim_k = c->k;
    a->head_dim_v = c->v;
    if (s->cu_seqlens) {
        a->cu_seqlens = s->cu_seqlens;
        a->cu_seqlens_dtype = KDA_INT64;
        a->num_seqs = s->num_seqs;
    }
    a->dtype = c->dtype;
    a->q = s->q;
    a->k = s->k;
    a->v = s->v;
    a->g = s->g;
    a->g_dtype = c->g_dtype;
    a->beta = s->beta;
    a->beta_dtype = c->beta_dtype;
    a->o = s->o;
    a->o_dtype = c->o_dtype;
    a->initial_state = s->h0;
    a->initial_state_dtype = c->initial_state_dtype;
    a->final_state = s->ht;
    a->final_state_dtype = c->final_state_dtype;
    a->state_v_first = c->state_v_first;
    a->scale = c->scale;
    a->use_qk_l2norm = c->l2norm;
    a->use_beta_sigmoid = c->beta_sigmoid;
    a->allow_neg_eigval = c->allow_neg_eigval;
    const float lb = c->lower_bound != 0.0f ? c->lower_bound : -5.0f;
    switch (c->gate) {
    case KDA_GATE_RAW:
        break;
    case KDA_GATE_SOFTPLUS:
        a->use_gate_in_kernel = 1;
        a->A_log = s->A_log;
        a->dt_bias = s->dt_bias;
        break;
    case KDA_GATE_LOWER_BOUND:
        a->use_gate_in_kernel = 1;
        a->A_log = s->A_log;
        a->dt_bias = s->dt_bias;
        a->lower_bound = lb;
        a->safe_gate = lb >= -5.0f;
        break;
    case KDA_GATE_LOWER_BOUND_NO_A:
        a->use_gate_in_kernel = 1;
        a->dt_bias = s->dt_bias;
        a->lower_bound = lb;
        break;
    }
}

int kda_synth_make(const kda_synth_config_t *c, kda_synth_t *s, kda_args_t *a) {
    memset(s, 0, sizeof *s);
    kda_args_init(a);
    uint64_t rng = c->seed * 0x2545f4914f6cdd1dull + 12345;
    int64_t B, T;
    synth_counts_t n;
    int rc = synth_sizes(c, s, &B, &T, &n);
    if (!rc) rc = synth_alloc(c, s, &n);
    if (!rc) rc = synth_fill_qkv(c, s, &rng);
    if (rc) {
        kda_synth_free(s);
        return rc;
    }
    synth_fill_rest(c, s, &n, &rng);
    synth_set_args(c, s, B, T, a);
    return 0;
}

void kda_synth_free(kda_synth_t *s) {
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->g);
    free(s->beta);
    free(s->o);
    free(s->h0);
    free(s->ht);
    free(s->A_log);
    free(s->dt_bias);
    free(s->cu_seqlens);
    memset(s, 0, sizeof *s);
}

void kda_synth_poison(void *x, kda_dtype_t dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) kda_store_f32(x, dt, i, NAN);
}

double kda_rel_err(const void *x, kda_dtype_t xdt, const void *ref, kda_dtype_t rdt, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double a = kda_load_f32(x, xdt, i), b = kda_load_f32(ref, rdt, i);
        if (!isfinite(a)) return INFINITY;
        num += (a - b) * (a - b);
        den += b * b;
    }
    if (n == 0) return 0.0;
    if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
    return sqrt(num / den);
}

int64_t kda_count_nonfinite(const void *x, kda_dtype_t dt, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += !isfinite(kda_load_f32(x, dt, i));
    return c;
}
