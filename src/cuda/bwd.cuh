/*
 * Device helpers shared by the backward's kernels (bwd_*.cu): an element of a state tensor, the tf32 products,
 * a warp's sum.
 */
#ifndef KDA_CUDA_BWD_CUH
#define KDA_CUDA_BWD_CUH

#include "bwd.h"
#include "common.cuh"

/* Element (d, c) of head h's state in slot `slot` of a [slots][hv][K][V] (V-first: [V][K]) tensor */
DEV int64_t state_elem(const kda_bwd_params_t &p, int64_t slot, int h, int d, int c) {
    const int64_t base = (slot * p.hv + h) * (int64_t)p.K * p.V;
    return base + (p.v_first ? (int64_t)c * p.K + d : (int64_t)d * p.V + c);
}

/* tf32 tensor-core products of the backward (bwd_chunk.cu, bwd_dstate.cu): a k-step of 16 is two m16n8k8 tf32
 * products; a lane feeds its k pair (2t, 2t + 1) into the slots t and t + 4 of one of them (the sum over k does
 * not depend on the order), so that its fragments are read as in the bf16 m16n8k16 layout: A rows g, g + 8 at
 * k 2t, 2t + 1 (and + 8), B column g (lane = 4g + t). */
typedef float2 frag_t; /* a lane's k pair of one operand row/column, tf32 */
DEV frag_t tf2(float lo, float hi) { return make_float2(to_tf32(lo), to_tf32(hi)); }
/* c += A B over a k-step of 16: a[0..3] = A(g, 2t..), A(g + 8, 2t..), A(g, 2t + 8..), A(g + 8, 2t + 8..);
 * b0 = B(2t.., g), b1 = B(2t + 8.., g) */
DEV void mma16(float c[4], const frag_t a[4], frag_t b0, frag_t b1) {
    mma_tf32(c, a[0].x, a[1].x, a[0].y, a[1].y, b0.x, b0.y);
    mma_tf32(c, a[2].x, a[3].x, a[2].y, a[3].y, b1.x, b1.y);
}

/* Σ over the warp's 32 lanes, the same order on every lane */
DEV float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

#endif /* KDA_CUDA_BWD_CUH */
