/* emulator stand-in for src/cuda/common.cuh: what decode.cu uses, on the host (one std::thread per CUDA thread,
 * warp shuffles and votes through a per-warp exchange and barrier) */
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <pthread.h>
#include <thread>
#include <vector>
#include <vector_types.h>
#include <vector_functions.h>
#include "kda_cuda.h"
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define DEV static inline
#define LOG2E 1.4426950408889634f
struct emu_dim { unsigned x, y, z; };
extern thread_local emu_dim threadIdx, blockIdx;
extern emu_dim gridDim;
enum { EMU_WARPS = 4 };
extern pthread_barrier_t emu_warp_bar[EMU_WARPS];
extern uint64_t emu_x[EMU_WARPS][32];
template <class T> inline T emu_xchg(T x, int src) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint64_t u = 0;
    memcpy(&u, &x, sizeof x);
    emu_x[w][lane] = u;
    pthread_barrier_wait(&emu_warp_bar[w]);
    u = emu_x[w][src & 31];
    pthread_barrier_wait(&emu_warp_bar[w]);
    T r;
    memcpy(&r, &u, sizeof r);
    return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T x, int o) { return emu_xchg(x, (int)(threadIdx.x & 31) ^ o); }
template <class T> inline T __shfl_sync(unsigned, T x, int src) { return emu_xchg(x, src); }
inline int __any_sync(unsigned, int pred) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_x[w][lane] = pred != 0;
    pthread_barrier_wait(&emu_warp_bar[w]);
    int r = 0;
    for (int l = 0; l < 32; l++) r |= (int)emu_x[w][l];
    pthread_barrier_wait(&emu_warp_bar[w]);
    return r;
}
template <class T> inline T __ldcs(const T *p) { return *p; }
template <class T> inline void __stcs(T *p, T x) { *p = x; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline void emu_launch(unsigned blocks, unsigned threads, const std::function<void()> &call) {
    gridDim = {blocks, 1, 1};
    for (unsigned b = 0; b < blocks; b++) {
        for (int w = 0; w < EMU_WARPS; w++) pthread_barrier_init(&emu_warp_bar[w], NULL, 32);
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; t++)
            ts.emplace_back([=, &call]() { threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; call(); });
        for (auto &t : ts) t.join();
        for (int w = 0; w < EMU_WARPS; w++) pthread_barrier_destroy(&emu_warp_bar[w]);
    }
}
inline cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char *cudaGetErrorString(cudaError_t) { return "emulated"; }

DEV float bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
DEV float f16_bits_to_f32(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
DEV uint16_t f32_to_bf16_bits(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
DEV uint32_t pack_bf16(float lo, float hi) { return (uint32_t)f32_to_bf16_bits(lo) | ((uint32_t)f32_to_bf16_bits(hi) << 16); }
DEV float2 unpack_bf16(uint32_t u) { return make_float2(bf16_bits_to_f32(u & 0xffff), bf16_bits_to_f32(u >> 16)); }
template <int F16> DEV float2 unpack_16x2(uint32_t u) {
    if (F16) return make_float2(f16_bits_to_f32(u & 0xffff), f16_bits_to_f32(u >> 16));
    return unpack_bf16(u);
}
/* the SFU approximations, as the hardware's ftz variants but exact: the emulation checks the algorithm */
DEV float ex2(float x) { return exp2f(x); }
DEV float rcp_approx(float x) { return 1.0f / x; }
DEV float lg2_approx(float x) { return log2f(x); }
DEV float sigmoidf_(float x) { return rcp_approx(1.0f + ex2(-x * LOG2E)); }
DEV float softplusf_(float x) {
    const float e = ex2(-fabsf(x) * LOG2E);
    const float l = e < 2.44140625e-4f ? e : lg2_approx(1.0f + e) * 0.69314718055994531f;
    return fmaxf(x, 0.0f) + l;
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
