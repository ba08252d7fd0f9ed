/* host emulation of the few CUDA features the backward kernels use: one std::thread per CUDA thread */
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <pthread.h>
#include <vector_types.h>
#include <vector_functions.h>
#include <algorithm>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__
struct emu_dim { unsigned x, y, z; };
extern thread_local emu_dim threadIdx, blockIdx;
extern pthread_barrier_t emu_block_bar;
extern pthread_barrier_t emu_warp_bar[16];
extern float emu_warp_x[16][32];
inline void __syncthreads() { pthread_barrier_wait(&emu_block_bar); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_warp_x[w][lane] = x;
    pthread_barrier_wait(&emu_warp_bar[w]);
    float r = emu_warp_x[w][lane ^ o];
    pthread_barrier_wait(&emu_warp_bar[w]);
    return r;
}
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
using std::isfinite;
#include <thread>
#include <vector>
extern unsigned char smem_raw[];
template <class F> void emu_launch(unsigned blocks, unsigned threads, F call) {
    for (unsigned b = 0; b < blocks; b++) {
        pthread_barrier_init(&emu_block_bar, NULL, threads);
        for (int w = 0; w < 16; w++) pthread_barrier_init(&emu_warp_bar[w], NULL, 32);
        memset(smem_raw, 0xff, 232448); /* poison shared memory */
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; t++)
            ts.emplace_back([=]() { threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; call(); });
        for (auto &t : ts) t.join();
        pthread_barrier_destroy(&emu_block_bar);
        for (int w = 0; w < 16; w++) pthread_barrier_destroy(&emu_warp_bar[w]);
    }
}
inline float __expf(float x) { return expf(x); }
