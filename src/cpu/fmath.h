/*
 * Float math for the CPU chunked path: exp, log1p, softplus, sigmoid written branch-free so that loops over
 * them vectorise (libm's expf/logf are calls the compiler cannot vectorise). Relative error about 2 ulp,
 * far inside what the chunked path is checked to (1e-5 against the fp64 oracle).
 *
 * Also the gate / beta / l2norm activations, in float (CPU chunked and recurrent paths) and double (the
 * oracle), so that both backends spell the definitions of docs/ALGORITHM.md the same way.
 */
#ifndef KDA_CPU_FMATH_H
#define KDA_CPU_FMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^xc for xc in [-87.3, 88] (the callers clamp): Cody-Waite range reduction, the degree-6 Taylor polynomial by
 * Estrin's scheme (3 dependent steps, not 6), the exponent put in by bits. kda_expf and kda_expf_fin both end
 * here, so they give the same bits wherever both are defined. */
static inline __attribute__((always_inline)) float kda_expf_reduce(float xc, float *r_out) {
    const float t = xc * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest integer */
    float r = xc - n * 0.693145751953125f;           /* Cody-Waite: ln2 = hi + lo */
    r = r - n * 1.428606765330187e-06f;
    *r_out = r;
    return n;
}

/* e^xc = 2^n e^r from kda_expf_reduce's n and r. */
static inline __attribute__((always_inline)) float kda_expf_finish(float n, float r) {
    const float r2 = r * r;
    const float p01 = 1.0f + r, p23 = 0.5f + r * (1.0f / 6.0f), p45 = 1.0f / 24.0f + r * (1.0f / 120.0f);
    const float p = p01 + r2 * (p23 + r2 * (p45 + r2 * (1.0f / 720.0f)));
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

static inline float kda_expf_core(float xc) {
    float r;
    const float n = kda_expf_reduce(xc, &r);
    return kda_expf_finish(n, r);
}

/* e^x; 0 below -87.3 (the smallest normal float), +inf above 88, NaN for NaN. The argument is clamped before
 * the float -> int conversion of its exponent, and NaN is clamped too (x > lo is false for NaN), so the
 * conversion is always defined; the NaN is put back at the end. */
#define KDA_EXPF_LO -87.3f /* the lower end of kda_expf, kda_expf_fin, kda_expf_row_fin and kda_expf8 */
#define KDA_EXPF_HI 88.0f  /* the upper end of kda_expf and kda_expf8 */
static inline float kda_expf(float x) {
    const float lo = KDA_EXPF_LO, hi = KDA_EXPF_HI;
    float xc = x > lo ? x : lo; /* NaN -> lo */
    xc = xc < hi ? xc : hi;
    float y = kda_expf_core(xc);
    y = x < lo ? 0.0f : y;
    y = x > hi ? INFINITY : y;
    y = x == x ? y : x; /* NaN in, NaN out */
    return y;
}

/* kda_expf for a finite x ≤ 88, as every exponent of the chunked path's prep is (its rows are finite, docs/
 * ALGORITHM.md §7, and its exponents are ≤ KDA_DIAG_RANGE): the same bits as kda_expf, without its NaN and
 * overflow selects. */
static inline float kda_expf_fin(float x) {
    const float lo = KDA_EXPF_LO;
    const float y = kda_expf_core(x > lo ? x : lo);
    return x < lo ? 0.0f : y;
}

/* y[d] = e^{a[d] − b[d]} (b NULL: e^{a[d]}) for d < n: kept as a loop of its own, with restrict rows, so that
 * the compilers vectorise it (inside bigger loop bodies GCC gives up on kda_expf's selects). */
static inline __attribute__((always_inline)) void kda_expf_row(float *restrict y, const float *restrict a,
                                                               const float *restrict b, int n) {
    if (b)
        for (int d = 0; d < n; d++) y[d] = kda_expf(a[d] - b[d]);
    else
        for (int d = 0; d < n; d++) y[d] = kda_expf(a[d]);
}

/* kda_expf_row for finite differences ≤ 88 (kda_expf_fin): the same bits, fewer instructions. In two passes over
 * blocks of up to 128 values, the range reduction (n, r into the stack), then the polynomial and the scale: each
 * pass's chain is half the exponential's, so a core holds twice as many iterations in flight (the loop is bound by
 * the chain's latency, not by its operations). The same operations on the same values as kda_expf_fin, so the
 * same bits. */
static inline __attribute__((always_inline)) void kda_expf_row_fin(float *restrict y, const float *restrict a,
                                                                   const float *restrict b, int n) {
    const float lo = KDA_EXPF_LO;
    for (int d0 = 0; d0 < n; d0 += 128) {
        const int m = n - d0 < 128 ? n - d0 : 128;
        const float *restrict ad = a + d0, *restrict bd = b ? b + d0 : NULL;
        float *restrict yd = y + d0;
        float nb[128], rb[128];
        if (bd) {
            for (int d = 0; d < m; d++) {
                const float x = ad[d] - bd[d];
                nb[d] = kda_expf_reduce(x > lo ? x : lo, &rb[d]);
            }
            for (int d = 0; d < m; d++) {
                const float x = ad[d] - bd[d], e = kda_expf_finish(nb[d], rb[d]);
                yd[d] = x < lo ? 0.0f : e;
            }
        } else {
            for (int d = 0; d < m; d++) nb[d] = kda_expf_reduce(ad[d] > lo ? ad[d] : lo, &rb[d]);
            for (int d = 0; d < m; d++) {
                const float e = kda_expf_finish(nb[d], rb[d]);
                yd[d] = ad[d] < lo ? 0.0f : e;
            }
        }
    }
}

/* log(1 + y) for y >= 0, accurate for small y: 2 atanh(y / (2 + y)) by its odd series (y <= 1 here). */
static inline float kda_log1pf_01(float y) {
    float s = y / (2.0f + y); /* in [0, 1/3] */
    float s2 = s * s;
    float p = 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return 2.0f * s * p;
}

/* softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|) */
static inline float kda_softplusf(float x) {
    float ax = x < 0.0f ? -x : x;
    float m = x > 0.0f ? x : 0.0f;
    return m + kda_log1pf_01(kda_expf(-ax));
}

static inline float kda_sigmoidf(float x) { return 1.0f / (1.0f + kda_expf(-x)); }

#endif /* KDA_CPU_FMATH_H */
