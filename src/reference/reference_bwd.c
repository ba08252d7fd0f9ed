/*
 * The oracle of the backward: reverse-mode differentiation of the token recurrence of reference.c, in float64,
 * one thread. Readable over fast: the CPU backward and (later) the CUDA backward are checked against it, and
 * it is checked by central finite differences of the forward oracle (tests/cpu/test_backward.c).
 *
 * Forward of one token (value head h, notation of docs/ALGORITHM.md; q̂, k̂ after l2norm, ĝ the clamped log
 * decay, α = e^ĝ, b = β after its sigmoid):
 *     S' = Diag(α) S_{t−1},   u = v − S'ᵀ k̂,   δ = b u,   S_t = S' + k̂ δᵀ,   o = s S_tᵀ q̂
 * Backward, with dS = ∂L/∂S_t arriving from the later tokens (∂L/∂S_T = d_final_state, or 0):
 *     dq̂ = s S_t do                      dS  ← dS + s q̂ doᵀ
 *     dδ = dSᵀ k̂                         dk̂  = dS δ − b S' dδ
 *     dv = b dδ                           db  = dδ · u
 *     dS' = dS − b k̂ dδᵀ                  dĝ  = rowsum(dS' ⊙ S')   (∂α/∂ĝ = α, S' = α S_{t−1})
 *     dS_{t−1} = Diag(α) dS'              d_initial_state = dS_{bos−1}
 * then through the in-kernel options: l2norm (dx = r (dy − y (y·dy)), y = r x), the clamp (no gradient where
 * it clamps), the gate (softplus: ∂λ/∂x = −A σ(x), ∂λ/∂A_log = λ; lower bound: ∂λ/∂x = lb σ'(A x) A,
 * ∂λ/∂A_log = lb σ'(A x) A x; x = g + dt_bias), β's sigmoid (c σ (1 − σ)). Value heads of one query/key head
 * sum their dq̂, dk̂ before the l2norm step (it is linear in dy).
 *
 * States: the forward is rerun from the initial state, keeping S at the start of every block of RB tokens;
 * the backward walks the blocks last to first, rerunning each block's RB states from its checkpoint.
 */
#include <math.h>
#include <string.h>

#include "../internal.h"
#include "reference.h"
#include "../dtype.h"
#include "reference_cp.h"

#define RB 64 /* tokens between two kept states */

/* ---------------------------------------------------------------------------------------------------------
 * Scratch (doubles)
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    double *ckpt;     /* (nblocks + 1) × K×V: S at each block start */
    double *blk;      /* (RB + 1) × K×V: S_{t0−1} .. S_{t0+RB−1} of the block being walked back */
    double *dS;       /* K×V */
    double *dq, *dk;  /* max_seq_len × K: Σ over the group of dq̂, dk̂ of one query/key head */
    double *dA, *ddt; /* HV, HV×K */
    double *q, *k, *v, *g, *gx, *gmask, *dout, *dqh, *dkh, *u, *dd; /* 256 each */
} scratch_t;

static size_t carve(double *base, const kda_bwd_problem_t *p, scratch_t *s) {
    const size_t KV = (size_t)kda_state_head_elems(&p->f), K = (size_t)p->f.a.head_dim_k;
    const size_t HV = (size_t)p->f.a.num_v_heads, T = (size_t)p->max_seq_len;
    const size_t nb = (T + RB - 1) / RB;
    size_t off = 0;
#define TAKE(field, count)                                                                                             \
    do {                                                                                                               \
        s->field = base ? base + off : NULL;                                                                           \
        off += ((size_t)(count) + 7) & ~(size_t)7;                                                                     \
    } while (0)
    TAKE(ckpt, (nb + 1) * KV);
    TAKE(blk, (RB + 1) * KV);
    TAKE(dS, KV);
    TAKE(dq, T * K);
    TAKE(dk, T * K);
    TAKE(dA, HV);
    TAKE(ddt, HV * K);
    TAKE(q, 256);
    TAKE(k, 256);
    TAKE(v, 256);
    TAKE(g, 256);
    TAKE(gx, 256);
    TAKE(gmask, 256);
    TAKE(dout, 256);
    TAKE(dqh, 256);
    TAKE(dkh, 256);
    TAKE(u, 256);
    TAKE(dd, 256);
#undef TAKE
    return off;
}

kda_status_t kda_reference_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes) {
    (void)ctx;
    scratch_t s;
    *bytes = carve(NULL, p, &s) * sizeof(double) + 64;
    return KDA_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * One token's inputs
 * ------------------------------------------------------------------------------------------------------- */

/* State element (i, j) of head h in slot `slot`: i indexes K, j indexes V, in either layout. */
static int64_t state_index(const kda_problem_t *p, int64_t slot, int h, int i, int j) {
    const int K = p->a.head_dim_k, V = p->a.head_dim_v;
    const int64_t base = (slot * p->a.num_v_heads + h) * (int64_t)K * V;
    return base + (p->a.state_v_first ? (int64_t)j * K + i : (int64_t)i * V + j);
}

static void load(double *x, const void *src, kda_dtype_t dt, int64_t off, int n) {
    for (int i = 0; i < n; i++) x[i] = (double)kda_load_f32(src, dt, off + i);
}

static void l2normalise(double *x, int n) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double r = 1.0 / sqrt(ss + KDA_L2NORM_EPS);
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* q̂, k̂, v, ĝ of token t, head h; gx = the gate's input x = g + dt_bias, gmask = 1 where the clamp passes. */
static double token(const kda_problem_t *p, const scratch_t *s, int64_t t, int h) {
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v, HQK = a->num_qk_heads, HV = a->num_v_heads;
    const int hq = h / p->group;
    load(s->q, a->q, a->dtype, (t * HQK + hq) * K, K);
    load(s->k, a->k, a->dtype, (t * HQK + hq) * K, K);
    if (a->use_qk_l2norm) {
        l2normalise(s->q, K);
        l2normalise(s->k, K);
    }
    load(s->v, a->v, a->dtype, (t * HV + h) * V, V);
    load(s->g, a->g, a->g_dtype, (t * HV + h) * K, K);
    const double A = a->A_log ? exp((double)a->A_log[h]) : 1.0;
    for (int i = 0; i < K; i++) {
        double lam = s->g[i];
        if (a->use_gate_in_kernel) {
            const double x = s->g[i] + (a->dt_bias ? (double)a->dt_bias[h * K + i] : 0.0);
            s->gx[i] = x;
            lam = p->has_lower_bound ? (double)a->lower_bound * kda_sigmoid(A * x) : -A * kda_softplus(x);
        }
        /* the clamp into [KDA_GATE_MIN, 0]; NaN passes */
        s->gmask[i] = 1.0;
        if (lam > 0.0) lam = 0.0, s->gmask[i] = 0.0;
        if (lam < (double)KDA_GATE_MIN) lam = (double)KDA_GATE_MIN, s->gmask[i] = 0.0;
        s->g[i] = lam;
    }
    double beta = (double)kda_load_f32(a->beta, a->beta_dtype, t * HV + h);
    if (a->use_beta_sigmoid) beta = (a->allow_neg_eigval ? 2.0 : 1.0) * kda_sigmoid(beta);
    return beta;
}

/* S_t from S_{t−1} (token inputs already in s). */
static void step(int K, int V, const scratch_t *s, double b, const double *Sp, double *St) {
    for (int i = 0; i < K; i++) {
        const double al = exp(s->g[i]);
        for (int j = 0; j < V; j++) St[i * V + j] = al * Sp[i * V + j];
    }
    for (int j = 0; j < V; j++) s->u[j] = s->v[j];
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++) s->u[j] -= s->k[i] * St[i * V + j];
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++) St[i * V + j] += s->k[i] * b * s->u[j];
}

/* ---------------------------------------------------------------------------------------------------------
 * One (sequence, value head): adds dq̂, dk̂ into s->dq, s->dk (rows from bos), dA_log, ddt_bias into s->dA,
 * s->ddt; writes dv, dg, dbeta, d_initial_state
 * ------------------------------------------------------------------------------------------------------- */
static void ref_bwd_head(const kda_bwd_problem_t *bp, int64_t n, int h, scratch_t *s) {
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    const int K = a->head_dim_k, V = a->head_dim_v, HV = a->num_v_heads;
    const int64_t KV = (int64_t)K * V;
    const double scale = (double)p->scale;
    int64_t bos, eos;
    kda_seq_bounds(p, n, &bos, &eos);
    const int64_t slot = kda_state_slot(p, n), len = eos - bos;
    const int64_t nb = (len + RB - 1) / RB;

    /* forward: S at each block start */
    double *S0 = s->ckpt;
    kda_ref_initial_state(p, n, h, S0); /* as the forward: a non-finite column is NaN whole; cross-rank CP's fold */
    for (int64_t blk = 0; blk < nb; blk++) {
        memcpy(s->blk, s->ckpt + blk * KV, sizeof(double) * (size_t)KV);
        const int64_t t1 = bos + (blk + 1) * RB < eos ? bos + (blk + 1) * RB : eos;
        for (int64_t t = bos + blk * RB; t < t1; t++) {
            const double be = token(p, s, t, h);
            step(K, V, s, be, s->blk, s->blk + KV);
            memcpy(s->blk, s->blk + KV, sizeof(double) * (size_t)KV);
        }
        memcpy(s->ckpt + (blk + 1) * KV, s->blk, sizeof(double) * (size_t)KV);
    }

    /* dS_T = d_final_state, or for a last sequence that continues on later ranks their fold (xcp.c) */
    if (n == p->num_seqs - 1 && bp->cp_dstate_out) {
        memcpy(s->dS, bp->cp_dstate_out + (size_t)h * KV, sizeof(double) * (size_t)KV);
    } else if (b->d_final_state && slot >= 0) {
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++)
                s->dS[i * V + j] =
                    kda_load_f32(b->d_final_state, b->d_final_state_dtype, state_index(p, slot, h, i, j));
    } else {
        memset(s->dS, 0, sizeof(double) * (size_t)KV);
    }

    const double A = a->A_log ? exp((double)a->A_log[h]) : 1.0;
    for (int64_t blk = nb - 1; blk >= 0; blk--) {
        const int64_t t0 = bos + blk * RB, t1 = t0 + RB < eos ? t0 + RB : eos;
        /* rerun the block: blk[i] = S_{t0+i−1} */
        memcpy(s->blk, s->ckpt + blk * KV, sizeof(double) * (size_t)KV);
        for (int64_t t = t0; t < t1; t++) {
            const double be = token(p, s, t, h);
            step(K, V, s, be, s->blk + (t - t0) * KV, s->blk + (t - t0 + 1) * KV);
        }
        for (int64_t t = t1 - 1; t >= t0; t--) {
            const double *Sp = s->blk + (t - t0) * KV, *St = s->blk + (t - t0 + 1) * KV;
            const double be = token(p, s, t, h);
            load(s->dout, b->d_o, b->d_o_dtype, (t * HV + h) * V, V);
            /* u = v − S'ᵀ k̂ */
            for (int j = 0; j < V; j++) s->u[j] = s->v[j];
            for (int i = 0; i < K; i++) {
                const double al = exp(s->g[i]);
                for (int j = 0; j < V; j++) s->u[j] -= s->k[i] * al * Sp[i * V + j];
            }
            /* dq̂ = s S_t do;  dS += s q̂ doᵀ */
            for (int i = 0; i < K; i++) {
                double acc = 0.0;
                for (int j = 0; j < V; j++) acc += St[i * V + j] * s->dout[j];
                s->dqh[i] = scale * acc;
                for (int j = 0; j < V; j++) s->dS[i * V + j] += scale * s->q[i] * s->dout[j];
            }
            /* dδ = dSᵀ k̂ */
            for (int j = 0; j < V; j++) s->dd[j] = 0.0;
            for (int i = 0; i < K; i++)
                for (int j = 0; j < V; j++) s->dd[j] += s->dS[i * V + j] * s->k[i];
            /* dk̂ = dS δ − b S' dδ  (δ = b u) */
            for (int i = 0; i < K; i++) {
                const double al = exp(s->g[i]);
                double acc = 0.0;
                for (int j = 0; j < V; j++) acc += s->dS[i * V + j] * be * s->u[j] - be * al * Sp[i * V + j] * s->dd[j];
                s->dkh[i] = acc;
            }
            /* dv, db */
            double db = 0.0;
            for (int j = 0; j < V; j++) {
                kda_store_f32(b->dv, b->dv_dtype, (t * HV + h) * V + j, (float)(be * s->dd[j]));
                db += s->dd[j] * s->u[j];
            }
            /* dS' = dS − b k̂ dδᵀ;  dĝ = rowsum(dS' ⊙ S');  dS ← Diag(α) dS' */
            for (int i = 0; i < K; i++) {
                const double al = exp(s->g[i]);
                double dgi = 0.0;
                for (int j = 0; j < V; j++) {
                    const double d = s->dS[i * V + j] - be * s->k[i] * s->dd[j];
                    dgi += d * al * Sp[i * V + j];
                    s->dS[i * V + j] = al * d;
                }
                /* through the clamp and the in-kernel gate */
                dgi *= s->gmask[i];
                double dx = dgi;
                if (a->use_gate_in_kernel) {
                    const double x = s->gx[i];
                    if (p->has_lower_bound) {
                        const double sg = kda_sigmoid(A * x), ds = (double)a->lower_bound * sg * (1.0 - sg);
                        dx = dgi * ds * A;
                        if (a->A_log) s->dA[h] += dgi * ds * A * x;
                    } else {
                        dx = dgi * -A * kda_sigmoid(x);
                        if (a->A_log) s->dA[h] += dgi * s->g[i];
                    }
                    if (a->dt_bias) s->ddt[h * K + i] += dx;
                }
                kda_store_f32(b->dg, b->dg_dtype, (t * HV + h) * K + i, (float)dx);
            }
            /* through β's sigmoid */
            if (a->use_beta_sigmoid) {
                const double c = a->allow_neg_eigval ? 2.0 : 1.0;
                const double sg = kda_sigmoid((double)kda_load_f32(a->beta, a->beta_dtype, t * HV + h));
                db *= c * sg * (1.0 - sg);
            }
            kda_store_f32(b->dbeta, b->dbeta_dtype, t * HV + h, (float)db);
            for (int i = 0; i < K; i++) {
                s->dq[(t - bos) * K + i] += s->dqh[i];
                s->dk[(t - bos) * K + i] += s->dkh[i];
            }
        }
    }

    if (n == 0 && p->cp_state_in) memset(s->dS, 0, sizeof(double) * (size_t)KV); /* its initial state unread */
    if (b->d_initial_state && slot >= 0)
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++)
                kda_store_f32(b->d_initial_state, b->d_initial_state_dtype, state_index(p, slot, h, i, j),
                              (float)s->dS[i * V + j]);
}

/* dx = r (dy − y (y·dy)) with y = r x, r = 1 / sqrt(Σ x² + eps); dy in place. */
static void l2norm_backward(double *dy, const double *x, int n) {
    double ss = 0.0, ydy = 0.0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double r = 1.0 / sqrt(ss + KDA_L2NORM_EPS);
    for (int i = 0; i < n; i++) ydy += r * x[i] * dy[i];
    for (int i = 0; i < n; i++) dy[i] = r * (dy[i] - r * x[i] * ydy);
}

kda_status_t kda_reference_backward(kda_context_t *ctx, const kda_bwd_problem_t *bp, void *ws, size_t ws_bytes,
                                    void *stream) {
    (void)ctx;
    (void)ws_bytes;
    (void)stream;
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    const int K = a->head_dim_k, HQK = a->num_qk_heads, HV = a->num_v_heads;
    scratch_t s;
    carve((double *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), bp, &s);
    memset(s.dA, 0, sizeof(double) * (size_t)HV);
    memset(s.ddt, 0, sizeof(double) * (size_t)HV * K);

    /* slots no sequence reads get a zero gradient */
    if (b->d_initial_state) {
        const int64_t nstate = a->state_indices ? a->num_state_slots : p->num_seqs;
        const int64_t total = nstate * HV * kda_state_head_elems(p);
        for (int64_t i = 0; i < total; i++) kda_store_f32(b->d_initial_state, b->d_initial_state_dtype, i, 0.0f);
    }

    for (int64_t n = 0; n < p->num_seqs; n++) {
        int64_t bos, eos;
        kda_seq_bounds(p, n, &bos, &eos);
        for (int hq = 0; hq < HQK; hq++) {
            memset(s.dq, 0, sizeof(double) * (size_t)(eos - bos) * K);
            memset(s.dk, 0, sizeof(double) * (size_t)(eos - bos) * K);
            for (int h = hq * p->group; h < (hq + 1) * p->group; h++) ref_bwd_head(bp, n, h, &s);
            for (int64_t t = bos; t < eos; t++) {
                double *dq = s.dq + (t - bos) * K, *dk = s.dk + (t - bos) * K;
                if (a->use_qk_l2norm) {
                    load(s.q, a->q, a->dtype, (t * HQK + hq) * K, K);
                    load(s.k, a->k, a->dtype, (t * HQK + hq) * K, K);
                    l2norm_backward(dq, s.q, K);
                    l2norm_backward(dk, s.k, K);
                }
                for (int i = 0; i < K; i++) {
                    kda_store_f32(b->dq, b->dq_dtype, (t * HQK + hq) * K + i, (float)dq[i]);
                    kda_store_f32(b->dk, b->dk_dtype, (t * HQK + hq) * K + i, (float)dk[i]);
                }
            }
        }
    }
    if (b->dA_log)
        for (int h = 0; h < HV; h++) b->dA_log[h] = (float)s.dA[h];
    if (b->ddt_bias)
        for (int i = 0; i < HV * K; i++) b->ddt_bias[i] = (float)s.ddt[i];
    return KDA_STATUS_SUCCESS;
}
