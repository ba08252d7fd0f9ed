/* Host emulation of the few CUDA features the backward kernels use: one pthread per CUDA thread, a block's threads
 * all alive at once (so __syncthreads is a barrier of the block and a warp's shuffles a barrier of its 32 lanes).
 * The kernels are CUDA C with template tile sizes, so this is compiled by g++ (-x c++); the emulator's own code is
 * C: structs, functions, macros. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <vector_types.h>
#include <vector_functions.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__

/* threadIdx, blockIdx, the CTA's rank in its cluster (0 outside clusters): per host thread; the CTAs' and the
 * warps' barriers and the shuffle exchange: shared, by rank (and warp) */
#define EMU_SMEM_BYTES 232448 /* an H100 block's largest dynamic shared memory */
#define EMU_MAX_CLUSTER 8
#define EMU_WARPS (16 * EMU_MAX_CLUSTER)
typedef struct { unsigned x, y, z; } emu_dim;
extern __thread emu_dim threadIdx, blockIdx;
extern __thread int emu_rank;
#define EMU_W(w) (16 * emu_rank + (w)) /* a warp's slot in the per-warp exchange arrays */
extern emu_dim gridDim; /* {0, 1, 1}: the chunk kernel's next-wave L2 prefetch (a hint) finds no next CTA */
extern pthread_barrier_t emu_block_bar[EMU_MAX_CLUSTER], emu_cluster_bar;
extern pthread_barrier_t emu_warp_bar[EMU_WARPS];
extern float emu_warp_x[EMU_WARPS][32];
/* the CTAs' shared memory, EMU_SMEM_BYTES each by rank: the kernels' `extern __shared__` array is rank 0's, and
 * cta_smem (common.cuh) moves it to the thread's CTA */
extern unsigned char smem_raw[];
#define EMU_SMEM (smem_raw + (size_t)emu_rank * EMU_SMEM_BYTES)

static inline void __syncthreads(void) { pthread_barrier_wait(&emu_block_bar[emu_rank]); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; pthread_barrier_wait(&emu_warp_bar[EMU_W(threadIdx.x >> 5)]); }
static inline float __shfl_xor_sync(unsigned mask, float x, int o) {
    const int lane = threadIdx.x & 31, w = EMU_W(threadIdx.x >> 5);
    (void)mask;
    emu_warp_x[w][lane] = x;
    pthread_barrier_wait(&emu_warp_bar[w]);
    const float r = emu_warp_x[w][lane ^ o];
    pthread_barrier_wait(&emu_warp_bar[w]);
    return r;
}
#define __ldg(p) (*(p)) /* read-only load of a float, float2 or float4 */
static inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; } /* the kernels' only use: chunk lengths */
static inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; } /* the inter kernel's maxima of exponent bytes and |x| bits */
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
#define __expf(x) expf(x) /* glibc declares its own __expf */

/* Runs kernel(arg) as a grid of `blocks` blocks of `threads` threads, one block after the other (shared memory
 * poisoned before each). kernel is a wrapper that calls one template instance with *arg, its parameters. */
typedef void (*emu_kernel_fn)(const void *arg);
void emu_launch(unsigned blocks, unsigned threads, emu_kernel_fn kernel, const void *arg);
/* the same in clusters of `cluster` consecutive blocks, whose threads run at once */
void emu_launch_cluster(unsigned blocks, unsigned cluster, unsigned threads, emu_kernel_fn kernel, const void *arg);
