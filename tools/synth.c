/*
 * Synthetic KDA problems: see synth.h. Deterministic for a seed (splitmix64 + Box-Muller).
 */
#include "synth.h"

#include <math.h>
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

static void *alloc_tensor(int64_t n, kda_dtype_t dt, size_t *bytes) {
    size_t b = (size_t)(n > 0 ? n : 1) * kda_dtype_size(dt);
    if (bytes) *bytes = b;
    return malloc(b);
}

int kda_synth_make(const kda_synth_config_t *c, kda_synth_t *s, kda_args_t *a) {
    memset(s, 0, sizeof *s);
    kda_args_init(a);
    uint64_t rng = c->seed * 0x2545f4914f6cdd1dull + 12345;
    const int K = c->k, V = c->v;

    int64_t T = c->seq_len, B = c->batch, N = B;
    if (c->num_seqs > 0) {
        N = c->num_seqs;
        B = 1;
        s->cu_seqlens = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N + 1));
        if (!s->cu_seqlens) return -1;
        s->cu_seqlens[0] = 0;
        for (int64_t n = 0; n < N; n++) s->cu_seqlens[n + 1] = s->cu_seqlens[n] + c->seqlens[n];
        T = s->cu_seqlens[N];
    }
    s->num_tokens = B * T;
    s->num_seqs = N;
    const int64_t NT = s->num_tokens;

    s->q = alloc_tensor(NT * c->hqk * K, c->dtype, &s->q_bytes);
    s->k = alloc_tensor(NT * c->hqk * K, c->dtype, NULL);
    s->v = alloc_tensor(NT * c->hv * V, c->dtype, &s->v_bytes);
    s->g = alloc_tensor(NT * c->hv * K, c->g_dtype, &s->g_bytes);
    s->beta = alloc_tensor(NT * c->hv, c->beta_dtype, &s->beta_bytes);
    s->o = alloc_tensor(NT * c->hv * V, c->o_dtype, &s->o_bytes);
    const int64_t state_elems = N * c->hv * (int64_t)K * V;
    if (c->initial_state) s->h0 = alloc_tensor(state_elems, c->initial_state_dtype, &s->h0_bytes);
    if (c->final_state) s->ht = alloc_tensor(state_elems, c->final_state_dtype, &s->ht_bytes);
    s->A_log = (float *)malloc(sizeof(float) * (size_t)c->hv);
    s->dt_bias = (float *)malloc(sizeof(float) * (size_t)c->hv * K);
    if (!s->q || !s->k || !s->v || !s->g || !s->beta || !s->o || !s->A_log || !s->dt_bias ||
        (c->initial_state && !s->h0) || (c->final_state && !s->ht)) {
        kda_synth_free(s);
        return -1;
    }

    /* q: noise. k: noise, unit-norm per token unless the kernel normalises it (as models feed it). */
    for (int64_t i = 0; i < NT * c->hqk * K; i++) kda_store_f32(s->q, c->dtype, i, (float)normal(&rng));
    float *row = (float *)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
    if (!row) {
        kda_synth_free(s);
        return -1;
    }
    for (int64_t r = 0; r < NT * c->hqk; r++) {
        double ss = 0.0;
        for (int d = 0; d < K; d++) {
            row[d] = (float)normal(&rng);
            ss += (double)row[d] * row[d];
        }
        const float f = c->l2norm ? 1.0f : (float)(1.0 / sqrt(ss));
        for (int d = 0; d < K; d++) kda_store_f32(s->k, c->dtype, r * K + d, row[d] * f);
    }
    free(row);
    for (int64_t i = 0; i < NT * c->hv * V; i++) kda_store_f32(s->v, c->dtype, i, (float)normal(&rng));

    /* gates */
    const double decay = c->decay > 0 ? c->decay : 1.0;
    for (int h = 0; h < c->hv; h++) {
        s->A_log[h] = (float)(log(0.3 * decay) + 0.3 * normal(&rng));
        for (int d = 0; d < K; d++) s->dt_bias[h * K + d] = (float)(0.5 * normal(&rng));
    }
    for (int64_t i = 0; i < NT * c->hv * K; i++) {
        double x = normal(&rng);
        if (c->gate == KDA_GATE_RAW) x = decay * logsigmoid(x + 2.0); /* log decay, mostly mild */
        kda_store_f32(s->g, c->g_dtype, i, (float)x);
    }
    for (int64_t i = 0; i < NT * c->hv; i++) {
        double x = c->beta_sigmoid ? normal(&rng) : uniform(&rng);
        kda_store_f32(s->beta, c->beta_dtype, i, (float)x);
    }
    kda_synth_poison(s->o, c->o_dtype, NT * c->hv * V);
    if (s->h0)
        for (int64_t i = 0; i < state_elems; i++) kda_store_f32(s->h0, c->initial_state_dtype, i, (float)(0.5 * normal(&rng)));
    if (s->ht) kda_synth_poison(s->ht, c->final_state_dtype, state_elems);

    /* args */
    a->batch = B;
    a->seq_len = T;
    a->num_qk_heads = c->hqk;
    a->num_v_heads = c->hv;
    a->head_dim_k = K;
    a->head_dim_v = V;
    if (s->cu_seqlens) {
        a->cu_seqlens = s->cu_seqlens;
        a->cu_seqlens_dtype = KDA_INT64;
        a->num_seqs = N;
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
    a->use_qk_l2norm = c->l2norm;
    a->use_beta_sigmoid = c->beta_sigmoid;
    a->allow_neg_eigval = c->allow_neg_eigval;
    const float lb = c->lower_bound != 0.0f ? c->lower_bound : -5.0f;
    switch (c->gate) {
    case KDA_GATE_RAW: break;
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
