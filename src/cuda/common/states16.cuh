/*
 * The 16-bit state tiles of the backward's split path (bf16 inputs), both in kda_cuda_states_dv's order (kda_cuda.h):
 *
 *     S   at every chunk start, bf16  (docs/ALGORITHM.md §6: the forward's recurrence, recurrence.cuh, holding Sᵀ)
 *     dS⁺ at every chunk end, fp16 with a power-of-two factor per (lane, 16-column block)
 *                                     (the state gradient's recurrence, bwd_dstate.cuh, holding dSᵀ)
 *
 * Both writers hold the transposed state in mma accumulators the same way: warp w of the tile owns the 16 value
 * columns vw = v0 + 16 w.., lane (g, t) = (lane / 4, lane mod 4) holds s[nt][c] = X[d][v] with
 * d = 8 nt + 2 t + (c mod 2), v = vw + g + 8 (c / 2). Each lane stores s[2 np .. 2 np + 1][0 .. 3] as one 16-byte
 * piece, so that a warp's store is one whole 512-byte run per np.
 *
 * What a lane of a reader finds in a piece (vb, np) it loads whole (16 bytes, as lane l of the writer held it):
 *   .x = X[16 np + 2 t + {0, 1}][16 vb + g],      .y = X[16 np + 2 t + {0, 1}][16 vb + 8 + g],
 *   .z = X[16 np + 8 + 2 t + {0, 1}][16 vb + g],  .w = X[16 np + 8 + 2 t + {0, 1}][16 vb + 8 + g]
 * — with d as the k index of a product, the B fragments (k pairs 2t, 2t + 1 and 2t + 8, 2t + 9 of column g) of
 * the 8-column tiles 16 vb.. (.x, .z) and 16 vb + 8.. (.y, .w) (bwd_chunk.cuh: K̃ dS⁺ straight from the pieces); as
 * four 8 × 8 matrices Xᵀ[16 vb + 8 h + ·][8 nt + ·], m = 2 (nt − 2 np) + h, transposed by stmatrix into a tile
 * (bwd_inter.cuh) or by movmatrix in registers (bwd_chunk.cuh: S for dX = −dR Sᵀ). A reader's lane l that loads the
 * pieces of lane l finds two tiles' same elements in the same places (bwd_inter.cuh: dγ from the pieces).
 *
 * Why dS⁺ is not bf16 as S is: dΔ = Aqkᵀ dO + K̃ dS⁺ (bwd_chunk.cuh) feeds dv and dβ, and bf16's 8 significant bits
 * there put their emulated errors 4-7x above the fp32 path's; fp16's 11 bits are
 * tf32's, the precision that product had from fp32 dS⁺. fp16's range is not: the lane's factor 2^e brings its
 * largest |x| to [2^14, 2^15), so every element within 2^28 of it keeps its 11 bits (exactly the value tf32
 * rounding gave) and none overflows. The factor's biased exponent is stored as a byte per (lane, block): 1/128 of
 * the tile's bytes.
 */
#ifndef KDA_CUDA_STATES16_CUH
#define KDA_CUDA_STATES16_CUH

#include "common.cuh"

/* The warp's accumulators s (X[d][v] of its 16 columns vw.., KD rows) into the (chunk, head) tile at dst
 * (KD · VC elements, the class VC implied by the pieces' order) in bf16, rounded to nearest even; padded rows and
 * columns are zero in s */
template <int KD>
DEV void store_states_bf16(uint16_t *dst, const float (&s)[KD / 8][4], int vw, int lane) {
    uint4 *out = (uint4 *)dst + (vw / 16) * (KD / 16) * 32 + lane;
#pragma unroll
    for (int np = 0; np < KD / 16; np++)
        out[32 * np] =
            make_uint4(pack_bf16(s[2 * np][0], s[2 * np][1]), pack_bf16(s[2 * np][2], s[2 * np][3]),
                       pack_bf16(s[2 * np + 1][0], s[2 * np + 1][1]), pack_bf16(s[2 * np + 1][2], s[2 * np + 1][3]));
}

/* The factor of a lane's values whose largest magnitude is m (≥ 0; NaN elements do not count): *inv = 2^−e brings m
 * to [2^14, 2^15); returned, the biased exponent of 2^e (the byte the readers keep). m below 2^−111 is taken as
 * 2^−111 (its values are far below any other term); m infinite (inputs the backward does not specify): factor 1. */
DEV uint32_t f16s_exponent(float m, float *inv) {
    const uint32_t E = __float_as_uint(m) >> 23, Ec = E < 16u ? 16u : E;
    if (E >= 255u) {
        *inv = 1.0f;
        return 127u;
    }
    *inv = __uint_as_float((268u - Ec) << 23); /* 2^(141 − Ec): m · inv < 2^(E − 126 + 141 − Ec) ≤ 2^15 */
    return Ec - 14u;                           /* 2^(Ec − 141) */
}
/* The factor 2^e of a stored exponent byte */
DEV float f16s_factor(uint32_t eb) { return __uint_as_float(eb << 23); }

/* The warp's accumulators s (dS⁺[d][v] of its 16 columns vw.., KD rows) into the (chunk, head) tile at dst in fp16
 * (rounded to nearest even after the lane's factor 2^−e, exact) and the lane's exponent byte into exps (VC / 16
 * blocks × 32 lanes per (chunk, head)) */
template <int KD>
DEV void store_dstates_f16s(uint16_t *dst, uint8_t *exps, const float (&s)[KD / 8][4], int vw, int lane) {
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) m[c] = fmaxf(m[c], fabsf(s[nt][c]));
    float inv;
    const uint32_t eb = f16s_exponent(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])), &inv);
    uint4 *out = (uint4 *)dst + (vw / 16) * (KD / 16) * 32 + lane;
#pragma unroll
    for (int np = 0; np < KD / 16; np++)
        out[32 * np] = make_uint4(pack_16x2<1>(s[2 * np][0] * inv, s[2 * np][1] * inv),
                                  pack_16x2<1>(s[2 * np][2] * inv, s[2 * np][3] * inv),
                                  pack_16x2<1>(s[2 * np + 1][0] * inv, s[2 * np + 1][1] * inv),
                                  pack_16x2<1>(s[2 * np + 1][2] * inv, s[2 * np + 1][3] * inv));
    exps[(vw / 16) * 32 + lane] = (uint8_t)eb;
}

/* A piece's pair of fp16 values times the lane's factor: fp32 (exact) */
DEV float2 f16s_pair(uint32_t w, float f) {
    const float2 x = unpack_16x2<1>(w);
    return make_float2(x.x * f, x.y * f);
}

#endif /* KDA_CUDA_STATES16_CUH */
