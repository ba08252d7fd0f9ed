/*
 * The bf16 state tiles of the backward's split path (bf16 inputs), in kda_cuda_states_dv's order (kda_cuda.h):
 *
 *     S   at every chunk start  (docs/ALGORITHM.md §6: the forward's recurrence, recurrence.cuh, holding Sᵀ)
 *     dS⁺ at every chunk end    (the state gradient's recurrence, bwd_dstate.cu, holding dSᵀ)
 *
 * Both writers hold the transposed state in mma accumulators the same way: warp w of the tile owns the 16 value
 * columns vw = v0 + 16 w.., lane (g, t) = (lane / 4, lane mod 4) holds s[nt][c] = X[d][v] with
 * d = 8 nt + 2 t + (c mod 2), v = vw + g + 8 (c / 2). Each lane stores s[2 np .. 2 np + 1][0 .. 3] as one 16-byte
 * piece, so that a warp's store is one whole 512-byte run per np (docs/PERF.md "Backward v8").
 *
 * What a lane of a reader finds in a piece (vb, np) it loads whole (16 bytes, as lane l of the writer held it):
 *   .x = X[16 np + 2 t + {0, 1}][16 vb + g],      .y = X[16 np + 2 t + {0, 1}][16 vb + 8 + g],
 *   .z = X[16 np + 8 + 2 t + {0, 1}][16 vb + g],  .w = X[16 np + 8 + 2 t + {0, 1}][16 vb + 8 + g]
 * — with d as the k index of a product, the B fragments (k pairs 2t, 2t + 1 and 2t + 8, 2t + 9 of column g) of
 * the 8-column tiles 16 vb.. (.x, .z) and 16 vb + 8.. (.y, .w) (bwd_chunk.cu: K̃ dS⁺ straight from the pieces); as
 * four 8 × 8 matrices Xᵀ[16 vb + 8 h + ·][8 nt + ·], m = 2 (nt − 2 np) + h, transposed by stmatrix into a tile
 * (bwd_inter.cu) or by movmatrix in registers (bwd_chunk.cu: S for dX = −dR Sᵀ).
 */
#ifndef KDA_CUDA_STATES_BF16_CUH
#define KDA_CUDA_STATES_BF16_CUH

#include "common.cuh"

/* The warp's accumulators s (X[d][v] of its 16 columns vw.., KD rows) into the (chunk, head) tile at dst
 * (KD · VC elements, the class VC implied by the pieces' order), rounded to nearest even; padded rows and columns
 * are zero in s */
template <int KD>
DEV void store_states_bf16(uint16_t *dst, const float (&s)[KD / 8][4], int vw, int lane) {
    uint4 *out = (uint4 *)dst + (vw / 16) * (KD / 16) * 32 + lane;
#pragma unroll
    for (int np = 0; np < KD / 16; np++)
        out[32 * np] = make_uint4(pack_bf16(s[2 * np][0], s[2 * np][1]), pack_bf16(s[2 * np][2], s[2 * np][3]),
                                  pack_bf16(s[2 * np + 1][0], s[2 * np + 1][1]),
                                  pack_bf16(s[2 * np + 1][2], s[2 * np + 1][3]));
}

#endif /* KDA_CUDA_STATES_BF16_CUH */
