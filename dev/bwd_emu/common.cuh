/* emulator stand-in for src/cuda/common/common.cuh: only what the backward kernels use */
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
/* load_elem in two halves (the kernels issue a batch of loads, then convert) */
DEV uint32_t load_bits(const void *p, int dtype, int64_t i) {
    return dtype == KDA_DT_F32 ? ((const uint32_t *)p)[i] : (uint32_t)((const uint16_t *)p)[i];
}
DEV float bits_value(uint32_t b, int dtype) {
    if (dtype == KDA_DT_F32) return __uint_as_float(b);
    if (dtype == KDA_DT_F16) return f16_bits_to_f32((uint16_t)b);
    return bf16_bits_to_f32((uint16_t)b);
}
template <int DT>
DEV float bits_as(uint32_t b) { return bits_value(b, DT); }
template <int N>
DEV void bits_values(float (&x)[N], const uint32_t (&b)[N], int dtype) {
    for (int r = 0; r < N; r++) x[r] = bits_value(b[r], dtype);
}
/* the SFU's 2^x (ex2.approx.ftz: results below 2^-126 flushed to 0), sigmoid and softplus (common.cuh), in libm */
#define LOG2E 1.4426950408889634f
DEV float ex2(float x) {
    const float y = exp2f(x);
    return y < 1.17549435e-38f ? 0.0f : y;
}
DEV float rsqrtf(float x) { return 1.0f / sqrtf(x); } /* the SFU's (MUFU.RSQ) within 2 ulp */
DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
DEV float beta_sigmoid(float x, int neg_eigval) { const float s = 1.0f / (1.0f + expf(-x)); return neg_eigval ? 2.0f * s : s; }
DEV float softplusf_(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
DEV void store_elem(void *p, int dtype, int64_t i, float x) {
    if (dtype == KDA_DT_F32) ((float *)p)[i] = x;
    else if (dtype == KDA_DT_F16) { _Float16 h = (_Float16)x; memcpy((uint16_t *)p + i, &h, 2); }
    else ((uint16_t *)p)[i] = f32_to_bf16_bits(x);
}
/* bf16 pairs and the tensor-core product (mma.sync m16n8k16 row.col, bf16 → fp32) of a warp: each lane posts its
 * fragments, then computes its own four outputs from the whole warp's (the PTX fragment layouts) */
DEV uint32_t pack_bf16(float lo, float hi) { return (uint32_t)f32_to_bf16_bits(lo) | ((uint32_t)f32_to_bf16_bits(hi) << 16); }
DEV float2 unpack_bf16(uint32_t u) { return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u)); }
DEV uint16_t emu_f16_bits(float x) { _Float16 h = (_Float16)x; uint16_t b; memcpy(&b, &h, 2); return b; }
template <int F16>
DEV uint32_t pack_16x2(float lo, float hi) {
    if (F16) return (uint32_t)emu_f16_bits(lo) | ((uint32_t)emu_f16_bits(hi) << 16);
    return pack_bf16(lo, hi);
}
template <int F16>
DEV float2 unpack_16x2(uint32_t u) {
    if (F16) return make_float2(f16_bits_to_f32((uint16_t)(u & 0xffffu)), f16_bits_to_f32((uint16_t)(u >> 16)));
    return unpack_bf16(u);
}
typedef struct { uint32_t a[4], b[2]; } emu_mma_frag;
extern emu_mma_frag emu_mma[EMU_WARPS][32];
template <int F16>
DEV float emu_half(uint32_t w, int hi) {
    const uint16_t h = (uint16_t)(hi ? w >> 16 : w & 0xffff);
    return F16 ? f16_bits_to_f32(h) : bf16_bits_to_f32(h);
}
template <int F16>
DEV void mma_16bit(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    const int lane = threadIdx.x & 31, w = EMU_W(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
    emu_mma_frag *f = &emu_mma[w][lane];
    for (int r = 0; r < 4; r++) f->a[r] = a[r];
    f->b[0] = b0, f->b[1] = b1;
    pthread_barrier_wait(&emu_warp_bar[w]);
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = c[e];
        for (int k = 0; k < 16; k++) {
            const emu_mma_frag *fa = &emu_mma[w][(row & 7) * 4 + (k & 7) / 2], *fb = &emu_mma[w][col * 4 + (k & 7) / 2];
            const float x = emu_half<F16>(fa->a[(row >> 3) + 2 * (k >> 3)], k & 1), y = emu_half<F16>(fb->b[k >> 3], k & 1);
            s += x * y;
        }
        c[e] = s;
    }
    pthread_barrier_wait(&emu_warp_bar[w]);
}
DEV void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) { mma_16bit<0>(c, a, b0, b1); }
DEV void mma_f16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) { mma_16bit<1>(c, a, b0, b1); }
#ifndef EMU_TU
#define EMU_TU "other"
#endif
/* tf32: round to nearest, ties to even (cvt.rn.tf32.f32), and the m16n8k8 tf32 product of a warp */
DEV float to_tf32(float x) {
    /* EMU_TF32_EXACT=1: tf32 operands keep all 24 bits (a what-if for the rounding budget); a list of stages
       (chunk, pairs, inter, dstate: the emulator's translation units, EMU_TU) limits it to those */
    static int exact = -1;
    if (exact < 0) {
        const char *e = getenv("EMU_TF32_EXACT");
        exact = e && (!strcmp(e, "1") || strstr(e, EMU_TU));
    }
    if (exact) return x;
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
    float y; memcpy(&y, &u, 4); return y;
}
DEV void split_tf32(float x, float *hi, float *lo) { *hi = to_tf32(x); *lo = to_tf32(x - *hi); }
#define EMU_TF32_SLOTS EMU_WARPS
#define EMU_TF32_SLOT(w) EMU_W(w)
#include "mma_tf32.cuh"
/* shared-memory "addresses" are offsets into the CTA's shared memory (EMU_SMEM); ldmatrix (x4, b16) of a warp: each lane posts
 * its row address, then gathers its four registers from the rows of the lanes 8q.. (q: the matrix) — row g's
 * 32-bit word t, or (.trans) the 16-bit elements g of rows 2t and 2t + 1 */
DEV uint32_t smem_u32(const void *p) { return (uint32_t)((const unsigned char *)p - EMU_SMEM); }
extern uint32_t emu_ldsm_addr[EMU_WARPS][32];
DEV void emu_ldsm(uint32_t r[4], uint32_t addr, int trans) {
    const int lane = threadIdx.x & 31, w = EMU_W(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
    emu_ldsm_addr[w][lane] = addr;
    pthread_barrier_wait(&emu_warp_bar[w]);
    for (int q = 0; q < 4; q++) {
        if (!trans) memcpy(&r[q], EMU_SMEM + emu_ldsm_addr[w][8 * q + g] + 4 * t, 4);
        else {
            uint16_t lo, hi;
            memcpy(&lo, EMU_SMEM + emu_ldsm_addr[w][8 * q + 2 * t] + 2 * g, 2);
            memcpy(&hi, EMU_SMEM + emu_ldsm_addr[w][8 * q + 2 * t + 1] + 2 * g, 2);
            r[q] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
    pthread_barrier_wait(&emu_warp_bar[w]);
}
/* stmatrix x4 .trans: each lane posts its row address; lane (g, t)'s halves of r[q] go to element g of rows 2t and
   2t + 1 of matrix q (the lanes 8q + 2t, 8q + 2t + 1's addresses) */
DEV void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    const int lane = threadIdx.x & 31, w = EMU_W(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
    const uint32_t r[4] = {r0, r1, r2, r3};
    emu_ldsm_addr[w][lane] = addr;
    pthread_barrier_wait(&emu_warp_bar[w]);
    for (int q = 0; q < 4; q++) {
        const uint16_t lo = (uint16_t)r[q], hi = (uint16_t)(r[q] >> 16);
        memcpy(EMU_SMEM + emu_ldsm_addr[w][8 * q + 2 * t] + 2 * g, &lo, 2);
        memcpy(EMU_SMEM + emu_ldsm_addr[w][8 * q + 2 * t + 1] + 2 * g, &hi, 2);
    }
    pthread_barrier_wait(&emu_warp_bar[w]);
}
/* movmatrix .trans: lane (g, t) takes element (2t, g) (lane 4 · 2t + g / 2's half g mod 2) and (2t + 1, g) */
DEV uint32_t movm_t(uint32_t a) {
    const int lane = threadIdx.x & 31, w = EMU_W(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
    emu_ldsm_addr[w][lane] = a;
    pthread_barrier_wait(&emu_warp_bar[w]);
    const uint32_t x = emu_ldsm_addr[w][4 * (2 * t) + g / 2], y = emu_ldsm_addr[w][4 * (2 * t + 1) + g / 2];
    const uint32_t lo = (g & 1) ? x >> 16 : x & 0xffffu, hi = (g & 1) ? y >> 16 : y & 0xffffu;
    pthread_barrier_wait(&emu_warp_bar[w]);
    return lo | (hi << 16);
}
DEV void lds_u4(uint32_t r[4], uint32_t addr) { memcpy(r, EMU_SMEM + addr, 16); }
DEV void ldsm_x4(uint32_t r[4], uint32_t addr) { emu_ldsm(r, addr, 0); }
DEV void ldsm_x4_t(uint32_t r[4], uint32_t addr) { emu_ldsm(r, addr, 1); }
/* cp.async: a plain copy (the emulated thread waits for nothing) */
DEV void cp_async16_zfill(uint32_t dst, const void *src, int src_bytes) {
    memset(EMU_SMEM + dst, 0, 16);
    memcpy(EMU_SMEM + dst, src, (size_t)src_bytes);
}
DEV void cp_async_commit(void) {}
DEV void cp_async_wait_all(void) {}
/* common.cuh's decay_state (the dstate recurrence kernel's decay) */
template <int KD>
DEV void decay_state(float (&s)[KD / 8][4], const float *gam, int t) {
    for (int nt = 0; nt < KD / 8; nt++) {
        const float2 gg = *(const float2 *)&gam[8 * nt + 2 * t];
        s[nt][0] *= gg.x, s[nt][1] *= gg.y, s[nt][2] *= gg.x, s[nt][3] *= gg.y;
    }
}
DEV int pan_off(int row, int col) {
    return (col >> 6) * 8192 + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2;
}
DEV int pan_off_r8(int row8, int r, int col) {
    return (col >> 6) * 8192 + row8 * 128 + (r * 128 + ((((col >> 3) & 7) ^ r) << 4) + (col & 7) * 2);
}
/* bulk copies and their mbarriers: a copy completes at its issue; an mbarrier (kept beside the block's shared
 * memory, by its offset) counts the arrivals and bytes still expected in its phase, and mbar_wait(parity) spins
 * until the phase of that parity is complete; cp.async's arrival (.noinc) is one arrival at its issue. wgmma
 * paths are not emulated. */
#include <sched.h>
#include <stdlib.h>
typedef struct { int phase, pending, count, tx; } emu_mbar_t;
static pthread_mutex_t emu_mbar_lock = PTHREAD_MUTEX_INITIALIZER;
static emu_mbar_t emu_mbar_tab[EMU_MAX_CLUSTER][EMU_SMEM_BYTES / 8]; /* by CTA rank and the barrier's offset */
DEV emu_mbar_t *emu_mbar(uint32_t bar) { return &emu_mbar_tab[emu_rank][bar / 8]; }
DEV void emu_mbar_settle(emu_mbar_t *m) {
    if (m->pending == 0 && m->tx == 0) m->phase++, m->pending = m->count;
}
DEV void mbar_init(uint32_t bar, int count) {
    pthread_mutex_lock(&emu_mbar_lock);
    emu_mbar_t *m = emu_mbar(bar);
    m->phase = 0, m->pending = m->count = count, m->tx = 0;
    pthread_mutex_unlock(&emu_mbar_lock);
}
DEV void mbar_init_fence(void) {}
DEV void mbar_expect_tx(uint32_t bar, uint32_t bytes) { /* arrive, expecting bytes */
    pthread_mutex_lock(&emu_mbar_lock);
    emu_mbar_t *m = emu_mbar(bar);
    m->tx += (int32_t)bytes, m->pending--;
    emu_mbar_settle(m);
    pthread_mutex_unlock(&emu_mbar_lock);
}
DEV void mbar_wait(uint32_t bar, uint32_t parity) {
    for (;;) {
        pthread_mutex_lock(&emu_mbar_lock);
        const uint32_t ph = emu_mbar(bar)->phase;
        pthread_mutex_unlock(&emu_mbar_lock);
        if ((ph & 1u) != parity) return;
        sched_yield();
    }
}
DEV void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    memcpy(EMU_SMEM + dst, src, bytes);
    pthread_mutex_lock(&emu_mbar_lock);
    emu_mbar_t *m = emu_mbar(bar);
    m->tx -= (int32_t)bytes;
    emu_mbar_settle(m);
    pthread_mutex_unlock(&emu_mbar_lock);
}
DEV void cp_async_mbar_arrive(uint32_t bar) { /* the copies are done at their issue: an arrival now */
    pthread_mutex_lock(&emu_mbar_lock);
    emu_mbar_t *m = emu_mbar(bar);
    m->pending--;
    emu_mbar_settle(m);
    pthread_mutex_unlock(&emu_mbar_lock);
}
DEV void fence_proxy_async(void) {}
#define __trap() abort()
/* thread-block clusters (emu_launch_cluster runs a cluster's CTAs at once, each with its own shared memory and
 * barriers): a cluster barrier's arrive is a barrier of all the cluster's threads (so its wait has nothing left to
 * wait for); a float pair into another CTA's shared memory at the same offset, completing bytes on its mbarrier */
DEV void cluster_arrive(void) { pthread_barrier_wait(&emu_cluster_bar); }
DEV void cluster_arrive_relaxed(void) { pthread_barrier_wait(&emu_cluster_bar); }
DEV void cluster_wait(void) {}
DEV void cluster_st_async2(const void *local, uint32_t bar, unsigned rank, float x, float y) {
    const float v[2] = {x, y};
    memcpy(smem_raw + (size_t)rank * EMU_SMEM_BYTES + smem_u32(local), v, 8);
    pthread_mutex_lock(&emu_mbar_lock);
    emu_mbar_t *m = &emu_mbar_tab[rank][bar / 8];
    m->tx -= 8;
    emu_mbar_settle(m);
    pthread_mutex_unlock(&emu_mbar_lock);
}
DEV unsigned char *cta_smem(unsigned char *smem) { return smem + (size_t)emu_rank * EMU_SMEM_BYTES; }
DEV float cluster_ld(const float *local, unsigned rank) {
    float x;
    memcpy(&x, smem_raw + (size_t)rank * EMU_SMEM_BYTES + smem_u32(local), 4);
    return x;
}
DEV void cluster_sync(void) { pthread_barrier_wait(&emu_cluster_bar); }
