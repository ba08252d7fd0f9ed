/* Stand-in for src/cuda/common/common.cuh under the host emulation of xcp.cu's kernels (xcp_emu.cu): one pthread per
 * CUDA thread, one CTA at a time; __syncthreads a barrier of the block; __shared__ statics are the CTA's (CTAs run one
 * after another), dynamic shared memory one poisoned buffer (run.sh makes the kernel's extern declaration a pointer
 * to it); tf32 mma.sync by an exchange through the warp's lanes (mma_tf32.cuh). Only what xcp.cu's fold and apply
 * kernels use. */
#pragma once
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kda_cuda.h"
#define DEV static inline
#define __device__
#define __host__
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
struct alignas(16) double2 { double x, y; };
struct float2 { float x, y; };
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
typedef struct { unsigned x, y, z; } emu_dim;
extern __thread emu_dim threadIdx;
extern emu_dim blockIdx, gridDim, blockDim;
#define EMU_SMEM_BYTES (256 * 1024)
extern unsigned char emu_smem[EMU_SMEM_BYTES];
extern pthread_barrier_t emu_block_bar;
static inline void __syncthreads(void) { pthread_barrier_wait(&emu_block_bar); }
#define EMU_MAX_WARPS 8
extern pthread_barrier_t emu_warp_bar[EMU_MAX_WARPS];
#define EMU_TF32_SLOTS EMU_MAX_WARPS
#define EMU_TF32_SLOT(w) (w)
#include "mma_tf32.cuh" /* dev/bwd_emu's, copied beside this file by run.sh */
/* shared addresses: offsets into the dynamic buffer; cp.async a plain copy at its issue (a thread's copies have
   landed by its wait, and other threads' by the barrier after it, as on the device) */
static inline uint32_t smem_u32(const void *p) { return (uint32_t)((const unsigned char *)p - emu_smem); }
static inline void emu_cp_async(uint32_t dst, const void *src, int bytes, int src_bytes) {
    if (dst + (uint32_t)bytes > EMU_SMEM_BYTES) { fprintf(stderr, "cp.async past the shared memory\n"); exit(2); }
    memset(emu_smem + dst, 0, (size_t)bytes);
    if (src_bytes) memcpy(emu_smem + dst, src, (size_t)src_bytes);
}
static inline void cp_async16_zfill(uint32_t dst, const void *src, int n) { emu_cp_async(dst, src, 16, n); }
static inline void cp_async4_zfill(uint32_t dst, const void *src, int n) { emu_cp_async(dst, src, 4, n); }
static inline void cp_async_commit(void) {}
static inline void cp_async_wait_all(void) {}
template <int N>
static inline void cp_async_wait_group(void) {}
