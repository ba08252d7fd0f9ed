/*
 * The chunk recurrence (docs/ALGORITHM.md §3): per sequence, chunk after chunk,
 *
 *     Δ = U − W S,     O = QΓ S + Aqk Δ,     S ← Diag(γ) S + K̃ᵀ Δ
 *
 * from the workspace blocks of prep.cu. One CTA per (sequence, value head, tile of BV state columns): the
 * recurrence is independent across the V columns of S, so a head's state splits over CTAs without any
 * exchange (BV = 128, 64 or 32 chosen by the host to fill the GPU). Each warp owns 16 columns: it holds Sᵀ
 * (16 × K, fp32) in accumulators for the whole sequence. With Sᵀ as the left operand every product has its
 * left operand in registers:
 *
 *     Δᵀ = Uᵀ − Sᵀ Wᵀ          (Sᵀ packed to bf16 A fragments; Uᵀ read in accumulator layout by ldmatrix.trans)
 *     Oᵀ = Sᵀ QΓᵀ + Δᵀ Aqkᵀ    (Δᵀ accumulators reused as A fragments)
 *     Sᵀ ← Sᵀ Diag(γ) + Δᵀ K̃
 *
 * Two ways to do the products, one kernel body (WG below):
 *   - wgmma (sm_90a, BV ≥ 64): each warpgroup of 4 warps owns 64 columns and issues m64nNk16 with B straight
 *     from the stage (the workspace panels are wgmma's 128-byte-swizzled layout, K-major for W, QΓ, Aqk and
 *     MN-major for K̃). The tensor cores read each B tile once per 64 columns of S; with mma.sync every warp
 *     read all of W, QΓ and K̃ through ldmatrix, and shared-memory bandwidth bounded a step (~110 ldmatrix.x4
 *     per warp, 8 warps: ~3.5 k cycles of the SM's 128 bytes per cycle).
 *   - mma.sync m16n8k16 (BV = 32, and sm_100a, where wgmma does not exist): B fragments by ldmatrix per warp;
 *     causal tiles of Aqk skipped.
 *
 * The next chunks' blocks stream in by bulk copies (the copy engine, completing on one mbarrier per stage) into
 * a 2- or 3-stage ring while this one is used. O goes through shared memory so that its global stores are
 * whole rows.
 */
#include "common.cuh"
#include "seq.cuh"

typedef __nv_bfloat16 bf16;

#define REC_MAX_THREADS 256

/* One stage: W, QΓ, K̃ (64×KD), Aqk (64×64), γ (KD fp32) exactly as in the workspace (REC_LINEAR bytes),
 * then the 64-column panels of U that hold this CTA's columns (REC_UP(BV) of them: each panel is 8 KB and
 * contiguous in the workspace, common.cuh). NST stages (3 where they fit, else 2), then the O staging rows (two
 * buffers, alternating by chunk, of BV + 8 elements of OES bytes), then one mbarrier per stage. */
#define REC_LINEAR(KD) (3 * 64 * (KD) * 2 + 64 * 64 * 2 + (KD) * 4)
#define REC_UP(BV) ((BV) >= 128 ? 2 : 1)
#define REC_STAGE_BYTES(KD, BV) ((REC_LINEAR(KD) + REC_UP(BV) * 8192 + 1023) / 1024 * 1024) /* wgmma: panels 1 KB-aligned */
#define REC_O_STRIDE(BV) ((BV) + 8)
#define REC_BYTES(KD, BV, NST, OES) \
    (1024 + (NST) * REC_STAGE_BYTES(KD, BV) + 2 * 64 * REC_O_STRIDE(BV) * (OES) + 8 * (NST)) /* 1024: aligning */
#define REC_SMEM_MAX 232448 /* bytes of shared memory a CTA may use on sm_90 */

/* Lane 0 of warp 0 copies chunk `blk` into a stage: two bulk copies (the linear part, the U panels) completing
 * on the stage's barrier, armed with their byte count. */
template <int KD>
DEV void issue_chunk_copy(unsigned char *stage, uint32_t bar, const unsigned char *blk, int v0, int bv) {
    const uint32_t dst = smem_u32(stage);
    const int ubytes = REC_UP(bv) * 8192;
    fence_proxy_async(); /* the stage's previous contents were read through the generic proxy */
    mbar_expect_tx(bar, REC_LINEAR(KD) + ubytes);
    bulk_g2s(dst, blk, REC_LINEAR(KD), bar);
    bulk_g2s(dst + REC_LINEAR(KD), blk + kda_cuda_off_u(KD) + (v0 >> 6) * 8192, ubytes, bar);
}

/* Δᵀ = Uᵀ − (Sᵀ Wᵀ) in place, Uᵀ read in accumulator layout by ldmatrix.trans; then Δᵀ as bf16 A fragments over
 * the tokens. */
DEV void delta_fragments(float (&dacc)[8][4], uint32_t (&da)[4][4], uint32_t sU, int ucol, int lane) {
#pragma unroll
    for (int np = 0; np < 4; np++) {
        const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = ucol + ((lane >> 3) & 1) * 8;
        uint32_t u[4];
        ldsm_x4_t(u, sU + pan_off(row, col));
        const float2 u0 = unpack_bf16(u[0]), u1 = unpack_bf16(u[1]), u2 = unpack_bf16(u[2]), u3 = unpack_bf16(u[3]);
        dacc[2 * np][0] = u0.x - dacc[2 * np][0];
        dacc[2 * np][1] = u0.y - dacc[2 * np][1];
        dacc[2 * np][2] = u1.x - dacc[2 * np][2];
        dacc[2 * np][3] = u1.y - dacc[2 * np][3];
        dacc[2 * np + 1][0] = u2.x - dacc[2 * np + 1][0];
        dacc[2 * np + 1][1] = u2.y - dacc[2 * np + 1][1];
        dacc[2 * np + 1][2] = u3.x - dacc[2 * np + 1][2];
        dacc[2 * np + 1][3] = u3.y - dacc[2 * np + 1][3];
    }
#pragma unroll
    for (int kt = 0; kt < 4; kt++)
        acc_pair_to_a(dacc[2 * kt], dacc[2 * kt + 1], da[kt]);
}

/* Sᵀ ← Sᵀ Diag(γ) */
template <int KD>
DEV void decay_state(float (&s)[KD / 8][4], const float *gam, int t) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++) {
        const float2 gg = *(const float2 *)&gam[8 * nt + 2 * t];
        s[nt][0] *= gg.x;
        s[nt][1] *= gg.y;
        s[nt][2] *= gg.x;
        s[nt][3] *= gg.y;
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * One chunk step of a warp's 16 columns of Sᵀ: oacc = Oᵀ (16 columns × 64 tokens, accumulator layout), s updated.
 * sW.. are the stage's tiles, ucol the warp's first column within the copied U panels.
 * ------------------------------------------------------------------------------------------------------- */
template <int KD>
DEV void step_mma(float (&s)[KD / 8][4], float (&oacc)[8][4], uint32_t sW, uint32_t sQG, uint32_t sKT,
                  uint32_t sAqk, uint32_t sU, const float *gam, int ucol, int lane) {
    constexpr int NKT = KD / 16;
    const int t = lane & 3;
    /* Sᵀ as bf16 A fragments over K */
    uint32_t sa[NKT][4];
#pragma unroll
    for (int kt = 0; kt < NKT; kt++)
        acc_pair_to_a(s[2 * kt], s[2 * kt + 1], sa[kt]);

    /* Sᵀ Wᵀ and Sᵀ QΓᵀ over the 64 tokens (8 n-tiles) */
    float dacc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = oacc[nt][c] = 0.0f;
    /* k-tiles outermost: the 16 mma of one k-tile are independent, so no mma waits on the one before */
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) {
#pragma unroll
        for (int np = 0; np < 4; np++) {
            const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
            const int col = kt * 16 + ((lane >> 3) & 1) * 8;
            const int off = pan_off(row, col);
            uint32_t b[4];
            ldsm_x4(b, sW + off);
            mma_bf16(dacc[2 * np], sa[kt], b[0], b[1]);
            mma_bf16(dacc[2 * np + 1], sa[kt], b[2], b[3]);
            ldsm_x4(b, sQG + off);
            mma_bf16(oacc[2 * np], sa[kt], b[0], b[1]);
            mma_bf16(oacc[2 * np + 1], sa[kt], b[2], b[3]);
        }
    }

    uint32_t da[4][4];
    delta_fragments(dacc, da, sU, ucol, lane);

    /* Oᵀ += Δᵀ Aqkᵀ: token tiles of Aqk rows i (n) against tokens j (k) ≤ i */
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
#pragma unroll
        for (int np = 0; np < 4; np++) {
            if (np < kt) continue;
            const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
            const int col = kt * 16 + ((lane >> 3) & 1) * 8;
            uint32_t b[4];
            ldsm_x4(b, sAqk + pan_off(row, col));
            mma_bf16(oacc[2 * np], da[kt], b[0], b[1]);
            mma_bf16(oacc[2 * np + 1], da[kt], b[2], b[3]);
        }
    }

    /* Sᵀ ← Sᵀ Diag(γ) + Δᵀ K̃ */
    decay_state<KD>(s, gam, t);
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
#pragma unroll
        for (int pp = 0; pp < KD / 16; pp++) {
            const int row = kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = pp * 16 + (lane >> 4) * 8;
            uint32_t b[4];
            ldsm_x4_t(b, sKT + pan_off(row, col));
            mma_bf16(s[2 * pp], da[kt], b[0], b[1]);
            mma_bf16(s[2 * pp + 1], da[kt], b[2], b[3]);
        }
    }
}

/* The same step by the warpgroup (all 4 warps call it; the warp's rows are the warpgroup's rows 16 (warp % 4)..).
 * Two commit groups for Sᵀ Wᵀ and Sᵀ QΓᵀ, so Δ is formed while the second still runs; then Δᵀ Aqkᵀ joins the
 * Oᵀ accumulators (in order behind Sᵀ QΓᵀ, same shape) and Δᵀ K̃ the decayed Sᵀ. */
template <int KD>
DEV void step_wgmma(float (&s)[KD / 8][4], float (&oacc)[8][4], uint32_t sW, uint32_t sQG, uint32_t sKT,
                    uint32_t sAqk, uint32_t sU, const float *gam, int ucol, int lane) {
#ifdef KDA_WGMMA
    constexpr int NT = KD / 8, NKT = KD / 16;
    const int t = lane & 3;
    uint32_t sa[NKT][4];
#pragma unroll
    for (int kt = 0; kt < NKT; kt++)
        acc_pair_to_a(s[2 * kt], s[2 * kt + 1], sa[kt]);
    float dacc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = oacc[nt][c] = 0.0f;
    reg_fence(&dacc[0][0], 32);
    reg_fence(&oacc[0][0], 32);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) wgmma_n64_kmaj(&dacc[0][0], sa[kt], wg_desc_kmaj(sW + (kt >> 2) * 8192 + (kt & 3) * 32));
    wg_commit();
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) wgmma_n64_kmaj(&oacc[0][0], sa[kt], wg_desc_kmaj(sQG + (kt >> 2) * 8192 + (kt & 3) * 32));
    wg_commit();
    WG_WAIT(1);
    reg_fence(&dacc[0][0], 32);

    uint32_t da[4][4];
    delta_fragments(dacc, da, sU, ucol, lane);
    decay_state<KD>(s, gam, t);
    reg_fence(&s[0][0], NT * 4);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < 4; kt++) wgmma_n64_kmaj(&oacc[0][0], da[kt], wg_desc_kmaj(sAqk + kt * 32));
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
        if (KD == 128) wgmma_n128_mnmaj(&s[0][0], da[kt], wg_desc_mnmaj(sKT + kt * 2048));
        else wgmma_n64_mnmaj(&s[0][0], da[kt], wg_desc_mnmaj(sKT + kt * 2048));
    }
    wg_commit();
    WG_WAIT(0);
    reg_fence(&oacc[0][0], 32);
    reg_fence(&s[0][0], NT * 4);
#else
    (void)s, (void)oacc, (void)sW, (void)sQG, (void)sKT, (void)sAqk, (void)sU, (void)gam, (void)ucol, (void)lane;
    __trap(); /* the host launches this path on sm_90 only */
#endif
}

template <int KD, int WG>
__global__ void __launch_bounds__(REC_MAX_THREADS, 1) kda_recurrence_kernel(const kda_cuda_params_t p) {
    constexpr int NT = KD / 8; /* n-tiles of Sᵀ over K */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u); /* stages 1 KB-aligned */

    const int bv = p.bv, nvt = KD / bv;
    const int tid = threadIdx.x, nthreads = blockDim.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int vt = (int)(blockIdx.x % nvt);
    const int64_t rest = blockIdx.x / nvt;
    const int h = (int)(rest % p.hv);
    const int64_t n = rest / p.hv;
    const int v0 = vt * bv;           /* first state column of this CTA */
    const int vw = v0 + 16 * warp;    /* first state column of this warp */

    const int stage_bytes = REC_STAGE_BYTES(KD, bv);
    unsigned char *sO0 = smem + p.rec_stages * stage_bytes;
    const int ostride = REC_O_STRIDE(bv);
    const int oes = p.o_dtype == KDA_DT_F32 ? 4 : 2;

    int64_t bos, eos;
    seq_bounds(p, n, &bos, &eos);
    const int64_t nchunks = (eos - bos + 63) / 64, chunk0 = seq_chunk0(p, n);
    const int64_t slot = seq_slot(p, n);

    /* Sᵀ: s[nt][c] = S[d][v] with v = vw + g + 8 (c >> 1), d = 8 nt + 2 t + (c & 1) */
    float s[NT][4];
    const int64_t sd = p.v_first ? 1 : KD, sv = p.v_first ? KD : 1; /* strides of d and v in a state */
    const int64_t sbase = slot >= 0 ? (slot * p.hv + h) * (int64_t)KD * KD : 0;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[nt][c] = 0.0f;
    if (p.h0 && slot >= 0) { /* dtype branch outside the loops, so that the loads are all in flight at once */
        if (p.h0_dtype == KDA_DT_F32) {
            const float *h0 = (const float *)p.h0 + sbase;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) s[nt][c] = h0[(8 * nt + 2 * t + (c & 1)) * sd + (vw + g + 8 * (c >> 1)) * sv];
        } else {
            const uint16_t *h0 = (const uint16_t *)p.h0 + sbase;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    s[nt][c] = bf16_bits_to_f32(h0[(8 * nt + 2 * t + (c & 1)) * sd + (vw + g + 8 * (c >> 1)) * sv]);
        }
    }

    const unsigned char *blocks = (const unsigned char *)p.blocks;
    const int nst = p.rec_stages; /* chunks in flight: nst - 1 ahead of the one in use */
    const uint32_t bars = smem_u32(sO0 + 2 * 64 * ostride * oes);
    if (tid == 0) {
        for (int sidx = 0; sidx < nst; sidx++) mbar_init(bars + 8 * sidx, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0)
        for (int sidx = 0; sidx < nst - 1 && sidx < nchunks; sidx++)
            issue_chunk_copy<KD>(smem + sidx * stage_bytes, bars + 8 * sidx,
                                 blocks + ((chunk0 + sidx) * p.hv + h) * p.block_bytes, v0, bv);
    for (int64_t ci = 0; ci < nchunks; ci++) {
        const int64_t ahead = ci + nst - 1;
        const int nocopy = p.dev_skip & 1024; /* development: stale stages, to time the math alone */
        if (tid == 0 && ahead < nchunks && !nocopy)
            issue_chunk_copy<KD>(smem + (ahead % nst) * stage_bytes, bars + 8 * (ahead % nst),
                                 blocks + ((chunk0 + ahead) * p.hv + h) * p.block_bytes, v0, bv);
        if (!nocopy || ci < nst - 1) mbar_wait(bars + 8 * (ci % nst), (uint32_t)((ci / nst) & 1));
        /* O staging alternates: the buffer of chunk ci - 2 is free once every thread passed chunk ci - 1's
           closing barrier, which it must have to get here */
        unsigned char *sO = sO0 + (ci & 1) * 64 * ostride * oes;
        const unsigned char *st = smem + (ci % nst) * stage_bytes;
        const uint32_t sW = smem_u32(st), sQG = sW + 64 * KD * 2, sKT = sW + 2 * 64 * KD * 2,
                       sAqk = sW + 3 * 64 * KD * 2, sU = sW + REC_LINEAR(KD);
        const float *gam = (const float *)(st + 3 * 64 * KD * 2 + 64 * 64 * 2);

        float oacc[8][4];
        if (!(p.dev_skip & 2048)) { /* development: skip the math, to time the copies alone */
            if (WG) step_wgmma<KD>(s, oacc, sW, sQG, sKT, sAqk, sU, gam, (v0 & 63) + 16 * warp, lane);
            else step_mma<KD>(s, oacc, sW, sQG, sKT, sAqk, sU, gam, (v0 & 63) + 16 * warp, lane);
        } else {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) oacc[nt][c] = 0.0f;
        }
        /* Oᵀ → staging rows O[token][v] (the dtype branch outside the loops) */
#define REC_STAGE_O(T, CONV)                                                                                   \
    for (int nt = 0; nt < 8; nt++)                                                                           \
        for (int c = 0; c < 4; c++)                                                                          \
            ((T *)sO)[(8 * nt + 2 * t + (c & 1)) * ostride + 16 * warp + g + 8 * (c >> 1)] = CONV(oacc[nt][c]);
        if (p.o_dtype == KDA_DT_BF16) {
#pragma unroll
            REC_STAGE_O(__nv_bfloat16, __float2bfloat16_rn)
        } else if (p.o_dtype == KDA_DT_F16) {
#pragma unroll
            REC_STAGE_O(__half, __float2half_rn)
        } else {
#pragma unroll
            REC_STAGE_O(float, )
        }
#undef REC_STAGE_O
        __syncthreads(); /* the stage is free for the next copy; O staging is complete */

        /* O rows of this chunk → global */
        const int64_t tok0 = bos + ci * 64;
        const int clen = (int)min((int64_t)64, eos - tok0);
        const int row16 = bv * oes / 16;
        for (int e = tid; e < clen * row16; e += nthreads) {
            const int r = e / row16, c = e % row16;
            const uint4 val = *(const uint4 *)(sO + r * ostride * oes + c * 16);
            unsigned char *dst = (unsigned char *)p.o + (((tok0 + r) * p.hv + h) * (int64_t)KD + v0) * oes + c * 16;
            *(uint4 *)dst = val;
        }
    }

    if (p.ht && slot >= 0) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                store_elem(p.ht, p.ht_dtype, sbase + (8 * nt + 2 * t + (c & 1)) * sd + (vw + g + 8 * (c >> 1)) * sv,
                           s[nt][c]);
    }
}

/* Shared memory of a recurrence CTA for this problem (also fixes p->rec_stages: 3 if they fit). */
extern "C" int kda_cuda_recurrence_smem(kda_cuda_params_t *p) {
    const int oes = p->o_dtype == KDA_DT_F32 ? 4 : 2;
    p->rec_stages = REC_BYTES(p->kd, p->bv, 3, oes) <= REC_SMEM_MAX ? 3 : 2;
    return REC_BYTES(p->kd, p->bv, p->rec_stages, oes);
}

extern "C" int kda_cuda_launch_recurrence(const kda_cuda_params_t *p, void *stream) {
    const int64_t ctas = p->num_seqs * p->hv * (p->kd / p->bv);
    if (ctas == 0) return 0;
    const int threads = p->bv * 2;
    const int oes = p->o_dtype == KDA_DT_F32 ? 4 : 2;
    const int bytes = REC_BYTES(p->kd, p->bv, p->rec_stages, oes);
    const void *kernel;
    static int done[4][KDA_MAX_DEVICES]; /* per kernel below */
    int which;
    if (p->kd == 128) {
        which = p->rec_wgmma ? 0 : 1;
        kernel = p->rec_wgmma ? (const void *)kda_recurrence_kernel<128, 1> : (const void *)kda_recurrence_kernel<128, 0>;
    } else {
        which = p->rec_wgmma ? 2 : 3;
        kernel = p->rec_wgmma ? (const void *)kda_recurrence_kernel<64, 1> : (const void *)kda_recurrence_kernel<64, 0>;
    }
    cudaError_t err;
    if ((err = kda_smem_limit(kernel, bytes, p->device, done[which])) != cudaSuccess) return (int)err;
    void *args[] = {(void *)p};
    if ((err = cudaLaunchKernel(kernel, dim3((unsigned)ctas), dim3((unsigned)threads), args, (size_t)bytes,
                                (cudaStream_t)stream)) != cudaSuccess)
        return (int)err;
    return (int)cudaGetLastError();
}
