/*
 * Backward, stage 2: the reverse recurrence of the state gradient (docs/ALGORITHM.md §6), dS⁺ = ∂L/∂S at the
 * end of every chunk into the workspace — fp32 [KC][VC], or on the split path (bf16 inputs) fp16 in S's order with
 * a power-of-two factor per (lane, 16 columns) (states16.cuh: tf32's precision, half the bytes) — and
 * d_initial_state, from the fp32 sums. From the forward's chunk blocks (prep.cuh: W, QΓ, K̃, Aqk, γ in bf16; QΓ
 * and Aqk carry the scale s) and d_o, per (sequence, value head, tile of value columns):
 *
 *     dS ← d_final_state (zeros without it, or for a sequence without a slot)
 *     for each chunk, last first:  dstates[chunk] ← dS                       (dS⁺ of the chunk)
 *                                  dΔ = Aqkᵀ dO + K̃ dS                       (C × BV)
 *                                  dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ          (K × BV)
 *     d_initial_state ← dS
 *
 * dS never reads S: this stage does not depend on stage 1 and d_initial_state stays finite where the initial
 * state is not (§7). Two kernels:
 *
 * The recurrence kernel (bf16 d_o, V a multiple of 8: the training case). The forward's recurrence
 * (recurrence.cuh) transposed: each warp owns 16 value columns and holds dSᵀ (16 × KC, fp32) in accumulators for
 * the whole sequence, so every product has its left operand in registers:
 *
 *     dΔᵀ = dSᵀ K̃ᵀ + dOᵀ Aqk            dSᵀ ← dSᵀ Diag(γ) + dOᵀ QΓ − dΔᵀ W
 *
 * dSᵀ and dΔᵀ enter the bf16 products as hi + lo (x = hi + lo, both bf16: 16 bits of the fp32 mantissa, more
 * than tf32's 11); the panels and dO are bf16 already, exactly. dOᵀ's A fragments come straight from the staged
 * dO rows by ldmatrix.trans. The chunk's block (W, QΓ, K̃, Aqk, γ byte for byte) and its dO rows stream in by
 * copies into a 3-stage ring, two chunks ahead (the block by one bulk copy, the dO rows by every thread's cp.async,
 * all completing on the stage's mbarrier); dOᵀ Aqk and dOᵀ QΓ do not depend on dS and run beside the
 * chain. wgmma on sm_90a (a warpgroup per 64 columns: BV ≥ 64), else mma.sync m16n8k16 per warp. The tile width
 * BV ∈ {32, 64, 128} as the forward's recurrence picks it (enough CTAs to fill the card).
 *
 * Intra-card CP (docs/ALGORITHM.md §6, the last paragraph): the chain is affine, dS = B dS⁺ + F per chunk, so
 * a long sequence with few heads (B1 T32768 H16: 32 chains of 512 steps on 132 SMs) splits into pieces as the
 * forward's does, on the forward's plan (cp_plan.cu, in this stage's workspace) walked mirrored: KDA_DS_PRESCAN
 * computes per (piece, head, tile) columns of M (from the identity, no dO) or of E (from zero, or from
 * d_final_state for a sequence's last piece) into the piece's mirrored slot; cp_merge.cu gives every piece its
 * incoming dS; KDA_DS_PIECES runs every piece from it (or from d_final_state), writing dS⁺ of its chunks and, for
 * a first piece, d_initial_state. The recurrence kernel alone takes these modes, with the widest tile.
 *
 * The fallback kernel (d_o in fp16 or fp32, V not a multiple of 8, or d_o not 16-byte aligned). One CTA of 256
 * threads per (sequence, value head, tile of BV value columns) (BV = KDA_BWD_BV = 16, or 32 when the (sequence,
 * head) pairs alone give a CTA per SM), dS in shared memory [KC][16], fp32; the chunk's panels copied in each
 * step (the next chunk's block prefetched into L2 meanwhile); the products on the tensor cores in tf32 (bwd.cuh
 * mma16: the bf16 panels exactly; dO, dS and dΔ rounded to tf32; fp32 sums): dΔ as 4 · BV/8 tiles of 16 × 8,
 * BV/16 per warp; the dS update as KC/16 · BV/8 tiles, KC · BV/1024 per warp.
 * The recurrence kernel is the fast one: the fallback's every chunk step waits for its own copies.
 */
#ifndef KDA_CUDA_BWD_DSTATE_CUH
#define KDA_CUDA_BWD_DSTATE_CUH

#include "bwd.cuh"
#include "cp_slot.cuh"
#include "seq.cuh"
#include "states16.cuh"

#define DS_THREADS 256

template <int KC, int BV>
struct dstate_smem {
    static constexpr int SS = BV + 4;
    unsigned char w[KDA_CHUNK * KC * 2];
    unsigned char qg[KDA_CHUNK * KC * 2];
    unsigned char kt[KDA_CHUNK * KC * 2];
    unsigned char qglo[KDA_CHUNK * KC * 2]; /* fine blocks: QΓ's low part (kda_cuda.h) */
    unsigned char aqk[KDA_PANEL_BYTES];
    float dS[KC * SS];
    float dO[KDA_CHUNK * SS];
    float dD[KDA_CHUNK * SS];
    float gamma[KC];
};

/* A hint that this CTA reads chunk block `blk`'s W, QΓ, K̃ and Aqk panels next: into L2 */
DEV void prefetch_block_l2(const unsigned char *blk, int KC, int tid) {
    const int64_t panels = (int64_t)KDA_CHUNK * KC * 2;
    const int64_t offs[4] = {0, kda_cuda_off_qg(KC), kda_cuda_off_kt(KC), kda_cuda_off_aqk(KC)};
    for (int r = 0; r < 4; r++) {
        const int64_t bytes = r < 3 ? panels : KDA_PANEL_BYTES;
        for (int64_t o = (int64_t)tid * 128; o < bytes; o += (int64_t)DS_THREADS * 128) l2_prefetch(blk + offs[r] + o);
    }
}

/* A tf32 A fragment (bwd.cuh mma16's frag_t a[4]) of a 16 × 16 block of a bf16 panel tile by one ldmatrix: rows
 * r0.., columns c0.. of the tile (ROWS: the fragment's rows are the tile's rows) or of its transpose (the
 * fragment's row i, column k is the tile's (k, i)); exact (bf16 ⊂ tf32). One LDSM.x4 instead of 8 two-byte
 * loads with their swizzle arithmetic each. */
template <int ROWS>
DEV void panel_frag(frag_t a[4], const unsigned char *tile, int r0, int c0, int lane) {
    uint32_t w[4];
    if (ROWS) ldsm_x4(w, smem_u32(tile + pan_off(r0 + (lane & 15), c0 + 8 * (lane >> 4))));
    else ldsm_x4_t(w, smem_u32(tile + pan_off(c0 + (lane & 7) + 8 * (lane >> 4), r0 + 8 * ((lane >> 3) & 1))));
#pragma unroll
    for (int r = 0; r < 4; r++) a[r] = unpack_bf16(w[r]);
}

template <int KC, int BV> /* (K class 256: one CTA per SM by shared memory, 138-163 KB, so no cap of 128 registers) */
__global__ void __launch_bounds__(DS_THREADS, KC > 128 ? 1 : 2) kda_bwd_dstate_kernel(const kda_bwd_params_t p) {
    constexpr int SS = BV + 4, NTL = BV / 8; /* 8-column tiles */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dstate_smem<KC, BV> &sm = *(dstate_smem<KC, BV> *)smem_raw;
    const int tid = threadIdx.x;
    const int tiles = p.pb.vc / BV;
    const int tile = (int)(blockIdx.x % tiles), h = (int)(blockIdx.x / tiles % p.pb.hv);
    const int64_t n = blockIdx.x / tiles / p.pb.hv;
    const int c0 = tile * BV;
    int64_t bos, eos;
    seq_bounds(p.pb.seqs, n, &bos, &eos);
    const int64_t nc = (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK, chunk0 = nc > 0 ? seq_chunk0(p.pb.seqs, n) : 0;
    const int64_t slot = seq_slot(p.pb.state_indices, NULL, p.pb.num_state_slots, n);

    for (int e = tid; e < KC * BV; e += DS_THREADS) {
        const int d = e / BV, c = e % BV;
        sm.dS[d * SS + c] = dstate_end(p, n, slot, h, d, c0 + c);
    }
    __syncthreads();

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    static_assert((BV == 16 || BV == 32) && DS_THREADS == 256 && KDA_CHUNK == 64, "dstate: 8 warps, C = 64");
    for (int64_t ci = nc - 1; ci >= 0; ci--) {
        const int64_t cid = chunk0 + ci, t0 = bos + ci * KDA_CHUNK;
        const int clen = (int)min((int64_t)KDA_CHUNK, eos - t0);
        const unsigned char *blk = (const unsigned char *)p.blocks.base + (cid * p.pb.hv + h) * p.blocks.block_bytes;
        if (p.dstates_f16) { /* the split path: fp16 pieces in S's order and the factors' exponents (states16.cuh);
                                the tile's BV / 16 column blocks are contiguous. Four adjacent threads per (block vb,
                                lane l): each forms the pieces np ≡ its part (mod 4) after their largest magnitude */
            const int64_t pair = cid * p.pb.hv + h;
            uint4 *out = (uint4 *)(p.dstates_f16 + pair * KC * p.pb.vc + (int64_t)c0 * KC);
            static_assert(BV / 16 * 32 * 4 <= DS_THREADS && KC / 16 % 4 == 0, "dstate: four threads per lane's pieces");
            if (tid < BV / 16 * 32 * 4) {
                const int unit = tid >> 2, part = tid & 3, vb = unit >> 5, l = unit & 31, gl = l >> 2, tl = l & 3;
                constexpr int NPP = KC / 16 / 4; /* pieces per thread */
                float x[NPP][8], m = 0.0f;
#pragma unroll
                for (int i = 0; i < NPP; i++)
#pragma unroll
                    for (int e = 0; e < 8; e++) { /* element e of piece np: dS⁺[8 (2 np + e / 4) + 2 tl + e mod 2]
                                                      [16 vb + gl + 8 (e / 2 mod 2)] */
                        const int np = part + 4 * i, d = 8 * (2 * np + (e >> 2)) + 2 * tl + (e & 1);
                        x[i][e] = sm.dS[d * SS + 16 * vb + gl + 8 * ((e >> 1) & 1)];
                        m = fmaxf(m, fabsf(x[i][e]));
                    }
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                float inv;
                const uint32_t eb = f16s_exponent(m, &inv);
#pragma unroll
                for (int i = 0; i < NPP; i++)
                    out[(vb * (KC / 16) + part + 4 * i) * 32 + l] = make_uint4(
                        pack_16x2<1>(x[i][0] * inv, x[i][1] * inv), pack_16x2<1>(x[i][2] * inv, x[i][3] * inv),
                        pack_16x2<1>(x[i][4] * inv, x[i][5] * inv), pack_16x2<1>(x[i][6] * inv, x[i][7] * inv));
                if (part == 0) p.dstates_exp[pair * (p.pb.vc / 16) * 32 + (c0 / 16 + vb) * 32 + l] = (uint8_t)eb;
            }
        } else {
            float *out = p.dstates + (cid * p.pb.hv + h) * (int64_t)KC * p.pb.vc + c0;
            for (int e = tid; e < KC * BV; e += DS_THREADS)
                out[(e / BV) * (int64_t)p.pb.vc + e % BV] = sm.dS[(e / BV) * SS + e % BV];
        }
        /* the panels by 16-byte asynchronous copies (no registers; waited for before the barrier) */
        for (int e = tid; e < KDA_CHUNK * KC * 2 / 16; e += DS_THREADS) {
            cp_async16_zfill(smem_u32(sm.w + 16 * e), blk + 16 * e, 16);
            cp_async16_zfill(smem_u32(sm.qg + 16 * e), blk + kda_cuda_off_qg(KC) + 16 * e, 16);
            cp_async16_zfill(smem_u32(sm.kt + 16 * e), blk + kda_cuda_off_kt(KC) + 16 * e, 16);
            if (p.blocks.fine & KDA_FINE_QG)
                cp_async16_zfill(smem_u32(sm.qglo + 16 * e), blk + kda_cuda_off_qglo(KC, p.pb.vc) + 16 * e, 16);
        }
        for (int e = tid; e < KDA_PANEL_BYTES / 16; e += DS_THREADS)
            cp_async16_zfill(smem_u32(sm.aqk + 16 * e), blk + kda_cuda_off_aqk(KC) + 16 * e, 16);
        cp_async_commit();
        for (int d = tid; d < KC; d += DS_THREADS) sm.gamma[d] = ((const float *)(blk + kda_cuda_off_gamma(KC)))[d];
        { /* dO: 4 loads issued before any conversion (a round trip per 4 elements, not per element) */
            constexpr int N = KDA_CHUNK * BV / DS_THREADS;
#pragma unroll 1
            for (int j0 = 0; j0 < N; j0 += 4) {
                uint32_t ob[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int e = tid + DS_THREADS * (j0 + j), i = e / BV, c = e % BV;
                    ob[j] = i < clen && c0 + c < p.pb.V
                                ? load_bits(p.d_o, p.do_dtype, ((t0 + i) * p.pb.hv + h) * (int64_t)p.pb.V + c0 + c)
                                : 0u;
                }
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int e = tid + DS_THREADS * (j0 + j);
                    sm.dO[(e / BV) * SS + e % BV] = bits_value(ob[j], p.do_dtype);
                }
            }
        }
        if (ci > 0) /* the next (earlier) chunk's block into L2 while this one is computed */
            prefetch_block_l2(blk - (int64_t)p.pb.hv * p.blocks.block_bytes, KC, tid);
        cp_async_wait_all();
        __syncthreads();
        /* dΔ = Aqkᵀ dO + K̃ dS: warp w computes rows 16 I.. (I = w mod 4) of the column tiles w / 4 + 2u, u <
           BV/16, on the tensor cores (tf32: the bf16 panels exactly, dO and dS rounded); the row block's A fragments
           once for its tiles */
        {
            constexpr int TW = BV / 16; /* tiles per warp */
            const int I = warp & 3;
            float acc[TW][4];
#pragma unroll
            for (int u = 0; u < TW; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.0f;
#pragma unroll 1
            for (int m0 = 16 * I; m0 < KDA_CHUNK; m0 += 16) { /* Aqk lower: rows m ≥ i */
                frag_t a[4];                                  /* A(i, m) = Aqk[m][i] */
                panel_frag<0>(a, sm.aqk, 16 * I, m0, lane);
                const int k = m0 + 2 * t;
#pragma unroll
                for (int u = 0; u < TW; u++) {
                    const int n = 8 * ((warp >> 2) + 2 * u) + g;
                    mma16(acc[u], a, tf2(sm.dO[k * SS + n], sm.dO[(k + 1) * SS + n]),
                          tf2(sm.dO[(k + 8) * SS + n], sm.dO[(k + 9) * SS + n]));
                }
            }
#pragma unroll 2
            for (int d0 = 0; d0 < KC; d0 += 16) {
                frag_t a[4];
                panel_frag<1>(a, sm.kt, 16 * I, d0, lane);
                const int k = d0 + 2 * t;
#pragma unroll
                for (int u = 0; u < TW; u++) {
                    const int n = 8 * ((warp >> 2) + 2 * u) + g;
                    mma16(acc[u], a, tf2(sm.dS[k * SS + n], sm.dS[(k + 1) * SS + n]),
                          tf2(sm.dS[(k + 8) * SS + n], sm.dS[(k + 9) * SS + n]));
                }
            }
#pragma unroll
            for (int u = 0; u < TW; u++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    sm.dD[(16 * I + g + 8 * (c >> 1)) * SS + 8 * ((warp >> 2) + 2 * u) + 2 * t + (c & 1)] = acc[u][c];
        }
        __syncthreads();
        /* dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ: KC/16 row blocks × NTL column tiles, KC · BV/1024 per warp (each
           element read and written by its owner only) */
#pragma unroll
        for (int u = 0; u < KC * BV / 1024; u++) {
            const int tile = warp * (KC * BV / 1024) + u, rb = tile / NTL, nt = tile % NTL, n = 8 * nt + g;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
            for (int i0 = 0; i0 < KDA_CHUNK; i0 += 16) {
                frag_t aq[4], aw[4]; /* A(d, i) = QΓ[i][d], W[i][d] */
                panel_frag<0>(aq, sm.qg, 16 * rb, i0, lane);
                panel_frag<0>(aw, sm.w, 16 * rb, i0, lane);
                const int k = i0 + 2 * t;
                mma16(acc, aq, tf2(sm.dO[k * SS + n], sm.dO[(k + 1) * SS + n]),
                      tf2(sm.dO[(k + 8) * SS + n], sm.dO[(k + 9) * SS + n]));
                mma16(acc, aw, tf2(-sm.dD[k * SS + n], -sm.dD[(k + 1) * SS + n]),
                      tf2(-sm.dD[(k + 8) * SS + n], -sm.dD[(k + 9) * SS + n]));
                if (p.blocks.fine & KDA_FINE_QG) { /* + QΓ_loᵀ dO: QΓ to ~16 bits (fp16, fp32 inputs) */
                    panel_frag<0>(aq, sm.qglo, 16 * rb, i0, lane);
                    mma16(acc, aq, tf2(sm.dO[k * SS + n], sm.dO[(k + 1) * SS + n]),
                          tf2(sm.dO[(k + 8) * SS + n], sm.dO[(k + 9) * SS + n]));
                }
            }
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int d = 16 * rb + g + 8 * (c >> 1), col = 8 * nt + 2 * t + (c & 1);
                sm.dS[d * SS + col] = sm.gamma[d] * sm.dS[d * SS + col] + acc[c];
            }
        }
        __syncthreads();
    }
    if (p.dh0 && slot >= 0)
        for (int e = tid; e < KC * BV; e += DS_THREADS) {
            const int d = e / BV, c = e % BV;
            if (d < p.pb.K && c0 + c < p.pb.V)
                store_elem(p.dh0, p.dh0_dtype, state_elem(p, slot, h, d, c0 + c),
                           p.dh0_zero_first && n == 0 ? 0.0f : sm.dS[d * SS + c]);
        }
}

/* ---------------------------------------------------------------------------------------------------------
 * The recurrence kernel
 * ------------------------------------------------------------------------------------------------------- */
#define DSR_NST(KC) ((KC) > 128 ? 2 : 3) /* ring stages: two chunks ahead (K class 256: one, for shared memory) */
#define DSR_LIN(KC) (3 * KDA_CHUNK * 2 * (KC) + KDA_CHUNK * KDA_CHUNK * 2 + 4 * (KC)) /* W, QΓ, K̃, Aqk, γ */
#define DSR_ROWB(BV) (2 * (BV) + 16) /* a staged dO row: padded, so that ldmatrix.trans's 8 rows hit 8 bank groups */
#define DSR_STAGE(KC, BV) ((DSR_LIN(KC) + KDA_CHUNK * DSR_ROWB(BV) + 1023) / 1024 * 1024) /* panels 1 KB-aligned */
#define DSR_BYTES(KC, BV) (1024 + DSR_NST(KC) * DSR_STAGE(KC, BV) + 8 * DSR_NST(KC))      /* K 256, BV 32: 226,320 */

/* x = hi + lo for a pair of fp32 values, both parts bf16 (hi: x rounded; lo: the remainder rounded) */
DEV void split_bf16(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    hi = pack_bf16(x0, x1);
    const float2 r = unpack_bf16(hi);
    lo = pack_bf16(x0 - r.x, x1 - r.y);
}
/* Two accumulator tiles side by side (columns 16k..16k+15) as hi and lo A fragments, times `sign` */
DEV void acc_pair_split(const float c0[4], const float c1[4], float sign, uint32_t hi[4], uint32_t lo[4]) {
    split_bf16(sign * c0[0], sign * c0[1], hi[0], lo[0]);
    split_bf16(sign * c0[2], sign * c0[3], hi[1], lo[1]);
    split_bf16(sign * c1[0], sign * c1[1], hi[2], lo[2]);
    split_bf16(sign * c1[2], sign * c1[3], hi[3], lo[3]);
}

/* Two 8-column accumulator tiles += A B with A = hi (+ lo when with_lo), b: the tiles' B fragments (ldmatrix x4) */
DEV void mma_hilo(float c0[4], float c1[4], const uint32_t hi[4], const uint32_t lo[4], const uint32_t b[4],
                  int with_lo) {
    mma_bf16(c0, hi, b[0], b[1]);
    mma_bf16(c1, hi, b[2], b[3]);
    if (with_lo) {
        mma_bf16(c0, lo, b[0], b[1]);
        mma_bf16(c1, lo, b[2], b[3]);
    }
}

/* The stage's tiles (shared addresses) */
typedef struct {
    uint32_t W, QG, KT, Aqk;
    const float *gam;
} dsr_stage_t;

/* One chunk step by mma.sync, per warp (16 columns): dacc = dΔᵀ (16 columns × 64 tokens), then dSᵀ updated */
template <int KC>
DEV void dsr_step_mma(float (&s)[KC / 8][4], const uint32_t (&da_o)[4][4], const dsr_stage_t &st, int lane, int lo_s,
                      int lo_d) {
    float dacc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = 0.0f;
            /* dΔᵀ = dSᵀ K̃ᵀ: B(d, i) = K̃[i][d], K̃'s rows by ldmatrix (as the forward's W) */
#pragma unroll
    for (int kt = 0; kt < KC / 16; kt++) {
        uint32_t hi[4], lo[4];
        acc_pair_split(s[2 * kt], s[2 * kt + 1], 1.0f, hi, lo);
#pragma unroll
        for (int np = 0; np < 4; np++) {
            const int row = np * 16 + (lane & 7) + (lane >> 4) * 8, col = kt * 16 + ((lane >> 3) & 1) * 8;
            uint32_t b[4];
            ldsm_x4(b, st.KT + pan_off(row, col));
            mma_hilo(dacc[2 * np], dacc[2 * np + 1], hi, lo, b, lo_s);
        }
    }
    /* + dOᵀ Aqk: B(j, i) = Aqk[j][i], nonzero for j ≥ i (token tiles kt ≥ np) */
#pragma unroll
    for (int kt = 0; kt < 4; kt++)
#pragma unroll
        for (int np = 0; np <= kt; np++) {
            const int row = kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = np * 16 + (lane >> 4) * 8;
            uint32_t b[4];
            ldsm_x4_t(b, st.Aqk + pan_off(row, col));
            mma_bf16(dacc[2 * np], da_o[kt], b[0], b[1]);
            mma_bf16(dacc[2 * np + 1], da_o[kt], b[2], b[3]);
        }
    /* dSᵀ ← dSᵀ Diag(γ) + dOᵀ QΓ − dΔᵀ W: B(i, d) = QΓ[i][d], W[i][d] by ldmatrix.trans (as the forward's K̃) */
    decay_state<KC>(s, st.gam, lane & 3);
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
        uint32_t hi[4], lo[4];
        acc_pair_split(dacc[2 * kt], dacc[2 * kt + 1], -1.0f, hi, lo);
#pragma unroll
        for (int pp = 0; pp < KC / 16; pp++) {
            const int row = kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = pp * 16 + (lane >> 4) * 8;
            uint32_t b[4];
            ldsm_x4_t(b, st.QG + pan_off(row, col));
            mma_bf16(s[2 * pp], da_o[kt], b[0], b[1]);
            mma_bf16(s[2 * pp + 1], da_o[kt], b[2], b[3]);
            ldsm_x4_t(b, st.W + pan_off(row, col));
            mma_hilo(s[2 * pp], s[2 * pp + 1], hi, lo, b, lo_d);
        }
    }
}

/* The same step by the warpgroup (its 4 warps call it; a warp's rows are the warpgroup's rows 16 (warp % 4)..), in
 * two halves so that the caller can issue copies while the products run. The first issues dSᵀ K̃ᵀ + dOᵀ Aqk as
 * one commit group and dOᵀ QΓ into the decayed dSᵀ as a second one; the second half waits for the first group,
 * splits dΔᵀ and adds − dΔᵀ W behind dOᵀ QΓ. hi, lo (dSᵀ's parts) must live until the second half. K class 64 or
 * 128. */
template <int KC>
DEV void dsr_wgmma_first(float (&s)[KC / 8][4], float (&dacc)[8][4], uint32_t (&hi)[KC / 16][4],
                         uint32_t (&lo)[KC / 16][4], const uint32_t (&da_o)[4][4], const dsr_stage_t &st, int lane,
                         int lo_s) {
#ifdef KDA_WGMMA
    constexpr int NT = KC / 8, NKT = KC / 16;
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) acc_pair_split(s[2 * kt], s[2 * kt + 1], 1.0f, hi[kt], lo[kt]);
    decay_state<KC>(s, st.gam, lane & 3);
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = 0.0f;
    reg_fence(&dacc[0][0], 32);
    reg_fence(&s[0][0], NT * 4);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) {
        const uint64_t d = wg_desc_kmaj(st.KT + (kt >> 2) * 8192 + (kt & 3) * 32);
        wgmma_n64_kmaj(&dacc[0][0], hi[kt], d);
        if (lo_s) wgmma_n64_kmaj(&dacc[0][0], lo[kt], d);
    }
#pragma unroll
    for (int kt = 0; kt < 4; kt++) wgmma_n64_mnmaj(&dacc[0][0], da_o[kt], wg_desc_mnmaj(st.Aqk + kt * 2048));
    wg_commit();
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
        if (KC == 128) wgmma_n128_mnmaj(&s[0][0], da_o[kt], wg_desc_mnmaj(st.QG + kt * 2048));
        else wgmma_n64_mnmaj(&s[0][0], da_o[kt], wg_desc_mnmaj(st.QG + kt * 2048));
    }
    wg_commit();
#else
    (void)s, (void)dacc, (void)hi, (void)lo, (void)da_o, (void)st, (void)lane, (void)lo_s;
    __trap(); /* the host launches this path on sm_90a only */
#endif
}

template <int KC>
DEV void dsr_wgmma_second(float (&s)[KC / 8][4], float (&dacc)[8][4], const dsr_stage_t &st, int lo_d) {
#ifdef KDA_WGMMA
    constexpr int NT = KC / 8;
    WG_WAIT(1);
    reg_fence(&dacc[0][0], 32);
    uint32_t dh[4][4], dl[4][4];
#pragma unroll
    for (int kt = 0; kt < 4; kt++) acc_pair_split(dacc[2 * kt], dacc[2 * kt + 1], -1.0f, dh[kt], dl[kt]);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
        const uint64_t d = wg_desc_mnmaj(st.W + kt * 2048);
        if (KC == 128) {
            wgmma_n128_mnmaj(&s[0][0], dh[kt], d);
            if (lo_d) wgmma_n128_mnmaj(&s[0][0], dl[kt], d);
        } else {
            wgmma_n64_mnmaj(&s[0][0], dh[kt], d);
            if (lo_d) wgmma_n64_mnmaj(&s[0][0], dl[kt], d);
        }
    }
    wg_commit();
    WG_WAIT(0);
    reg_fence(&s[0][0], NT * 4);
#else
    (void)s, (void)dacc, (void)st, (void)lo_d;
    __trap();
#endif
}

/* Chunk `cid`'s copies into a stage, by every thread of the CTA: thread 0 arms the stage's barrier with the bytes
 * of the block's [W | QΓ | K̃ | Aqk | γ] and copies them byte for byte (one bulk copy); the chunk's dO rows of this
 * tile go by 16-byte asynchronous copies, each thread's completing on the barrier (an arrival of each thread:
 * the barrier counts 1 + the CTA's threads). Rows past the chunk's end and columns past V are not copied: they
 * stay zero. (One bulk copy per dO row, by warp 0, was slower: a bulk copy's operands are uniform registers, so
 * the warp issued its 32 lanes' copies one after the other while the other warps waited at the step's first
 * product.) */
DEV void dsr_issue(const kda_bwd_params_t &p, unsigned char *stg, uint32_t bar, int64_t cid, int h, int64_t t0,
                   int clen, int v0, int bv, int lin, int rowb, int tid, int nth) {
    if (tid == 0) {
        const unsigned char *blk = (const unsigned char *)p.blocks.base + (cid * p.pb.hv + h) * p.blocks.block_bytes;
        fence_proxy_async(); /* the stage was last read through the generic proxy */
        mbar_expect_tx(bar, (uint32_t)lin);
        bulk_g2s(smem_u32(stg), blk, (uint32_t)lin, bar);
    }
    const int pieces = p.pb.V > v0 ? (int)min((int64_t)bv, (int64_t)(p.pb.V - v0)) / 8 : 0; /* 16-byte pieces per row */
    const unsigned char *src = (const unsigned char *)p.d_o + ((t0 * p.pb.hv + h) * (int64_t)p.pb.V + v0) * 2;
    const int64_t stride = (int64_t)p.pb.hv * p.pb.V * 2;
    for (int e = tid; e < clen * pieces; e += nth) {
        const int r = e / pieces, c = e % pieces;
        cp_async16_zfill(smem_u32(stg + lin + r * rowb + 16 * c), src + r * stride + 16 * c, 16);
    }
    cp_async_mbar_arrive(bar);
}

/* The CTA's work: a whole sequence (KDA_DS_SEQ), or a piece of the CP table (KDA_DS_PRESCAN, KDA_DS_PIECES). The
 * table is the forward's (pieces in chunk order); this chain runs last chunk first, so the merge (cp_merge.cu,
 * S_in(j + 1) = M_j S_in(j) + E_j over its slots in order) gets the pieces of a sequence mirrored: the piece of
 * index i of np takes the sequence's slot np − 1 − i, and the last piece's real output from d_final_state is the
 * merge's E_0. */
typedef struct {
    int64_t n, bos, eos, nc, chunk0; /* the sequence, the piece's tokens and chunks */
    int h, vt;                       /* value head, column tile (of M's columns when mcols) */
    float *slot_base;                /* the piece's CP slot for this head, or NULL */
    int mcols;                       /* pre-scan: M's columns (from the identity, no dO) */
    int from_dht;                    /* start from d_final_state (else zero, the identity or the merged dS) */
    int load_sin;                    /* start from the merged incoming dS in the slot */
    int write_dh0;                   /* write d_initial_state at the end */
} dsr_work_t;

/* This CTA's work, or 0 when it has none */
template <int KC, int BV, int MODE>
DEV int dsr_work(const kda_bwd_params_t &p, dsr_work_t *w) {
    memset(w, 0, sizeof *w);
    if (MODE == KDA_DS_SEQ) {
        const int tiles = p.pb.vc / BV;
        w->vt = (int)(blockIdx.x % tiles);
        w->h = (int)(blockIdx.x / tiles % p.pb.hv);
        w->n = blockIdx.x / tiles / p.pb.hv;
        seq_bounds(p.pb.seqs, w->n, &w->bos, &w->eos);
        w->nc = (w->eos - w->bos + KDA_CHUNK - 1) / KDA_CHUNK;
        w->chunk0 = w->nc > 0 ? seq_chunk0(p.pb.seqs, w->n) : 0;
        w->from_dht = w->write_dh0 = 1;
        return 1;
    }
    const int mt = MODE == KDA_DS_PRESCAN ? KC / BV : 0, ntiles = mt + p.pb.vc / BV;
    const int tile = (int)(blockIdx.x % ntiles);
    const int64_t rest = blockIdx.x / ntiles;
    w->h = (int)(rest % p.pb.hv);
    const int64_t piece = rest / p.pb.hv; /* the pre-scan's grid covers the slots: entry = slot (cp_plan.h) */
    if (piece >= p.cp_header[MODE == KDA_DS_PRESCAN ? 2 : 0]) return 0;
    const kda_cp_piece_t *e = &p.cp_table[piece];
    const int64_t flags = e->flags;
    w->n = e->seq;
    w->bos = e->bos;
    w->eos = e->eos;
    w->nc = e->num_chunks;
    w->chunk0 = e->chunk0;
    if (e->slot >= 0) { /* the mirrored slot: the sequence's first slot + (np − 1 − index) */
        const int64_t ms = e->slot - e->index + (e->seq_pieces - 1 - e->index);
        w->slot_base = p.cp_slots + (ms * p.pb.hv + w->h) * kda_cuda_cp_slot_floats(KC, p.pb.vc);
    }
    if (MODE == KDA_DS_PRESCAN) { /* split pieces after their sequence's first; a last piece has no M, nor any
                                     piece where the plan took the forward's maps (cp_header[3]: cp_merge.cu) */
        if (e->slot < 0 || (flags & KDA_CP_FIRST) || (tile < mt && ((flags & KDA_CP_LAST) || p.cp_header[3]))) return 0;
        w->mcols = tile < mt;
        w->vt = w->mcols ? tile : tile - mt;
        w->from_dht = !w->mcols && (flags & KDA_CP_LAST);
        return 1;
    }
    w->vt = tile;
    w->load_sin = e->slot >= 0 && !(flags & KDA_CP_LAST);
    w->from_dht = !w->load_sin;
    w->write_dh0 = (flags & KDA_CP_FIRST) != 0;
    return 1;
}

/* LO: bit 0 dSᵀ's lo parts, bit 1 dΔᵀ's (3 in the library; development builds time and measure the others).
 * MODE: KDA_DS_SEQ, KDA_DS_PRESCAN or KDA_DS_PIECES (bwd.h). */
template <int KC, int BV, int WG, int LO, int MODE>
__global__ void __launch_bounds__(2 * BV, 1) kda_bwd_dstate_rec_kernel(const kda_bwd_params_t p) {
    constexpr int NT = KC / 8, NTH = 2 * BV, LIN = DSR_LIN(KC), ROWB = DSR_ROWB(BV), STAGE = DSR_STAGE(KC, BV);
    static_assert(KDA_CHUNK == 64 && (BV == 32 || BV == 64 || BV == 128) && (!WG || BV >= 64) &&
                      (KC <= 128 || (KC == 256 && BV == 32 && !WG && MODE == KDA_DS_SEQ)),
                  "dstate recurrence: C = 64, a warp per 16 columns, wgmma per 64; K 256: mma.sync at BV 32");
    constexpr int NST = DSR_NST(KC);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u); /* stages 1 KB-aligned */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    dsr_work_t wk;
    if (!dsr_work<KC, BV, MODE>(p, &wk)) return;
    const int h = wk.h;
    const int v0 = wk.vt * BV, vw = v0 + 16 * warp; /* the CTA's and the warp's first column */
    const int64_t bos = wk.bos, eos = wk.eos, nc = wk.nc, chunk0 = wk.chunk0;
    const int64_t slot = seq_slot(p.pb.state_indices, NULL, p.pb.num_state_slots, wk.n);
    const uint32_t bars = smem_u32(smem + NST * STAGE);

    /* dO tiles zero once: a partial chunk (a sequence's last, the first one here) copies only its rows */
    for (int e = tid; e < NST * KDA_CHUNK * ROWB / 16; e += NTH) {
        const int st = e / (KDA_CHUNK * ROWB / 16), r = e % (KDA_CHUNK * ROWB / 16);
        *(uint4 *)(smem + st * STAGE + LIN + 16 * r) = make_uint4(0u, 0u, 0u, 0u);
    }
    if (tid == 0) {
        for (int i = 0; i < NST; i++) mbar_init(bars + 8 * i, 1 + NTH);
        mbar_init_fence();
    }
    /* dSᵀ: s[nt][c] = dS[d][v], v = vw + g + 8 (c >> 1), d = 8 nt + 2 t + (c & 1) */
    float s[NT][4];
    if (wk.mcols) {
        identity_cols<KC>(s, p.pb.K, vw, g, t);
    } else if (wk.load_sin) {
        load_slot<KC>(wk.slot_base + KC * KC + KC * p.pb.vc, s, p.pb.vc, 1, vw, g, t);
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int d = 8 * nt + 2 * t + (c & 1), v = vw + g + 8 * (c >> 1);
                s[nt][c] = wk.from_dht ? dstate_end(p, wk.n, slot, h, d, v) : 0.0f;
            }
    }
    __syncthreads();
    /* M's columns take no dO: its rows are not copied, so the staged dO stays zero */
#define DSR_ISSUE(j)                                                                                                   \
    do {                                                                                                               \
        const int64_t ci_ = nc - 1 - (j), t0_ = bos + ci_ * KDA_CHUNK;                                                 \
        dsr_issue(p, smem + ((j) % NST) * STAGE, bars + 8 * (uint32_t)((j) % NST), chunk0 + ci_, h, t0_,               \
                  wk.mcols ? 0 : (int)min((int64_t)KDA_CHUNK, eos - t0_), v0, BV, LIN, ROWB, tid, NTH);                \
    } while (0)
    for (int64_t j = 0; j < NST - 1 && j < nc; j++) DSR_ISSUE(j);

    for (int64_t j = 0; j < nc; j++) {
        const int64_t ci = nc - 1 - j;
        if (j + NST - 1 < nc) DSR_ISSUE(j + NST - 1); /* into the stage step j − 1 freed */
        const int cur = (int)(j % NST);
        mbar_wait(bars + 8 * cur, (uint32_t)((j / NST) & 1));
        const unsigned char *stg = smem + cur * STAGE;
        /* dS⁺ of this chunk (none in the pre-scan): on the split path fp16 in S's order (a 16-byte piece per lane
           and np) and the lane's factor (states16.cuh), else fp32 [KC][VC] */
        const int64_t dso = (chunk0 + ci) * p.pb.hv + h;
        if (MODE != KDA_DS_PRESCAN && p.dstates_f16) {
            store_dstates_f16s<KC>(p.dstates_f16 + dso * KC * p.pb.vc, p.dstates_exp + dso * (p.pb.vc / 16) * 32, s, vw,
                                   lane);
        } else if (MODE != KDA_DS_PRESCAN) {
            float *const dsout = p.dstates + dso * KC * p.pb.vc;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    dsout[(int64_t)(8 * nt + 2 * t + (c & 1)) * p.pb.vc + vw + g + 8 * (c >> 1)] = s[nt][c];
        }
        /* dOᵀ's A fragments (16 columns × 16 tokens each) straight from the staged rows */
        uint32_t da_o[4][4];
        const uint32_t sdo = smem_u32(stg + LIN);
#pragma unroll
        for (int kt = 0; kt < 4; kt++) {
            const int row = kt * 16 + (lane & 7) + (lane >> 4) * 8, col = 16 * warp + ((lane >> 3) & 1) * 8;
            ldsm_x4_t(da_o[kt], sdo + row * ROWB + col * 2);
        }
        dsr_stage_t st;
        st.W = smem_u32(stg);
        st.QG = st.W + KDA_CHUNK * KC * 2;
        st.KT = st.W + 2 * KDA_CHUNK * KC * 2;
        st.Aqk = st.W + 3 * KDA_CHUNK * KC * 2;
        st.gam = (const float *)(stg + 3 * KDA_CHUNK * KC * 2 + KDA_CHUNK * KDA_CHUNK * 2);
        if (WG) {
            float dacc[8][4];
            uint32_t hi[KC / 16][4], lo[KC / 16][4];
            dsr_wgmma_first<KC>(s, dacc, hi, lo, da_o, st, lane, LO & 1);
            dsr_wgmma_second<KC>(s, dacc, st, LO >> 1);
        } else {
            dsr_step_mma<KC>(s, da_o, st, lane, LO & 1, LO >> 1);
        }
        __syncthreads(); /* the stage is free for the copies two steps on */
    }
#undef DSR_ISSUE
    if (MODE == KDA_DS_PRESCAN) {
        if (wk.mcols) store_map<KC>(wk.slot_base, s, 1, vw, g, t);            /* Mᵀ[e][d] (swizzled) */
        else store_slot<KC>(wk.slot_base + KC * KC, s, p.pb.vc, 1, vw, g, t); /* E[d][v] */
    } else if (wk.write_dh0 && p.dh0 && slot >= 0) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int d = 8 * nt + 2 * t + (c & 1), v = vw + g + 8 * (c >> 1);
                if (d < p.pb.K && v < p.pb.V)
                    store_elem(p.dh0, p.dh0_dtype, state_elem(p, slot, h, d, v),
                               p.dh0_zero_first && wk.n == 0 ? 0.0f : s[nt][c]);
            }
    }
}

template <int KC, int BV>
static int launch_dstate(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->pb.seqs.num_seqs * p->pb.hv * (p->pb.vc / BV);
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    const int bytes = (int)sizeof(dstate_smem<KC, BV>);
    return kda_launch((const void *)kda_bwd_dstate_kernel<KC, BV>, ctas, DS_THREADS, bytes, p, device, done, stream);
}

template <int KC, int BV, int WG, int LO, int MODE>
static int launch_dstate_rec_lo(const kda_bwd_params_t *p, int64_t ctas, int device, void *stream) {
    static int done[KDA_MAX_DEVICES];
    return kda_launch((const void *)kda_bwd_dstate_rec_kernel<KC, BV, WG, LO, MODE>, ctas, 2 * BV, DSR_BYTES(KC, BV), p,
                      device, done, stream);
}

template <int KC, int BV, int WG>
static int launch_dstate_rec(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->pb.seqs.num_seqs * p->pb.hv * (p->pb.vc / BV);
    if (ctas == 0) return 0;
#ifdef KDA_DEV_BUILD
    /* development builds: dev_skip 4096 / 8192 leave out dSᵀ's / dΔᵀ's lo parts (their cost in time and accuracy) */
    if (KC == 128 && (BV == 32 || WG) && (p->dev_skip & (4096 | 8192))) {
        const int lo = 3 & ~((p->dev_skip >> 12) & 3);
        return lo == 0   ? launch_dstate_rec_lo<KC, BV, WG, 0, KDA_DS_SEQ>(p, ctas, device, stream)
               : lo == 1 ? launch_dstate_rec_lo<KC, BV, WG, 1, KDA_DS_SEQ>(p, ctas, device, stream)
                         : launch_dstate_rec_lo<KC, BV, WG, 2, KDA_DS_SEQ>(p, ctas, device, stream);
    }
#endif
    return launch_dstate_rec_lo<KC, BV, WG, 3, KDA_DS_SEQ>(p, ctas, device, stream);
}

/* The CP modes: a CTA per (table entry up to the capacity, value head, tile); the pre-scan's per (slot up to the
 * capacity, value head, tile), its tiles M's KC / BV then E's VC / BV */
template <int KC, int BV, int WG>
static int launch_dstate_cp(const kda_bwd_params_t *p, int device, void *stream) {
    const int prescan = p->ds_mode == KDA_DS_PRESCAN;
    const int64_t ctas = prescan ? p->cp_capacity_slots * p->pb.hv * (p->pb.vc / BV + KC / BV)
                                 : p->cp_capacity * p->pb.hv * (p->pb.vc / BV);
    if (ctas == 0) return 0;
    return prescan ? launch_dstate_rec_lo<KC, BV, WG, 3, KDA_DS_PRESCAN>(p, ctas, device, stream)
                   : launch_dstate_rec_lo<KC, BV, WG, 3, KDA_DS_PIECES>(p, ctas, device, stream);
}

/* ds_mode's launch of the recurrence kernel's row (KC, BV, WG): whole sequences, or the CP modes where the row
 * has them (CP) */
template <int KC, int BV, int WG, int CP>
static int launch_dstate_rec_row(const kda_bwd_params_t *p, int device, void *stream) {
    if (p->ds_mode == KDA_DS_SEQ) return launch_dstate_rec<KC, BV, WG>(p, device, stream);
    if constexpr (CP) return launch_dstate_cp<KC, BV, WG>(p, device, stream);
    return (int)cudaErrorInvalidValue;
}

/* One instance of each kernel (KDA_BWD_DSTATE_CONFIG, KDA_BWD_DSTATE_REC_CONFIG rows of configs.def; CMake generates
 * their translation units): the launchers kda_bwd_dstate_k<KC>_b<BV> (the fallback) and
 * kda_bwd_dstate_rec_k<KC>_b<BV>_w<WG>, found by bwd/configs.c's tables */
#define KDA_BWD_DSTATE_INSTANCE(KC, BV)                                                                                \
    extern "C" int kda_bwd_dstate_k##KC##_b##BV(const kda_bwd_params_t *p, int device, void *stream) {                 \
        return launch_dstate<KC, BV>(p, device, stream);                                                               \
    }
#define KDA_BWD_DSTATE_REC_INSTANCE(KC, BV, WG, CP)                                                                    \
    extern "C" int kda_bwd_dstate_rec_k##KC##_b##BV##_w##WG(const kda_bwd_params_t *p, int device, void *stream) {     \
        return launch_dstate_rec_row<KC, BV, WG, CP>(p, device, stream);                                               \
    }

#endif /* KDA_CUDA_BWD_DSTATE_CUH */
