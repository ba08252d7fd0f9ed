/* The m16n8k8 tf32 product of a warp (mma.sync) under the host emulators (dev/bwd_emu, dev/cp_merge_emu,
 * dev/prep_emu, dev/xcp_emu), and the tf32 parts by masks that operands are split into. The product: each lane
 * posts its fragments, then sums its four outputs over k = 0 .. 7 in order, each product and sum rounded to fp32
 * (the emulators compile without FMA contraction). a0..a3 = A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4);
 * b0, b1 = B(t, g), B(t + 4, g) (lane = 4g + t). The includer has DEV, memcpy, threadIdx and emu_warp_bar (a
 * barrier of 32 per warp slot) and defines EMU_TF32_SLOTS and EMU_TF32_SLOT(w), the slot of warp w of the
 * thread's CTA; one of its translation units defines emu_tf32. */
#pragma once
/* tf32 parts by masks (src/cuda/common/common.cuh's split_tf32_rz): 13 low mantissa bits cleared, x = hi + lo + ε */
DEV float tf32_rz(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u &= 0xffffe000u;
    float y;
    memcpy(&y, &u, 4);
    return y;
}
DEV void split_tf32_rz(float x, float *hi, float *lo) { *hi = tf32_rz(x); *lo = tf32_rz(x - *hi); }
typedef struct { float a[4], b[2]; } emu_tf32_frag;
extern emu_tf32_frag emu_tf32[EMU_TF32_SLOTS][32];
DEV void mma_tf32(float c[4], float a0, float a1, float a2, float a3, float b0, float b1) {
    const int lane = threadIdx.x & 31, w = EMU_TF32_SLOT(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
    emu_tf32_frag *f = &emu_tf32[w][lane];
    f->a[0] = a0, f->a[1] = a1, f->a[2] = a2, f->a[3] = a3, f->b[0] = b0, f->b[1] = b1;
    pthread_barrier_wait(&emu_warp_bar[w]);
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = c[e];
        for (int k = 0; k < 8; k++)
            s += emu_tf32[w][(row & 7) * 4 + (k & 3)].a[(row >> 3) + 2 * (k >> 2)] * emu_tf32[w][col * 4 + (k & 3)].b[k >> 2];
        c[e] = s;
    }
    pthread_barrier_wait(&emu_warp_bar[w]);
}
/* src/cuda/common/common.cuh's mma_3xtf32: B's elements split, the three parts' products, each into its accumulator */
DEV void mma_3xtf32(float c_hh[4], float c_lh[4], float c_hl[4], const float ah[4], const float al[4], float b0,
                    float b1) {
    float bh0, bl0, bh1, bl1;
    split_tf32_rz(b0, &bh0, &bl0);
    split_tf32_rz(b1, &bh1, &bl1);
    mma_tf32(c_hh, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
    mma_tf32(c_lh, al[0], al[1], al[2], al[3], bh0, bh1);
    mma_tf32(c_hl, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
}
