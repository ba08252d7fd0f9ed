/*
 * Device helpers shared by the CUDA kernels, written as C: tensor-core and copy instructions through inline
 * PTX, conversions, fast math, and the shared-memory tile layouts.
 *
 * Fragment layouts (mma.sync m16n8k16, bf16 in, fp32 out), with g = lane / 4 and t = lane % 4:
 *   A (16×16, row-major): a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
 *   B (16×8, "col"):      b0 = (k 2t..2t+1, n g)                b1 = (k 2t+8.., n g)
 *   C (16×8, fp32):       c0, c1 = (g, 2t..2t+1)                c2, c3 = (g+8, 2t..2t+1)
 * so two C tiles side by side are, packed to bf16, exactly one A fragment (the C → A reuse of FlashAttention).
 */
#ifndef KDA_CUDA_COMMON_CUH
#define KDA_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kda_cuda.h"

#define DEV static __device__ __forceinline__

#define LOG2E 1.4426950408889634f

/* ---------------------------------------------------------------------------------------------------------
 * Conversions and math
 * ------------------------------------------------------------------------------------------------------- */
DEV uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

DEV uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

DEV float2 unpack_bf16(uint32_t u) {
    __nv_bfloat162 v = *(__nv_bfloat162 *)&u;
    return __bfloat1622float2(v);
}

DEV float bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
DEV float f16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }

/* 2^x with the SFU; x = -inf gives 0 */
DEV float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* 1/x with the SFU (about 1 ulp); 1/inf = 0 */
DEV float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* log2(x) with the SFU (absolute error about 2^-22 near 1) */
DEV float lg2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

DEV float sigmoidf_(float x) { return rcp_approx(1.0f + ex2(-x * LOG2E)); }

DEV float softplusf_(float x) {
    /* log(1 + e^x) = max(x, 0) + log1p(e^-|x|), log1p(e) = e below 2^-12 (error < e^2 / 2) */
    const float e = ex2(-fabsf(x) * LOG2E);
    const float l = e < 2.44140625e-4f ? e : lg2_approx(1.0f + e) * 0.69314718055994531f; /* a select */
    return fmaxf(x, 0.0f) + l;
}

/* Element i of a float tensor of runtime dtype (0 f32, 1 f16, 2 bf16). */
DEV float load_elem(const void *p, int dtype, int64_t i) {
    if (dtype == KDA_DT_F32) return ((const float *)p)[i];
    if (dtype == KDA_DT_F16) return f16_bits_to_f32(((const uint16_t *)p)[i]);
    return bf16_bits_to_f32(((const uint16_t *)p)[i]);
}

DEV void store_elem(void *p, int dtype, int64_t i, float x) {
    if (dtype == KDA_DT_F32) ((float *)p)[i] = x;
    else if (dtype == KDA_DT_F16) ((__half *)p)[i] = __float2half_rn(x);
    else ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(x);
}

/* ---------------------------------------------------------------------------------------------------------
 * Tensor cores and copies
 * ------------------------------------------------------------------------------------------------------- */
DEV void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DEV void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

DEV void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* Bulk copies (the Hopper copy engine) completing on an mbarrier: one thread arms the barrier with the bytes
 * to expect, then the copies are issued; consumers wait on the barrier's phase parity. */
DEV void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
DEV void mbar_init_fence(void) { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
DEV void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
DEV void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n\t.reg .pred P1;\n"
                 "LAB_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
                 "@P1 bra DONE;\n\t"
                 "bra LAB_WAIT;\n"
                 "DONE:\n\t}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
DEV void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
/* order this thread's earlier generic-proxy shared accesses before later async-proxy (bulk copy) ones */
DEV void fence_proxy_async(void) { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* ---------------------------------------------------------------------------------------------------------
 * Tile layout
 * ------------------------------------------------------------------------------------------------------- */
/* Panel layout of a [64][KD] bf16 tile (the workspace's W, QΓ, K̃ and U, and the Aqk tile, KD = 64): KD / 64
 * panels of 64 rows × 128 bytes, 8 KB each, the 16-byte chunk c of row r at chunk c ^ (r & 7), so that the 8
 * rows an ldmatrix reads at one column fall in 8 different bank groups. This is the 128-byte swizzle of the
 * Hopper copy engine and of wgmma's K-major operands, and it makes every 64-column slice of a tile one
 * contiguous 8 KB piece; the recurrence copies the workspace's tiles to shared memory byte for byte. Byte
 * offset of element (row, col); col % 8 == 0 gives the chunk. */
DEV int pan_off(int row, int col) {
    return (col >> 6) * 8192 + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2;
}

/* ---------------------------------------------------------------------------------------------------------
 * Host side of the launchers
 * ------------------------------------------------------------------------------------------------------- */
/* Raise `kernel`'s dynamic shared-memory limit to `bytes` on `device`, once: `done` (one per kernel, indexed by
 * device) remembers what was set (a benign race between threads: they set the same value). */
static inline cudaError_t kda_smem_limit(const void *kernel, int bytes, int device, int done[KDA_MAX_DEVICES]) {
    const int known = device >= 0 && device < KDA_MAX_DEVICES;
    if (known && done[device] >= bytes) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess && known) done[device] = bytes;
    return err;
}

#endif /* KDA_CUDA_COMMON_CUH */
