/*
 * Backward, stage 3a: the chunk's products with its states (docs/ALGORITHM.md §6, "Chunked"), before the chunk
 * kernel (bwd_chunk.cuh), as plain tensor-core products of bf16 tiles in shared memory.
 *
 * One CTA of 256 threads per (chunk, value head), several per SM. From the forward's chunk blocks (W, U in bf16,
 * prep.cuh), S at the chunk's start (stage 1) and dS⁺ at its end (stage 2), in §3's notation:
 *
 *     Δ   = U − W S          (= T Z: the chunk's new values; C × V)
 *     dQΓ = dO Sᵀ            (C × K)
 *     dK̃  = Δ dS⁺ᵀ           (C × K; fp16 operands, 11 bits each, with power-of-two factors: Δ's per row,
 *                            dS⁺'s per row class; in bf16 its error, carried by the pairs kernel's reverse sum
 *                            through the chunk, put dA_log above FLA's)
 *     dγ  = rowsum(S ⊙ dS⁺)  (K; fp32 sums of the bf16 S and the fp16-exact dS⁺)
 *
 * Written: Δ (per (chunk, head, V part): the fp16 [C][VC] of dK̃'s operand and each row's exponent byte,
 * KDA_BWD_DELTA_BYTES, for the chunk kernel); dQΓ and dK̃ raw (fp32) into the dq̂, dk̂ scratch rows of the chunk's
 * tokens, which the pairs kernel reads and multiplies by the factors (s e^G, e^{G_last − G}); dγ per (chunk, head).
 * dΔ stays the chunk kernel's (from fp32 Aqk and K̃): read from the bf16 blocks it put dv's
 * and dβ's errors 5-13x above the fp32 path's (dev/bwd_emu, use_blocks = 2) and dβ's above FLA's. Here, and not in
 * the chunk kernel, because there these products read S and dS⁺ element by element from L2 as tf32 operands.
 *
 * Tiles (bf16, the 128-byte swizzled panels of common.cuh, so every ldmatrix is conflict-free): S [KC][VC] (bf16
 * as stage 1 or the forward wrote it, in kda_cuda_states_dv's order: the forward's products take S in bf16 too),
 * dS⁺ [KC][VC] (fp16 from stage 2's fp16 pieces, rescaled to one factor per row class: states16.cuh), W [C][KC]
 * and U [C][VC] copied from the block byte for byte (Δ in fp16 overwrites U in place), dO [C][VC]. 8 warps: warp
 * w owns rows 16 (w mod 4).. and the half w / 4 of the columns of each product, mma.sync m16n8k16 (bf16 operands,
 * f16 for dK̃; fp32 sums).
 *
 * Class 256: V in two halves (NVH = 2), a CTA per (chunk, value head, half) on 128 columns of U, S, dS⁺ and dO,
 * writing its half of Δ and its copy of dγ, dQΓ, dK̃ (the pairs kernel adds the halves); K 256 (16 row blocks of
 * S for 8 warps: two each; dQΓ, dK̃ in two passes of KC / 4 columns per warp, for registers). 197,632 bytes at
 * K 256, V 128: one CTA per SM.
 */
#ifndef KDA_CUDA_BWD_INTER_CUH
#define KDA_CUDA_BWD_INTER_CUH

#include "bwd.cuh"
#include "seq.cuh"
#include "states16.cuh"

#define BI_THREADS 256
#define C KDA_CHUNK

/* Byte offset of element (row, col) of a bf16 tile of `rows` rows in 64-column panels (pan_off's swizzle) */
DEV int tile_off(int rows, int row, int col) {
    return (col >> 6) * (rows * 128) + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2;
}

/* Piece (vb, np) of a bf16 state tile as a lane loaded it (states16.cuh) into a [KC][VC] tile, transposed by
 * stmatrix: lane l gives the address of row l mod 8 of matrix m = l / 8, tile row 8 (2 np + m / 2) + l mod 8,
 * columns 16 vb + 8 (m mod 2).. */
template <int KC>
DEV void piece_to_tile(unsigned char *tile, uint4 piece, int vb, int np, int lane) {
    const int m = lane >> 3, r = lane & 7;
    stsm_x4_t(smem_u32(tile + tile_off(KC, 8 * (2 * np + (m >> 1)) + r, 16 * vb + 8 * (m & 1))), piece.x, piece.y,
              piece.z, piece.w);
}

template <int KC, int VC>
struct inter_smem {
    unsigned char s[KC * VC * 2], ds[KC * VC * 2]; /* S, dS⁺ [KC][VC] */
    unsigned char w[C * KC * 2];                   /* W [C][KC] (the block's panels) */
    unsigned char u[C * VC * 2];                   /* U [C][VC], then Δ */
    unsigned char o[C * VC * 2];                   /* dO [C][VC] */
    float red[KC == 64 ? 2 : 1][KC];               /* KC = 64: dγ's sums of the two warps of an np */
};

/* A CTA's place: its (chunk, value head), V half and threads' roles */
struct inter_cta {
    int tid, lane, warp, I, hf, g, t; /* warp w: rows 16 I.. (I = w mod 4), column half hf = w / 4 of a product */
    int vh, v0, h, clen;              /* V half, its first column; value head; the chunk's tokens */
    int64_t t0, pair, hpart;          /* first token; (chunk, head); its V half's copy */
};

/* W and U by 16-byte copies (the panels as they are), in flight while the states are read */
template <int KC, int VC>
DEV void load_blocks(inter_smem<KC, VC> &sm, const unsigned char *blk, const inter_cta &c) {
    for (int e = c.tid; e < C * KC * 2 / 16; e += BI_THREADS)
        cp_async16_zfill(smem_u32(sm.w + 16 * e), blk + 16 * (int64_t)e, 16);
    for (int e = c.tid; e < C * VC * 2 / 16; e += BI_THREADS)
        cp_async16_zfill(smem_u32(sm.u + 16 * e), blk + kda_cuda_off_u(KC) + (int64_t)c.v0 * C * 2 + 16 * (int64_t)e,
                         16);
    cp_async_commit();
}

/* S (bf16) and dS⁺ (fp16 and the lane's factor) in kda_cuda_states_dv's order (states16.cuh) into their bf16
   tiles, dγ = rowsum(S ⊙ dS⁺), all loads in flight together and no CTA barrier: warp w takes the rows
   16 np.. of np = w mod NP (NP = KC / 16) and every VG-th 16-column block vb. Its lanes load the pieces
   (vb, np) of both — a lane's 16 bytes are four 8 × 8 matrices Xᵀ[16 vb + 8 h + ·][8 nt + ·]
   (m = 2 (nt − 2 np) + h) — and write them transposed into the tiles by stmatrix (piece_to_tile, dS⁺ rounded
   to bf16 first). dγ from the pieces themselves (a lane holds the same elements of both): fp32 products of
   bf16 S and fp16-exact dS⁺, per lane 4 rows (16 np + 2 t + {0, 1, 8, 9}) summed over its blocks, then over
   the lanes g, and with KC = 64 the VG = 2 warps of an np. Returns et, the exponent of dS⁺'s row class. */
template <int KC, int VC, int NVH>
DEV uint32_t load_states(const kda_bwd_params_t &p, inter_smem<KC, VC> &sm, const uint16_t *S, const uint16_t *dS,
                         const uint8_t *dSe, const inter_cta &c) {
    const int lane = c.lane, warp = c.warp;
    constexpr int NP = KC / 16, NW = BI_THREADS / 32, VG = NW / NP > 0 ? NW / NP : 1;
    constexpr int NV = VC / 16 / VG; /* blocks per warp */
    static_assert(VG >= 1 && VG <= 2 && NV >= 1 && (NP <= NW || NP % NW == 0), "inter: warps per np");
    constexpr int NPW = NP > NW ? NP / NW : 1; /* row blocks per warp (K 256: two) */
    /* dS⁺'s tile in fp16 for dK̃'s f16 product, at one factor per row class: a lane's rows 16 np + 2 t + {0, 1, 8,
       9} (every np) carry its exponent byte per 16-column block; the largest over the half's blocks and the lanes
       of a t, et, is the rows' common factor 2^(et − 127). Every value becomes fp16 after 2^(127 − et): exact
       where its piece's largest is within 2^28 of the class's (stage 2 put each piece's largest in [2^14, 2^15)) */
    uint32_t et = 0;
#pragma unroll
    for (int vb = 0; vb < VC / 16; vb++) et = max(et, (uint32_t)__ldg(dSe + vb * 32 + lane));
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) et = max(et, __shfl_xor_sync(0xffffffffu, et, o));
    const float to_f16 = __uint_as_float((254u - et) << 23); /* 2^(127 − et) */
#pragma unroll 1
    for (int u = 0; u < NPW; u++) {
        const int np = warp % NP + NW * u, vg = warp / NP;
        float dg4[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* rows 16 np + 2 t + {0, 1, 8, 9} */
        constexpr int GB = NV < 4 ? NV : 4;      /* blocks in flight (registers) */
#pragma unroll 1
        for (int j0 = 0; j0 < NV; j0 += GB) {
            uint4 sb[GB], db[GB];
            uint32_t eb[GB];
#pragma unroll
            for (int j = 0; j < GB; j++) {
                const int vb = vg + VG * (j0 + j);
                sb[j] = __ldg((const uint4 *)S + (vb * NP + np) * 32 + lane);
                db[j] = __ldg((const uint4 *)dS + (vb * NP + np) * 32 + lane);
                eb[j] = __ldg(dSe + vb * 32 + lane);
            }
#pragma unroll
            for (int j = 0; j < GB; j++) {
                const int vb = vg + VG * (j0 + j);
                const float f = f16s_factor(eb[j]);
                const uint32_t sw[4] = {sb[j].x, sb[j].y, sb[j].z, sb[j].w};
                const uint32_t dw[4] = {db[j].x, db[j].y, db[j].z, db[j].w};
                uint32_t bw[4];
#pragma unroll
                for (int q = 0; q < 4; q++) { /* q: .x .y (rows 2t, 2t + 1), .z .w (rows 2t + 8, 2t + 9) */
                    const float2 x = unpack_bf16(sw[q]), y = f16s_pair(dw[q], f);
                    dg4[2 * (q >> 1)] += x.x * y.x;
                    dg4[2 * (q >> 1) + 1] += x.y * y.y;
                    bw[q] = pack_16x2<1>(y.x * to_f16, y.y * to_f16);
                }
                piece_to_tile<KC>(sm.s, sb[j], vb, np, lane);
                piece_to_tile<KC>(sm.ds, make_uint4(bw[0], bw[1], bw[2], bw[3]), vb, np, lane);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) /* over the lanes g of a t */
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) dg4[r] += __shfl_xor_sync(0xffffffffu, dg4[r], o);
        if (lane < 4) {
            float *out = VG == 1 ? p.dgam + c.hpart * (int64_t)KC : sm.red[vg];
#pragma unroll
            for (int r = 0; r < 4; r++) out[16 * np + 2 * lane + (r & 1) + 8 * (r >> 1)] = dg4[r];
        }
    }
    return et;
}

/* dO → bf16 (rows past the chunk's end and padded columns zero): a thread's 8 · C·VC/2048 elements, every load
   issued before any conversion (load_bits: one round trip, not one per element) */
template <int KC, int VC>
DEV void load_do(const kda_bwd_params_t &p, inter_smem<KC, VC> &sm, const inter_cta &c) {
    constexpr int N = C * VC / 8 / BI_THREADS;
    uint32_t ob[N][8];
#pragma unroll
    for (int j = 0; j < N; j++) {
        const int e = c.tid + BI_THREADS * j, i = e / (VC / 8), col = (e % (VC / 8)) * 8;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int64_t o = ((c.t0 + i) * p.pb.hv + c.h) * (int64_t)p.pb.V + c.v0 + col + u;
            ob[j][u] = i < c.clen && c.v0 + col + u < p.pb.V ? load_bits(p.d_o, p.do_dtype, o) : 0u;
        }
    }
#pragma unroll
    for (int j = 0; j < N; j++) {
        const int e = c.tid + BI_THREADS * j, i = e / (VC / 8), col = (e % (VC / 8)) * 8;
        float x[8];
        bits_values<8>(x, ob[j], p.do_dtype);
        *(uint4 *)(sm.o + tile_off(C, i, col)) =
            make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7]));
    }
}

/* Δ = U − W S: rows 16 I.., columns (VC / 2) hf.., in fp16 in place of U for dK̃'s product, each row after a power
   of two 2^(141 − E) that puts its largest below 2^15 (f16s_exponent, as stage 2's dS⁺): the row's largest over
   the lanes t, then over the two column halves (warps hf) through shared memory (red, free here). The rows'
   exponents E into rowe (the lane's rows 16 I + g, + 8) and dle. */
template <int KC, int VC>
DEV void delta_product(inter_smem<KC, VC> &sm, uint8_t *dle, uint32_t (&rowe)[2], const inter_cta &c) {
    const int lane = c.lane, I = c.I, hf = c.hf, g = c.g, t = c.t;
    const int lr = lane & 7, lm = lane >> 3;
    const uint32_t s_u = smem_u32(sm.s), w_u = smem_u32(sm.w);
    constexpr int NT = VC / 16;
    const int n0 = hf * (VC / 2);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < KC; k0 += 16) {
        uint32_t a[4];
        ldsm_x4(a, w_u + tile_off(C, 16 * I + (lane & 15), k0 + 8 * (lane >> 4)));
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4]; /* k rows k0 + lr + 8 (lm & 1), n columns n0 + 16 np + 8 (lm >> 1) */
            ldsm_x4_t(b, s_u + tile_off(KC, k0 + lr + 8 * (lm & 1), n0 + 16 * np + 8 * (lm >> 1)));
            mma_bf16(acc[2 * np], a, b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
    uint32_t mx[2] = {0u, 0u}; /* the largest |Δ| of the lane's two rows, as bits (NaN above ∞) */
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int i = 16 * I + g + 8 * hr, col = n0 + 8 * nt + 2 * t;
            const float2 uu = unpack_bf16(*(const uint32_t *)(sm.u + tile_off(C, i, col)));
            const float d0 = uu.x - acc[nt][2 * hr], d1 = uu.y - acc[nt][2 * hr + 1];
            acc[nt][2 * hr] = d0;
            acc[nt][2 * hr + 1] = d1;
            mx[hr] = max(mx[hr], max(__float_as_uint(d0) & 0x7fffffffu, __float_as_uint(d1) & 0x7fffffffu));
        }
    uint32_t *rmax = (uint32_t *)&sm.red[0][0]; /* [2][C] */
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        mx[hr] = max(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
        mx[hr] = max(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
        if (t == 0) rmax[hf * C + 16 * I + g + 8 * hr] = mx[hr];
    }
    __syncthreads(); /* also: every read of U's tile by the W S product is done */
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = 16 * I + g + 8 * hr;
        float inv;
        rowe[hr] = f16s_exponent(__uint_as_float(max(rmax[i], rmax[C + i])), &inv);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) /* the element's owner only: in place */
            *(uint32_t *)(sm.u + tile_off(C, i, n0 + 8 * nt + 2 * t)) =
                pack_16x2<1>(acc[nt][2 * hr] * inv, acc[nt][2 * hr + 1] * inv);
        if (hf == 0 && t == 0) dle[i] = (uint8_t)rowe[hr];
    }
}

/* Δ for the chunk kernel as these fp16 rows and their exponent bytes (its products take Δ as tf32, whose rounding
   of each element is the fp16 one here: the same operands at half the bytes), row-major by 16-byte pieces of the
   swizzled tile */
template <int KC, int VC>
DEV void store_delta(const inter_smem<KC, VC> &sm, uint16_t *dlh, int tid) {
    for (int e = tid; e < C * VC / 8; e += BI_THREADS) {
        const int i = e / (VC / 8), c = 8 * (e % (VC / 8));
        *(uint4 *)(dlh + i * VC + c) = *(const uint4 *)(sm.u + tile_off(C, i, c));
    }
}

/* dQΓ = dO Sᵀ and dK̃ = Δ dS⁺ᵀ: rows 16 I.., columns (KC / 2) hf.., raw into the dq̂, dk̂ scratch rows (dK̃ times Δ's
   row factor and dS⁺'s class factor 2^(et − 127)) */
template <int KC, int VC, int NVH>
DEV void dqk_products(const kda_bwd_params_t &p, const inter_smem<KC, VC> &sm, const uint32_t (&rowe)[2], uint32_t et,
                      const inter_cta &c) {
    const int lane = c.lane, I = c.I, hf = c.hf, g = c.g, t = c.t;
    const int lr = lane & 7, lm = lane >> 3;
    const uint32_t s_u = smem_u32(sm.s), ds_u = smem_u32(sm.ds), u_u = smem_u32(sm.u), o_u = smem_u32(sm.o);
    constexpr int NPASS = KC > 128 ? 2 : 1; /* (registers: 2 × KC / 16 × 4 accumulators a pass) */
#pragma unroll 1
    for (int pass = 0; pass < NPASS; pass++) {
        constexpr int NT = KC / 16 / NPASS;
        const int n0 = hf * (KC / 2) + pass * (KC / 2 / NPASS);
        float aq[NT][4], ak[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) aq[nt][e] = ak[nt][e] = 0.0f;
#pragma unroll 2
        for (int k0 = 0; k0 < VC; k0 += 16) {
            uint32_t ao[4], ad[4];
            ldsm_x4(ao, o_u + tile_off(C, 16 * I + (lane & 15), k0 + 8 * (lane >> 4)));
            ldsm_x4(ad, u_u + tile_off(C, 16 * I + (lane & 15), k0 + 8 * (lane >> 4)));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                const int off = tile_off(KC, n0 + 16 * np + lr + 8 * (lm >> 1), k0 + 8 * (lm & 1));
                uint32_t bs[4], bd[4]; /* n rows n0 + 16 np + lr + 8 (lm >> 1), k columns k0 + 8 (lm & 1) */
                ldsm_x4(bs, s_u + off);
                ldsm_x4(bd, ds_u + off);
                mma_bf16(aq[2 * np], ao, bs[0], bs[1]);
                mma_bf16(aq[2 * np + 1], ao, bs[2], bs[3]);
                mma_f16(ak[2 * np], ad, bd[0], bd[1]);
                mma_f16(ak[2 * np + 1], ad, bd[2], bd[3]);
            }
        }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int i = 16 * I + g + 8 * hr;
            if (i >= c.clen) continue;
            float *row = p.dqk + (((c.t0 + i) * p.pb.hv + c.h) * NVH + c.vh) * (int64_t)(2 * KC);
            const float fr = f16s_factor(rowe[hr]), fc = f16s_factor(et); /* Δ's row, dS⁺'s class (the lane's t) */
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int col = n0 + 8 * nt + 2 * t;
                *(float2 *)(row + col) = make_float2(aq[nt][2 * hr], aq[nt][2 * hr + 1]);
                *(float2 *)(row + KC + col) = make_float2(ak[nt][2 * hr] * fr * fc, ak[nt][2 * hr + 1] * fr * fc);
            }
        }
    }
}

/* VC: the CTA's columns (≤ 128); NVH = 2: V class 256, block b = (chunk · hv + head) · 2 + half */
template <int KC, int VC, int NVH>
__global__ void __launch_bounds__(BI_THREADS, 2) kda_bwd_inter_kernel(const kda_bwd_params_t p) {
    constexpr int VT = VC * NVH; /* the V class */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    inter_smem<KC, VC> &sm = *(inter_smem<KC, VC> *)smem_raw;
    inter_cta c;
    c.tid = threadIdx.x, c.lane = c.tid & 31, c.warp = c.tid >> 5;
    c.I = c.warp & 3, c.hf = c.warp >> 2, c.g = c.lane >> 2, c.t = c.lane & 3;
    const unsigned unit = blockIdx.x / NVH; /* (chunk, head) */
    c.vh = NVH == 1 ? 0 : (int)(blockIdx.x % NVH), c.v0 = VC * c.vh;
    const int64_t cid = unit / p.pb.hv;
    c.h = (int)(unit % p.pb.hv);
    c.clen = chunk_tokens(p.pb.seqs, cid, &c.t0);
    if (c.clen <= 0) return;
    c.pair = cid * p.pb.hv + c.h, c.hpart = c.pair * NVH + c.vh;
    const unsigned char *blk = (const unsigned char *)p.blocks.base + c.pair * p.blocks.block_bytes;
    /* the half's 16-column blocks of S and dS⁺ (kda_cuda_states_dv's order): a contiguous run */
    const uint16_t *__restrict__ S = p.states_bf16 + c.pair * (int64_t)KC * VT + (int64_t)c.v0 * KC;
    const uint16_t *__restrict__ dS = p.dstates_f16 + c.pair * (int64_t)KC * VT + (int64_t)c.v0 * KC;
    const uint8_t *__restrict__ dSe = p.dstates_exp + c.pair * (int64_t)(VT / 16) * 32 + (c.v0 / 16) * 32;

    load_blocks<KC, VC>(sm, blk, c);
    const uint32_t et = load_states<KC, VC, NVH>(p, sm, S, dS, dSe, c);
    load_do<KC, VC>(p, sm, c);
    cp_async_wait_all();
    __syncthreads();
    constexpr int NP = KC / 16, NW = BI_THREADS / 32, VG = NW / NP > 0 ? NW / NP : 1;
    if (VG == 2) { /* dγ: the two warps' sums, in a fixed order */
        for (int d = c.tid; d < KC; d += BI_THREADS)
            p.dgam[c.hpart * (int64_t)KC + d] = sm.red[0][d] + sm.red[VG - 1][d];
        __syncthreads(); /* red is Δ's row maxima next */
    }
    uint32_t rowe[2]; /* Δ's factors 2^(rowe − 127) of the lane's rows 16 I + g, 16 I + g + 8 */
    uint16_t *dlh = (uint16_t *)(p.delta + c.hpart * KDA_BWD_DELTA_BYTES(VC)); /* Δ out: fp16 [C][VC], C exponents */
    delta_product<KC, VC>(sm, (uint8_t *)(dlh + C * VC), rowe, c);
    __syncthreads();
    store_delta<KC, VC>(sm, dlh, c.tid);
    dqk_products<KC, VC, NVH>(p, sm, rowe, et, c);
}

template <int KC, int VC, int NVH>
static int launch_inter(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->blocks.max_chunks * p->pb.hv * NVH;
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    const int bytes = (int)sizeof(inter_smem<KC, VC>);
    return kda_launch((const void *)kda_bwd_inter_kernel<KC, VC, NVH>, ctas, BI_THREADS, bytes, p, device, done,
                      stream);
}

/* One instance (a KDA_BWD_INTER_CONFIG row of configs.def; CMake generates its translation unit): the launcher
 * kda_bwd_inter_k<KC>_v<VC>_h<NVH>, found by bwd/configs.c's table */
#define KDA_BWD_INTER_INSTANCE(KC, VC, NVH)                                                                            \
    extern "C" int kda_bwd_inter_k##KC##_v##VC##_h##NVH(const kda_bwd_params_t *p, int device, void *stream) {         \
        return launch_inter<KC, VC, NVH>(p, device, stream);                                                           \
    }

#endif /* KDA_CUDA_BWD_INTER_CUH */
