/*
 * Backward, stage 3, version 1 (development builds only: dev_skip bit KDA_DEV_BWD_V1_CHUNK selects it, so that
 * bench/bwd_stages.py can time it beside bwd_chunk.cu's tensor-core kernel on the same inputs): the same math on
 * CUDA cores in fp32, every pair product with its own exponential (~830 k per chunk and head at K = 128).
 * Thread t owns row t / 4 and the columns ≡ t (mod 4) of every C-row tile it computes. Included by
 * bwd_chunk.cu after the helpers it shares (chunk_smem, load_rows, gate_cumsum, gexp, ...).
 */
/* dĝ = reverse cumsum of dG (in q̂'s tile) + the G_last terms (ext); then the clamp and the gate (inputs x in G's
 * tile), column by column: dg written, the chunk's sums of ∂L/∂A_log and ∂L/∂dt_bias into the partials */
template <int KC, int VC>
DEV void gate_backward(const kda_bwd_params_t &p, chunk_smem<KC, VC> &sm, int64_t cid, int64_t t0, int clen, int h,
                       float A, int tid) {
    constexpr int KS = KC + 4;
    for (int d = tid; d < KC; d += CK_THREADS) {
        float acc = sm.ext[d], dbias = 0.0f, dAl = 0.0f;
        for (int i = C - 1; i >= 0; i--) {
            acc += sm.q[i * KS + d];
            if (i >= clen || d >= p.K) continue;
            const int64_t t = t0 + i;
            const float x = sm.G[i * KS + d], lam = gate_value(p, A, x);
            float gi = acc * (lam <= 0.0f && lam >= KDA_GATE_MIN ? 1.0f : 0.0f); /* as chunk_bwd.c: NaN stays NaN */
            if (p.gate_in_kernel) {
                if (p.lower_bound != 0.0f) {
                    const float sg = sigm(A * x), ds = p.lower_bound * sg * (1.0f - sg) * A;
                    dAl += gi * ds * x;
                    gi *= ds;
                } else {
                    dAl += -gi * A * softplus_acc(x);
                    gi *= -A * sigm(x);
                }
                dbias += gi;
            }
            store_elem(p.dg, p.dg_dtype, (t * p.hv + h) * (int64_t)p.K + d, gi);
        }
        sm.dal[d] = dAl;
        if (p.part) p.part[(cid * p.hv + h) * (int64_t)(KC + 1) + 1 + d] = dbias;
    }
    __syncthreads();
    if (tid == 0 && p.part) {
        float acc = 0.0f;
        for (int d = 0; d < KC; d++) acc += sm.dal[d];
        p.part[(cid * p.hv + h) * (int64_t)(KC + 1)] = acc;
    }
}

static constexpr int d_unroll = 4; /* rows of S (dS⁺) in flight in the K-long loops of Z and dΔ (255 registers
                                      at KC = VC = 128 with 4; a constant, as #pragma unroll takes no macro) */

/* Σ_c a[c] b[c] over n (a multiple of 4) floats, both 16-byte aligned */
DEV float dot4(const float *a, const float *b, int n) {
    float acc = 0.0f;
#pragma unroll 4
    for (int c = 0; c < n; c += 4) {
        const float4 x = *(const float4 *)(a + c), y = *(const float4 *)(b + c);
        acc += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
    }
    return acc;
}

/* acc[u] = Σ_c a[c] b[(l4 + 4 (u0 + u)) VC + c] for u < NU, each in dot4's order: the c loop outside, so that
 * the NU rows' loads of one step are independent and in flight together (a loop per row waited on each) */
template <int NU, int VC>
DEV void dots4_g(const float *a, const float *__restrict__ b, int l4, int u0, float (&acc)[NU]) {
#pragma unroll
    for (int u = 0; u < NU; u++) acc[u] = 0.0f;
#pragma unroll 1
    for (int c = 0; c < VC; c += 4) {
        const float4 x = *(const float4 *)(a + c);
#pragma unroll
        for (int u = 0; u < NU; u++) {
            const float4 y = __ldg((const float4 *)(b + (int64_t)(l4 + 4 * (u0 + u)) * VC + c));
            acc[u] += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
        }
    }
}

/* M (strictly lower) and Aqk (lower, × s), pair by pair: row r's pairs j = l4 + 4 m ≤ r, the channel loop
 * outside so that row r's own q̂, k̂, G are read once per channel for its 16 pairs */
template <int KC, int VC>
DEV void pair_products(chunk_smem<KC, VC> &sm, float scale, int r, int l4) {
    constexpr int KS = KC + 4, NJ = C / 4;
    const float *qi = sm.q + r * KS, *ki = sm.k + r * KS, *Gi = sm.G + r * KS;
    float sa[NJ], sq[NJ];
#pragma unroll
    for (int m = 0; m < NJ; m++) sa[m] = sq[m] = 0.0f;
#pragma unroll 1
    for (int d = 0; d < KC; d++) {
        const float gi = Gi[d], kid = ki[d], qid = qi[d];
#pragma unroll
        for (int m = 0; m < NJ; m++) {
            const int j = l4 + 4 * m;
            if (j <= r) {
                const float kk = sm.k[j * KS + d] * gexp(gi - sm.G[j * KS + d]);
                sa[m] += kid * kk;
                sq[m] += qid * kk;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NJ; m++) {
        const int j = l4 + 4 * m;
        sm.M[r * CS + j] = j < r ? sa[m] : 0.0f;
        sm.A2[r * CS + j] = scale * sq[m];
    }
}

/* T = (I + Diag(β) M)⁻¹ by forward substitution, row after row (all threads reach every barrier) */
template <int KC, int VC>
DEV void invert(chunk_smem<KC, VC> &sm, int tid) {
    for (int e = tid; e < C * C; e += CK_THREADS) sm.T[(e / C) * CS + e % C] = e / C == e % C ? 1.0f : 0.0f;
    __syncthreads();
    for (int i = 1; i < C; i++) {
        if (tid < i) {
            const int j = tid;
            float acc = 0.0f;
            for (int m = j; m < i; m++) acc += sm.M[i * CS + m] * sm.T[m * CS + j];
            sm.T[i * CS + j] = -sm.beta[i] * acc;
        }
        __syncthreads();
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernel
 * ------------------------------------------------------------------------------------------------------- */
template <int KC, int VC>
__global__ void __launch_bounds__(CK_THREADS, 1) kda_bwd_chunk_kernel_v1(const kda_bwd_params_t p) {
    constexpr int KS = KC + 4, VS = VC + 4, KU = KC / 4, VU = VC / 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    chunk_smem<KC, VC> &sm = *(chunk_smem<KC, VC> *)smem_raw;
    const int tid = threadIdx.x, r = tid >> 2, l4 = tid & 3, lane = tid & 31, warp = tid >> 5;

    const int64_t cid = blockIdx.x / p.hv;
    const int h = (int)(blockIdx.x % p.hv);
    const int64_t n = chunk_seq(p.seqs, cid);
    if (n < 0) return;
    int64_t bos, eos;
    seq_bounds(p.seqs, n, &bos, &eos);
    const int64_t t0 = bos + (cid - seq_chunk0(p.seqs, n)) * C;
    const int clen = (int)min((int64_t)C, eos - t0);
    if (clen <= 0) return;
    const float scale = p.scale;
    const float A = p.A_log ? expf(p.A_log[h]) : 1.0f;
    const float *__restrict__ S = p.states + (cid * p.hv + h) * (int64_t)KC * VC;
    const float *__restrict__ dS = p.dstates + (cid * p.hv + h) * (int64_t)KC * VC;

    /* ---- forward ---- */
    /* S and dS⁺ (written by stages 1-2, 128 KB, in HBM) are first read after the chunk's forward: have them in L2 */
    prefetch_l2(S, (int64_t)KC * VC * 4, tid);
    prefetch_l2(dS, (int64_t)KC * VC * 4, tid);
    load_rows<KC, VC>(p, sm, t0, clen, h, A, tid);
    __syncthreads();
    gate_cumsum<KC>(sm.G, tid);
    __syncthreads();
    pair_products<KC, VC>(sm, scale, r, l4);
    __syncthreads();
    invert<KC, VC>(sm, tid);

    const float *qr = sm.q + r * KS, *kr = sm.k + r * KS, *Gr = sm.G + r * KS, *Gl = sm.G + (C - 1) * KS;
    const float br = sm.beta[r];
    float y[VU];
    /* Z = Diag(β) (V − KΓ S), in place of v (each element is its owner's) */
#pragma unroll
    for (int u = 0; u < VU; u++) y[u] = sm.D[r * VS + l4 + 4 * u];
#pragma unroll d_unroll
    for (int d = 0; d < KC; d++) {
        const float f = kr[d] * gexp(Gr[d]);
        const float *Sd = S + (int64_t)d * VC + l4;
#pragma unroll
        for (int u = 0; u < VU; u++) y[u] -= f * __ldg(Sd + 4 * u);
    }
#pragma unroll
    for (int u = 0; u < VU; u++) sm.D[r * VS + l4 + 4 * u] = br * y[u];
    __syncthreads();
    /* Δ = T Z */
#pragma unroll
    for (int u = 0; u < VU; u++) y[u] = 0.0f;
#pragma unroll 1
    for (int m = 0; m <= r; m++) {
        const float t = sm.T[r * CS + m];
#pragma unroll
        for (int u = 0; u < VU; u++) y[u] += t * sm.D[m * VS + l4 + 4 * u];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < VU; u++) sm.D[r * VS + l4 + 4 * u] = y[u];

    /* ---- backward ---- */
    /* dO into R; γ, dγ = rowsum(dS⁺ ⊙ S) */
#pragma unroll 8 /* 8 loads in flight per thread (a loop step waited on each) */
    for (int e = tid; e < C * VC; e += CK_THREADS) {
        const int i = e / VC, c = e % VC;
        sm.R[i * VS + c] = i < clen && c < p.V ? load_elem(p.d_o, p.do_dtype, ((t0 + i) * p.hv + h) * (int64_t)p.V + c) : 0.0f;
    }
    for (int d = tid; d < KC; d += CK_THREADS) {
        sm.gam[d] = gexp(Gl[d]);
        float acc = 0.0f;
#pragma unroll 8
        for (int c = 0; c < VC; c++) acc += __ldg(dS + (int64_t)d * VC + c) * __ldg(S + (int64_t)d * VC + c);
        sm.dgam[d] = acc;
    }
    __syncthreads();

    /* dq̂, dk̂ of row r accumulate in its scratch row (rows past the chunk's end are dropped), dG in registers */
    const bool own = r < clen;
    float *dqr = p.dqk + ((t0 + (own ? r : 0)) * p.hv + h) * (int64_t)(2 * KC), *dkr = dqr + KC;
    float dG[KU];
    /* dQΓ = dO Sᵀ: dq̂ = s e^G dQΓ (its first term), dG = QΓ ⊙ dQΓ */
#pragma unroll
    for (int h2 = 0; h2 < 2; h2++) { /* two halves of the row's KU columns: 16 loads in flight per step */
        float a[KU / 2];
        dots4_g<KU / 2, VC>(sm.R + r * VS, S, l4, h2 * (KU / 2), a);
#pragma unroll
        for (int uu = 0; uu < KU / 2; uu++) {
            const int u = h2 * (KU / 2) + uu, d = l4 + 4 * u;
            const float e = scale * gexp(Gr[d]) * a[uu];
            if (own) dqr[d] = e;
            dG[u] = qr[d] * e;
        }
    }
    /* dΔ = Aqkᵀ dO + K̃ dS⁺ (into y until dO is no longer needed) */
#pragma unroll
    for (int u = 0; u < VU; u++) y[u] = 0.0f;
#pragma unroll 1
    for (int m = r; m < C; m++) {
        const float a = sm.A2[m * CS + r];
#pragma unroll
        for (int u = 0; u < VU; u++) y[u] += a * sm.R[m * VS + l4 + 4 * u];
    }
#pragma unroll d_unroll
    for (int d = 0; d < KC; d++) {
        const float f = kr[d] * gexp(Gl[d] - Gr[d]);
        const float *dSd = dS + (int64_t)d * VC + l4;
#pragma unroll
        for (int u = 0; u < VU; u++) y[u] += f * __ldg(dSd + 4 * u);
    }
    __syncthreads(); /* every read of Aqk is done */
    /* dAqk = dO Δᵀ (lower) in place of Aqk */
    for (int j = l4; j < C; j += 4) sm.A2[r * CS + j] = j <= r ? dot4(sm.R + r * VS, sm.D + j * VS, VC) : 0.0f;
    __syncthreads(); /* every read of dO is done */
#pragma unroll
    for (int u = 0; u < VU; u++) sm.R[r * VS + l4 + 4 * u] = y[u];
    __syncthreads();
    /* dR = Tᵀ dΔ */
#pragma unroll
    for (int u = 0; u < VU; u++) y[u] = 0.0f;
#pragma unroll 1
    for (int m = r; m < C; m++) {
        const float t = sm.T[m * CS + r];
#pragma unroll
        for (int u = 0; u < VU; u++) y[u] += t * sm.R[m * VS + l4 + 4 * u];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < VU; u++) sm.R[r * VS + l4 + 4 * u] = y[u];
    __syncthreads();
    /* dA = −dR Δᵀ (strictly lower) in place of T; dβ's pair term Σ_j dA M */
    float db = 0.0f;
    for (int j = l4; j < C; j += 4) {
        const float a = j < r ? -dot4(sm.R + r * VS, sm.D + j * VS, VC) : 0.0f;
        sm.T[r * CS + j] = a;
        db += a * sm.M[r * CS + j];
    }
    __syncthreads(); /* M is free from here on: the scratch of the G_last reduction */

    /* dv = β dR, dβ += v·dR */
    if (r < clen) {
        const int64_t row = ((t0 + r) * p.hv + h) * (int64_t)p.V;
#pragma unroll 8
        for (int c = l4; c < p.V; c += 4) db += load_elem(p.v, p.dtype, row + c) * sm.R[r * VS + c];
        for (int c = l4; c < p.V; c += 4) store_elem(p.dv, p.dv_dtype, row + c, br * sm.R[r * VS + c]);
    }
    /* dX = −dR Sᵀ and dK̃ = Δ dS⁺ᵀ through X = β k e^G and K̃ = k e^{G_last − G} */
    float ext[KU];
#pragma unroll
    for (int u = 0; u < KU; u++) ext[u] = 0.0f;
#pragma unroll
    for (int h2 = 0; h2 < 4; h2++) { /* quarters of the row's KU columns: 2 × KU/4 loads in flight per step */
        float axs[KU / 4], aks[KU / 4];
        dots4_g<KU / 4, VC>(sm.R + r * VS, S, l4, h2 * (KU / 4), axs);
        dots4_g<KU / 4, VC>(sm.D + r * VS, dS, l4, h2 * (KU / 4), aks);
#pragma unroll
        for (int uu = 0; uu < KU / 4; uu++) {
            const int u = h2 * (KU / 4) + uu, d = l4 + 4 * u;
            const float ax = -axs[uu];
            const float ak = aks[uu];
            const float e = gexp(Gr[d]), f = gexp(Gl[d] - Gr[d]), kd = kr[d];
            if (own) dkr[d] = br * e * ax + f * ak; /* dk̂'s first term */
            db += kd * e * ax;
            const float kt = kd * f * ak;
            dG[u] += br * kd * e * ax - kt;
            ext[u] = kt;
        }
    }
    /* Σ over the rows of K̃ ⊙ dK̃ (+ γ dγ): the G_last terms, added to every row's dĝ below */
#pragma unroll
    for (int u = 0; u < KU; u++) {
        float x = ext[u];
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        if (lane < 4) sm.M[warp * KC + l4 + 4 * u] = x;
    }
    __syncthreads();
    for (int d = tid; d < KC; d += CK_THREADS) {
        float acc = sm.gam[d] * sm.dgam[d];
        for (int w = 0; w < CK_THREADS / 32; w++) acc += sm.M[w * KC + d];
        sm.ext[d] = acc;
    }

    /* the pair products backward: row r as the later token i (pairs j ≤ r), then as the earlier j (i ≥ r) */
    float aq[KU], ak[KU];
#pragma unroll
    for (int u = 0; u < KU; u++) aq[u] = ak[u] = 0.0f;
#pragma unroll 1
    for (int j = 0; j <= r; j++) {
        const float cm = j < r ? br * sm.T[r * CS + j] : 0.0f, cq = scale * sm.A2[r * CS + j];
        const float *kj = sm.k + j * KS, *Gj = sm.G + j * KS;
#pragma unroll
        for (int u = 0; u < KU; u++) {
            const int d = l4 + 4 * u;
            const float kk = kj[d] * gexp(Gr[d] - Gj[d]);
            ak[u] += cm * kk;
            aq[u] += cq * kk;
            dG[u] += (cm * kr[d] + cq * qr[d]) * kk;
        }
    }
#pragma unroll 1
    for (int i = r; i < C; i++) {
        const float cm = i > r ? sm.beta[i] * sm.T[i * CS + r] : 0.0f, cq = scale * sm.A2[i * CS + r];
        const float *ki = sm.k + i * KS, *qi = sm.q + i * KS, *Gi = sm.G + i * KS;
#pragma unroll
        for (int u = 0; u < KU; u++) {
            const int d = l4 + 4 * u;
            const float ti = (cm * ki[d] + cq * qi[d]) * gexp(Gi[d] - Gr[d]);
            ak[u] += ti;
            dG[u] -= ti * kr[d];
        }
    }
    if (own)
#pragma unroll
        for (int u = 0; u < KU; u++) {
            dqr[l4 + 4 * u] += aq[u];
            dkr[l4 + 4 * u] += ak[u];
        }

    /* dβ: the row's four threads sum; through the sigmoid */
    db += __shfl_xor_sync(0xffffffffu, db, 1);
    db += __shfl_xor_sync(0xffffffffu, db, 2);
    if (l4 == 0 && r < clen) {
        const int64_t e = (t0 + r) * p.hv + h;
        if (p.beta_sigmoid) {
            const float sg = sigm(load_elem(p.beta, p.beta_dtype, e));
            db *= (p.neg_eigval ? 2.0f : 1.0f) * sg * (1.0f - sg);
        }
        store_elem(p.dbeta, p.dbeta_dtype, e, db);
    }
    __syncthreads(); /* q̂ is free: it holds dG next; G holds the gate inputs x (loaded by all threads at once,
                        not in the column loop below, where each load would wait on the store before it) */
#pragma unroll
    for (int u = 0; u < KU; u++) sm.q[r * KS + l4 + 4 * u] = dG[u];
#pragma unroll 8
    for (int e = tid; e < C * KC; e += CK_THREADS) {
        const int i = e / KC, d = e % KC;
        sm.G[i * KS + d] = i < clen && d < p.K ? gate_input(p, t0 + i, h, d) : 0.0f;
    }
    __syncthreads();

    gate_backward<KC, VC>(p, sm, cid, t0, clen, h, A, tid);
}

