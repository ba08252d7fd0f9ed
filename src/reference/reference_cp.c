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

#include "../dtype.h"
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

void kda_ref_cp_compose(int K, int V, const double *Ma, const double *Ea, const double *Mb, const double *Eb, double *M,
                        double *E) {
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

kda_status_t kda_ref_cp_merge(const kda_problem_t *p, const kda_cp_piece_t *table, int64_t num_pieces, const double *M,
                              const double *E, double *S_in) {
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

/* ---------------------------------------------------------------------------------------------------------
 * Context parallelism across ranks (docs/ALGORITHM.md §4a). The forward's summary of value head h is [M | E] of
 * the last local sequence part: from kda_ref_cp_map, or M = 0 and E = the oracle's own state at the slice's end
 * when the sequence starts here. The backward's is [Mᵀ | dE] of the first part: dE = ∂L/∂S before its first token
 * from the part's d_o and dS_out (d_final_state when the sequence ends here, else 0, and then Mᵀ the transposed
 * map), walking its tokens last to first:
 *     dS ← dS + s q_t do_tᵀ,   dS ← Diag(α_t) (I − β_t k_t k_tᵀ) dS
 * the adjoint of S_t = (I − β k kᵀ) Diag(α) S_{t−1} + β k vᵀ and o_t = s S_tᵀ q_t (reference_bwd.c's dS chain).
 * ------------------------------------------------------------------------------------------------------- */
kda_status_t kda_ref_xcp_summary_workspace(const kda_context_t *ctx, const kda_problem_t *p,
                                           const kda_bwd_problem_t *bp, size_t *bytes) {
    (void)ctx;
    (void)bp;
    const size_t K = (size_t)p->a.head_dim_k, V = (size_t)p->a.head_dim_v;
    *bytes = (K * K + 2 * K * V) * sizeof(double) + 64;
    return KDA_STATUS_SUCCESS;
}

/* Element (i, j) of head h of state slot `slot` of a [slots, HV, K, V] (V-first: [.., V, K]) tensor */
static int64_t xcp_state_index(const kda_problem_t *p, int64_t slot, int h, int i, int j) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    const int64_t base = (slot * p->a.num_v_heads + h) * (int64_t)K * V;
    return base + (p->a.state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j);
}

/* dS (K×V) back through tokens [t0, t1) of value head h, last first */
static void xcp_adjoint(const kda_bwd_problem_t *bp, int h, int64_t t0, int64_t t1, double *dS) {
    const kda_problem_t *p = &bp->f;
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads;
    const double s = (double)p->scale;
    double q[256], k[256], v[256], gate[256], beta[256], r[256];
    for (int64_t t = t1 - 1; t >= t0; t--) {
        const int bad = kda_ref_token(p, t, h, q, k, v, gate, beta);
        for (int j = 0; j < V; j++) {
            const double d = (double)kda_load_f32(bp->b.d_o, bp->b.d_o_dtype, (t * HV + h) * V + j);
            for (int i = 0; i < K; i++) dS[i * V + j] += s * q[i] * d;
        }
        for (int j = 0; j < V; j++) {
            r[j] = 0.0;
            for (int i = 0; i < K; i++) r[j] += k[i] * dS[i * V + j];
        }
        for (int i = 0; i < K; i++) {
            const double alpha = exp(gate[i]);
            for (int j = 0; j < V; j++) dS[i * V + j] = alpha * (dS[i * V + j] - beta[0] * k[i] * r[j]);
        }
        if (bad)
            for (int i = 0; i < K * V; i++) dS[i] = NAN;
    }
}

kda_status_t kda_ref_xcp_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out,
                                 void *ws, size_t ws_bytes) {
    (void)ctx;
    (void)ws_bytes;
    const int K = p->a.head_dim_k, V = p->a.head_dim_v, HV = p->a.num_v_heads, W = K + V;
    double *M = (double *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), *E = M + (size_t)K * K, *S = E + (size_t)K * V;
    const int64_t n = bp ? 0 : p->num_seqs - 1;
    const int zero_m = bp ? kda_xcp_first_ends_here(p) : kda_xcp_last_starts_here(p);
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    for (int h = 0; h < HV; h++) {
        if (zero_m) memset(M, 0, sizeof(double) * (size_t)K * K);
        if (!bp) {
            if (zero_m) kda_ref_state_at(p, n, h, eos, E);
            else kda_ref_cp_map(p, n, h, bos, eos, M, E);
        } else {
            if (!zero_m) kda_ref_cp_map(p, n, h, bos, eos, M, S); /* S: the map's E, not needed */
            const kda_backward_args_t *b = &bp->b;
            const int64_t slot = kda_state_slot(p, n);
            memset(E, 0, sizeof(double) * (size_t)K * V);
            if (zero_m && b->d_final_state && slot >= 0)
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < V; j++)
                        E[i * V + j] =
                            kda_load_f32(b->d_final_state, b->d_final_state_dtype, xcp_state_index(p, slot, h, i, j));
            xcp_adjoint(bp, h, bos, eos, E);
        }
        double *X = out + (size_t)h * K * W;
        for (int i = 0; i < K; i++) {
            for (int l = 0; l < K; l++) X[i * W + l] = bp ? M[l * K + i] : M[i * K + l];
            for (int j = 0; j < V; j++) X[i * W + K + j] = E[i * V + j];
        }
    }
    return KDA_STATUS_SUCCESS;
}
