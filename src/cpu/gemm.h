/*
 * Small float32 matrix products for the CPU chunked path.
 *
 *     C[m×n] = (accumulate ? C : 0) + A[m×kd] · B[kd×n]     (kda_gemm_ex: also X − A·B and Diag(X) C + A·B)
 *
 * (kda_gemm_tri: A is lower triangular, A(i, l) = 0 for l > i. Those terms are never formed: row i of C only
 * reads rows l ≤ i of B, so a non-finite value in a later row of B cannot reach it through 0·inf — the
 * causality of docs/ALGORITHM.md's non-finite contract.)
 *
 * A is read through element strides (A(i, l) = A[i*rsa + l*csa]) so the same code serves A and Aᵀ; B and C are
 * row-major. Every element of C is one chain of fused multiply-adds over l = 0, 1, ... in order, whatever the
 * tile, the column range or m: a product over a column slice gives the same bits as the full product (the
 * column-split recurrence of chunk.c relies on it).
 *
 * Register tile: KDA_GEMM_MR rows × KDA_GEMM_NV vectors of KDA_GEMM_VW floats, sized to the register file of
 * the target the including file is compiled for (accumulators + B vectors + one broadcast ≤ the registers):
 *   AVX-512 (32 zmm):      4 × 2×16   (8 accumulators)
 *   AVX/AVX2 (16 ymm):     6 × 2×8    (12 accumulators + 2 + 1 = 15; a short last tile of 4 rows)
 *   SSE2 (16 xmm):         4 × 2×4    (8 + 2 + 1 = 11)
 *   NEON (32 q):           4 × 4×4    (16 + 4 + 1 = 21)
 The tile follows the macros of the file's compile target: a file built once for the default x86-64 target
 * (or through KDA_CPU_CLONES, whose clones share the base target's macros) gets the SSE2 tile; chunk.c is
 * compiled once per x86-64 level instead (CMakeLists.txt's KDA_CPU_ISAS; KDA_CPU_ISA) and gets the tile of each.
 * Header-only and always inlined.
 */
#ifndef KDA_CPU_GEMM_H
#define KDA_CPU_GEMM_H

#include <stdint.h>
#include <string.h>

/* KDA_NO_CLONES (set by CMakeLists.txt for KDA_SANITIZE=thread, and here for any ThreadSanitizer build, e.g.
 * -fsanitize=thread in CMAKE_C_FLAGS): one version, no target_clones resolver; the resolvers run during
 * relocation, before a sanitizer runtime that instruments them is initialised. */
#if !defined(KDA_NO_CLONES) && defined(__SANITIZE_THREAD__) /* gcc */
#define KDA_NO_CLONES 1
#endif
#if !defined(KDA_NO_CLONES) && defined(__has_feature)
#if __has_feature(thread_sanitizer) /* clang */
#define KDA_NO_CLONES 1
#endif
#endif
/* KDA_CPU_CLONES: a function compiled for the base target and once more per x86-64 level the build carries
 * (KDA_CPU_HAVE_V4, KDA_CPU_HAVE_V3: CMakeLists.txt's KDA_CPU_ISAS, the levels chunk.c is built for too), the
 * version run chosen when the library loads; no level (or KDA_NO_CLONES): one version, no resolver. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(KDA_NO_CLONES)
#if KDA_CPU_HAVE_V4 && KDA_CPU_HAVE_V3
#define KDA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif KDA_CPU_HAVE_V4
#define KDA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#elif KDA_CPU_HAVE_V3
#define KDA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef KDA_CPU_CLONES
#define KDA_CPU_CLONES
#endif
#define KDA_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define KDA_GEMM_VW 16
#define KDA_GEMM_NV 2
#elif defined(__AVX__)
#define KDA_GEMM_VW 8
#define KDA_GEMM_NV 2
#define KDA_GEMM_MR 6
#elif defined(__aarch64__)
#define KDA_GEMM_VW 4
#define KDA_GEMM_NV 4
#else
#define KDA_GEMM_VW 4
#define KDA_GEMM_NV 2
#endif
#ifndef KDA_GEMM_MR
#define KDA_GEMM_MR 4
#endif
#define KDA_GEMM_NR (KDA_GEMM_VW * KDA_GEMM_NV)

typedef float kda_vf __attribute__((vector_size(4 * KDA_GEMM_VW)));

KDA_INLINE kda_vf kda_ldv(const float *p) {
    kda_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

KDA_INLINE void kda_stv(float *p, kda_vf v) { memcpy(p, &v, sizeof v); }

/* One tile: rows a[0..MR) (row r of the tile may use l < lim[r]), NV vectors of columns from B + j. */
#define KDA_GEMM_TILE(MRT, NVT)                                                                                        \
    do {                                                                                                               \
        kda_vf acc[MRT][NVT];                                                                                          \
        for (int r = 0; r < MRT; r++)                                                                                  \
            for (int u = 0; u < NVT; u++) acc[r][u] = (kda_vf){0};                                                     \
        int l = 0;                                                                                                     \
        for (; l < lfull; l++) {                                                                                       \
            const float *b = B + (int64_t)l * ldb + j;                                                                 \
            kda_vf bv[NVT];                                                                                            \
            for (int u = 0; u < NVT; u++) bv[u] = kda_ldv(b + u * KDA_GEMM_VW);                                        \
            const int64_t o = (int64_t)l * csa;                                                                        \
            for (int r = 0; r < MRT; r++) {                                                                            \
                const float x = ar[r][o];                                                                              \
                for (int u = 0; u < NVT; u++) acc[r][u] += x * bv[u];                                                  \
            }                                                                                                          \
        }                                                                                                              \
        for (; l < lend; l++) { /* triangular edge: row r takes l only while l < lim[r] */                             \
            const float *b = B + (int64_t)l * ldb + j;                                                                 \
            kda_vf bv[NVT];                                                                                            \
            for (int u = 0; u < NVT; u++) bv[u] = kda_ldv(b + u * KDA_GEMM_VW);                                        \
            const int64_t o = (int64_t)l * csa;                                                                        \
            for (int r = 0; r < MRT; r++)                                                                              \
                if (l < lim[r]) {                                                                                      \
                    const float x = ar[r][o];                                                                          \
                    for (int u = 0; u < NVT; u++) acc[r][u] += x * bv[u];                                              \
                }                                                                                                      \
        }                                                                                                              \
        if (mr == MRT) /* a whole tile: no row guard (else clang keeps testing r < mr row by row) */                   \
            for (int r = 0; r < MRT; r++)                                                                              \
                for (int u = 0; u < NVT; u++) KDA_GEMM_STORE(r, u);                                                    \
        else                                                                                                           \
            for (int r = 0; r < MRT; r++) /* constant indices into acc (a loop to mr put it on the stack) */           \
                for (int u = 0; u < NVT && r < mr; u++) KDA_GEMM_STORE(r, u);                                          \
    } while (0)

/* Element vector (r, u) of a tile: acc[r][u] combined with C or X by the mode, stored into C. */
#define KDA_GEMM_STORE(r, u)                                                                                           \
    do {                                                                                                               \
        float *c = cr + (int64_t)(r)*ldc + j + (u)*KDA_GEMM_VW;                                                        \
        kda_vf y = acc[r][u];                                                                                          \
        if (mode == KDA_GEMM_ADD) y = kda_ldv(c) + y;                                                                  \
        if (mode == KDA_GEMM_SUB_FROM) y = kda_ldv(xr + (int64_t)(r)*ldx + j + (u)*KDA_GEMM_VW) - y;                   \
        if (mode == KDA_GEMM_SCALE_ADD) y = kda_ldv(c) * X[i + (r)] + y;                                               \
        kda_stv(c, y);                                                                                                 \
    } while (0)

/* What a product does with C (mode): C = A·B; C += A·B; C = X − A·B (X m×n, row stride ldx); C = Diag(X) C + A·B
 * (X the m row scales: C[i][j]·X[i] + (A·B)[i][j], one expression). */
#define KDA_GEMM_SET 0
#define KDA_GEMM_ADD 1
#define KDA_GEMM_SUB_FROM 2
#define KDA_GEMM_SCALE_ADD 3

KDA_INLINE void kda_gemm_ex(int m, int n, int kd, const float *A, int64_t rsa, int64_t csa, const float *B, int64_t ldb,
                            float *C, int64_t ldc, int mode, const float *X, int64_t ldx, int lower) {
    const int nr = n - n % KDA_GEMM_NR, nv = n - n % KDA_GEMM_VW;
    for (int i = 0; i < m; i += KDA_GEMM_MR) {
        const int mr = m - i < KDA_GEMM_MR ? m - i : KDA_GEMM_MR;
        /* rows past m repeat the last row: valid memory, results discarded */
        const float *ar[KDA_GEMM_MR];
        int lim[KDA_GEMM_MR];
        for (int r = 0; r < KDA_GEMM_MR; r++) {
            const int row = r < mr ? i + r : i + mr - 1;
            ar[r] = A + (int64_t)row * rsa;
            lim[r] = lower && row + 1 < kd ? row + 1 : kd;
        }
        const int lfull = lower ? (i < kd ? i + 1 : kd) : kd; /* every row of the tile takes l < lfull */
        float *cr = C + (int64_t)i * ldc;
        const float *xr = mode == KDA_GEMM_SUB_FROM ? X + (int64_t)i * ldx : NULL;
        if (KDA_GEMM_MR > 4 && mr <= 4) { /* a short last tile: 4 rows (64 = 10·6 + 4, 16 = 2·6 + 4) */
            const int lend = lim[3];
            for (int j = 0; j < nr; j += KDA_GEMM_NR) KDA_GEMM_TILE(4, KDA_GEMM_NV);
            for (int j = nr; j < nv; j += KDA_GEMM_VW) KDA_GEMM_TILE(4, 1);
        } else {
            const int lend = lim[KDA_GEMM_MR - 1];
            for (int j = 0; j < nr; j += KDA_GEMM_NR) KDA_GEMM_TILE(KDA_GEMM_MR, KDA_GEMM_NV);
            for (int j = nr; j < nv; j += KDA_GEMM_VW) KDA_GEMM_TILE(KDA_GEMM_MR, 1);
        }
        for (int r = 0; r < mr; r++) {
            for (int j = nv; j < n; j++) {
                float s = 0.0f;
                for (int l = 0; l < lim[r]; l++) s += ar[r][(int64_t)l * csa] * B[(int64_t)l * ldb + j];
                float *c = cr + (int64_t)r * ldc + j;
                if (mode == KDA_GEMM_ADD) s = *c + s;
                if (mode == KDA_GEMM_SUB_FROM) s = xr[(int64_t)r * ldx + j] - s;
                if (mode == KDA_GEMM_SCALE_ADD) s = *c * X[i + r] + s;
                *c = s;
            }
        }
    }
}

KDA_INLINE void kda_gemm_tri(int m, int n, int kd, const float *A, int64_t rsa, int64_t csa, const float *B,
                             int64_t ldb, float *C, int64_t ldc, int accumulate, int lower) {
    kda_gemm_ex(m, n, kd, A, rsa, csa, B, ldb, C, ldc, accumulate ? KDA_GEMM_ADD : KDA_GEMM_SET, NULL, 0, lower);
}

KDA_INLINE void kda_gemm(int m, int n, int kd, const float *A, int64_t rsa, int64_t csa, const float *B, int64_t ldb,
                         float *C, int64_t ldc, int accumulate) {
    kda_gemm_ex(m, n, kd, A, rsa, csa, B, ldb, C, ldc, accumulate ? KDA_GEMM_ADD : KDA_GEMM_SET, NULL, 0, 0);
}

#endif /* KDA_CPU_GEMM_H */
