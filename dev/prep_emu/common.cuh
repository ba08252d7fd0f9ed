/* Stand-in for src/cuda/common/common.cuh under the host emulation of the chunk preparation (prep.cuh): the backward
 * emulator's shim and device helpers (dev/bwd_emu/shim.h and common.cuh, copied beside this file by run.sh as
 * shim.h and bwd_common.cuh), and what prep.cuh, seq.cuh and cp_plan.cuh use beyond them. One pthread per CUDA
 * thread, one CTA at a time; the launcher's kda_launch_ex only records the grid, which the harness then runs. */
#ifndef PREP_EMU_COMMON_CUH /* a guard, not pragma once: run.sh copies this file beside the kernel sources */
#define PREP_EMU_COMMON_CUH
#define KDA_CUDA_COMMON_CUH /* the real header's guard: a quoted include of it from src/cuda finds nothing more */
#include "bwd_common.cuh"
#include <stdio.h>
#include <stdlib.h>

/* 16-bit float storage types: the kernel only stores, loads and converts them */
typedef struct { uint16_t x; } __nv_bfloat16;
typedef struct { uint16_t x; } __half;
DEV __nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 b = {f32_to_bf16_bits(f)};
    return b;
}
DEV float __bfloat162float(__nv_bfloat16 b) { return bf16_bits_to_f32(b.x); }
DEV float __half2float(__half h) { return f16_bits_to_f32(h.x); }

/* The SFU's reciprocal and log2 (rcp.approx.ftz, lg2.approx.ftz), in libm: the GPU's last bits are not
 * reproduced, but candidate and reference get the same function, which is what a byte comparison needs. */
DEV float rcp_approx(float x) { return 1.0f / x; }
DEV float lg2_approx(float x) { return log2f(x); }

/* mul.rn.bf16x2: each product of two bf16 values is exact in fp32 (16 significant bits), then rounded once */
DEV uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
    const float2 x = unpack_bf16(a), y = unpack_bf16(b);
    return pack_bf16(x.x * y.x, x.y * y.y);
}
DEV uint32_t pack_bf16_lo(float x0, float x1, uint32_t hi) {
    const float2 h = unpack_bf16(hi);
    return pack_bf16(x0 - h.x, x1 - h.y);
}

/* cp.async of 8 and 4 bytes: plain copies, as the 16-byte one (the emulated thread waits for nothing) */
DEV void cp_async8_zfill(uint32_t dst, const void *src, int src_bytes) {
    memset(EMU_SMEM + dst, 0, 8);
    memcpy(EMU_SMEM + dst, src, (size_t)src_bytes);
}
DEV void cp_async4_zfill(uint32_t dst, const void *src, int src_bytes) {
    memset(EMU_SMEM + dst, 0, 4);
    memcpy(EMU_SMEM + dst, src, (size_t)src_bytes);
}
template <int N>
DEV void cp_async_wait_group(void) {}
DEV void pdl_wait(void) {}
DEV void pdl_trigger(void) {}

/* atomicMin on a shared int (prep's first poisoning row t*) */
DEV int atomicMin(int *a, int v) {
    int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(a, &old, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}

/* 64-bit shuffles (cp_plan.cuh's scans; compiled in, run only with params.plan set) through a warp's slots */
extern int64_t emu_warp_x64[EMU_WARPS][32];
DEV int64_t emu_exchange64(int64_t x, int src) {
    const int lane = threadIdx.x & 31, w = EMU_W(threadIdx.x >> 5);
    emu_warp_x64[w][lane] = x;
    pthread_barrier_wait(&emu_warp_bar[w]);
    const int64_t r = emu_warp_x64[w][src];
    pthread_barrier_wait(&emu_warp_bar[w]);
    return r;
}
DEV int64_t __shfl_up_sync(unsigned mask, int64_t x, int o) { /* lanes below o keep their own value */
    (void)mask;
    const int lane = threadIdx.x & 31;
    return emu_exchange64(x, lane >= o ? lane - o : lane);
}
DEV int64_t __shfl_xor_sync(unsigned mask, int64_t x, int o) {
    (void)mask;
    return emu_exchange64(x, (threadIdx.x & 31) ^ o);
}

/* The launcher's grid, recorded for the harness to run (prep_inst.emu.cu): the kernel (a function of the params
 * struct by value), its CTAs, threads and dynamic shared memory */
typedef struct {
    const void *kernel;
    int64_t ctas;
    int threads, bytes;
} emu_grid_t;
extern emu_grid_t emu_grid;
static inline int kda_launch_ex(const void *kernel, int64_t ctas, int cluster, int threads, int bytes, const void *params,
                                int device, int done[KDA_MAX_DEVICES], void *stream, int pdl) {
    (void)params, (void)device, (void)done, (void)stream, (void)pdl;
    if (cluster != 1) {
        fprintf(stderr, "prep_emu: clusters are not emulated here (cluster %d)\n", cluster);
        exit(3);
    }
    emu_grid.kernel = kernel, emu_grid.ctas = ctas, emu_grid.threads = threads, emu_grid.bytes = bytes;
    return 0;
}

#endif /* PREP_EMU_COMMON_CUH */
