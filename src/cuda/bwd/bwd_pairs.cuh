/*
 * Backward, stage 3c: what is per channel — the pair products' backward, the factor rules, the gate's backward
 * (docs/ALGORITHM.md §6, "Chunked"; src/cpu/chunk_bwd.c is the same computation on the CPU).
 *
 * One CTA of 256 threads per (chunk, query/key head, PK_KT-channel tile d0..), looping over the G value heads
 * h = hq·G … hq·G + G − 1 of its query/key head hq in that order. Every term below is a sum over tokens for one
 * channel d, so the channels split across CTAs with nothing to combine. The chunk kernel (bwd_chunk.cuh) leaves, per
 * value head, the coefficient gradients P = s·dAqk (lower) and B = Diag(β) dA (strictly lower), β ⊙ dX and the
 * l2norm factors; the raw dQΓ, dK̃ and dγ come from bwd_inter.cuh (bf16 inputs) or the chunk kernel (fp32, fp16
 * inputs). With q̂, k̂ (per query/key head: loaded once) and ĝ (per value head) recomputed from the inputs and
 * G = cumsum ĝ, for each value head and channel (e_i = e^{G_i}, f_i = e^{G_last − G_i}):
 *
 *   Pq_i = Σ_{j ≤ i} P_ij k_j e^{G_i − G_j}     Pk_i = Σ_{j < i} B_ij k_j e^{G_i − G_j}
 *   E_j  = Σ_{i ≥ j} (B_ij k_i + P_ij q_i) e^{G_i − G_j}        (the pair products M, Aqk differentiated)
 *   dq̂_i = s e_i dQΓ_i + Pq_i                                      (QΓ = s q e^G)
 *   dk̂_i = e_i (β dX)_i + f_i dK̃_i + Pk_i + E_i                     (X = β k e^G, K̃ = k e^{G_last − G})
 *   dG_i = q_i dq̂_i + k_i (e_i (β dX)_i − f_i dK̃_i + Pk_i − E_i)
 *   dĝ_i = Σ_{i' ≥ i} dG_i' + γ dγ + Σ_i' k_i' f_i' dK̃_i'          (the G_last terms: every row; γ = e^{G_last})
 *   then the clamp and the gate (softplus or lower-bound form): dg, and the chunk's sums of ∂L/∂A_log and
 *   ∂L/∂dt_bias for the channel.
 * Written per value head: dg of the chunk's tokens in the tile's channels and the per-channel partial sums
 * (bwd_finish.cu sums them over chunks and channels, in order). dq̂, dk̂ of the lane's elements are summed over the
 * G heads in registers, in head order (no atomics: the same bits on every call); after the last head, dq and dk
 * themselves: dx = r (dŷ − ŷ (ŷ·dŷ)) with ŷ·dŷ summed over the row's KC channels, which lie in the KC / 32 CTAs of
 * the (chunk, query/key head); r is the chunk kernel's factor of any value head of the group (all the same).
 * Those CTAs form a cluster: each pushes its rows' partial sums into every CTA's shared memory by st.async,
 * completing bytes on the receiver's mbarrier, right after the last head's pair products, and waits on its own
 * barrier only at the end, after that head's gate backward, so that the exchange costs no wait. The sums are added
 * in rank order: the same bits in every CTA. Without l2norm (dx = dŷ) no cluster: the stores follow the last head's
 * factor rules.
 *
 * The pair sums are tensor-core products (mma.sync m16n8k8, tf32, fp32 sums) of the C × C coefficients with
 * k, q scaled by split factors e^{G_i − R} · e^{R − G_j} around a reference row R of each 16-row block
 * (block_split, decided for this tile's channels), the diagonal blocks in 3xTF32 or, where a block does not split,
 * pair by pair, the others with the k, q operand in two tf32 parts (mma16_blk: why). Warp w owns row block w mod 4:
 * its rows as the later token (Pq, Pk) and as the earlier one (E), for one half of the tile's channels.
 * Latency-bound, so 8 warps per CTA and two CTAs per SM at up to 128 registers (three CTAs would need 80 registers
 * and spills); the diagonal block is peeled out of the off-diagonal loops, whose tf32 products form no lo parts.
 * Layout: q̂, k̂, G, the gate inputs [C][PK_KT] and P (later dG), B [C][C + 4], fp32 in shared
 * memory (74 KB); each head's P and B arrive by cp.async (the chunk kernel writes their rows padded as here) while
 * its rows are loaded and its gate computed.
 */
#ifndef KDA_CUDA_BWD_PAIRS_CUH
#define KDA_CUDA_BWD_PAIRS_CUH

#include "bwd.cuh"
#include "seq.cuh"

#define PK_THREADS 256 /* 8 warps; in the products warp w has row block w mod 4 and the channel half w / 4 */
#define PK_WARPS (PK_THREADS / 32)
#define PK_KT 32                     /* channels per CTA */
#define PK_NT (PK_KT / 16)           /* 8-channel tiles of a warp's half */
#define PK_RG (KDA_CHUNK / PK_WARPS) /* rows per warp in the per-element phases */
#define C KDA_CHUNK
#define CS (C + 4) /* fp32 strides 4 banks apart: a fragment's 8 rows in distinct banks */
#define TS (PK_KT + 4)

struct pairs_smem {
    float q[C * TS], k[C * TS], G[C * TS], x[C * TS]; /* q̂, k̂, G, the gate inputs x = g (+ dt_bias) */
    float P[C * CS], B[C * CS]; /* adjacent: one region, as the chunk kernel writes them; P later dG [C][TS] */
    float ext[4][PK_KT];        /* by row block: Σ k f dK̃ */
    float tot[PK_WARPS][PK_KT]; /* by warp: its rows' sums of ĝ, then of dG */
    float red[2][PK_THREADS];   /* the gate parameters' per-thread sums */
    /* with l2norm: from the cluster's CTA of rank r (its channel tile), by channel half, Σ over the half's 16
       channels of (q̂ dq̂, k̂ dk̂) of each row */
    float2 ys[256 / PK_KT][2][C];
    uint64_t bar; /* with l2norm: complete when every CTA's ys have arrived */
};

/* dq or dk elements d, d + 1 (d even) of row `row` (K per row), those below K: bf16 with K even and the buffer
 * 4-byte aligned (the training case) as one 4-byte store */
DEV void store_final(void *dst, int dtype, int K, int64_t row, int d, float2 x) {
    const int64_t i = row * K + d;
    if (dtype == KDA_DT_BF16 && !(K & 1) && !((uintptr_t)dst & 3)) {
        if (d < K) *(uint32_t *)((uint16_t *)dst + i) = pack_16x2<0>(x.x, x.y);
        return;
    }
    if (d < K) store_elem(dst, dtype, i, x.x);
    if (d + 1 < K) store_elem(dst, dtype, i + 1, x.y);
}

/* A fragments of rows 16 I.. at coefficient columns j0.. (TR: coefficient (col, row), the transpose) as tf32, or
 * (X3) as parts hi + lo */
template <int X3, int TR>
DEV void coef_frags(const float *X, int I, int j0, int lane, frag_t f[4], frag_t fl[4]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = 16 * I + g + 8 * (r & 1), col = j0 + 2 * t + 8 * (r >> 1);
        const float2 x =
            TR ? make_float2(X[col * CS + row], X[(col + 1) * CS + row]) : *(const float2 *)&X[row * CS + col];
        if (X3) split2(x, &f[r], &fl[r]);
        else f[r] = tf2(x.x, x.y);
    }
}

/* c += A B for one 16-column block: in 3xTF32 on a diagonal block (X3), else as Ah (Bh + Bl) — the operand B (k or
 * q times its factor) in two tf32 parts, the coefficient A in one. A pair's coefficient enters dG twice (rows i and
 * j) rounded the same way, so its rounding cancels in dĝ's reverse sum; the operands of the two entries are
 * different numbers, and their tf32 rounding did not cancel: carried by the reverse sum to every earlier row, it was
 * most of dA_log's error at strong decay */
template <int X3>
DEV void mma16_blk(float c[4], const frag_t ah[4], const frag_t al[4], frag_t b0, frag_t b1) {
    frag_t bh0, bl0, bh1, bl1;
    split2(b0, &bh0, &bl0);
    split2(b1, &bh1, &bl1);
    if (X3) mma16(c, al, bh0, bh1); /* the coefficient's lo part too: mma16_x3's three products, in its order */
    mma16(c, ah, bl0, bl1);
    mma16(c, ah, bh0, bh1);
}

/* pairs_later's products with the coefficients' columns j0 .. j0 + 15 */
template <int X3>
DEV void later_block(const pairs_smem &sm, int I, int c0, int j0, const float *R, int lane, float (*pq)[4],
                     float (*pk)[4]) {
    const int g = lane >> 2, t = lane & 3;
    frag_t fq[4], fm[4], fql[4], fml[4];
    coef_frags<X3, 0>(sm.P, I, j0, lane, fq, fql);
    coef_frags<X3, 0>(sm.B, I, j0, lane, fm, fml);
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++) {
        const int d = c0 + 8 * nt + g;
        frag_t bf[2];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int j = j0 + 2 * t + 8 * hh;
            bf[hh] = make_float2(sm.k[j * TS + d] * gexp(R[d] - sm.G[j * TS + d]),
                                 sm.k[(j + 1) * TS + d] * gexp(R[d] - sm.G[(j + 1) * TS + d]));
        }
        mma16_blk<X3>(pq[nt], fq, fql, bf[0], bf[1]);
        mma16_blk<X3>(pk[nt], fm, fml, bf[0], bf[1]);
    }
}

/* pairs_earlier's products with the coefficients' rows i0 .. i0 + 15 */
template <int X3>
DEV void earlier_block(const pairs_smem &sm, int J, int c0, int i0, const float *R, int lane, float (*pe)[4]) {
    const int g = lane >> 2, t = lane & 3;
    frag_t fq[4], fm[4], fql[4], fml[4];
    coef_frags<X3, 1>(sm.P, J, i0, lane, fq, fql); /* A(j, i) = coefficient (i, j): transposed reads */
    coef_frags<X3, 1>(sm.B, J, i0, lane, fm, fml);
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++) {
        const int d = c0 + 8 * nt + g;
        frag_t bk[2], bq[2];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int i = i0 + 2 * t + 8 * hh;
            const float e0 = gexp(sm.G[i * TS + d] - R[d]), e1 = gexp(sm.G[(i + 1) * TS + d] - R[d]);
            bk[hh] = make_float2(sm.k[i * TS + d] * e0, sm.k[(i + 1) * TS + d] * e1);
            bq[hh] = make_float2(sm.q[i * TS + d] * e0, sm.q[(i + 1) * TS + d] * e1);
        }
        mma16_blk<X3>(pe[nt], fm, fml, bk[0], bk[1]);
        mma16_blk<X3>(pe[nt], fq, fql, bq[0], bq[1]);
    }
}

/* Row i (block I) as the later token, the tile's columns c0 + 8 nt..: Pq_i = Σ_{j ≤ i} P_ij k_j e^{G_i − G_j},
 * Pk_i = Σ_{j < i} B_ij k_j e^{G_i − G_j} (P, B zero where they do not apply) */
DEV void pairs_later(const pairs_smem &sm, int I, int c0, int split, int lane, float (*pq)[4], float (*pk)[4]) {
    const int g = lane >> 2, t = lane & 3;
    const float *R = sm.G + (16 * I + (split ? 7 : 0)) * TS;
    zero_acc<PK_NT>(pq);
    zero_acc<PK_NT>(pk);
#pragma unroll 1
    for (int j0 = 0; j0 < 16 * I; j0 += 16) later_block<0>(sm, I, c0, j0, R, lane, pq, pk);
    if (split) later_block<1>(sm, I, c0, 16 * I, R, lane, pq, pk); /* the diagonal block */
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int i = 16 * I + g + 8 * (c >> 1), d = c0 + 8 * nt + 2 * t + (c & 1);
            const float f = gexp(sm.G[i * TS + d] - R[d]);
            float sq = f * pq[nt][c], sk = f * pk[nt][c];
            if (!split) /* the diagonal block, pair by pair */
                for (int j = 16 * I; j <= i; j++) {
                    const float kk = sm.k[j * TS + d] * gexp(sm.G[i * TS + d] - sm.G[j * TS + d]);
                    sq += sm.P[i * CS + j] * kk;
                    sk += sm.B[i * CS + j] * kk;
                }
            pq[nt][c] = sq;
            pk[nt][c] = sk;
        }
}

/* Row j (block J) as the earlier token, the tile's columns c0 + 8 nt..: E_j = Σ_{i ≥ j} (B_ij k_i + P_ij q_i) e^{G_i − G_j} */
DEV void pairs_earlier(const pairs_smem &sm, int J, int c0, int split, int lane, float (*pe)[4]) {
    const int g = lane >> 2, t = lane & 3;
    const float *R = sm.G + (16 * J + (split ? 7 : 15)) * TS;
    zero_acc<PK_NT>(pe);
    if (split) earlier_block<1>(sm, J, c0, 16 * J, R, lane, pe); /* the diagonal block */
#pragma unroll 1
    for (int i0 = 16 * (J + 1); i0 < C; i0 += 16) earlier_block<0>(sm, J, c0, i0, R, lane, pe);
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int j = 16 * J + g + 8 * (c >> 1), d = c0 + 8 * nt + 2 * t + (c & 1);
            float s = gexp(R[d] - sm.G[j * TS + d]) * pe[nt][c];
            if (!split)
                for (int i = j; i < 16 * (J + 1); i++)
                    s += (sm.B[i * CS + j] * sm.k[i * TS + d] + sm.P[i * CS + j] * sm.q[i * TS + d]) *
                         gexp(sm.G[i * TS + d] - sm.G[j * TS + d]);
            pe[nt][c] = s;
        }
}

/* ĝ of the warp's rows PK_RG w + r (r < nrow, else 0) from the gate inputs, form MODE */
template <int MODE>
DEV void gate_rows(pairs_smem &sm, float lower_bound, float A, int w, int dl, int nrow) {
#pragma unroll
    for (int r = 0; r < PK_RG; r++) {
        const int i = PK_RG * w + r;
        sm.G[i * TS + dl] = r < nrow ? gate_clamped<MODE>(lower_bound, A, sm.x[i * TS + dl]) : 0.0f;
    }
}

/* dg of the warp's rows PK_RG w + r, r < nrow, from dĝ = dG (the tile dGt, [C][TS]) + off; the ∂L/∂A_log and
 * ∂L/∂dt_bias terms summed into *dAl, *dbias in row order; every store after the gate's math. Every row's gate
 * backward is computed (x = 0 in rows that do not exist) and selected: as a call per existing row behind a branch,
 * the eight rows' latency chains ran one after another (BSSY / BRA pairs were a sixth of this phase's instructions) */
template <int MODE, int DT>
DEV void gate_backward_rows(const kda_bwd_params_t &p, const pairs_smem &sm, const float *dGt, float A, float off,
                            int w, int dl, int nrow, int64_t base, float *dAl, float *dbias) {
    float gv[PK_RG];
#pragma unroll
    for (int r = 0; r < PK_RG; r++) {
        const int i = PK_RG * w + r;
        float al = *dAl; /* the running sum, taken on only where the row exists: the same operations as before */
        const float gi = gate_backward<MODE>(p.pb.lower_bound, A, sm.x[i * TS + dl], dGt[i * TS + dl] + off, &al);
        gv[r] = r < nrow ? gi : 0.0f;
        *dAl = r < nrow ? al : *dAl;
        if (MODE != GATE_NONE) *dbias += gv[r];
    }
    const int64_t stride = (int64_t)p.pb.hv * p.pb.K;
#pragma unroll
    for (int r = 0; r < PK_RG; r++)
        if (r < nrow) store_elem(p.dg, DT, base + r * stride, gv[r]);
}

/* gate_backward_rows with the gradient's dtype as a constant */
template <int MODE>
DEV void gate_backward_rows_dt(const kda_bwd_params_t &p, const pairs_smem &sm, const float *dGt, float A, float off,
                               int w, int dl, int nrow, int64_t base, float *dAl, float *dbias) {
    switch (p.dg_dtype) {
    case KDA_DT_F32:
        gate_backward_rows<MODE, KDA_DT_F32>(p, sm, dGt, A, off, w, dl, nrow, base, dAl, dbias);
        break;
    case KDA_DT_F16:
        gate_backward_rows<MODE, KDA_DT_F16>(p, sm, dGt, A, off, w, dl, nrow, base, dAl, dbias);
        break;
    default:
        gate_backward_rows<MODE, KDA_DT_BF16>(p, sm, dGt, A, off, w, dl, nrow, base, dAl, dbias);
    }
}

/* dq and dk of the lane's elements (rows 16 I + g + 8 hr below clen, channels d0 + c0 + 8 nt + 2t, + 1) from
 * their dq̂, dk̂ summed over the group's value heads (fq, fk), the l2norm factors rn (q, k) and, with l2norm (L2),
 * the rows' sums y·dy from ys (the cluster's NTILE CTAs and two halves each, in that order: the same bits in every
 * CTA) */
template <int NTILE>
DEV void store_dqdk(const kda_bwd_params_t &p, const pairs_smem &sm, int I, int c0, int d0, int g, int t, int64_t t0,
                    int clen, int hq, const float2 rn[2], const float2 (*fq)[2], const float2 (*fk)[2], int L2) {
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = 16 * I + g + 8 * hr;
        if (i >= clen) continue;
        float tq = 0.0f, tk = 0.0f;
        if (L2)
#pragma unroll
            for (int r = 0; r < NTILE; r++) {
                const float2 a = sm.ys[r][0][i], b = sm.ys[r][1][i];
                tq += a.x + b.x;
                tk += a.y + b.y;
            }
        const int64_t row = (t0 + i) * p.pb.hqk + hq;
#pragma unroll
        for (int nt = 0; nt < PK_NT; nt++) {
            const int col = c0 + 8 * nt + 2 * t;
            const float2 yq = *(const float2 *)&sm.q[i * TS + col], yk = *(const float2 *)&sm.k[i * TS + col];
            const float2 dq = make_float2(rn[hr].x * (fq[nt][hr].x - yq.x * tq), rn[hr].x * (fq[nt][hr].y - yq.y * tq));
            const float2 dk = make_float2(rn[hr].y * (fk[nt][hr].x - yk.x * tk), rn[hr].y * (fk[nt][hr].y - yk.y * tk));
            store_final(p.dq, p.dq_dtype, p.pb.K, row, d0 + col, dq);
            store_final(p.dk, p.dk_dtype, p.pb.K, row, d0 + col, dk);
        }
    }
}

/* The rows of value head h (the warp's PK_RG, lane = channel d0 + lane; nrow of them exist): the gate inputs
 * x = g (+ dt_bias) and ĝ into G (rows that do not exist: 0), and with QK (the group's first head) q̂ = r q,
 * k̂ = r k of the query/key head; every load issued before any is converted */
DEV void head_rows(const kda_bwd_params_t &p, pairs_smem &sm, int h, int hq, int64_t t0, int w, int d0, int nrow,
                   float A, int QK) {
    const int dl = threadIdx.x & 31, d = d0 + dl;
    const int nqk = QK ? nrow : 0;
    uint32_t qb[PK_RG], kb[PK_RG], gb[PK_RG];
    const int64_t t1 = t0 + PK_RG * w; /* the warp's first token */
    load_bits_n<PK_RG>(qb, p.pb.q, p.pb.dtype, (t1 * p.pb.hqk + hq) * (int64_t)p.pb.K + d, (int64_t)p.pb.hqk * p.pb.K,
                       nqk);
    load_bits_n<PK_RG>(kb, p.pb.k, p.pb.dtype, (t1 * p.pb.hqk + hq) * (int64_t)p.pb.K + d, (int64_t)p.pb.hqk * p.pb.K,
                       nqk);
    load_bits_n<PK_RG>(gb, p.pb.g, p.pb.g_dtype, (t1 * p.pb.hv + h) * (int64_t)p.pb.K + d, (int64_t)p.pb.hv * p.pb.K,
                       nrow);
    float rq[PK_RG], rk[PK_RG]; /* (the factors of any value head of the group: the same) */
    const float *rn = p.rnorm + (t1 * p.pb.hv + h) * 2;
#pragma unroll
    for (int r = 0; r < PK_RG; r++) {
        const bool l2 = p.pb.l2norm && r < nqk;
        rq[r] = l2 ? rn[(int64_t)r * p.pb.hv * 2] : 1.0f;
        rk[r] = l2 ? rn[(int64_t)r * p.pb.hv * 2 + 1] : 1.0f;
    }
    const float bias = p.pb.gate_in_kernel && p.pb.dt_bias && d < p.pb.K ? p.pb.dt_bias[(int64_t)h * p.pb.K + d] : 0.0f;
    float gv[PK_RG];
    bits_values<PK_RG>(gv, gb, p.pb.g_dtype);
    if (QK) {
        float qv[PK_RG], kv[PK_RG];
        bits_values<PK_RG>(qv, qb, p.pb.dtype);
        bits_values<PK_RG>(kv, kb, p.pb.dtype);
#pragma unroll
        for (int r = 0; r < PK_RG; r++) {
            const int i = PK_RG * w + r;
            sm.q[i * TS + dl] = qv[r] * rq[r];
            sm.k[i * TS + dl] = kv[r] * rk[r];
        }
    }
#pragma unroll
    for (int r = 0; r < PK_RG; r++) sm.x[(PK_RG * w + r) * TS + dl] = r < nrow ? gv[r] + bias : 0.0f;
    switch (gate_mode(p)) { /* ĝ into G (rows that do not exist: 0) */
    case GATE_NONE:
        gate_rows<GATE_NONE>(sm, p.pb.lower_bound, A, w, dl, nrow);
        break;
    case GATE_LOWER:
        gate_rows<GATE_LOWER>(sm, p.pb.lower_bound, A, w, dl, nrow);
        break;
    default:
        gate_rows<GATE_SOFTPLUS>(sm, p.pb.lower_bound, A, w, dl, nrow);
    }
}

/* ĝ of the pair x (two channels of one row; 0 where the row does not exist: computed, then selected, so that a
 * warp's rows are not one branch each), form MODE */
template <int MODE>
DEV float2 gate_pair(float lower_bound, float A, float2 x, bool valid) {
    const float a = gate_clamped<MODE>(lower_bound, A, x.x), b = gate_clamped<MODE>(lower_bound, A, x.y);
    return make_float2(valid ? a : 0.0f, valid ? b : 0.0f);
}

/* head_rows for 16-bit q, k and g, K even and every channel of the tile below K: the same values
 * into the same places, with two channels per lane — lane l takes rows PK_RG w + 2 r + l / 16 (r < PK_RG / 2),
 * channels d0 + 2 (l mod 16) and the next, by one 4-byte load per row and tensor and a pointer stepped by two rows.
 * (head_rows' 2-byte loads, each forming its own 64-bit address, made its phase ~880 instructions per warp and a
 * quarter of the kernel's stall samples.) The cumulative sum that follows reads other lanes' rows: a __syncwarp
 * there. */
template <int MODE>
DEV void head_rows_vec(const kda_bwd_params_t &p, pairs_smem &sm, int h, int hq, int64_t t0, int w, int d0, int clen,
                       float A, int QK) {
    constexpr int RV = PK_RG / 2;
    const int lane = threadIdx.x & 31, cl = 2 * (lane & 15), d = d0 + cl;
    const int i0 = PK_RG * w + (lane >> 4); /* the lane's first row, then every second */
    const int rem = clen - i0, nv = rem <= 0 ? 0 : rem >= 2 * RV ? RV : (rem + 1) / 2; /* its rows that exist */
    const int nqk = QK ? nv : 0;
    const int64_t t1 = t0 + i0;
    const int64_t sqk = (int64_t)p.pb.hqk * p.pb.K, sg = (int64_t)p.pb.hv * p.pb.K; /* two rows, in 4-byte words */
    const uint32_t *qp = (const uint32_t *)((const uint16_t *)p.pb.q + (t1 * p.pb.hqk + hq) * (int64_t)p.pb.K + d);
    const uint32_t *kp = (const uint32_t *)((const uint16_t *)p.pb.k + (t1 * p.pb.hqk + hq) * (int64_t)p.pb.K + d);
    const uint32_t *gp = (const uint32_t *)((const uint16_t *)p.pb.g + (t1 * p.pb.hv + h) * (int64_t)p.pb.K + d);
    const float2 *rp = (const float2 *)(p.rnorm + (t1 * p.pb.hv + h) * 2);
    uint32_t qb[RV], kb[RV], gb[RV];
    float2 rn[RV];
#pragma unroll
    for (int r = 0; r < RV; r++) {
        qb[r] = r < nqk ? __ldg(qp) : 0u;
        kb[r] = r < nqk ? __ldg(kp) : 0u;
        gb[r] = r < nv ? __ldg(gp) : 0u;
        rn[r] = p.pb.l2norm && r < nqk ? __ldg(rp) : make_float2(1.0f, 1.0f);
        qp += sqk, kp += sqk, gp += sg, rp += 2 * p.pb.hv;
    }
    const bool bias = p.pb.gate_in_kernel && p.pb.dt_bias;
    const float b0 = bias ? p.pb.dt_bias[(int64_t)h * p.pb.K + d] : 0.0f,
                b1 = bias ? p.pb.dt_bias[(int64_t)h * p.pb.K + d + 1] : 0.0f;
    const int f16 = p.pb.dtype == KDA_DT_F16, gf16 = p.pb.g_dtype == KDA_DT_F16;
#pragma unroll
    for (int r = 0; r < RV; r++) {
        const int i = i0 + 2 * r;
        if (QK) {
            const float2 q = f16 ? unpack_16x2<1>(qb[r]) : unpack_16x2<0>(qb[r]);
            const float2 k = f16 ? unpack_16x2<1>(kb[r]) : unpack_16x2<0>(kb[r]);
            *(float2 *)&sm.q[i * TS + cl] = make_float2(q.x * rn[r].x, q.y * rn[r].x);
            *(float2 *)&sm.k[i * TS + cl] = make_float2(k.x * rn[r].y, k.y * rn[r].y);
        }
        const float2 g = gf16 ? unpack_16x2<1>(gb[r]) : unpack_16x2<0>(gb[r]);
        const float2 x = r < nv ? make_float2(g.x + b0, g.y + b1) : make_float2(0.0f, 0.0f);
        *(float2 *)&sm.x[i * TS + cl] = x;
        *(float2 *)&sm.G[i * TS + cl] = gate_pair<MODE>(p.pb.lower_bound, A, x, r < nv);
    }
}

/* A CTA's place: its (chunk, query/key head), channel tile and threads' roles */
struct pairs_cta {
    int tid, lane, w, g, t; /* warp w, lane (g, t) */
    int I, c0;              /* the products: row block I, channels c0 .. c0 + 15 of the tile */
    int d0, hq, clen;       /* the tile's first channel; query/key head; the chunk's tokens */
    int dl, d, nrow;        /* the per-element phases: the lane's channel d = d0 + dl, the thread's rows that exist */
    int64_t cid, t0;        /* the chunk, its first token */
};

/* With l2norm: the barrier that receives the cluster's sums, expecting their bytes; then this CTA has started
   (the wait before the first push: every CTA has) */
template <int NTILE>
DEV void init_sum_barrier(pairs_smem &sm, int tid) {
    if (tid == 0) {
        mbar_init(smem_u32(&sm.bar), 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) mbar_expect_tx(smem_u32(&sm.bar), NTILE * 2 * C * (uint32_t)sizeof(float2));
    cluster_arrive_relaxed(); /* (the barrier's initialisation is released by its fence) */
}

/* P and B of (chunk, value head) `pair`, rows padded as here (the chunk kernel writes them so): one contiguous
   region, by 16-byte cp.async pieces at the same offsets in both (as pieces of unpadded rows they took ~26
   instructions each). The previous head's last reads of this region (dG) were before its barrier after the gate's
   backward. NVH = 2: the two V halves' copies, added (half 0 + half 1) by plain loads. */
template <int NVH>
DEV void load_coefs(const kda_bwd_params_t &p, pairs_smem &sm, int64_t pair, int tid) {
    static_assert(sizeof(sm.P) + sizeof(sm.B) == 2 * C * CS * 4, "P, B: one region");
    if (NVH == 1) {
        const char *src = (const char *)(p.dcoef + pair * (int64_t)(2 * C * CS));
        const uint32_t dst = smem_u32(sm.P);
        for (uint32_t o = 16u * tid; o < 2u * C * CS * 4; o += 16u * PK_THREADS) cp_async16_zfill(dst + o, src + o, 16);
        cp_async_commit();
    } else {
        const float4 *s0 = (const float4 *)(p.dcoef + pair * 2 * (int64_t)(2 * C * CS)), *s1 = s0 + C * CS / 2;
        for (int o = tid; o < C * CS / 2; o += PK_THREADS) {
            const float4 a = __ldg(s0 + o), b = __ldg(s1 + o);
            ((float4 *)sm.P)[o] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
    }
}

/* The head's rows (head_rows_vec where its loads apply, else head_rows), then G = cumsum ĝ: each thread its
   warp's rows of its column, then the earlier warps' totals (after a barrier) */
DEV void head_inputs(const kda_bwd_params_t &p, pairs_smem &sm, int h, float A, int first, bool vec,
                     const pairs_cta &c) {
    const int w = c.w, dl = c.dl;
    if (vec) {
        switch (gate_mode(p)) {
        case GATE_NONE:
            head_rows_vec<GATE_NONE>(p, sm, h, c.hq, c.t0, w, c.d0, c.clen, A, first);
            break;
        case GATE_LOWER:
            head_rows_vec<GATE_LOWER>(p, sm, h, c.hq, c.t0, w, c.d0, c.clen, A, first);
            break;
        default:
            head_rows_vec<GATE_SOFTPLUS>(p, sm, h, c.hq, c.t0, w, c.d0, c.clen, A, first);
        }
        __syncwarp(); /* (the sum below reads the other lanes' rows) */
    } else {
        head_rows(p, sm, h, c.hq, c.t0, w, c.d0, c.nrow, A, first);
    }
    {
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < PK_RG; r++) {
            s += sm.G[(PK_RG * w + r) * TS + dl];
            sm.G[(PK_RG * w + r) * TS + dl] = s;
        }
        sm.tot[w][dl] = s;
    }
    __syncthreads();
    {
        float off = 0.0f;
        for (int u = 0; u < w; u++) off += sm.tot[u][dl];
#pragma unroll
        for (int r = 0; r < PK_RG; r++) sm.G[(PK_RG * w + r) * TS + dl] += off;
    }
}

/* The lane's scratch rows (rows g, g + 8 of block I; past the chunk's end: zeros) of value head h: the raw dQΓ,
   dK̃ and β ⊙ dX (NVH = 2: both V halves', added), and with the group's first head the l2norm factors rn */
template <int KC, int NVH>
DEV void load_scratch(const kda_bwd_params_t &p, int h, int first, float2 (*dQ)[2], float2 (*dK)[2], float2 (*xb)[2],
                      float2 rn[2], const pairs_cta &c) {
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = 16 * c.I + c.g + 8 * hr;
        const int64_t srow = i < c.clen ? (c.t0 + i) * p.pb.hv + h : -1;
        if (first)
            rn[hr] = p.pb.l2norm && srow >= 0 ? __ldg((const float2 *)&p.rnorm[srow * 2]) : make_float2(1.0f, 1.0f);
#pragma unroll
        for (int nt = 0; nt < PK_NT; nt++) {
            const int dd = c.d0 + c.c0 + 8 * nt + 2 * c.t;
            const float2 z = make_float2(0.0f, 0.0f);
            dQ[nt][hr] = srow >= 0 ? __ldg((const float2 *)&p.dqk[srow * NVH * (2 * KC) + dd]) : z;
            dK[nt][hr] = srow >= 0 ? __ldg((const float2 *)&p.dqk[srow * NVH * (2 * KC) + KC + dd]) : z;
            xb[nt][hr] = srow >= 0 ? __ldg((const float2 *)&p.dx[srow * NVH * KC + dd]) : z;
            if (NVH == 2 && srow >= 0) { /* + the second V half's */
                const float2 q1 = __ldg((const float2 *)&p.dqk[(srow * 2 + 1) * (2 * KC) + dd]);
                const float2 k1 = __ldg((const float2 *)&p.dqk[(srow * 2 + 1) * (2 * KC) + KC + dd]);
                const float2 x1 = __ldg((const float2 *)&p.dx[(srow * 2 + 1) * KC + dd]);
                dQ[nt][hr] = make_float2(dQ[nt][hr].x + q1.x, dQ[nt][hr].y + q1.y);
                dK[nt][hr] = make_float2(dK[nt][hr].x + k1.x, dK[nt][hr].y + k1.y);
                xb[nt][hr] = make_float2(xb[nt][hr].x + x1.x, xb[nt][hr].y + x1.y);
            }
        }
    }
}

/* The factor rules for the lane's element pairs (c, c + 1) of adjacent columns: dq̂, dk̂ added to fq, fk (the
   sums over the heads so far), dG, the rows' Σ q̂ dq̂ and Σ k̂ dk̂ of those sums into yq, yk, and per row block
   Σ k f dK̃ into ext */
DEV void factor_rules(pairs_smem &sm, float scale, const float (*pq)[4], const float (*pk)[4], const float (*pe)[4],
                      const float2 (*dQ)[2], const float2 (*dK)[2], const float2 (*xb)[2], float2 (*fq)[2],
                      float2 (*fk)[2], float (*dG)[4], float yq[2], float yk[2], const pairs_cta &c) {
    const int I = c.I, g = c.g, t = c.t, c0 = c.c0;
    const float *Gl = sm.G + (C - 1) * TS;
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++) {
        float ext[2] = {0.0f, 0.0f};
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int i = 16 * I + g + 8 * hr, col = c0 + 8 * nt + 2 * t;
            const float dq_in[2] = {dQ[nt][hr].x, dQ[nt][hr].y}, dk_in[2] = {dK[nt][hr].x, dK[nt][hr].y};
            const float x_in[2] = {xb[nt][hr].x, xb[nt][hr].y};
            float oq[2], ok[2], qv[2], kv[2];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int e = 2 * hr + u;
                const float Gi = sm.G[i * TS + col + u], ei = gexp(Gi), f = gexp(Gl[col + u] - Gi);
                qv[u] = sm.q[i * TS + col + u], kv[u] = sm.k[i * TS + col + u];
                const float ex = ei * x_in[u], fy = f * dk_in[u];
                oq[u] = scale * ei * dq_in[u] + pq[nt][e];
                ok[u] = ex + fy + pk[nt][e] + pe[nt][e];
                dG[nt][e] = qv[u] * oq[u] + kv[u] * (ex - fy + pk[nt][e] - pe[nt][e]);
                ext[u] += kv[u] * fy;
            }
            fq[nt][hr] = make_float2(fq[nt][hr].x + oq[0], fq[nt][hr].y + oq[1]);
            fk[nt][hr] = make_float2(fk[nt][hr].x + ok[0], fk[nt][hr].y + ok[1]);
            yq[hr] += qv[0] * fq[nt][hr].x;
            yq[hr] += qv[1] * fq[nt][hr].y;
            yk[hr] += kv[0] * fk[nt][hr].x;
            yk[hr] += kv[1] * fk[nt][hr].y;
        }
        /* Σ over the block's 16 rows (the lanes of one t) of k f dK̃ for columns 2t, 2t + 1 */
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float x = ext[u];
            x += __shfl_xor_sync(0xffffffffu, x, 4);
            x += __shfl_xor_sync(0xffffffffu, x, 8);
            x += __shfl_xor_sync(0xffffffffu, x, 16);
            if (g == 0) sm.ext[I][c0 + 8 * nt + 2 * t + u] = x;
        }
    }
}

/* With l2norm, after the last head: y·dy of a row over its KC channels, this warp's 16, then the CTA's two halves
   and the cluster's CTAs, each of which pushes its sums into every CTA's ys: lane t of a quad sends the quad's two
   rows into CTAs t (and t + 4 in a cluster of 8), completing bytes on their barriers */
template <int NTILE>
DEV void push_norm_sums(pairs_smem &sm, float yq[2], float yk[2], const pairs_cta &c) {
#pragma unroll
    for (int hr = 0; hr < 2; hr++)
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            yq[hr] += __shfl_xor_sync(0xffffffffu, yq[hr], o);
            yk[hr] += __shfl_xor_sync(0xffffffffu, yk[hr], o);
        }
    cluster_wait(); /* every CTA of the cluster has started, its barrier initialised */
#pragma unroll
    for (int rk = c.t; rk < NTILE; rk += 4) {
        const int me = c.d0 / PK_KT;
#pragma unroll
        for (int hr = 0; hr < 2; hr++)
            cluster_st_async2(&sm.ys[me][c.w >> 2][16 * c.I + c.g + 8 * hr], smem_u32(&sm.bar), (unsigned)rk, yq[hr],
                              yk[hr]);
    }
}

/* dĝ = reverse cumsum of dG + the G_last terms: dG into P's tile (every read of P and B done), each thread its
   warp's rows of its column, then the later warps' totals; then the clamp and the gate, element by element: dg
   of value head h written, the thread's ∂L/∂A_log and ∂L/∂dt_bias terms into red */
template <int KC, int NVH>
DEV void gate_phase(const kda_bwd_params_t &p, pairs_smem &sm, const float (*dG)[4], int h, int64_t pair, float A,
                    const pairs_cta &c) {
    const int w = c.w, dl = c.dl, d = c.d;
    const float *Gl = sm.G + (C - 1) * TS;
    __syncthreads();   /* every read of P and B is done: dG goes there */
    float *dGt = sm.P; /* [C][TS] */
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dGt[(16 * c.I + c.g + 8 * (e >> 1)) * TS + c.c0 + 8 * nt + 2 * c.t + (e & 1)] = dG[nt][e];
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int r = PK_RG - 1; r >= 0; r--) {
        s += dGt[(PK_RG * w + r) * TS + dl];
        dGt[(PK_RG * w + r) * TS + dl] = s;
    }
    sm.tot[w][dl] = s;
    __syncthreads();
    float off = sm.ext[0][dl] + sm.ext[1][dl] + sm.ext[2][dl] + sm.ext[3][dl];
    if (d < p.pb.K) /* γ dγ (NVH = 2: half 0's + half 1's) */
        off += gexp(Gl[dl]) *
               (NVH == 1 ? p.dgam[pair * KC + d] : p.dgam[pair * 2 * KC + d] + p.dgam[(pair * 2 + 1) * KC + d]);
    for (int u = w + 1; u < PK_WARPS; u++) off += sm.tot[u][dl];
    float dAl = 0.0f, dbias = 0.0f;
    const int64_t gbase = ((c.t0 + PK_RG * w) * p.pb.hv + h) * (int64_t)p.pb.K + d;
    switch (gate_mode(p)) {
    case GATE_NONE:
        gate_backward_rows_dt<GATE_NONE>(p, sm, dGt, A, off, w, dl, c.nrow, gbase, &dAl, &dbias);
        break;
    case GATE_LOWER:
        gate_backward_rows_dt<GATE_LOWER>(p, sm, dGt, A, off, w, dl, c.nrow, gbase, &dAl, &dbias);
        break;
    default:
        gate_backward_rows_dt<GATE_SOFTPLUS>(p, sm, dGt, A, off, w, dl, c.nrow, gbase, &dAl, &dbias);
    }
    sm.red[0][c.tid] = dAl;
    sm.red[1][c.tid] = dbias;
}

/* Per channel of the tile: Σ ∂L/∂A_log terms (tid < PK_KT) and Σ ∂L/∂dt_bias[d] over the threads, in order */
template <int KC>
DEV void store_parts(const kda_bwd_params_t &p, const pairs_smem &sm, int64_t pair, int d0, int tid) {
    if (tid < 2 * PK_KT && p.part) {
        const int which = tid / PK_KT, c = tid % PK_KT;
        float v = 0.0f;
        for (int u = 0; u < PK_WARPS; u++) v += sm.red[which][u * PK_KT + c];
        p.part[(pair * 2 + which) * (int64_t)KC + d0 + c] = v;
    }
}

/* NVH = 2 (V class 256): the chunk kernel's sums over V come in two copies, one per V half, added here as they are
 * loaded (P and B by plain loads then, not cp.async) */
template <int KC, int NVH>
__global__ void __launch_bounds__(PK_THREADS, 2) kda_bwd_pairs_kernel(const kda_bwd_params_t p) {
    constexpr int NTILE = KC / PK_KT; /* with l2norm: the CTAs of a cluster (≤ 8, the portable cluster size) */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    pairs_smem &sm = *(pairs_smem *)cta_smem(smem_raw);
    pairs_cta c;
    c.tid = threadIdx.x, c.lane = c.tid & 31, c.w = c.tid >> 5, c.g = c.lane >> 2, c.t = c.lane & 3;
    c.I = c.w & 3, c.c0 = 16 * (c.w >> 2);
    const int64_t qpair = blockIdx.x / NTILE; /* (chunk, query/key head) */
    c.d0 = (int)(blockIdx.x % NTILE) * PK_KT;
    c.cid = qpair / p.pb.hqk;
    c.hq = (int)(qpair % p.pb.hqk);
    const int h0 = c.hq * p.pb.group, h1 = h0 + p.pb.group; /* its value heads h0 .. h1 − 1 */
    c.clen = chunk_tokens(p.pb.seqs, c.cid, &c.t0);
    if (c.clen <= 0) return; /* (the whole cluster: its CTAs share the chunk) */
    if (p.pb.l2norm) init_sum_barrier<NTILE>(sm, c.tid);
    const float scale = p.pb.scale;
    c.dl = c.lane, c.d = c.d0 + c.lane;
    c.nrow = c.d < p.pb.K ? min(PK_RG, c.clen - PK_RG * c.w) : 0;
    const bool vec = p.pb.dtype != KDA_DT_F32 && p.pb.g_dtype != KDA_DT_F32 && !(p.pb.K & 1) &&
                     c.d0 + PK_KT <= p.pb.K &&
                     !(((uintptr_t)p.pb.q | (uintptr_t)p.pb.k | (uintptr_t)p.pb.g) & 3); /* head_rows_vec's loads */
    float2 fq[PK_NT][2], fk[PK_NT][2]; /* dq̂, dk̂ of the lane's elements, summed over the value heads in order */
#pragma unroll
    for (int nt = 0; nt < PK_NT; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) fq[nt][hr] = fk[nt][hr] = make_float2(0.0f, 0.0f);
    float2 rn[2]; /* the l2norm factors of the lane's rows g, g + 8 of block I */

#pragma unroll 1
    for (int h = h0; h < h1; h++) {               /* one value head: everything but q̂, k̂ and the l2norm step */
        const int64_t pair = c.cid * p.pb.hv + h; /* (chunk, value head) */
        const int first = h == h0, last = h == h1 - 1;
        const float A = p.pb.A_log ? expf(p.pb.A_log[h]) : 1.0f;
        load_coefs<NVH>(p, sm, pair, c.tid);
        head_inputs(p, sm, h, A, first, vec, c);
        float2 dQ[PK_NT][2], dK[PK_NT][2], xb[PK_NT][2]; /* loaded now, used after the pair sums */
        load_scratch<KC, NVH>(p, h, first, dQ, dK, xb, rn, c);
        cp_async_wait_all();
        __syncthreads();

        const int split = block_split<TS, PK_KT>(sm.G, c.I, c.lane);
        float pq[PK_NT][4], pk[PK_NT][4], pe[PK_NT][4];
        pairs_later(sm, c.I, c.c0, split, c.lane, pq, pk);
        pairs_earlier(sm, c.I, c.c0, split, c.lane, pe);
        float dG[PK_NT][4];
        float yq[2] = {0.0f, 0.0f}, yk[2] = {0.0f, 0.0f}; /* by row: used after the last head */
        factor_rules(sm, scale, pq, pk, pe, dQ, dK, xb, fq, fk, dG, yq, yk, c);
        /* after the last head, dq and dk: the l2norm step dx = r (dy − y (y·dy)), y = q̂ or k̂, r = 1/‖x‖ (the chunk
           kernel's) */
        if (last && p.pb.l2norm) push_norm_sums<NTILE>(sm, yq, yk, c);
        else if (last) store_dqdk<NTILE>(p, sm, c.I, c.c0, c.d0, c.g, c.t, c.t0, c.clen, c.hq, rn, fq, fk, 0);
        gate_phase<KC, NVH>(p, sm, dG, h, pair, A, c);
        __syncthreads(); /* also: every read of this head's P (dG), G, x, ext and tot is done, so the next head may
                            write them */
        store_parts<KC>(p, sm, pair, c.d0, c.tid);
    }
    if (p.pb.l2norm) {
        mbar_wait(smem_u32(&sm.bar), 0); /* every CTA's sums are in ys (long since: the gate's work came between);
                                            no CTA exits before the pushes into it have landed */
        store_dqdk<NTILE>(p, sm, c.I, c.c0, c.d0, c.g, c.t, c.t0, c.clen, c.hq, rn, fq, fk, 1);
    }
}

template <int KC, int NVH>
static int launch_pairs(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->blocks.max_chunks * p->pb.hqk * (KC / PK_KT);
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    if (!p->pb.l2norm)
        return kda_launch((const void *)kda_bwd_pairs_kernel<KC, NVH>, ctas, PK_THREADS, (int)sizeof(pairs_smem), p,
                          device, done, stream);
    return kda_launch_cluster((const void *)kda_bwd_pairs_kernel<KC, NVH>, ctas, KC / PK_KT, PK_THREADS,
                              (int)sizeof(pairs_smem), p, device, done, stream);
}

/* One instance (a KDA_BWD_PAIRS_CONFIG row of configs.def; CMake generates its translation unit): the launcher
 * kda_bwd_pairs_k<KC>_h<NVH>, found by bwd/configs.c's table */
#define KDA_BWD_PAIRS_INSTANCE(KC, NVH)                                                                                \
    extern "C" int kda_bwd_pairs_k##KC##_h##NVH(const kda_bwd_params_t *p, int device, void *stream) {                 \
        return launch_pairs<KC, NVH>(p, device, stream);                                                               \
    }

#endif /* KDA_CUDA_BWD_PAIRS_CUH */
