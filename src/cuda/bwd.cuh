/*
 * Device helpers shared by the backward's kernels (bwd_*.cu): an element (or a run of 4 or 8) of a bf16 panel
 * tile of the chunk blocks, an element of a state tensor, a warp's sum.
 */
#ifndef KDA_CUDA_BWD_CUH
#define KDA_CUDA_BWD_CUH

#include "bwd.h"
#include "common.cuh"

/* Element (row, col) of a bf16 tile in the panel layout (common.cuh pan_off), as fp32 */
DEV float panel_at(const unsigned char *tile, int row, int col) {
    return bf16_bits_to_f32(*(const uint16_t *)(tile + pan_off(row, col)));
}

/* N (8 or 4) consecutive bf16 of a panel row from column d0 (a multiple of N), as fp32: one 16- (8-) byte load */
template <int N>
DEV void panel_run(const unsigned char *tile, int row, int d0, float (&x)[N]) {
    uint32_t w[N / 2];
    if constexpr (N == 8) {
        const uint4 v = *(const uint4 *)(tile + pan_off(row, d0));
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
        const uint2 v = *(const uint2 *)(tile + pan_off(row, d0));
        w[0] = v.x, w[1] = v.y;
    }
#pragma unroll
    for (int j = 0; j < N / 2; j++) {
        x[2 * j] = __uint_as_float(w[j] << 16);
        x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

/* Element (d, c) of head h's state in slot `slot` of a [slots][hv][K][V] (V-first: [V][K]) tensor */
DEV int64_t state_elem(const kda_bwd_params_t &p, int64_t slot, int h, int d, int c) {
    const int64_t base = (slot * p.hv + h) * (int64_t)p.K * p.V;
    return base + (p.v_first ? (int64_t)c * p.K + d : (int64_t)d * p.V + c);
}

/* Σ over the warp's 32 lanes, the same order on every lane */
DEV float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

#endif /* KDA_CUDA_BWD_CUH */
