/* Stand-in for src/cuda/common/common.cuh under the host emulation of the CP merge (merge_emu.cu): one pthread per CUDA
 * thread, one CTA at a time; __syncthreads a barrier of the block, a warp's ballot an exchange through its lanes'
 * slots between two barriers of the warp; shared memory one poisoned buffer (run.sh turns the kernel's extern
 * declaration into a pointer to it; __shared__ statics are the CTA's since CTAs run one after another); bulk copies
 * land at once and complete their mbarrier's phase, whose waiters spin until it has; tf32 mma.sync by an exchange
 * through the warp's lanes. Only what cp_merge.cu uses. */
#pragma once
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <atomic>
#include "kda_cuda.h"
#define DEV static inline
#define __device__
#define __host__
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define KDA_MAX_DEVICES 16
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
struct float2 { float x, y; };
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
typedef struct { unsigned x, y, z; } emu_dim;
extern __thread emu_dim threadIdx;
extern emu_dim blockIdx, gridDim;
#define EMU_MAX_WARPS 32
#define EMU_SMEM (232 * 1024)
extern unsigned char emu_smem[EMU_SMEM];
extern pthread_barrier_t emu_block_bar, emu_warp_bar[EMU_MAX_WARPS];
extern int emu_warp_x[EMU_MAX_WARPS][32];
static inline void __syncthreads(void) { pthread_barrier_wait(&emu_block_bar); }
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    (void)mask;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_warp_x[w][lane] = pred != 0;
    pthread_barrier_wait(&emu_warp_bar[w]);
    unsigned m = 0;
    for (int l = 0; l < 32; l++) m |= (unsigned)emu_warp_x[w][l] << l;
    pthread_barrier_wait(&emu_warp_bar[w]);
    return m;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
/* tf32: round to nearest, ties to even (cvt.rn.tf32.f32); the m16n8k8 tf32 product of a warp sums in k order
 * (mma_tf32.cuh), and the merge's host reference (merge_emu.cu) sums in the same order */
DEV float to_tf32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
    float y;
    memcpy(&y, &u, 4);
    return y;
}
DEV void split_tf32(float x, float *hi, float *lo) { *hi = to_tf32(x); *lo = to_tf32(x - *hi); }
#define EMU_TF32_SLOTS EMU_MAX_WARPS
#define EMU_TF32_SLOT(w) (w)
#include "mma_tf32.cuh" /* dev/bwd_emu's, copied beside this file by run.sh */
DEV void pdl_wait(void) {}
DEV void pdl_trigger(void) {}
DEV uint32_t smem_u32(const void *p) { return (uint32_t)((const unsigned char *)p - emu_smem); }
/* mbarriers: by their offset; count 1 (one arrive, the expect_tx) */
struct emu_mbar { uint32_t off; int used; long expect, got; int arrived; std::atomic<int> phase; };
extern emu_mbar emu_bars[64];
extern pthread_mutex_t emu_bar_lock;
static inline emu_mbar *emu_bar(uint32_t off) {
    for (int i = 0; i < 64; i++) if (emu_bars[i].used && emu_bars[i].off == off) return &emu_bars[i];
    fprintf(stderr, "emu: no mbarrier at %u\n", off);
    exit(3);
}
static inline void emu_complete(emu_mbar *b) {
    if (b->arrived && b->got == b->expect) { b->arrived = 0, b->got = b->expect = 0; b->phase.fetch_add(1); }
}
DEV void mbar_init(uint32_t bar, int count) {
    if (count != 1) { fprintf(stderr, "emu: mbarrier count %d\n", count); exit(3); }
    for (int i = 0; i < 64; i++)
        if (!emu_bars[i].used) { emu_bars[i].used = 1, emu_bars[i].off = bar, emu_bars[i].expect = emu_bars[i].got = 0;
                                 emu_bars[i].arrived = 0; emu_bars[i].phase = 0; return; }
    exit(3);
}
DEV void mbar_init_fence(void) {}
DEV void fence_proxy_async(void) {}
DEV void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    pthread_mutex_lock(&emu_bar_lock);
    emu_mbar *b = emu_bar(bar);
    if (b->arrived) { fprintf(stderr, "emu: second arrive on mbarrier %u in one phase\n", bar); exit(3); }
    b->arrived = 1, b->expect += bytes;
    emu_complete(b);
    pthread_mutex_unlock(&emu_bar_lock);
}
DEV void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    if (dst + bytes > EMU_SMEM) { fprintf(stderr, "emu: bulk copy past shared memory\n"); exit(3); }
    memcpy(emu_smem + dst, src, bytes);
    pthread_mutex_lock(&emu_bar_lock);
    emu_mbar *b = emu_bar(bar);
    b->got += bytes;
    emu_complete(b);
    pthread_mutex_unlock(&emu_bar_lock);
}
DEV void mbar_wait(uint32_t bar, uint32_t parity) {
    emu_mbar *b = emu_bar(bar);
    for (long spin = 0; (b->phase.load() & 1) == (int)parity; spin++) {
        if (spin > 200000000L) { fprintf(stderr, "emu: mbarrier %u never reached parity %u\n", bar, parity); exit(3); }
        sched_yield();
    }
}
/* the launcher's grid, for the harness to run */
extern const void *emu_kernel;
extern int64_t emu_ctas;
extern int emu_threads, emu_bytes;
static inline int kda_launch_ex(const void *kernel, int64_t ctas, int cluster, int threads, int bytes, const void *params,
                                int device, int done[KDA_MAX_DEVICES], void *stream, int pdl) {
    (void)cluster, (void)params, (void)device, (void)done, (void)stream, (void)pdl;
    emu_kernel = kernel, emu_ctas = ctas, emu_threads = threads, emu_bytes = bytes;
    return 0;
}
