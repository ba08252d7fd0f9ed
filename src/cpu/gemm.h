/*
 * Small float32 matrix products for the CPU chunked path.
 *
 *     C[m×n] = (accumulate ? C : 0) + A[m×kd] · B[kd×n]
 *
 * (kda_gemm_tri: A is lower triangular, A(i, l) = 0 for l > i, and those terms are skipped: row i of C never
 * reads rows l > i of B, so an inf or NaN in a later row of B cannot reach it through 0 · inf. This is what
 * keeps the chunked forward causal: row i is token i.)
 *
 * A is read through element strides (A(i, l) = A[i*rsa + l*csa]) so the same code serves A and Aᵀ; B and C are
 * row-major. Register tiles of 4 rows × 16 columns held in GCC vector registers (one AVX-512 register, two
 * AVX2 registers or four SSE registers, whichever the clone was built for). Header-only and always inlined,
 * so that it is compiled once per target of the function that calls it (see KDA_CPU_CLONES).
 */
#ifndef KDA_CPU_GEMM_H
#define KDA_CPU_GEMM_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(KDA_NO_CLONES)
#define KDA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KDA_CPU_CLONES
#endif
#define KDA_INLINE static inline __attribute__((always_inline))

typedef float kda_v16f __attribute__((vector_size(64)));

KDA_INLINE kda_v16f kda_ld16(const float *p) {
    kda_v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

KDA_INLINE void kda_st16(float *p, kda_v16f v) { memcpy(p, &v, sizeof v); }

KDA_INLINE void kda_gemm_tri(int m, int n, int kd, const float *A, int64_t rsa, int64_t csa, const float *B,
                             int64_t ldb, float *C, int64_t ldc, int accumulate, int lower) {
    const int n32 = n & ~31, n16 = n & ~15;
    for (int i = 0; i < m; i += 4) {
        const int mr = m - i < 4 ? m - i : 4;
        /* lower triangular A: A(i, l) = 0 for l > i. Terms l <= i hold for all four rows of the tile; for
           l in (i, i + 3] only rows i + r with r >= l − i take them (below) */
        const int kdi = lower && i + 4 < kd ? i + 4 : kd;
        const int kdall = lower && i + 1 < kd ? i + 1 : kd;
        /* rows past m repeat the last row: valid memory, results discarded */
        const float *a0 = A + (int64_t)i * rsa;
        const float *a1 = A + (int64_t)(mr > 1 ? i + 1 : i) * rsa;
        const float *a2 = A + (int64_t)(mr > 2 ? i + 2 : i) * rsa;
        const float *a3 = A + (int64_t)(mr > 3 ? i + 3 : i) * rsa;
        float *cr = C + (int64_t)i * ldc;
        for (int j = 0; j < n32; j += 32) {
            kda_v16f c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
            for (int l = 0; l < kdall; l++) {
                const kda_v16f b = kda_ld16(B + (int64_t)l * ldb + j), e = kda_ld16(B + (int64_t)l * ldb + j + 16);
                const int64_t o = (int64_t)l * csa;
                const float x0 = a0[o], x1 = a1[o], x2 = a2[o], x3 = a3[o];
                c0 += x0 * b;
                d0 += x0 * e;
                c1 += x1 * b;
                d1 += x1 * e;
                c2 += x2 * b;
                d2 += x2 * e;
                c3 += x3 * b;
                d3 += x3 * e;
            }
            for (int l = kdall; l < kdi; l++) { /* lower only: l − i in 1..3 */
                const kda_v16f b = kda_ld16(B + (int64_t)l * ldb + j), e = kda_ld16(B + (int64_t)l * ldb + j + 16);
                const int64_t o = (int64_t)l * csa;
                if (l <= i + 1) {
                    c1 += a1[o] * b;
                    d1 += a1[o] * e;
                }
                if (l <= i + 2) {
                    c2 += a2[o] * b;
                    d2 += a2[o] * e;
                }
                c3 += a3[o] * b;
                d3 += a3[o] * e;
            }
            kda_v16f *acc[4][2] = {{&c0, &d0}, {&c1, &d1}, {&c2, &d2}, {&c3, &d3}};
            for (int r = 0; r < mr; r++)
                for (int h = 0; h < 2; h++) {
                    float *c = cr + (int64_t)r * ldc + j + 16 * h;
                    kda_st16(c, accumulate ? *acc[r][h] + kda_ld16(c) : *acc[r][h]);
                }
        }
        for (int j = n32; j < n16; j += 16) {
            kda_v16f c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int l = 0; l < kdall; l++) {
                const kda_v16f b = kda_ld16(B + (int64_t)l * ldb + j);
                const int64_t o = (int64_t)l * csa;
                c0 += a0[o] * b;
                c1 += a1[o] * b;
                c2 += a2[o] * b;
                c3 += a3[o] * b;
            }
            for (int l = kdall; l < kdi; l++) { /* lower only, as above */
                const kda_v16f b = kda_ld16(B + (int64_t)l * ldb + j);
                const int64_t o = (int64_t)l * csa;
                if (l <= i + 1) c1 += a1[o] * b;
                if (l <= i + 2) c2 += a2[o] * b;
                c3 += a3[o] * b;
            }
            kda_v16f *acc[4] = {&c0, &c1, &c2, &c3};
            for (int r = 0; r < mr; r++) {
                float *c = cr + (int64_t)r * ldc + j;
                kda_st16(c, accumulate ? *acc[r] + kda_ld16(c) : *acc[r]);
            }
        }
        for (int r = 0; r < mr; r++) {
            const int kdr = lower && i + r + 1 < kd ? i + r + 1 : kd;
            for (int j = n16; j < n; j++) {
                float s = 0.0f;
                for (int l = 0; l < kdr; l++) s += A[(int64_t)(i + r) * rsa + (int64_t)l * csa] * B[(int64_t)l * ldb + j];
                float *c = cr + (int64_t)r * ldc + j;
                *c = accumulate ? *c + s : s;
            }
        }
    }
}

KDA_INLINE void kda_gemm(int m, int n, int kd, const float *A, int64_t rsa, int64_t csa, const float *B,
                         int64_t ldb, float *C, int64_t ldc, int accumulate) {
    kda_gemm_tri(m, n, kd, A, rsa, csa, B, ldb, C, ldc, accumulate, 0);
}

#endif /* KDA_CPU_GEMM_H */
