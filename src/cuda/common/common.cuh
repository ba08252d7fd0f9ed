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
#include <string.h>

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

/* exact, by bits (bf16 is fp32's upper half): no split into 16-bit registers, which cost the kernels a pair of PRMT
   wherever a packed pair was also read back */
DEV float2 unpack_bf16(uint32_t u) { return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u)); }

/* The low part of the pair (x0, x1) whose bf16 rounding is hi = pack_bf16(x0, x1): x = hi + lo to ~16 bits */
DEV uint32_t pack_bf16_lo(float x0, float x1, uint32_t hi) {
    const float2 h = unpack_bf16(hi);
    return pack_bf16(x0 - h.x, x1 - h.y);
}

/* two bf16 products in one instruction (each rounded once, to bf16) */
DEV uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
    uint32_t c;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(c) : "r"(a), "r"(b));
    return c;
}

/* a pair of 16-bit floats (the low half first) → fp32, the format fixed at compile time: F16 fp16, else bf16 */
template <int F16>
DEV float2 unpack_16x2(uint32_t u) {
    if (F16)
        return make_float2(__half2float(__ushort_as_half((uint16_t)(u & 0xffffu))),
                           __half2float(__ushort_as_half((uint16_t)(u >> 16))));
    return unpack_bf16(u);
}

/* two fp32 → a pair of 16-bit floats (the low half first, rounded to nearest), F16 fp16, else bf16 */
template <int F16>
DEV uint32_t pack_16x2(float lo, float hi) {
    if (F16) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *(uint32_t *)&v;
    }
    return pack_bf16(lo, hi);
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

/* β after its sigmoid (c = 1, or 2 with allow_neg_eigval), as torch computes sigmoid in fp32: 1 / (1 + expf(−x))
   with the accurate expf and an IEEE division. A caller who applies the sigmoid before the call (FLA's tests
   compare the two) then passes the same β bits as the kernel forms; one value per token and head, so the cost
   of the accurate functions is nothing. */
DEV float beta_sigmoid(float x, int neg_eigval) {
    const float s = __fdiv_rn(1.0f, 1.0f + expf(-x));
    return neg_eigval ? 2.0f * s : s;
}

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

/* load_elem in two halves: the element's bits (no conversion, so loads issued one after another do not wait
 * for each other's data), and their value. */
DEV uint32_t load_bits(const void *p, int dtype, int64_t i) {
    return dtype == KDA_DT_F32 ? ((const uint32_t *)p)[i] : (uint32_t)((const uint16_t *)p)[i];
}
DEV float bits_value(uint32_t b, int dtype) {
    if (dtype == KDA_DT_F32) return __uint_as_float(b);
    if (dtype == KDA_DT_F16) return f16_bits_to_f32((uint16_t)b);
    return bf16_bits_to_f32((uint16_t)b);
}

/* bits_value for a dtype known at compile time (its tests fold away) */
template <int DT>
DEV float bits_as(uint32_t b) {
    return bits_value(b, DT);
}

/* bits_value of N elements, the dtype tested once outside the loop (per element the test became a constant
 * load, a compare and a branch around each conversion: ~6 instructions instead of 1) */
template <int N>
DEV void bits_values(float (&x)[N], const uint32_t (&b)[N], int dtype) {
    if (dtype == KDA_DT_F32) {
#pragma unroll
        for (int r = 0; r < N; r++) x[r] = __uint_as_float(b[r]);
    } else if (dtype == KDA_DT_F16) {
#pragma unroll
        for (int r = 0; r < N; r++) x[r] = f16_bits_to_f32((uint16_t)b[r]);
    } else {
#pragma unroll
        for (int r = 0; r < N; r++) x[r] = bf16_bits_to_f32((uint16_t)b[r]);
    }
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

/* the same with fp16 operands (11 significant bits) */
DEV void mma_f16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x rounded to tf32 (nearest, ties to even), as an fp32 bit pattern. cvt.rn (sm_90+) is one instruction
 * (F2FP.TF32.F32); cvt.rna, ties away, was emulated by three (a compare with inf, an add, a mask), ~30 % of the
 * backward kernels' instructions in their product phases */
DEV float to_tf32(float x) {
    uint32_t r;
    asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}

/* x as tf32 parts hi + lo (lo = x − hi, rounded): the operands of 3xTF32, A B ≈ Ah Bh + Ah Bl + Al Bh (~fp32) */
DEV void split_tf32(float x, float *hi, float *lo) {
    *hi = to_tf32(x);
    *lo = to_tf32(x - *hi);
}

/* x as tf32 parts by masks, hi = x with its 13 low mantissa bits cleared, lo = x − hi (exact) likewise: two integer
 * ops and an add, where split_tf32's two cvt.rn are conversions (F2FP: 30 % of the CP merge's instructions with
 * split_tf32). Both parts toward zero, so A B ≈ Ah Bh + Ah Bl + Al Bh within ~2^-19
 * relative (against ~2^-21 for split_tf32): still far below the bf16 outputs' 2^-8 */
DEV void split_tf32_rz(float x, float *hi, float *lo) {
    *hi = __uint_as_float(__float_as_uint(x) & 0xffffe000u);
    *lo = __uint_as_float(__float_as_uint(x - *hi) & 0xffffe000u);
}

/* c += A B, m16n8k8 with tf32 operands: a0..a3 = A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4);
 * b0, b1 = B(t, g), B(t + 4, g) (lane = 4g + t) */
DEV void mma_tf32(float c[4], float a0, float a1, float a2, float a3, float b0, float b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)),
                   "r"(__float_as_uint(a3)), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

/* One k8 step of an ~fp32 product on the tensor cores (3xTF32: A B ≈ Ah Bh + (Al Bh + Ah Bl), each part a chain of
 * its own accumulator): A's fragment already split into ah, al (a0..a3 as mma_tf32 takes them), B's two elements
 * b0, b1 split here by split_tf32_rz */
DEV void mma_3xtf32(float c_hh[4], float c_lh[4], float c_hl[4], const float ah[4], const float al[4], float b0,
                    float b1) {
    float bh0, bl0, bh1, bl1;
    split_tf32_rz(b0, &bh0, &bl0);
    split_tf32_rz(b1, &bh1, &bl1);
    mma_tf32(c_hh, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
    mma_tf32(c_lh, al[0], al[1], al[2], al[3], bh0, bh1);
    mma_tf32(c_hl, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
}

/* Two C tiles side by side (columns 16k..16k+15), packed to bf16: the A fragment over those columns (the C → A
 * reuse above; also wgmma's register A operand from its accumulators) */
DEV void acc_pair_to_a(const float c0[4], const float c1[4], uint32_t a[4]) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}

/* A state held transposed in accumulators, s[nt][c] = S[8 nt + 2 t + (c & 1)][row]: each of its K rows d scaled by
 * gam[d] (Sᵀ ← Sᵀ Diag(γ); the recurrence's decay, forward and backward) */
template <int KD>
DEV void decay_state(float (&s)[KD / 8][4], const float *gam, int t) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++) {
        const float2 gg = *(const float2 *)&gam[8 * nt + 2 * t];
        s[nt][0] *= gg.x;
        s[nt][1] *= gg.y;
        s[nt][2] *= gg.x;
        s[nt][3] *= gg.y;
    }
}

/* 16 bytes of shared memory into four registers where the code stands (volatile: a plain load may be hoisted
   and lengthen its registers' lives; prep's solve_w_u spilled so) */
DEV void lds_u4(uint32_t r[4], uint32_t addr) {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
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

/* stmatrix (x4, .trans): the warp's four 8 × 8 bf16 matrices r[q], held as mma accumulators are (lane (g, t):
 * row g, columns 2t, 2t + 1), stored transposed: row i of matrix q (its column i) to the 16 bytes at the address of
 * lane 8q + i */
DEV void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

/* movmatrix (.trans): an 8 × 8 bf16 matrix held as an mma accumulator, transposed across the warp (lane (g, t)
 * then holds row g, columns 2t, 2t + 1 of the transpose) */
DEV uint32_t movm_t(uint32_t a) {
    uint32_t d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}

/* 16 bytes global → shared through L2 (cp.async.cg), of which the first src_bytes (0 or 16) are read and the
 * rest zero-filled; cp_async_wait_all waits for this thread's copies. */
DEV void cp_async16_zfill(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* 8 or 4 bytes global → shared through L1 (cp.async.ca), the first src_bytes read, the rest zero-filled */
DEV void cp_async8_zfill(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
DEV void cp_async4_zfill(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
DEV void cp_async_wait_all(void) { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
/* An arrival on the mbarrier at `bar` once this thread's earlier cp.async copies are complete (.noinc: the
 * barrier's count includes it) */
DEV void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/* Close this thread's copies issued since the last commit into a group; wait until at most N groups are pending
 * (the older ones' data is then visible to this thread). */
DEV void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
DEV void cp_async_wait_group(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
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

/* Thread-block clusters (sm_90 and later): a barrier of every thread of the cluster in two halves (arrive
 * releases this thread's earlier memory accesses, wait acquires the others'; every thread of a warp executes both,
 * at the same point), and an asynchronous store of a float pair into CTA `rank`'s shared memory at the offset that
 * `local` has in this CTA's, which completes 8 bytes of the transaction count of that CTA's mbarrier at the offset
 * `bar` (no fence on the sender's side; the receiver's wait on its barrier makes the data visible to it). The
 * receiving CTA must have started and initialised the barrier (a cluster barrier between its init and the first
 * such store) and must not exit before its barrier completes. A CTA's own dynamic shared memory is
 * cta_smem(smem_raw): the array itself here (the host emulator gives each CTA of a cluster its own). */
DEV void cluster_arrive(void) { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
/* An arrive that orders nothing but an mbarrier's initialisation before it (fence.mbarrier_init.release.cluster):
 * the release form would put a MEMBAR.ALL.GPU at the kernel's start */
DEV void cluster_arrive_relaxed(void) { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
DEV void cluster_wait(void) { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
DEV void cluster_st_async2(const void *local, uint32_t bar, unsigned rank, float x, float y) {
    uint32_t a, b;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_u32(local)), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(b) : "r"(bar), "r"(rank));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(a),
                 "f"(x), "f"(y), "r"(b)
                 : "memory");
}
/* The float at the offset that `local` has in this CTA's shared memory, read from CTA `rank`'s (distributed shared
 * memory; ordered by the cluster barriers around it) */
DEV float cluster_ld(const float *local, unsigned rank) {
    uint32_t a;
    float x;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_u32(local)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(a) : "memory");
    return x;
}
/* The whole cluster's barrier: every thread's earlier shared-memory accesses (its own CTA's and the others') before
 * every thread's later ones */
DEV void cluster_sync(void) {
    cluster_arrive();
    cluster_wait();
}
DEV unsigned char *cta_smem(unsigned char *smem) { return smem; }

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
/* pan_off(row8 + r, col) for row8 a multiple of 8 and 0 ≤ r < 8, written so that the swizzle term depends on r and
 * col only: in a loop over row8 (prep's solve_w_u) it is computed once, not per row block (the compiler cannot
 * tell that (row8 + r) & 7 == r) */
DEV int pan_off_r8(int row8, int r, int col) {
    return (col >> 6) * 8192 + row8 * 128 + (r * 128 + ((((col >> 3) & 7) ^ r) << 4) + (col & 7) * 2);
}

/* ---------------------------------------------------------------------------------------------------------
 * Warpgroup MMA (sm_90a only: KDA_WGMMA is defined in the device pass of that target)
 *
 * wgmma.mma_async m64nNk16, bf16 in, fp32 accumulators; A (64×16) from registers, B (16×N) from shared memory
 * through a descriptor. Per warp w of the warpgroup the fragments are those of mma.sync above for rows
 * 16w..16w+15: the A registers are an m16n8k16 A fragment, and accumulator 4j + c is C tile j's c (columns
 * 8j..8j+7). Our panel layout is the 128-byte swizzle of both operand majors:
 *   K-major B (B[n][k] has k contiguous: W, QΓ, Aqk rows): 8-row groups 1024 bytes apart (SBO); a k-step of 16
 *     moves the start 32 bytes along the row, the next 64 k are the next panel.
 *   MN-major B (n contiguous: K̃ rows are tokens = k, columns n): 64 n per panel, the next panel LBO = 8192
 *     bytes on; 8 k-rows per 1024-byte group (SBO); a k-step of 16 moves the start 2048 bytes.
 * Panels must start on 1024-byte boundaries (the swizzle is taken from address bits 4–9).
 * ------------------------------------------------------------------------------------------------------- */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_WGMMA 1
#endif

DEV uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62); /* 128-byte swizzle */
}
DEV uint64_t wg_desc_kmaj(uint32_t addr) { return wg_desc(addr, 16, 1024); }
DEV uint64_t wg_desc_mnmaj(uint32_t addr) { return wg_desc(addr, 8192, 1024); }

#ifdef KDA_WGMMA
DEV void wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEV void wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
#define WG_WAIT(N) asm volatile("wgmma.wait_group.sync.aligned " #N ";\n" ::: "memory")
/* keep the compiler from moving accesses of accumulator registers across an issue or a wait */
DEV void reg_fence(float *r, int n) {
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(r[i])::"memory");
}

DEV void wgmma_n64_kmaj(float *d, const uint32_t a[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
                 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
                   "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
DEV void wgmma_n64_mnmaj(float *d, const uint32_t a[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
                 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
                   "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
DEV void wgmma_n128_mnmaj(float *d, const uint32_t a[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                 "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
                   "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
                   "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
                   "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
                   "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
                   "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#endif /* KDA_WGMMA */

/* Programmatic dependent launch (sm_90 on; kda_launch_ex with pdl sets the launch attribute): a kernel so launched
 * may be scheduled before the kernel ahead of it in the stream has finished, so its first act is pdl_wait(), which
 * returns once that kernel has completed and its writes are visible (at once for a kernel launched without the
 * attribute). pdl_trigger() then lets the next such kernel be scheduled once every CTA of this one has passed it:
 * its CTAs take the SMs that this kernel's last wave leaves, and wait there, rather than being launched after it
 * ends. */
DEV void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
DEV void pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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

/* Launch `kernel`, whose one argument is the params struct at `params`, on `ctas` CTAs of `threads` threads with
 * `bytes` of dynamic shared memory (its limit raised once per device through `done`), in clusters of `cluster`
 * consecutive CTAs when cluster > 1 (ctas a multiple of it; scheduled for load balance, not the default spread),
 * with programmatic stream serialisation when pdl (the kernel
 * may be scheduled before the one ahead of it in the stream completes: see pdl_trigger): 0 or the cudaError_t. */
static inline int kda_launch_ex(const void *kernel, int64_t ctas, int cluster, int threads, int bytes,
                                const void *params, int device, int done[KDA_MAX_DEVICES], void *stream, int pdl) {
    cudaError_t err = kda_smem_limit(kernel, bytes, device, done);
    if (err != cudaSuccess) return (int)err;
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[3];
    memset(&cfg, 0, sizeof cfg);
    memset(attr, 0, sizeof attr);
    unsigned n = 0;
    if (cluster > 1) {
        attr[n].id = cudaLaunchAttributeClusterDimension;
        attr[n].val.clusterDim.x = (unsigned)cluster, attr[n].val.clusterDim.y = 1, attr[n].val.clusterDim.z = 1;
        n++;
        attr[n].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
        attr[n].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
        n++;
    }
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    cfg.gridDim = dim3((unsigned)ctas), cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = (size_t)bytes, cfg.stream = (cudaStream_t)stream;
    cfg.attrs = n ? attr : NULL, cfg.numAttrs = n;
    void *args[] = {(void *)params};
    err = cudaLaunchKernelExC(&cfg, kernel, args);
    return err != cudaSuccess ? (int)err : (int)cudaGetLastError();
}

/* kda_launch_ex without clusters or the attribute: the plain launch */
static inline int kda_launch(const void *kernel, int64_t ctas, int threads, int bytes, const void *params, int device,
                             int done[KDA_MAX_DEVICES], void *stream) {
    return kda_launch_ex(kernel, ctas, 1, threads, bytes, params, device, done, stream, 0);
}

/* kda_launch with the CTAs in clusters of `cluster` consecutive ones (ctas a multiple of it) */
static inline int kda_launch_cluster(const void *kernel, int64_t ctas, int cluster, int threads, int bytes,
                                     const void *params, int device, int done[KDA_MAX_DEVICES], void *stream) {
    return kda_launch_ex(kernel, ctas, cluster, threads, bytes, params, device, done, stream, 0);
}

#endif /* KDA_CUDA_COMMON_CUH */
