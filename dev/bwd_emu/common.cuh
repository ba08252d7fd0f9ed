/* emulator stand-in for src/cuda/common.cuh: only what the backward kernels use */
#pragma once
#include "shim.h"
#include "kda_cuda.h"
#define DEV static inline
DEV float bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
DEV float f16_bits_to_f32(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
DEV uint16_t f32_to_bf16_bits(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
DEV float load_elem(const void *p, int dtype, int64_t i) {
    if (dtype == KDA_DT_F32) return ((const float *)p)[i];
    if (dtype == KDA_DT_F16) return f16_bits_to_f32(((const uint16_t *)p)[i]);
    return bf16_bits_to_f32(((const uint16_t *)p)[i]);
}
DEV void store_elem(void *p, int dtype, int64_t i, float x) {
    if (dtype == KDA_DT_F32) ((float *)p)[i] = x;
    else if (dtype == KDA_DT_F16) { _Float16 h = (_Float16)x; memcpy((uint16_t *)p + i, &h, 2); }
    else ((uint16_t *)p)[i] = f32_to_bf16_bits(x);
}
/* bf16 pairs and the tensor-core product (mma.sync m16n8k16 row.col, bf16 → fp32) of a warp: each lane posts its
 * fragments, then computes its own four outputs from the whole warp's (the PTX fragment layouts) */
DEV uint32_t pack_bf16(float lo, float hi) { return (uint32_t)f32_to_bf16_bits(lo) | ((uint32_t)f32_to_bf16_bits(hi) << 16); }
typedef struct { uint32_t a[4], b[2]; } emu_mma_frag;
extern emu_mma_frag emu_mma[16][32];
DEV float emu_half(uint32_t w, int hi) { return bf16_bits_to_f32((uint16_t)(hi ? w >> 16 : w & 0xffff)); }
DEV void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    emu_mma_frag *f = &emu_mma[w][lane];
    for (int r = 0; r < 4; r++) f->a[r] = a[r];
    f->b[0] = b0, f->b[1] = b1;
    pthread_barrier_wait(&emu_warp_bar[w]);
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = c[e];
        for (int k = 0; k < 16; k++) {
            const emu_mma_frag *fa = &emu_mma[w][(row & 7) * 4 + (k & 7) / 2], *fb = &emu_mma[w][col * 4 + (k & 7) / 2];
            const float x = emu_half(fa->a[(row >> 3) + 2 * (k >> 3)], k & 1), y = emu_half(fb->b[k >> 3], k & 1);
            s += x * y;
        }
        c[e] = s;
    }
    pthread_barrier_wait(&emu_warp_bar[w]);
}
/* tf32: round to nearest, ties away (cvt.rna.tf32.f32), and the m16n8k8 tf32 product of a warp */
DEV float to_tf32(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    float y; memcpy(&y, &u, 4); return y;
}
typedef struct { float a[4], b[2]; } emu_tf32_frag;
extern emu_tf32_frag emu_tf32[16][32];
DEV void mma_tf32(float c[4], float a0, float a1, float a2, float a3, float b0, float b1) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
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
DEV int pan_off(int row, int col) {
    return (col >> 6) * 8192 + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2;
}
