/* Stand-in for src/cuda/common/common.cuh under the host emulation of the CP plan (plan_emu.cu): one pthread per CUDA
 * thread of one CTA, __syncthreads a barrier of the block, a warp's shuffles an exchange through its lanes' slots
 * between two barriers of the warp. Only what cp_plan.cuh and seq.cuh use. */
#pragma once
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include "kda_cuda.h"
#define DEV static inline
#define __device__
#define __host__
#define __global__
#define __shared__
typedef struct { unsigned x, y, z; } emu_dim;
extern __thread emu_dim threadIdx;
#define EMU_MAX_WARPS 32
extern pthread_barrier_t emu_block_bar, emu_warp_bar[EMU_MAX_WARPS];
extern int64_t emu_warp_x[EMU_MAX_WARPS][32];
static inline void __syncthreads(void) { pthread_barrier_wait(&emu_block_bar); }
static inline int64_t emu_exchange(int64_t x, int src) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_warp_x[w][lane] = x;
    pthread_barrier_wait(&emu_warp_bar[w]);
    const int64_t r = emu_warp_x[w][src];
    pthread_barrier_wait(&emu_warp_bar[w]);
    return r;
}
/* shfl.up: lanes below o get their own value */
static inline int64_t __shfl_up_sync(unsigned mask, int64_t x, int o) {
    (void)mask;
    const int lane = threadIdx.x & 31;
    return emu_exchange(x, lane >= o ? lane - o : lane);
}
static inline int64_t __shfl_xor_sync(unsigned mask, int64_t x, int o) {
    (void)mask;
    return emu_exchange(x, (threadIdx.x & 31) ^ o);
}
static inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
