/*
 * The oracle of intra-card context parallelism (docs/ALGORITHM.md §4), in float64, straight from the definition.
 *
 * A range of tokens maps the state it starts from affinely, S_out = M S_in + E (M K×K, E = S_ext K×V). Writing
 * X = [M | E] (K × (K + V)), X starts as [I | 0] and every token of the range applies the recurrence to both
 * parts, with the zero vector in place of v for M's columns:
 *     X ← Diag(α_t) X                       decay
 *     δ ← β_t ([0 | v_t] − Xᵀ k_t)          the delta-rule correction, a (K + V)-vector
 *     X ← X + k_t δᵀ                        i.e. X ← (I − β k kᵀ) Diag(α) X + β k [0 | v]ᵀ
 * with the oracle's own per-token inputs (kda_ref_token: l2norm, gate mode and clamp, β sigmoid). Ranges compose
 * as (M_b, E_b) ∘ (M_a, E_a) = (M_b M_a, M_b E_a + E_b); the merge walks a sequence's pieces in order, S_0 = the
 * initial state, S_{j+1} = M_j S_j + E_j. Non-finite inputs: a poisoning token makes its range's map NaN, so every
 * state composed through it is NaN, as the oracle's is.
 * Readable over fast: the CUDA pre-scan and merge are checked against this file.
 */
#include <math.h>
#include <string.h>

#include "reference_cp.h"

int kda_ref_cp_map(const kda_problem_t *p, int64_t n, int h, int64_t t0, int64_t t1, double *M, double *E) {
    (void)n;
    const kda_args_t *a = &p->a;
    if (a->beta_headwise) return -1;
    const int K = a->head_dim_k, V = a->head_dim_v, W = K + V;
    double q[256], k[256], v[256], gate[256], beta[256], d[512];
    for (int i = 0; i < K; i++)
        for (int j = 0; j < K; j++) M[i * K + j] = i == j ? 1.0 : 0.0;
    memset(E, 0, sizeof(double) * (size_t)K * V);
    int poisoned = 0;
    for (int64_t t = t0; t < t1; t++) {
        if (kda_ref_token(p, t, h, q, k, v, gate, beta)) poisoned = 1;
        if (poisoned) {
            for (int i = 0; i < K * K; i++) M[i] = NAN;
            for (int i = 0; i < K * V; i++) E[i] = NAN;
        }
        /* X <- Diag(exp(gate)) X */
        for (int i = 0; i < K; i++) {
            const double alpha = exp(gate[i]);
            for (int j = 0; j < K; j++) M[i * K + j] *= alpha;
            for (int j = 0; j < V; j++) E[i * V + j] *= alpha;
        }
        /* δ = β ([0 | v] − Xᵀ k) */
        for (int j = 0; j < W; j++) d[j] = 0.0;
        for (int i = 0; i < K; i++) {
            for (int j = 0; j < K; j++) d[j] += k[i] * M[i * K + j];
            for (int j = 0; j < V; j++) d[K + j] += k[i] * E[i * V + j];
        }
        for (int j = 0; j < K; j++) d[j] = beta[0] * (0.0 - d[j]);
        for (int j = 0; j < V; j++) d[K + j] = beta[0] * (v[j] - d[K + j]);
        /* X <- X + k δᵀ */
        for (int i = 0; i < K; i++) {
            for (int j = 0; j < K; j++) M[i * K + j] += k[i] * d[j];
            for (int j = 0; j < V; j++) E[i * V + j] += k[i] * d[K + j];
        }
    }
    return poisoned;
}

void kda_ref_cp_compose(int K, int V, const double *Ma, const double *Ea, const double *Mb, const double *Eb,
                        double *M, double *E) {
    for (int i = 0; i < K; i++) {
        for (int j = 0; j < K; j++) {
            double s = 0.0;
            for (int l = 0; l < K; l++) s += Mb[i * K + l] * Ma[l * K + j];
            M[i * K + j] = s;
        }
        for (int j = 0; j < V; j++) {
            double s = Eb[i * V + j];
            for (int l = 0; l < K; l++) s += Mb[i * K + l] * Ea[l * V + j];
            E[i * V + j] = s;
        }
    }
}

void kda_ref_cp_apply(int K, int V, const double *M, const double *E, const double *S_in, double *S_out) {
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++) {
            double s = E[i * V + j];
            for (int l = 0; l < K; l++) s += M[i * K + l] * S_in[l * V + j];
            S_out[i * V + j] = s;
        }
}

kda_status_t kda_ref_cp_prescan(const kda_problem_t *p, const kda_cp_piece_t *table, int64_t num_pieces, double *M,
                                double *E) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads;
    if (p->a.beta_headwise)
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "kda_ref_cp_prescan: argument 'beta_headwise': no K x K map");
    for (int64_t e = 0; e < num_pieces; e++) {
        const kda_cp_piece_t *x = &table[e];
        if (x->slot < 0) continue;
        for (int h = 0; h < HV; h++) {
            const int64_t s = x->slot * HV + h;
            kda_ref_cp_map(p, x->seq, h, x->bos, x->eos, M + s * K * K, E + s * K * V);
        }
    }
    return KDA_STATUS_SUCCESS;
}

kda_status_t kda_ref_cp_merge(const kda_problem_t *p, const kda_cp_piece_t *table, int64_t num_pieces,
                              const double *M, const double *E, double *S_in) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads;
    if (p->a.beta_headwise)
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "kda_ref_cp_merge: argument 'beta_headwise': no K x K map");
    for (int64_t e = 0; e < num_pieces; e++) {
        const kda_cp_piece_t *x = &table[e];
        if (x->slot < 0) continue;
        for (int h = 0; h < HV; h++) {
            const int64_t s = x->slot * HV + h;
            if (x->flags & KDA_CP_FIRST) {
                kda_ref_initial_state(p, x->seq, h, S_in + s * K * V);
            } else {
                const int64_t r = table[e - 1].slot * HV + h; /* the piece before, of the same sequence */
                kda_ref_cp_apply(K, V, M + r * K * K, E + r * K * V, S_in + r * K * V, S_in + s * K * V);
            }
        }
    }
    return KDA_STATUS_SUCCESS;
}
