/*
 * Backward, stage 3b: the products of one chunk with its C × C coefficients (docs/ALGORITHM.md §6, "Chunked";
 * src/cpu/chunk_bwd.c is the same computation on the CPU).
 *
 * One CTA of 512 threads per (chunk, value head), all chunks in parallel. It recomputes the chunk's pair products
 * and inverse in fp32 from the inputs (and with fp32 inputs Δ from S), takes S and dS⁺ from stages 1–2 and, with
 * bf16 inputs (SPLIT), Δ from bwd_inter.cuh, S in bf16 (from stage 1 or kept by the forward) and dS⁺ in scaled fp16
 * (states16.cuh). In §3's notation,
 * A = Diag(β) M, X = Diag(β) KΓ, Y = Diag(β) V, Z = Y − X S:
 *
 *   forward    q̂, k̂ (l2norm), ĝ (gate, clamp), β (sigmoid), G = cumsum ĝ
 *              M[i][j] = Σ_d k_i k_j e^{G_i − G_j} (j < i),  Aqk[i][j] = s Σ_d q_i k_j e^{G_i − G_j} (j ≤ i)
 *              by split factors e^{G_i − R} · e^{R − G_j} around a reference row R of each 16-row block
 *              (block_split: any decay is safe); T = (I + A)⁻¹,  Δ = T Z  (= U − W S: the inter kernel's)
 *   backward   dΔ  = Aqkᵀ dO + K̃ dS⁺      dAqk = dO Δᵀ (lower)    dR = Tᵀ dΔ    dA = −dR Δᵀ (strict)
 *              dX  = −dR Sᵀ                dv = β dR               dβ = v·dR + Σ_d k e^G dX + Σ_j dA M
 * Written: dv, dβ (through the sigmoid) of the chunk's tokens; for bwd_pairs.cuh, which does the rest per channel
 * (the pair products' backward, the factor rules into dq̂, dk̂, dG, the gate's backward): P = s·dAqk and
 * B = Diag(β) dA, β ⊙ dX, the l2norm factors; with fp32 inputs also the raw dQΓ = dO Sᵀ, dK̃ = Δ dS⁺ᵀ and
 * dγ = rowsum(dS⁺ ⊙ S) (bwd_inter.cuh's with bf16 inputs).
 *
 * Layout: the q̂, k̂, G tiles [C][KC], M, Aqk (later dAqk), T (later dA) [C][C], Δ and a second C × VC tile (dO,
 * then dΔ, then dR) in shared memory, fp32 (≤ 223 KB at KC = VC = 128: one CTA per SM); S and dS⁺ are staged
 * from the workspace (L2: prefetched at the start) into the free tiles as tensor-core operands (SPLIT: of dX and
 * K̃ dS⁺ only; dS⁺ as its fp16 pieces, S widened to fp32 by movmatrix; fp32: dS⁺ by halves). Before its
 * dv phase a CTA prefetches into L2 the rows that the CTA one wave later reads first (prefetch_next_wave).
 *
 * Every product is on the tensor cores (mma.sync m16n8k8, tf32 operands rounded from the fp32 tiles as they are
 * read, fp32 sums; the diagonal blocks of the pair products in 3xTF32, see mma16_x3, and with fp16/fp32 inputs Δ =
 * T Z and dK̃ = Δ dS⁺ᵀ too: their tf32 rounding reaches dg and dA_log, see mma_rows_2g): 16 warps, warp w computes
 * rows 16 (w mod 4).. of every C-row product and the quarter w / 4 of its columns (CK_NQ parts: the kernel is
 * latency-bound, and four warps per scheduler hide more of it than two). T = (I + A)⁻¹ by 16-row blocks: the
 * diagonal ones in fp32 (invert_diag),
 * the others by column strips in 3xTF32 (invert_offdiag).
 * dev/bwd_emu runs the kernel on the host against the fp64 oracle (and `run.sh profile` counts its source lines'
 * executions).
 */
#ifndef KDA_CUDA_BWD_CHUNK_CUH
#define KDA_CUDA_BWD_CHUNK_CUH

#include "bwd.cuh"
#include "seq.cuh"
#include "states16.cuh"

#define CK_THREADS 512
#define CK_NQ (CK_THREADS / 128) /* column parts: warp w owns row block w mod 4 and column part w / 4 */
#define C KDA_CHUNK
#define CS (C + 4) /* fp32 strides: rows 4 banks apart, so the 8 rows a warp reads fall in distinct banks */

template <int KC, int VC>
struct chunk_smem {
    float q[C * (KC + 4)], k[C * (KC + 4)], G[C * (KC + 4)];
    float M[C * CS], A2[C * CS], T[C * CS];
    float D[C * (VC + 4)], R[C * (VC + 4)];
    float beta[C];
    float dbp[2 * CK_NQ][C]; /* dβ's pair terms (by column part) and dX terms (CK_NQ + part) per row */
    float Y[16 * C];         /* the inverse's scratch (Y_IJ of one row block) */
};

/* A hint that this CTA will read [p, p + bytes) soon: into L2 */
DEV void prefetch_l2(const void *p, int64_t bytes, int tid) {
    for (int64_t o = (int64_t)tid * 128; o < bytes; o += (int64_t)CK_THREADS * 128) l2_prefetch((const char *)p + o);
}

/* The rows that the CTA one wave later (blockIdx + sm_count: one CTA per SM) reads first, into L2 now: q, k, g,
   β and Δ (SPLIT) or v — its load phase then waits for L2, not DRAM (S, dS⁺, dO and v it prefetches itself,
   long before their use). One or two lines a thread; waves drift apart, so "one wave later" is approximate. */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void prefetch_next_wave(const kda_bwd_params_t &p, int tid) {
    const int64_t nb = (int64_t)blockIdx.x + p.sm_count;
    if (nb >= (int64_t)gridDim.x) return;
    const int64_t nu = nb / (KSP * NVH); /* its (chunk, value head) */
    const int64_t cid = nu / p.pb.hv;
    const int h = (int)(nu % p.pb.hv);
    int64_t t0;
    const int clen = chunk_tokens(p.pb.seqs, cid, &t0);
    if (clen <= 0) return;
    const int esz = p.pb.dtype == KDA_DT_F32 ? 4 : 2, gsz = p.pb.g_dtype == KDA_DT_F32 ? 4 : 2;
    static_assert(CK_THREADS == 8 * C, "thread groups of C rows");
    const int grp = tid / C, i = tid % C;
    const int64_t t = t0 + (i < clen ? i : 0);
    const char *row = NULL;
    int bytes = 0;
    switch (grp) {
    case 0:
        row = (const char *)p.pb.q + (t * p.pb.hqk + h / p.pb.group) * (int64_t)p.pb.K * esz;
        bytes = p.pb.K * esz;
        break;
    case 1:
        row = (const char *)p.pb.k + (t * p.pb.hqk + h / p.pb.group) * (int64_t)p.pb.K * esz;
        bytes = p.pb.K * esz;
        break;
    case 2:
        row = (const char *)p.pb.g + (t * p.pb.hv + h) * (int64_t)p.pb.K * gsz;
        bytes = p.pb.K * gsz;
        break;
    case 3:
        row = (const char *)p.pb.beta + (t * p.pb.hv + h) * (int64_t)(p.pb.beta_dtype == KDA_DT_F32 ? 4 : 2);
        bytes = 1;
        break;
    default:
        if (SPLIT) { /* Δ: C × VC fp16 and C exponent bytes, contiguous, a line per thread of the four groups */
            row = (const char *)(p.delta + ((cid * p.pb.hv + h) * NVH + (nb / KSP) % NVH) * KDA_BWD_DELTA_BYTES(VC)) +
                  (int64_t)(tid - 4 * C) * 128;
            bytes = (tid - 4 * C) * 128 < C * VC * 2 + C ? 1 : 0;
        } else if (grp == 4) {
            row = (const char *)p.pb.v + (t * p.pb.hv + h) * (int64_t)p.pb.V * esz;
            bytes = p.pb.V * esz;
        }
    }
    if (i >= clen && grp < 4) bytes = 0;
    for (int o = 0; o < bytes; o += 128) l2_prefetch(row + o);
    if (bytes > 1) l2_prefetch(row + bytes - 1); /* a row not aligned to a line ends in one more */
}

/* ---------------------------------------------------------------------------------------------------------
 * Forward of the chunk
 * ------------------------------------------------------------------------------------------------------- */
/* ĝ in place of the gate inputs x in G (the warp's rows, the lane's columns; 0 where there is no element), form
 * MODE; the rows in a loop (the unrolled version's straight-line code made the warps wait for instruction
 * fetches) */
template <int KC, int MODE>
DEV void gate_rows(float *G, float lower_bound, float A, int warp, int lane, int clen, int ucols) {
    constexpr int KS = KC + 4;
#pragma unroll 1
    for (int i = warp; i < C; i += CK_THREADS / 32) {
        const int n = i < clen ? ucols : 0;
#pragma unroll
        for (int u = 0; u < KC / 32; u++) {
            float *x = &G[i * KS + lane + 32 * u];
            *x = u < n ? gate_clamped<MODE>(lower_bound, A, *x) : 0.0f;
        }
    }
}

/* Δ into D (fp32 [C][VC + 4]) from the fp16 rows and exponent bytes that load_rows staged in T's tile: each value
 * times its row's power of two, exact (the tf32 operands of dAqk and dA are these values) */
template <int KC, int VC>
DEV void delta_rows(chunk_smem<KC, VC> &sm, int tid) {
    const uint4 *src = (const uint4 *)sm.T;
    const uint8_t *ex = (const uint8_t *)sm.T + C * VC * 2;
    for (int e = tid; e < C * VC / 8; e += CK_THREADS) {
        const int i = e / (VC / 8), c = 8 * (e % (VC / 8));
        const uint4 w = src[e];
        const float f = f16s_factor(ex[i]);
        const float2 a = f16s_pair(w.x, f), b = f16s_pair(w.y, f), d = f16s_pair(w.z, f), h = f16s_pair(w.w, f);
        *(float4 *)&sm.D[i * (VC + 4) + c] = make_float4(a.x, a.y, b.x, b.y);
        *(float4 *)&sm.D[i * (VC + 4) + c + 4] = make_float4(d.x, d.y, h.x, h.y);
    }
}

/* q̂, k̂, the clamped log decay ĝ (into G), β, and into D the chunk's Δ (SPLIT: the inter kernel's fp16 rows, staged
 * in T's tile for delta_rows) or
 * v; rows past the chunk's end and padded columns zero. Each warp's rows (C / 16) at once: every load's bits are
 * issued before any is converted (load_bits), so that the warp waits for one round trip, not one per element
 * (a load_elem per element kept the conversions between the loads: ~20% of the kernel's stall samples). */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void load_rows(const kda_bwd_params_t &p, chunk_smem<KC, VC> &sm, const unsigned char *delta, int64_t t0, int clen,
                   int h, float A, int tid, int rank, int v0) {
    const int dk0 = KC * rank; /* the CTA's first channel (KSP = 2: a cluster's two CTAs split K), first V column v0 */
    const bool rows_out = (KSP == 1 || rank == 0) && (NVH == 1 || v0 == 0); /* this CTA writes the row factors */
    constexpr int KS = KC + 4, VS = VC + 4, U = KC / 32, RW = C / (CK_THREADS / 32); /* rows per warp */
    static_assert(RW <= 32 && CK_THREADS % KC == 0, "load_rows: a lane per row's β; whole columns per thread");
    const int warp = tid >> 5, lane = tid & 31, hq = h / p.pb.group;
    uint32_t qb[RW][U], kb[RW][U], gb[RW][U], bb = 0;
    float db[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int d = lane + 32 * u;
        db[u] = p.pb.gate_in_kernel && p.pb.dt_bias && dk0 + d < p.pb.K ? p.pb.dt_bias[(int64_t)h * p.pb.K + dk0 + d]
                                                                        : 0.0f;
    }
    const int kl = p.pb.K - dk0;                             /* channels of the CTA's that exist (may be ≤ 0) */
    const int ucols = kl > lane ? (kl - lane + 31) / 32 : 0; /* the lane's columns lane + 32 u that exist */
#pragma unroll
    for (int r = 0; r < RW; r++) {
        const int i = warp + (CK_THREADS / 32) * r;
        const int64_t t = t0 + i;
        const int n = i < clen ? ucols : 0;
        load_bits_n<U>(qb[r], p.pb.q, p.pb.dtype, (t * p.pb.hqk + hq) * (int64_t)p.pb.K + dk0 + lane, 32, n);
        load_bits_n<U>(kb[r], p.pb.k, p.pb.dtype, (t * p.pb.hqk + hq) * (int64_t)p.pb.K + dk0 + lane, 32, n);
        load_bits_n<U>(gb[r], p.pb.g, p.pb.g_dtype, (t * p.pb.hv + h) * (int64_t)p.pb.K + dk0 + lane, 32, n);
    }
    { /* lane r < RW: the β of the warp's row r, one load (four predicated loads into one register waited for
           each other: ~5% of the kernel's stall samples) */
        const int i = warp + (CK_THREADS / 32) * lane;
        if (lane < RW && i < clen) bb = load_bits(p.pb.beta, p.pb.beta_dtype, (t0 + i) * p.pb.hv + h);
    }
    if (SPLIT) { /* Δ as the inter kernel wrote it (fp16 rows, then their exponent bytes: one contiguous run) by
                    cp.async into T's tile (free until the inverse), one commit group, widened into D after the
                    cumulative sum (delta_rows): as loads into registers and stores, every thread's first store
                    waited for DRAM */
        static_assert(C * VC * 2 + C <= C * CS * 4, "Δ's fp16 rows and exponents fit in T's tile");
        for (unsigned e = tid; e < (unsigned)(C * VC / 8 + C / 16); e += CK_THREADS)
            cp_async16_zfill(smem_u32((unsigned char *)sm.T + 16 * e), delta + 16 * e, 16);
        cp_async_commit();
    } else {
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int i = warp + (CK_THREADS / 32) * r;
            uint32_t vb[VC / 32];
#pragma unroll
            for (int u = 0; u < VC / 32; u++) {
                const int c = v0 + lane + 32 * u;
                vb[u] = i < clen && c < p.pb.V
                            ? load_bits(p.pb.v, p.pb.dtype, ((t0 + i) * p.pb.hv + h) * (int64_t)p.pb.V + c)
                            : 0u;
            }
#pragma unroll
            for (int u = 0; u < VC / 32; u++) sm.D[i * VS + lane + 32 * u] = bits_value(vb[u], p.pb.dtype);
        }
    }
    /* the rows' squared norms first, their warp sums interleaved, then the factors (rsqrtf, as the forward's
       prep), the stores, one l2norm-factor store and one β per lane: row by row, each sum's shuffles, the IEEE
       square root and division and the per-row stores ran as one dependent chain after another */
    float qv[RW][U], kv[RW][U], sq[RW], sk[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) {
        const int i = warp + (CK_THREADS / 32) * r;
        float gv[U];
        bits_values<U>(qv[r], qb[r], p.pb.dtype);
        bits_values<U>(kv[r], kb[r], p.pb.dtype);
        bits_values<U>(gv, gb[r], p.pb.g_dtype);
        sq[r] = sk[r] = 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
            sq[r] += qv[r][u] * qv[r][u];
            sk[r] += kv[r][u] * kv[r][u];
            sm.G[i * KS + lane + 32 * u] = gv[u] + db[u]; /* the gate input x */
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < RW; r++) {
            sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], o);
            sk[r] += __shfl_xor_sync(0xffffffffu, sk[r], o);
        }
    if (KSP == 2 && p.pb.l2norm) { /* the rows' sums over the peer's channels too, through dbp (free until the dA phase,
                                  several cluster barriers later): own + peer, the same bits in both CTAs */
        float *xs = &sm.dbp[0][0];
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < RW; r++) {
                xs[warp + (CK_THREADS / 32) * r] = sq[r];
                xs[C + warp + (CK_THREADS / 32) * r] = sk[r];
            }
        cluster_sync();
#pragma unroll
        for (int r = 0; r < RW; r++) {
            sq[r] += cluster_ld(&xs[warp + (CK_THREADS / 32) * r], (unsigned)(rank ^ 1));
            sk[r] += cluster_ld(&xs[C + warp + (CK_THREADS / 32) * r], (unsigned)(rank ^ 1));
        }
    }
    float fl = 0.0f; /* lane 2r + m < 2 RW: row r's factor for q (m = 0) or k (m = 1) */
#pragma unroll
    for (int r = 0; r < RW; r++) {
        const int i = warp + (CK_THREADS / 32) * r;
        const float rq = p.pb.l2norm ? rsqrtf(sq[r] + 1e-6f) : 1.0f;
        const float rk = p.pb.l2norm ? rsqrtf(sk[r] + 1e-6f) : 1.0f;
        fl = lane == 2 * r ? rq : lane == 2 * r + 1 ? rk : fl;
#pragma unroll
        for (int u = 0; u < U; u++) {
            sm.q[i * KS + lane + 32 * u] = qv[r][u] * rq;
            sm.k[i * KS + lane + 32 * u] = kv[r][u] * rk;
        }
    }
    if (lane < 2 * RW) { /* for bwd_pairs.cuh */
        const int i = warp + (CK_THREADS / 32) * (lane >> 1);
        if (p.pb.l2norm && i < clen && rows_out) p.rnorm[((t0 + i) * p.pb.hv + h) * 2 + (lane & 1)] = fl;
    }
    if (lane < RW) { /* β of the warp's row `lane` */
        const int i = warp + (CK_THREADS / 32) * lane;
        float b = 0.0f;
        if (i < clen) {
            b = bits_value(bb, p.pb.beta_dtype);
            if (p.pb.beta_sigmoid) b = beta_sigmoid(b, p.pb.neg_eigval);
        }
        sm.beta[i] = b;
    }
    /* ĝ from x, each lane its own elements, the gate's form tested once */
    switch (gate_mode(p)) {
    case GATE_NONE:
        gate_rows<KC, GATE_NONE>(sm.G, p.pb.lower_bound, A, warp, lane, clen, ucols);
        break;
    case GATE_LOWER:
        gate_rows<KC, GATE_LOWER>(sm.G, p.pb.lower_bound, A, warp, lane, clen, ucols);
        break;
    default:
        gate_rows<KC, GATE_SOFTPLUS>(sm.G, p.pb.lower_bound, A, warp, lane, clen, ucols);
    }
}

/* G = cumulative sum of ĝ down each channel */
template <int KC>
DEV void gate_cumsum(float *G, int tid) {
    constexpr int KS = KC + 4;
    for (int d = tid; d < KC; d += CK_THREADS)
        for (int i = 1; i < C; i++) G[i * KS + d] += G[(i - 1) * KS + d];
}

/* ---------------------------------------------------------------------------------------------------------
 * Tensor-core helpers. A warp owns a 16-row block of every C-row product (rows 16 I.., I = warp mod 4) and one
 * half of its columns (warp / 4); mma.sync with tf32 operands rounded from the fp32 tiles as they are read,
 * fp32 sums. Lane (g, t) = (lane / 4, lane mod 4) holds, of an 8-column tile, rows g, g + 8 and columns
 * 2t, 2t + 1 (element c: row g + 8 (c / 2), column 2t + c mod 2).
 *
 * The operands are tf32 (10-bit mantissa, rounded to nearest): with bf16 operands (8 bits) the emulated
 * gradients of the gate parameters were off by up to 7.6e-2 of their norm (sums over the tokens that cancel),
 * above the GPU tests' bound of 6e-2. frag_t, tf2, mma16: bwd.cuh.
 * ------------------------------------------------------------------------------------------------------- */
template <int GLB>
DEV float ld(const float *p) {
    if (GLB) return __ldg(p);
    return *p;
}
template <int GLB>
DEV float2 ld2(const float *p) {
    if (GLB) return __ldg((const float2 *)p);
    return *(const float2 *)p;
}

/* acc[nt] += Σ_{k ∈ [k0, k1)} A(i, k) B(k, n) for rows i0..i0+15 and columns n0 + 8 nt.., nt < NT, k1 − k0 a
 * multiple of 16; A(i, k) = a[i lda + k] (AT: a[k lda + i]), B(k, n) = b[k ldb + n] (BT: b[n ldb + k]); b in
 * global memory when GLB; X3: in 3xTF32 (mma16_x3), ~fp32 accurate; X3 = 2: the same three terms, each in its own
 * accumulators, added to acc at the end, so that a k-step's six tensor-core instructions are three independent
 * pairs rather than one dependent chain of six (invert_offdiag's strips are chains of such products: their length
 * is the phase's) */
template <int NT, int AT, int BT, int GLB, int X3 = 0>
DEV void mma_rows(float (*acc)[4], const float *a, int lda, const float *b, int ldb, int i0, int n0, int k0, int k1,
                  int lane) {
    const int g = lane >> 2, t = lane & 3;
    float c1[NT][4], c2[NT][4], c3[NT][4]; /* X3 = 2: Al Bh, Ah Bl, Ah Bh */
    if (X3 == 2) {
        zero_acc<NT>(c1);
        zero_acc<NT>(c2);
        zero_acc<NT>(c3);
    }
#pragma unroll(GLB ? 2 : 1) /* global B: two k-steps' loads in flight (an L2 round trip per step otherwise) */
    for (int k = k0; k < k1; k += 16) {
        frag_t af[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = i0 + g + 8 * (r & 1), col = k + 2 * t + 8 * (r >> 1);
            const float2 x =
                AT ? make_float2(a[col * lda + row], a[(col + 1) * lda + row]) : *(const float2 *)&a[row * lda + col];
            if (X3) split2(x, &af[r], &al[r]);
            else af[r] = tf2(x.x, x.y);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int n = n0 + 8 * nt + g;
            frag_t bf[2];
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int kk = k + 2 * t + 8 * hh;
                if (BT) bf[hh] = ld2<GLB>(&b[n * ldb + kk]);
                else bf[hh] = make_float2(ld<GLB>(&b[kk * ldb + n]), ld<GLB>(&b[(kk + 1) * ldb + n]));
            }
            if (X3 == 2) {
                frag_t bh0, bl0, bh1, bl1;
                split2(bf[0], &bh0, &bl0);
                split2(bf[1], &bh1, &bl1);
                mma16(c1[nt], al, bh0, bh1);
                mma16(c2[nt], af, bl0, bl1);
                mma16(c3[nt], af, bh0, bh1);
            } else if (X3) {
                mma16_x3(acc[nt], af, al, bf[0], bf[1], 1);
            } else {
                mma16(acc[nt], af, tf2(bf[0].x, bf[0].y), tf2(bf[1].x, bf[1].y));
            }
        }
    }
    if (X3 == 2)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[nt][c] += c3[nt][c] + (c1[nt][c] + c2[nt][c]);
}

/* Two products of that form in one k loop (their L2 loads in flight together): acc1[nt] += Σ_k a1(i, k) b1(n, k),
 * acc2[nt] += Σ_k a2(i, k) b2(n, k) over k < kn; a1, a2 shared (row-major), b1, b2 global (BT). The second in
 * 3xTF32 (mma16_x3): it is dK̃ = Δ dS⁺ᵀ, whose tf32 rounding reaches every earlier row's dĝ through the chunk's G_last
 * terms, a correlated error that dominates fp32 inputs' dg and dA_log error otherwise */
template <int NT>
DEV void mma_rows_2g(float (*acc1)[4], float (*acc2)[4], const float *a1, const float *a2, int lda, const float *b1,
                     const float *b2, int ldb, int i0, int n0, int kn, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
    for (int k = 0; k < kn; k += 16) {
        frag_t f1[4], f2[4], f2l[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = i0 + g + 8 * (r & 1), col = k + 2 * t + 8 * (r >> 1);
            const float2 x = *(const float2 *)&a1[row * lda + col], y = *(const float2 *)&a2[row * lda + col];
            f1[r] = tf2(x.x, x.y);
            split2(y, &f2[r], &f2l[r]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int n = n0 + 8 * nt + g, kk = k + 2 * t;
            const float2 x0 = __ldg((const float2 *)&b1[n * ldb + kk]),
                         x1 = __ldg((const float2 *)&b1[n * ldb + kk + 8]);
            const float2 y0 = __ldg((const float2 *)&b2[n * ldb + kk]),
                         y1 = __ldg((const float2 *)&b2[n * ldb + kk + 8]);
            mma16(acc1[nt], f1, tf2(x0.x, x0.y), tf2(x1.x, x1.y));
            mma16_x3(acc2[nt], f2, f2l, y0, y1, 1);
        }
    }
}

/* The tf32 A fragment of (k_i f_i)_d, rows i0.., k-step dk.., f = e^{G} (ref NULL: KΓ) or e^{ref − G} (ref =
 * G_last: K̃) */
template <int KC>
DEV void gated_k_frag(frag_t af[4], const float *k, const float *G, const float *ref, int i0, int dk, int lane) {
    constexpr int KS = KC + 4;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = i0 + g + 8 * (r & 1), col = dk + 2 * t + 8 * (r >> 1);
        const float2 kx = *(const float2 *)&k[row * KS + col], gx = *(const float2 *)&G[row * KS + col];
        float2 ex;
        if (ref) {
            const float2 rf = *(const float2 *)&ref[col];
            ex = make_float2(gexp(rf.x - gx.x), gexp(rf.y - gx.y));
        } else ex = make_float2(gexp(gx.x), gexp(gx.y));
        af[r] = tf2(kx.x * ex.x, kx.y * ex.y);
    }
}
/* acc[nt] += Σ_{d ∈ [d0, d1)} (k_i f_i)_d B(d, n) for rows i0.., f as gated_k_frag's; B(d, n) = b[d ldb + n], a
 * state tile in global memory (GLB: Z's X S) or shared memory (dΔ's K̃ dS⁺ with fp32 inputs, by halves of d) */
template <int NT, int KC, int GLB>
DEV void mma_gated_k_state(float (*acc)[4], const float *k, const float *G, const float *ref, const float *b, int ldb,
                           int i0, int n0, int d0, int d1, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 2
    for (int dk = d0; dk < d1; dk += 16) {
        frag_t af[4];
        gated_k_frag<KC>(af, k, G, ref, i0, dk, lane);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int n = n0 + 8 * nt + g;
            const int kk = dk + 2 * t;
            const frag_t b0 = tf2(ld<GLB>(&b[kk * ldb + n]), ld<GLB>(&b[(kk + 1) * ldb + n]));
            const frag_t b1 = tf2(ld<GLB>(&b[(kk + 8) * ldb + n]), ld<GLB>(&b[(kk + 9) * ldb + n]));
            mma16(acc[nt], af, b0, b1);
        }
    }
}

/* The split path's K̃ dS⁺ (acc[nt] += Σ_{d < KC} K̃[i][d] dS⁺[d][n], rows i0.., columns n0 + 8 nt.., n0 a multiple
 * of 16): K̃ = k e^{G_last − G} as mma_gated_k_state's, dS⁺ from its fp16 pieces (states16.cuh) staged whole in
 * shared memory with the exponents of their factors after them: the lane's 16 bytes of piece (vb, np) are the B
 * fragments of k-step 16 np for the column tiles 16 vb.. (.x, .z) and 16 vb + 8.. (.y, .w), one 16-byte load for
 * two tiles; fp16 values times 2^e are exact in tf32 (the values fp32 dS⁺ rounded to tf32 had) */
template <int NT, int KC>
DEV void mma_gated_k_pieces(float (*acc)[4], const float *k, const float *G, const float *ref, const uint4 *pieces,
                            const uint8_t *exps, int i0, int n0, int lane) {
    static_assert(NT % 2 == 0, "column tiles in pairs: a piece holds 16 columns");
    float f[NT / 2];
#pragma unroll
    for (int vp = 0; vp < NT / 2; vp++) f[vp] = f16s_factor(exps[(n0 / 16 + vp) * 32 + lane]);
#pragma unroll 2
    for (int dk = 0; dk < KC; dk += 16) {
        frag_t af[4];
        gated_k_frag<KC>(af, k, G, ref, i0, dk, lane);
#pragma unroll
        for (int vp = 0; vp < NT / 2; vp++) {
            const uint4 b = pieces[((n0 / 16 + vp) * (KC / 16) + dk / 16) * 32 + lane];
            mma16(acc[2 * vp], af, f16s_pair(b.x, f[vp]), f16s_pair(b.z, f[vp]));
            mma16(acc[2 * vp + 1], af, f16s_pair(b.y, f[vp]), f16s_pair(b.w, f[vp]));
        }
    }
}

/* rows [d0, d0 + KC / 2) of a [KC][VC] fp32 state tile (row stride LDS: the class's VC, or 256 for a 128-column
 * part) into shared memory at dst (row stride VC + 4, dst holding row d0 first) by cp.async, one commit group */
template <int KC, int VC, int LDS>
DEV void copy_state_half(float *dst, const float *src, int d0, int tid) {
    for (unsigned e = tid; e < (unsigned)(KC / 2 * VC / 4); e += CK_THREADS) {
        const int d = e / (VC / 4), c = 4 * (e % (VC / 4));
        cp_async16_zfill(smem_u32(&dst[d * (VC + 4) + c]), src + (int64_t)(d0 + d) * LDS + c, 16);
    }
    cp_async_commit();
}

/* ---------------------------------------------------------------------------------------------------------
 * Forward of the chunk on the tensor cores
 * ------------------------------------------------------------------------------------------------------- */
/* M (strictly lower) and Aqk (lower, × s) of the warp's row block I, columns (C / CK_NQ) hf..: Σ_d (k_i, q_i) e^{G_i − R}
 * · k_j e^{R − G_j} by 16-column k-steps; the diagonal block by exponentials per pair when not split */
template <int KC, int VC>
DEV void pair_products_mma(chunk_smem<KC, VC> &sm, float scale, int I, int hf, int split, int lane) {
    constexpr int KS = KC + 4;
    const int g = lane >> 2, t = lane & 3;
    const float *R = sm.G + (16 * I + (split ? 7 : 0)) * KS;
    constexpr int CT = C / 8 / CK_NQ; /* 8-column tiles of the warp's columns */
    const int jc0 = (C / CK_NQ) * hf;
    float am[CT][4], aq[CT][4];
    zero_acc<CT>(am);
    zero_acc<CT>(aq);
    /* tile nt (columns jc0 + 8 nt.., block J = (jc0 + 8 nt) / 16) by the split factors when J < I, or J == I when
       split; the tiles of later blocks stay 0 */
    int any = 0;
#pragma unroll
    for (int nt = 0; nt < CT; nt++) {
        const int J = (jc0 + 8 * nt) >> 4;
        any |= J < I || (J == I && split);
    }
    if (any) {
#pragma unroll 1
        for (int d0 = 0; d0 < KC; d0 += 16) {
            frag_t fk[4], fq[4], fkl[4], fql[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int row = 16 * I + g + 8 * (r & 1), col = d0 + 2 * t + 8 * (r >> 1);
                const float2 gx = *(const float2 *)&sm.G[row * KS + col], rf = *(const float2 *)&R[col];
                const float e0 = gexp(gx.x - rf.x), e1 = gexp(gx.y - rf.y);
                const float2 kx = *(const float2 *)&sm.k[row * KS + col], qx = *(const float2 *)&sm.q[row * KS + col];
                split2(make_float2(kx.x * e0, kx.y * e1), &fk[r], &fkl[r]);
                split2(make_float2(qx.x * e0, qx.y * e1), &fq[r], &fql[r]);
            }
#pragma unroll
            for (int nt = 0; nt < CT; nt++) {
                const int J = (jc0 + 8 * nt) >> 4;
                if (!(J < I || (J == I && split))) continue;
                const int j = jc0 + 8 * nt + g;
                frag_t bf[2];
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int col = d0 + 2 * t + 8 * hh;
                    const float2 gx = *(const float2 *)&sm.G[j * KS + col], rf = *(const float2 *)&R[col];
                    const float2 kx = *(const float2 *)&sm.k[j * KS + col];
                    bf[hh] = make_float2(kx.x * gexp(rf.x - gx.x), kx.y * gexp(rf.y - gx.y));
                }
                const int x3 = J == I; /* the diagonal block */
                mma16_x3(am[nt], fk, fkl, bf[0], bf[1], x3);
                mma16_x3(aq[nt], fq, fql, bf[0], bf[1], x3);
            }
        }
    }
    if (!split) { /* the diagonal block, pair by pair */
#pragma unroll
        for (int nt = 0; nt < CT; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                if (((jc0 + 8 * nt) >> 4) != I) continue; /* constant indices: the accumulators stay in registers */
                const int i = 16 * I + g + 8 * (c >> 1), j = jc0 + 8 * nt + 2 * t + (c & 1);
                float sa = 0.0f, sq = 0.0f;
                if (j <= i)
                    for (int d = 0; d < KC; d++) {
                        const float kk = sm.k[j * KS + d] * gexp(sm.G[i * KS + d] - sm.G[j * KS + d]);
                        sa += sm.k[i * KS + d] * kk;
                        sq += sm.q[i * KS + d] * kk;
                    }
                am[nt][c] = sa;
                aq[nt][c] = sq;
            }
    }
#pragma unroll
    for (int nt = 0; nt < CT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int i = 16 * I + g + 8 * (c >> 1), j = jc0 + 8 * nt + 2 * t + (c & 1);
            sm.M[i * CS + j] = j < i ? am[nt][c] : 0.0f;
            sm.A2[i * CS + j] = j <= i ? scale * aq[nt][c] : 0.0f;
        }
}

/* T = (I + Diag(β) M)⁻¹ by 16-row blocks, fp32: here the blocks above the diagonal zeroed and the diagonal blocks
 * T_II by forward substitution (warps 0-3, a column per lane; the other warps go on: no barrier), then
 * invert_offdiag */
template <int KC, int VC>
DEV void invert_diag(chunk_smem<KC, VC> &sm, int tid) {
    const int warp = tid >> 5, lane = tid & 31;
    for (int e = tid; e < C * C; e += CK_THREADS) {
        const int i = e / C, j = e % C;
        if ((j >> 4) > (i >> 4)) sm.T[i * CS + j] = 0.0f;
    }
    if (warp < 4 && lane < 16) {
        const int b = 16 * warp, j = lane;
        /* right-looking: row m's entry is final once rows < m have added their terms, then adds its own to the
           later rows' sums (the same sums in the same order as the dot product per row, whose chain of dependent
           FMAs was 120 long; now 16 steps of one FMA and one multiply) */
        float tcol[16], acc[16];
#pragma unroll
        for (int i = 0; i < 16; i++) acc[i] = 0.0f;
#pragma unroll
        for (int m = 0; m < 16; m++) {
            tcol[m] = m == j ? 1.0f : (m > j ? -sm.beta[b + m] * acc[m] : 0.0f);
#pragma unroll
            for (int i = m + 1; i < 16; i++) acc[i] += sm.M[(b + i) * CS + b + m] * tcol[m];
        }
#pragma unroll
        for (int i = 0; i < 16; i++) sm.T[(b + i) * CS + b + j] = tcol[i];
    }
}

/* The rest of T (after invert_diag and a barrier) by column strips on the tensor cores: warp s < 6 owns the 8
 * columns 8s.. (column block J = s / 2) of the blocks T_IJ, I > J, and computes them in the order of I by block
 * forward substitution, Y = Diag(β_I) Σ_{J ≤ L < I} M_IL T_LJ, T_IJ = −T_II Y, both products in 3xTF32 (~fp32
 * accurate), Y through the warp's 16 × 8 piece of scr. The T_LJ a strip reads are its own or the diagonal blocks:
 * no barrier inside, and the other warps go on to the next one (rounds of I over all warps would need a CTA
 * barrier per round with most warps idle). */
template <int KC, int VC>
DEV void invert_offdiag(chunk_smem<KC, VC> &sm, float *scr, int warp, int lane) {
    static_assert(C == 64 && CK_THREADS / 32 >= 6 && 6 * 16 * 8 <= 16 * C, "four 16-row blocks; six strips of 8");
    if (warp >= 6) return;
    const int J = warp >> 1, n0 = 8 * warp, g = lane >> 2, t = lane & 3;
    float *y = scr + 16 * 8 * warp; /* Y [16][8] */
#pragma unroll 1
    for (int I = J + 1; I < 4; I++) {
        float acc[1][4];
        zero_acc<1>(acc);
        mma_rows<1, 0, 0, 0, 2>(acc, sm.M, CS, sm.T, CS, 16 * I, n0, 16 * J, 16 * I, lane);
        const float b0 = sm.beta[16 * I + g], b1 = sm.beta[16 * I + g + 8];
        *(float2 *)&y[g * 8 + 2 * t] = make_float2(b0 * acc[0][0], b0 * acc[0][1]);
        *(float2 *)&y[(g + 8) * 8 + 2 * t] = make_float2(b1 * acc[0][2], b1 * acc[0][3]);
        __syncwarp();
        zero_acc<1>(acc);
        mma_rows<1, 0, 0, 0, 2>(acc, sm.T + 16 * I, CS, y, 8, 16 * I, 0, 0, 16, lane); /* T_II Y */
        *(float2 *)&sm.T[(16 * I + g) * CS + n0 + 2 * t] = make_float2(-acc[0][0], -acc[0][1]);
        *(float2 *)&sm.T[(16 * I + g + 8) * CS + n0 + 2 * t] = make_float2(-acc[0][2], -acc[0][3]);
        __syncwarp(); /* T_IJ in for the next I; every read of Y done */
    }
}

/* dO's elements tid + CK_THREADS j (their bits in ob, dtype DT) into the rows of R (stride VC + 4) */
template <int DT, int VC, int N>
DEV void do_rows(float *R, const uint32_t (&ob)[N], int tid) {
#pragma unroll
    for (int j = 0; j < N; j++) {
        const int e = tid + CK_THREADS * j;
        R[(e / VC) * (VC + 4) + e % VC] = bits_as<DT>(ob[j]);
    }
}

/* dv = β dR of one row and its part of dβ's v·dR, thread l4 of the row's CK_THREADS / C: columns 4 l4 + 32 k
 * (groups of four, so that the 16-byte reads of R of 8 adjacent threads fall in distinct banks), by 8-byte loads
 * and stores. For 16-bit v and dv of one format (F16: fp16, else bf16), V = VC, 8-byte aligned (per element
 * the loads were 2-byte pieces of 16-byte segments and each store tested the dtype). v's pieces vb were loaded
 * (dv_row_load) two phases earlier: loaded here, their round trip was a quarter of this phase's stall samples. */
template <int VC>
DEV void dv_row_load(const kda_bwd_params_t &p, int64_t row, int l4, uint2 (&vb)[VC / 32]) {
    const uint2 *vs = (const uint2 *)((const uint16_t *)p.pb.v + row);
#pragma unroll
    for (int k = 0; k < VC / 32; k++) vb[k] = vs[l4 + 8 * k];
}
template <int F16, int VC>
DEV float dv_row_vec(const kda_bwd_params_t &p, const float *Rr, float br, int64_t row, int l4,
                     const uint2 (&vb)[VC / 32]) {
    static_assert(CK_THREADS / C == 8 && VC % 32 == 0, "8 threads a row, 4 columns each per 32");
    constexpr int NK = VC / 32;
    uint2 *ds = (uint2 *)((uint16_t *)p.dv + row);
    float db = 0.0f;
#pragma unroll
    for (int k = 0; k < NK; k++) {
        const float4 x = *(const float4 *)&Rr[4 * l4 + 32 * k];
        const float2 a = unpack_16x2<F16>(vb[k].x), b = unpack_16x2<F16>(vb[k].y);
        db += a.x * x.x + a.y * x.y + b.x * x.z + b.y * x.w;
        ds[l4 + 8 * k] = make_uint2(pack_16x2<F16>(br * x.x, br * x.y), pack_16x2<F16>(br * x.z, br * x.w));
    }
    return db;
}

/* dX's tiles (−ax) of rows i0.., columns n0 + 8 nt..: β ⊙ dX into the rows dx_row (the lane's rows g, g + 8),
 * dβ's term Σ_d k e^G dX into dbx; DK: ak (dK̃) into dq_row's second half */
template <int NT, int KC, int DK, int KOFF = KC>
DEV void dx_out(const float (*ax)[4], const float (*ak)[4], const float *k, const float *G, const float *beta,
                float *const *dx_row, float *const *dq_row, float *dbx, int i0, int n0, int clen, int lane) {
    constexpr int KS = KC + 4;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c += 2) { /* the element pair (c, c + 1): adjacent columns of one row */
            const int i = i0 + g + 8 * (c >> 1), d = n0 + 8 * nt + 2 * t;
            const float b = beta[i], x0 = -ax[nt][c], x1 = -ax[nt][c + 1];
            const float2 kd = *(const float2 *)&k[i * KS + d], gd = *(const float2 *)&G[i * KS + d];
            dbx[c >> 1] += kd.x * gexp(gd.x) * x0 + kd.y * gexp(gd.y) * x1;
            if (i < clen) {
                *(float2 *)&dx_row[c >> 1][d] = make_float2(b * x0, b * x1);
                if (DK) *(float2 *)&dq_row[c >> 1][KOFF + d] = make_float2(ak[nt][c], ak[nt][c + 1]);
            }
        }
}

/* Σ over the lanes of one t (the rows g) of a per-row value: the 4 lanes of a row (t = 0..3) summed */
DEV float row_sum4(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

/* dAqk = dO Δᵀ (lower) in place of Aqk: the warp's CT tiles of columns jc0.. */
template <int KC, int VC>
DEV void daqk_rows(chunk_smem<KC, VC> &sm, int I, int jc0, int lane) {
    constexpr int VS = VC + 4, CT = C / 8 / CK_NQ;
    const int g = lane >> 2, t = lane & 3;
    float a[CT][4];
    zero_acc<CT>(a);
    if ((jc0 >> 4) <= I) mma_rows<CT, 0, 1, 0>(a, sm.R, VS, sm.D, VS, 16 * I, jc0, 0, VC, lane);
#pragma unroll
    for (int nt = 0; nt < CT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int i = 16 * I + g + 8 * (c >> 1), j = jc0 + 8 * nt + 2 * t + (c & 1);
            sm.A2[i * CS + j] = j <= i ? a[nt][c] : 0.0f;
        }
}

/* K class 256 (a cluster of two CTAs, each with 128 of the channels): the lane's tiles of a C-row product summed
 * over the two CTAs' partial sums (rows i0.., columns n0 + 8 nt..), through buf (a free shared tile, row stride
 * ld) at the same offsets in both: own + peer, the same bits in both CTAs (a sum of two is commutative). Cluster
 * barriers before the reads (the peer's partial is in) and after them (buf may be written again). */
template <int NT>
DEV void cluster_sum_tiles(float (*acc)[4], float *buf, int ld, int i0, int n0, int lane, int rank) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) buf[(i0 + g + 8 * (c >> 1)) * ld + n0 + 8 * nt + 2 * t + (c & 1)] = acc[nt][c];
    cluster_sync();
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[nt][c] +=
                cluster_ld(&buf[(i0 + g + 8 * (c >> 1)) * ld + n0 + 8 * nt + 2 * t + (c & 1)], (unsigned)(rank ^ 1));
    cluster_sync();
}

/* The same for M and Aqk, which pair_products_mma wrote as this CTA's partial sums: both tiles summed in place */
template <int KC, int VC>
DEV void cluster_sum_pairs(chunk_smem<KC, VC> &sm, int tid, int rank) {
    constexpr int N = C * C / CK_THREADS;
    float m[N], a[N];
    cluster_sync();
#pragma unroll
    for (int u = 0; u < N; u++) {
        const int e = tid + CK_THREADS * u, o = (e / C) * CS + e % C;
        m[u] = sm.M[o] + cluster_ld(&sm.M[o], (unsigned)(rank ^ 1));
        a[u] = sm.A2[o] + cluster_ld(&sm.A2[o], (unsigned)(rank ^ 1));
    }
    cluster_sync();
#pragma unroll
    for (int u = 0; u < N; u++) {
        const int e = tid + CK_THREADS * u, o = (e / C) * CS + e % C;
        sm.M[o] = m[u];
        sm.A2[o] = a[u];
    }
    __syncthreads();
}

/* Piece e (16 bytes: lane e mod 32 of piece e / 32, in the local order (vb, np) of a KC × VC part) of a 16-bit
 * state tile of class KT × VT in kda_cuda_states_dv's order (states16.cuh), the part's first row dk0 and column v0:
 * its index in the whole tile's pieces */
template <int KC, int KT>
DEV int64_t part_piece(unsigned e, int dk0, int v0) {
    if (KC == KT && v0 == 0) return e; /* (the whole K: the part is a contiguous run) */
    const int pc = (int)(e >> 5), vb = pc / (KC / 16), np = pc % (KC / 16);
    return ((int64_t)(v0 / 16 + vb) * (KT / 16) + dk0 / 16 + np) * 32 + (e & 31);
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernel's phases
 * ------------------------------------------------------------------------------------------------------- */
/* A CTA's place: its (chunk, value head), K and V parts, threads' roles and state tiles */
struct chunk_cta {
    int tid, lane, warp, I, hf, g, t; /* warp w: row block I = w mod 4, column part hf = w / 4; lane (g, t) */
    int rank, vh, h, dk0, v0, clen;   /* cluster rank (K part), V half, value head, first channel and V column */
    bool lead;                        /* writes what both CTAs of a cluster compute alike */
    int nv0, nk0, jc0;                /* the warp's first V / K / C column */
    int64_t cid, t0, pair, hpart;     /* chunk, first token, (chunk, head), its V half's copy */
    float scale, A;
    const float *S, *dS;      /* fp32 S and dS⁺ (the CTA's part) */
    const uint16_t *Sb, *dSh; /* the split path's: bf16 S, fp16 dS⁺ pieces */
    const uint8_t *dSe;       /* the split path's: dS⁺'s exponents */
};

/* S, dS⁺ (the CTA's part: rows of VC columns in fp32, or runs of pieces in 16 bits), dO's and v's rows into L2:
   read after the inverse and in the dv step */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void prefetch_inputs(const kda_bwd_params_t &p, const chunk_cta &c) {
    constexpr int KT = KC * KSP, VT = VC * NVH;
    const int tid = c.tid;
    if (KSP * NVH > 1) {
        for (int d = tid / 4; d < KC; d += CK_THREADS / 4)
            if (SPLIT) {
                if (d < VC / 16 && tid % 4 == 0)
                    for (int o = 0; o < KC * 32; o += 128) {
                        l2_prefetch((const char *)(c.Sb + part_piece<KC, KT>(32u * (KC / 16) * d, c.dk0, c.v0) * 8) +
                                    o);
                        l2_prefetch((const char *)(c.dSh + part_piece<KC, KT>(32u * (KC / 16) * d, c.dk0, c.v0) * 8) +
                                    o);
                    }
            } else {
                l2_prefetch((const char *)(c.S + (int64_t)d * VT) + 128 * (tid % 4));
                l2_prefetch((const char *)(c.dS + (int64_t)d * VT) + 128 * (tid % 4));
            }
    } else if (SPLIT) {
        prefetch_l2(c.Sb, (int64_t)KC * VC * 2, tid);
        prefetch_l2(c.dSh, (int64_t)KC * VC * 2, tid);
        prefetch_l2(c.dSe, (int64_t)VC * 2, tid);
    } else {
        prefetch_l2(c.S, (int64_t)KC * VC * 4, tid);
        prefetch_l2(c.dS, (int64_t)KC * VC * 4, tid);
    }
    {
        const int i = tid >> 2, part = tid & 3, which = i / C, row = i % C; /* 4 threads per row, 128 B apart */
        static_assert(CK_THREADS == 8 * C, "two tensors' C rows, 4 threads each");
        const int esz = which ? (p.pb.dtype == KDA_DT_F32 ? 4 : 2) : (p.do_dtype == KDA_DT_F32 ? 4 : 2);
        /* both tests by &: one predicate, no branch (a branch here costs the K-cluster instances spill) */
        if ((row < c.clen) & (part * 128 < (p.pb.V - c.v0) * esz))
            l2_prefetch((const char *)(which ? p.pb.v : p.d_o) +
                        (((c.t0 + row) * p.pb.hv + c.h) * (int64_t)p.pb.V + c.v0) * esz + part * 128);
    }
}

/* The chunk's rows (load_rows), G = cumsum ĝ, and with SPLIT Δ widened from its staged fp16 rows */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void chunk_rows(const kda_bwd_params_t &p, chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    load_rows<KC, VC, SPLIT, KSP, NVH>(p, sm, p.delta + c.hpart * KDA_BWD_DELTA_BYTES(VC), c.t0, c.clen, c.h, c.A,
                                       c.tid, c.rank, c.v0);
    __syncthreads();
    gate_cumsum<KC>(sm.G, c.tid);
    if (SPLIT) cp_async_wait_all(); /* Δ's copies (their only group so far) */
    __syncthreads();
    if (SPLIT)
        delta_rows<KC, VC>(sm, c.tid); /* (read T's tile before the inverse writes it: the barrier after the
                                                pair products) */
}

/* M and Aqk: the pair products' blocks by a table that gives each SM sub-partition (warp mod 4) one diagonal block
   (3xTF32) and at most two below it (with block (I, hf) on warp 4 hf + I, sub-partition 3 carried row block 3's
   four working warps); KSP = 2: summed over the cluster's channels, in both CTAs */
template <int KC, int VC, int KSP>
DEV void pair_products(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    static_assert(CK_NQ == 4, "16 warps, 4 x 4 blocks");
    const int map =
        (int)((0xe984dc32b761fa50ull >> (4 * c.warp)) & 0xfull); /* warp → (pI, phf) = (map & 3, map >> 2) */
    const int pI = map & 3, phf = map >> 2;
    const int split = block_split<KC + 4, KC>(sm.G, pI, c.lane);
    pair_products_mma<KC, VC>(sm, c.scale, pI, phf, split, c.lane);
    __syncthreads();
    if (KSP == 2) cluster_sum_pairs<KC, VC>(sm, c.tid, c.rank);
}

/* T = (I + A)⁻¹ with dO into R and dS⁺ into q̂'s tile around it: dO's first loads issued before the diagonal
   blocks, the rest after them, then all converted into R, so that warps 4-15 do it while warps 0-3 compute T_II.
   16-bit dO with V = VC and 16-byte rows: every element by 16-byte loads (NV a thread), all issued first. dS⁺ in
   flight during the inverse: SPLIT, all of its fp16 pieces as they are (KC · VC · 2 bytes) and then their exponent
   bytes (2 VC); fp32, its first KC / 2 rows (the second half after the first's product; KSP = 2: after Z's
   exchange, which goes through this tile) */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void inverse_phase(const kda_bwd_params_t &p, chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int VS = VC + 4, KT = KC * KSP, VT = VC * NVH;
    const int tid = c.tid, clen = c.clen, h = c.h, v0 = c.v0;
    const int64_t t0 = c.t0;
    constexpr int NO = C * VC / CK_THREADS, NO1 = NO < 8 ? NO : 8;
    constexpr int NV = C * VC / 8 / CK_THREADS;
    static_assert(NV >= 1 && (C * VC / 8) % CK_THREADS == 0, "whole 16-byte pieces of dO per thread");
    const bool do_vec = p.do_dtype != KDA_DT_F32 && p.pb.V == VT && ((uintptr_t)p.d_o & 15) == 0;
    uint32_t ob[NO];
    uint4 ov[NV];
    if (do_vec) {
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int u = tid + CK_THREADS * j, i = u / (VC / 8), col = 8 * (u % (VC / 8));
            ov[j] = i < clen ? __ldg((const uint4 *)((const uint16_t *)p.d_o + ((t0 + i) * p.pb.hv + h) * (int64_t)VT +
                                                     v0 + col))
                             : make_uint4(0u, 0u, 0u, 0u);
        }
    } else {
#pragma unroll
        for (int j = 0; j < NO1; j++) {
            const int e = tid + CK_THREADS * j, i = e / VC, col = v0 + e % VC;
            ob[j] = i < clen && col < p.pb.V
                        ? load_bits(p.d_o, p.do_dtype, ((t0 + i) * p.pb.hv + h) * (int64_t)p.pb.V + col)
                        : 0u;
        }
    }
    float *sdS = sm.q; /* fp32: [KC / 2][VC + 4] */
    static_assert(KC / 2 * (VC + 4) <= C * (KC + 4), "half of dS⁺ fits in q̂'s tile");
    static_assert(KC * VC * 2 + 2 * VC <= C * (KC + 4) * 4, "fp16 dS⁺ and its exponents fit in q̂'s tile");
    if (SPLIT) {
        for (unsigned e = tid; e < (unsigned)(KC * VC / 8 + VC / 8); e += CK_THREADS) {
            const void *src = e < KC * VC / 8 ? (const void *)(c.dSh + 8 * part_piece<KC, KT>(e, c.dk0, v0))
                                              : c.dSe + 16 * (e - KC * VC / 8);
            cp_async16_zfill(smem_u32((unsigned char *)sm.q + 16 * e), src, 16);
        }
        cp_async_commit();
    } else if (KSP == 1) {
        copy_state_half<KC, VC, VT>(sdS, c.dS, 0, tid);
    }
    invert_diag<KC, VC>(sm, tid);
    if (do_vec) { /* dO into R: each piece's 8 values as two float4 */
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int u = tid + CK_THREADS * j, i = u / (VC / 8), col = 8 * (u % (VC / 8));
            const uint32_t w[4] = {ov[j].x, ov[j].y, ov[j].z, ov[j].w};
            float2 x[4];
#pragma unroll
            for (int m = 0; m < 4; m++) x[m] = p.do_dtype == KDA_DT_F16 ? unpack_16x2<1>(w[m]) : unpack_16x2<0>(w[m]);
            *(float4 *)&sm.R[i * VS + col] = make_float4(x[0].x, x[0].y, x[1].x, x[1].y);
            *(float4 *)&sm.R[i * VS + col + 4] = make_float4(x[2].x, x[2].y, x[3].x, x[3].y);
        }
    } else {
#pragma unroll
        for (int j = NO1; j < NO; j++) {
            const int e = tid + CK_THREADS * j, i = e / VC, col = v0 + e % VC;
            ob[j] = i < clen && col < p.pb.V
                        ? load_bits(p.d_o, p.do_dtype, ((t0 + i) * p.pb.hv + h) * (int64_t)p.pb.V + col)
                        : 0u;
        }
        switch (p.do_dtype) { /* dO into R, the dtype tested once, not per element */
        case KDA_DT_F32:
            do_rows<KDA_DT_F32, VC>(sm.R, ob, tid);
            break;
        case KDA_DT_F16:
            do_rows<KDA_DT_F16, VC>(sm.R, ob, tid);
            break;
        default:
            do_rows<KDA_DT_BF16, VC>(sm.R, ob, tid);
        }
    }
    __syncthreads(); /* T_II and dO are in */
    invert_offdiag<KC, VC>(sm, sm.Y, c.warp, c.lane);
}

/* The lane's tiles (rows 16 I + g, + 8; columns n0 + 8 nt + 2t, + 1) of acc into the tile X (row stride VC + 4) */
template <int NT, int VC>
DEV void store_tiles(float *X, const float (*acc)[4], int I, int n0, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            X[(16 * I + g + 8 * (e >> 1)) * (VC + 4) + n0 + 8 * nt + 2 * t + (e & 1)] = acc[nt][e];
}

/* fp32 and fp16 inputs: Z = Diag(β) (V − KΓ S) in place of v (each element is its owner's; KSP = 2: over the
   peer's channels too, through q̂'s tile, then dS⁺'s first half into that tile), then Δ = T Z in 3xTF32 (Δ's tf32
   rounding reached dK̃ = Δ dS⁺ᵀ and through it every earlier row's dĝ: mma_rows_2g) */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void delta_fp32(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int VS = VC + 4, VN = VC / 8 / CK_NQ, VT = VC * NVH;
    const int I = c.I, g = c.g, t = c.t, nv0 = c.nv0, lane = c.lane;
    float acc[VN][4];
    zero_acc<VN>(acc);
    mma_gated_k_state<VN, KC, 1>(acc, sm.k, sm.G, NULL, c.S, VT, 16 * I, nv0, 0, KC, lane);
    if (KSP == 2) {
        cluster_sum_tiles<VN>(acc, sm.q, VS, 16 * I, nv0, lane, c.rank);
        copy_state_half<KC, VC, VT>(sm.q, c.dS, 0, c.tid);
    }
#pragma unroll
    for (int nt = 0; nt < VN; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = 16 * I + g + 8 * (e >> 1), col = nv0 + 8 * nt + 2 * t + (e & 1);
            sm.D[i * VS + col] = sm.beta[i] * (sm.D[i * VS + col] - acc[nt][e]);
        }
    __syncthreads();
    zero_acc<VN>(acc);
    mma_rows<VN, 0, 0, 0, !SPLIT>(acc, sm.T, CS, sm.D, VS, 16 * I, nv0, 0, 16 * (I + 1), lane);
    __syncthreads();
    store_tiles<VN, VC>(sm.D, acc, I, nv0, g, t);
}

/* fp32 and fp16 inputs: dγ = rowsum(dS⁺ ⊙ S) (the inter kernel's with bf16 inputs): TPR threads per row of S, dS⁺
   (adjacent lanes), all their float4 loads in flight */
template <int KC, int VC, int KSP, int NVH>
DEV void dgamma_fp32(const kda_bwd_params_t &p, const chunk_cta &c) {
    constexpr int KT = KC * KSP, VT = VC * NVH;
    constexpr int TPR = CK_THREADS / KC, NC = VC / TPR;
    const int d = c.tid / TPR, c0 = (c.tid % TPR) * NC;
    float s = 0.0f;
#pragma unroll
    for (int col = 0; col < NC; col += 4) {
        const float4 x = __ldg((const float4 *)(c.dS + (int64_t)d * VT + c0 + col));
        const float4 y = __ldg((const float4 *)(c.S + (int64_t)d * VT + c0 + col));
        s += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (c.tid % TPR == 0) p.dgam[c.hpart * KT + c.dk0 + d] = s;
}

/* fp32 and fp16 inputs: dQΓ = dO Sᵀ, raw (the inter kernel's with bf16 inputs), into the lane's scratch rows */
template <int KC, int VC, int KSP, int NVH>
DEV void dq_fp32(chunk_smem<KC, VC> &sm, float *const *dq_row, const chunk_cta &c) {
    constexpr int VS = VC + 4, KN = KC / 8 / CK_NQ, VT = VC * NVH;
    const int g = c.g, t = c.t;
    float a[KN][4];
    zero_acc<KN>(a);
    mma_rows<KN, 0, 1, 1>(a, sm.R, VS, c.S, VT, 16 * c.I, c.nk0, 0, VC, c.lane);
#pragma unroll
    for (int nt = 0; nt < KN; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = 16 * c.I + g + 8 * (e >> 1), d = c.nk0 + 8 * nt + 2 * t + (e & 1);
            if (i < c.clen) dq_row[e >> 1][d] = a[nt][e];
        }
}

/* dΔ = Aqkᵀ dO + K̃ dS⁺ into R, and dAqk = dO Δᵀ (lower) in place of Aqk. KSP = 1: from the fp32 Aqk and K̃ (in acc
   until dO is no longer needed), fp32 dS⁺'s second half in flight during dAqk. KSP = 2: K̃ dS⁺ over this CTA's
   channels + the peer's, the partial first, through q̂'s tile once every read of dS⁺ there is done. */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void ddelta_phase(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int KS = KC + 4, VS = VC + 4, VN = VC / 8 / CK_NQ, VT = VC * NVH;
    const int I = c.I, nv0 = c.nv0, lane = c.lane, tid = c.tid;
    const float *Gl = sm.G + (C - 1) * KS;
    float *sdS = sm.q; /* fp32: [KC / 2][VC + 4] */
    const uint8_t *sdSe = (const uint8_t *)sm.q + KC * VC * 2;
    float acc[VN][4];
    if (KSP == 2) {
        zero_acc<VN>(acc);
        if (SPLIT) {
            mma_gated_k_pieces<VN, KC>(acc, sm.k, sm.G, Gl, (const uint4 *)sm.q, sdSe, 16 * I, nv0, lane);
        } else {
            mma_gated_k_state<VN, KC, 0>(acc, sm.k, sm.G, Gl, sdS, VS, 16 * I, nv0, 0, KC / 2, lane);
            __syncthreads();
            copy_state_half<KC, VC, VT>(sdS, c.dS, KC / 2, tid);
            cp_async_wait_all();
            __syncthreads();
            mma_gated_k_state<VN, KC, 0>(acc, sm.k, sm.G, Gl, sdS - (KC / 2) * VS, VS, 16 * I, nv0, KC / 2, KC, lane);
        }
        __syncthreads(); /* every read of dS⁺ is done */
        cluster_sum_tiles<VN>(acc, sm.q, VS, 16 * I, nv0, lane, c.rank);
        mma_rows<VN, 1, 0, 0>(acc, sm.A2, CS, sm.R, VS, 16 * I, nv0, 16 * I, C, lane);
        __syncthreads(); /* every read of Aqk is done */
        daqk_rows<KC, VC>(sm, I, c.jc0, lane);
        __syncthreads(); /* every read of dO is done */
        store_tiles<VN, VC>(sm.R, acc, I, nv0, c.g, c.t);
    } else {
        zero_acc<VN>(acc);
        mma_rows<VN, 1, 0, 0>(acc, sm.A2, CS, sm.R, VS, 16 * I, nv0, 16 * I, C, lane);
        if (SPLIT) mma_gated_k_pieces<VN, KC>(acc, sm.k, sm.G, Gl, (const uint4 *)sm.q, sdSe, 16 * I, nv0, lane);
        else mma_gated_k_state<VN, KC, 0>(acc, sm.k, sm.G, Gl, sdS, VS, 16 * I, nv0, 0, KC / 2, lane);
        __syncthreads(); /* every read of Aqk (and of dS⁺'s first half) is done */
        if (!SPLIT) copy_state_half<KC, VC, VT>(sdS, c.dS, KC / 2, tid); /* the second half, in flight during dAqk */
        daqk_rows<KC, VC>(sm, I, c.jc0, lane);                           /* dAqk = dO Δᵀ (lower) in place of Aqk */
        if (!SPLIT) cp_async_wait_all();
        __syncthreads(); /* every read of dO is done (fp32: dS⁺'s second half is in) */
        if (!SPLIT)
            mma_gated_k_state<VN, KC, 0>(acc, sm.k, sm.G, Gl, sdS - (KC / 2) * VS, VS, 16 * I, nv0, KC / 2, KC, lane);
        store_tiles<VN, VC>(sm.R, acc, I, nv0, c.g, c.t);
    }
    __syncthreads();
}

/* dR = Tᵀ dΔ in place of dΔ */
template <int KC, int VC>
DEV void dr_phase(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int VS = VC + 4, VN = VC / 8 / CK_NQ;
    float acc[VN][4];
    zero_acc<VN>(acc);
    mma_rows<VN, 1, 0, 0>(acc, sm.T, CS, sm.R, VS, 16 * c.I, c.nv0, 16 * c.I, C, c.lane);
    __syncthreads();
    store_tiles<VN, VC>(sm.R, acc, c.I, c.nv0, c.g, c.t);
    __syncthreads();
}

/* dA = −dR Δᵀ (strictly lower) in place of T; dβ's pair term Σ_j dA M by column part into dbp */
template <int KC, int VC>
DEV void da_phase(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int VS = VC + 4, CT = C / 8 / CK_NQ;
    const int I = c.I, g = c.g, t = c.t, jc0 = c.jc0;
    float a[CT][4];
    zero_acc<CT>(a);
    if ((jc0 >> 4) <= I) mma_rows<CT, 0, 1, 0>(a, sm.R, VS, sm.D, VS, 16 * I, jc0, 0, VC, c.lane);
    float db[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < CT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = 16 * I + g + 8 * (e >> 1), j = jc0 + 8 * nt + 2 * t + (e & 1);
            const float x = j < i ? -a[nt][e] : 0.0f;
            sm.T[i * CS + j] = x;
            db[e >> 1] += x * sm.M[i * CS + j];
        }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const float s = row_sum4(db[hr]);
        if (t == 0) sm.dbp[c.hf][16 * I + g + 8 * hr] = s;
    }
}

/* The pairs kernel's coefficients P = s·dAqk, B = Diag(β) dA, float4 pieces of rows padded to CS (the pairs
   kernel's shared layout: one contiguous copy there), the padding zero */
template <int KC, int VC>
DEV void store_coefs(const kda_bwd_params_t &p, const chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    const int tid = c.tid;
    float *dc = p.dcoef + c.hpart * (int64_t)(2 * C * CS);
    for (unsigned e = tid; e < (unsigned)(2 * C * C / 4); e += CK_THREADS) {
        const int m = e / (C * C / 4), i = (e / (C / 4)) % C, j = 4 * (e % (C / 4));
        const float4 x = *(const float4 *)&(m ? sm.T : sm.A2)[i * CS + j];
        const float f = m ? sm.beta[i] : c.scale;
        *(float4 *)&dc[(m * C + i) * CS + j] = make_float4(f * x.x, f * x.y, f * x.z, f * x.w);
    }
    static_assert(CS - C == 4 && 2 * C <= CK_THREADS, "one float4 of padding per row, a thread each");
    if (tid < 2 * C) *(float4 *)&dc[tid * CS + C] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

/* SPLIT: S (bf16, kda_cuda_states_dv's order) into q̂'s tile (free since dΔ) by cp.async, in flight during the dv
   loads, widened later (widen_s) */
template <int KC, int VC, int KSP>
DEV void stage_s(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int KT = KC * KSP;
    static_assert(KC * (VC + 4) <= 3 * C * CS + C * (VC + 4), "S fits over M, A2, T and D");
    static_assert(KC * VC * 2 <= C * (KC + 4) * 4, "bf16 S fits in q̂'s tile");
    for (unsigned e = c.tid; e < (unsigned)(KC * VC / 8); e += CK_THREADS)
        cp_async16_zfill(smem_u32((unsigned char *)sm.q + 16 * e), c.Sb + 8 * part_piece<KC, KT>(e, c.dk0, c.v0), 16);
    cp_async_commit();
}

/* dv = β dR and dβ's v·dR (returned) of row r, thread l4 of its TPRW: by dv_row_vec where it applies (v's pieces
   vb loaded before dR), else element by element in two batches */
template <int KC, int VC, int NVH>
DEV float dv_phase(const kda_bwd_params_t &p, const chunk_smem<KC, VC> &sm, int r, int l4, bool dv_vec, int64_t vrow,
                   const uint2 (&vb)[VC / 32], const chunk_cta &c) {
    constexpr int VS = VC + 4, TPRW = CK_THREADS / C;
    float db = 0.0f;
    if (!c.lead) {
        /* (the peer writes dv and dβ) */
    } else if (r < c.clen && dv_vec) {
        db = p.pb.dtype == KDA_DT_F16 ? dv_row_vec<1, VC>(p, sm.R + r * VS, sm.beta[r], vrow, l4, vb)
                                      : dv_row_vec<0, VC>(p, sm.R + r * VS, sm.beta[r], vrow, l4, vb);
    } else if (r < c.clen) {
        const int vn = NVH == 1 ? p.pb.V : min(p.pb.V - c.v0, VC); /* the part's columns that exist */
        const float br = sm.beta[r];
        constexpr int N = VC / TPRW / 2; /* two batches */
#pragma unroll
        for (int j0 = 0; j0 < 2 * N; j0 += N) {
            uint32_t vbits[N];
            float vv[N];
#pragma unroll
            for (int j = 0; j < N; j++) {
                const int col = l4 + TPRW * (j0 + j);
                vbits[j] = col < vn ? load_bits(p.pb.v, p.pb.dtype, vrow + col) : 0u;
            }
            bits_values<N>(vv, vbits, p.pb.dtype);
#pragma unroll
            for (int j = 0; j < N; j++) db += vv[j] * sm.R[r * VS + l4 + TPRW * (j0 + j)];
        }
        for (int col = l4; col < vn; col += TPRW) store_elem(p.dv, p.dv_dtype, vrow + col, br * sm.R[r * VS + col]);
    }
    return db;
}

/* SPLIT: S staged in q̂'s tile widened to fp32 [KC][VC + 4] over M, Aqk, T and Δ for dX's products. The warp's 32
   pieces e are the 32 lanes of one (vb, np): four 8 × 8 matrices Sᵀ[16 vb + 8 h + ·][8 nt + ·]
   (m = 2 (nt − 2 np) + h), each transposed by movmatrix so that the lane holds two adjacent columns */
template <int KC, int VC>
DEV void widen_s(chunk_smem<KC, VC> &sm, const chunk_cta &c) {
    constexpr int VS = VC + 4;
    float *sS = sm.M; /* [KC][VC + 4] */
    cp_async_wait_all();
    __syncthreads(); /* S is in; every read of M, Aqk, T, Δ is done */
    for (unsigned e = c.tid; e < (unsigned)(KC * VC / 8); e += CK_THREADS) {
        const uint4 b = *(const uint4 *)((const unsigned char *)sm.q + 16 * e);
        const uint32_t w[4] = {b.x, b.y, b.z, b.w};
        const int piece = (int)(e >> 5), vb = piece / (KC / 16), np = piece % (KC / 16);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const float2 x = unpack_bf16(movm_t(w[m]));
            *(float2 *)&sS[(8 * (2 * np + (m >> 1)) + c.g) * VS + 16 * vb + 8 * (m & 1) + 2 * c.t] = x;
        }
    }
    __syncthreads();
}

/* dX = −dR Sᵀ: β ⊙ dX into the pairs kernel's rows and dβ's term Σ_d k e^G dX (X = β k e^G) by column part into
   dbp; with fp32 inputs also dK̃ = Δ dS⁺ᵀ, raw, by halves of the warp's columns (two products' accumulators);
   SPLIT: all the warp's columns at once (dR's fragments read and rounded once per k-step, not once per half) */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
DEV void dx_phase(chunk_smem<KC, VC> &sm, float *const *dq_row, float *const *dx_row, const chunk_cta &c) {
    constexpr int VS = VC + 4, KN = KC / 8 / CK_NQ, KT = KC * KSP, VT = VC * NVH;
    const int I = c.I, lane = c.lane;
    float dbx[2] = {0.0f, 0.0f};
    if (SPLIT) {
        float ax[KN][4];
        zero_acc<KN>(ax);
        mma_rows<KN, 0, 1, 0>(ax, sm.R, VS, sm.M, VS, 16 * I, c.nk0, 0, VC, lane);
        dx_out<KN, KC, 0, KT>(ax, ax, sm.k, sm.G, sm.beta, dx_row, dq_row, dbx, 16 * I, c.nk0, c.clen, lane);
    } else {
#pragma unroll
        for (int q2 = 0; q2 < 2; q2++) {
            constexpr int NH = KN / 2;
            const int n0 = c.nk0 + q2 * (KC / 2 / CK_NQ);
            float ax[NH][4], ak[NH][4];
            zero_acc<NH>(ax);
            zero_acc<NH>(ak);
            mma_rows_2g<NH>(ax, ak, sm.R, sm.D, VS, c.S, c.dS, VT, 16 * I, n0, VC, lane);
            dx_out<NH, KC, 1, KT>(ax, ak, sm.k, sm.G, sm.beta, dx_row, dq_row, dbx, 16 * I, n0, c.clen, lane);
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const float s = row_sum4(dbx[hr]);
        if (c.t == 0) sm.dbp[CK_NQ + c.hf][16 * I + c.g + 8 * hr] = s;
    }
}

/* dβ: the row's TPRW threads sum, with the terms by column part (KSP = 2: then the peer's dX terms, over its
   channels); through the sigmoid (NVH = 2: this V half's part before it, into dbeta_part) */
template <int KC, int VC, int KSP, int NVH>
DEV void dbeta_phase(const kda_bwd_params_t &p, const chunk_smem<KC, VC> &sm, float db, int r, int l4,
                     const chunk_cta &c) {
    constexpr int TPRW = CK_THREADS / C;
#pragma unroll
    for (int o = 1; o < TPRW; o <<= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
    if (c.lead && l4 == 0 && r < c.clen) {
#pragma unroll
        for (int u = 0; u < 2 * CK_NQ; u++) db += sm.dbp[u][r];
        if (KSP == 2)
#pragma unroll
            for (int u = CK_NQ; u < 2 * CK_NQ; u++) db += cluster_ld(&sm.dbp[u][r], 1u);
        const int64_t e = (c.t0 + r) * p.pb.hv + c.h;
        if (NVH == 2) {
            p.dbeta_part[e * 2 + c.vh] = db;
        } else if (p.pb.beta_sigmoid) {
            const float sg = beta_sigmoid(load_elem(p.pb.beta, p.pb.beta_dtype, e), 0);
            db *= (p.pb.neg_eigval ? 2.0f : 1.0f) * sg * (1.0f - sg);
        }
        if (NVH == 1) store_elem(p.dbeta, p.dbeta_dtype, e, db);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernel
 * ------------------------------------------------------------------------------------------------------- */
/* KC, VC: the CTA's tile (≤ 128). KSP = 2: K class 256, a cluster of two CTAs, rank r holding channels KC r..; NVH =
 * 2: V class 256, the grid's CTAs (clusters) take the V halves VC vh.. (their sums over V into the regions' copy
 * vh). Block b: ((chunk · hv + head) · NVH + vh) · KSP + rank. */
template <int KC, int VC, int SPLIT, int KSP, int NVH>
__global__ void __launch_bounds__(CK_THREADS, 1) kda_bwd_chunk_kernel(const kda_bwd_params_t p) {
    constexpr int KT = KC * KSP, VT = VC * NVH, TPRW = CK_THREADS / C; /* the classes; threads per row */
    static_assert((KSP == 1 || (KSP == 2 && KC == 128)) && (NVH == 1 || VC == 128),
                  "chunk: class 256 as 128-wide parts");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    chunk_smem<KC, VC> &sm = *(chunk_smem<KC, VC> *)(KSP == 1 ? smem_raw : cta_smem(smem_raw)); /* (the emulator's
                                                                                                    rank) */
    chunk_cta c;
    c.tid = threadIdx.x, c.lane = c.tid & 31, c.warp = c.tid >> 5;
    c.I = c.warp & 3, c.hf = c.warp >> 2, c.g = c.lane >> 2, c.t = c.lane & 3;
    c.rank = KSP == 1 ? 0 : (int)(blockIdx.x % KSP);
    const unsigned unit = blockIdx.x / (KSP * NVH); /* (chunk, head) */
    c.vh = NVH == 1 ? 0 : (int)(blockIdx.x / KSP % NVH);
    c.cid = unit / p.pb.hv;
    c.h = (int)(unit % p.pb.hv);
    c.dk0 = KC * c.rank, c.v0 = VC * c.vh;
    c.lead = KSP == 1 || c.rank == 0;
    c.clen = chunk_tokens(p.pb.seqs, c.cid, &c.t0);
    if (c.clen <= 0) return;
    c.scale = p.pb.scale;
    c.A = p.pb.A_log ? expf(p.pb.A_log[c.h]) : 1.0f;
    c.pair = c.cid * p.pb.hv + c.h, c.hpart = c.pair * NVH + c.vh;
    c.S = SPLIT ? NULL : p.states + c.pair * (int64_t)KT * VT + (int64_t)c.dk0 * VT + c.v0;
    c.Sb = SPLIT ? p.states_bf16 + c.pair * (int64_t)KT * VT : NULL;
    c.dS = SPLIT ? NULL : p.dstates + c.pair * (int64_t)KT * VT + (int64_t)c.dk0 * VT + c.v0;
    c.dSh = SPLIT ? p.dstates_f16 + c.pair * (int64_t)KT * VT : NULL;
    c.dSe = SPLIT ? p.dstates_exp + c.pair * (int64_t)(VT / 16) * 32 + (c.v0 / 16) * 32 : NULL;
    c.nv0 = c.hf * (VC / CK_NQ), c.nk0 = c.hf * (KC / CK_NQ), c.jc0 = c.hf * (C / CK_NQ);

    /* ---- forward ---- */
    prefetch_inputs<KC, VC, SPLIT, KSP, NVH>(p, c);
    chunk_rows<KC, VC, SPLIT, KSP, NVH>(p, sm, c);
    pair_products<KC, VC, KSP>(sm, c);
    inverse_phase<KC, VC, SPLIT, KSP, NVH>(p, sm, c);
    if (!SPLIT) delta_fp32<KC, VC, SPLIT, KSP, NVH>(sm, c);

    /* ---- backward ---- */
    if (!SPLIT) dgamma_fp32<KC, VC, KSP, NVH>(p, c);
    cp_async_wait_all(); /* dS⁺ (fp32: its first half) */
    __syncthreads();
    /* the lane's rows g, g + 8 of block I: their scratch rows (raw dQΓ, dK̃ with fp32 inputs) and β ⊙ dX rows
       (rows past the chunk's end are dropped) */
    float *dq_row[2], *dx_row[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = 16 * c.I + c.g + 8 * hr;
        const int64_t row = (c.t0 + (i < c.clen ? i : 0)) * p.pb.hv + c.h;
        dq_row[hr] = p.dqk + (row * NVH + c.vh) * (int64_t)(2 * KT) + c.dk0; /* dK̃ at KT on */
        dx_row[hr] = p.dx + (row * NVH + c.vh) * (int64_t)KT + c.dk0;
    }
    if (!SPLIT) dq_fp32<KC, VC, KSP, NVH>(sm, dq_row, c);
    ddelta_phase<KC, VC, SPLIT, KSP, NVH>(sm, c);
    /* v's pieces for the dv phase (dv_row_load), in flight during dR and dA */
    const int r = c.tid / TPRW, l4 = c.tid % TPRW;
    const bool dv_vec = p.pb.V == VT && p.pb.dtype != KDA_DT_F32 && p.dv_dtype == p.pb.dtype &&
                        (((uintptr_t)p.pb.v | (uintptr_t)p.dv) & 7) == 0;
    const int64_t vrow = ((c.t0 + (r < c.clen ? r : 0)) * p.pb.hv + c.h) * (int64_t)p.pb.V + c.v0;
    uint2 vb[VC / 32];
    if (c.lead && r < c.clen && dv_vec) dv_row_load<VC>(p, vrow, l4, vb);
    dr_phase<KC, VC>(sm, c);
    da_phase<KC, VC>(sm, c);
    __syncthreads();
    if (c.lead) store_coefs<KC, VC>(p, sm, c);
    prefetch_next_wave<KC, VC, SPLIT, KSP, NVH>(p, c.tid);
    if (SPLIT) stage_s<KC, VC, KSP>(sm, c);
    const float db = dv_phase<KC, VC, NVH>(p, sm, r, l4, dv_vec, vrow, vb, c);
    if (SPLIT) widen_s<KC, VC>(sm, c);
    dx_phase<KC, VC, SPLIT, KSP, NVH>(sm, dq_row, dx_row, c);
    __syncthreads();
    if (KSP == 2) cluster_sync(); /* the peer's dX terms of dβ are in its dbp */
    dbeta_phase<KC, VC, KSP, NVH>(p, sm, db, r, l4, c);
    if (KSP == 2) cluster_sync(); /* rank 0 has read rank 1's dbp: rank 1 may exit */
}

template <int KC, int VC, int SPLIT, int KSP, int NVH>
static int launch_chunk(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->blocks.max_chunks * p->pb.hv * NVH * KSP;
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    const int bytes = (int)sizeof(chunk_smem<KC, VC>);
    const void *kernel = (const void *)kda_bwd_chunk_kernel<KC, VC, SPLIT, KSP, NVH>;
    if (KSP == 1) return kda_launch(kernel, ctas, CK_THREADS, bytes, p, device, done, stream);
    return kda_launch_cluster(kernel, ctas, KSP, CK_THREADS, bytes, p, device, done, stream);
}

/* One instance (a KDA_BWD_CHUNK_CONFIG row of configs.def; CMake generates its translation unit): the launcher
 * kda_bwd_chunk_k<KC>_v<VC>_s<SPLIT>_c<KSP>_h<NVH>, found by bwd/configs.c's table */
#define KDA_BWD_CHUNK_INSTANCE(KC, VC, SPLIT, KSP, NVH)                                                                \
    extern "C" int kda_bwd_chunk_k##KC##_v##VC##_s##SPLIT##_c##KSP##_h##NVH(const kda_bwd_params_t *p, int device,     \
                                                                            void *stream) {                            \
        return launch_chunk<KC, VC, SPLIT, KSP, NVH>(p, device, stream);                                               \
    }

#endif /* KDA_CUDA_BWD_CHUNK_CUH */
