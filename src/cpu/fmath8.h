/*
 * fmath.h's exponential, softplus and their helpers on 8 floats at once (GNU vectors: one ymm with AVX, two
 * registers on SSE2 and NEON), for the chunked path's per-token pass (chunk.c, load_token8). Each is the scalar
 * function's operations in the same order, so it gives the same bits (a select by masks where the scalar code has
 * ?:, which C has no vector form of). Only for files built with -Wno-psabi (vectors of 32 bytes by value).
 */
#ifndef KDA_CPU_FMATH8_H
#define KDA_CPU_FMATH8_H

#include <math.h>
#include <stdint.h>

#include "fmath.h" /* KDA_EXPF_LO, KDA_EXPF_HI */

typedef float kda_f8 __attribute__((vector_size(32)));
typedef int32_t kda_i8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) kda_f8 kda_sel8(kda_i8 m, kda_f8 a, kda_f8 b) {
    return (kda_f8)((m & (kda_i8)a) | (~m & (kda_i8)b));
}

/* kda_expf_reduce, kda_expf_finish (fmath.h) on 8 floats */
static inline __attribute__((always_inline)) kda_f8 kda_expf8_reduce(kda_f8 xc, kda_f8 *r_out) {
    const kda_f8 t = xc * 1.44269504088896341f;
    const kda_f8 n = (t + 12582912.0f) - 12582912.0f;
    kda_f8 r = xc - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    *r_out = r;
    return n;
}

static inline __attribute__((always_inline)) kda_f8 kda_expf8_finish(kda_f8 n, kda_f8 r) {
    const kda_f8 r2 = r * r;
    const kda_f8 p01 = 1.0f + r, p23 = 0.5f + r * (1.0f / 6.0f), p45 = 1.0f / 24.0f + r * (1.0f / 120.0f);
    const kda_f8 p = p01 + r2 * (p23 + r2 * (p45 + r2 * (1.0f / 720.0f)));
    const kda_i8 bits = (__builtin_convertvector(n, kda_i8) + 127) << 23;
    return p * (kda_f8)bits;
}

static inline __attribute__((always_inline)) kda_f8 kda_expf8_core(kda_f8 xc) {
    kda_f8 r;
    const kda_f8 n = kda_expf8_reduce(xc, &r);
    return kda_expf8_finish(n, r);
}

/* kda_expf's argument clamp and its results out of range (0, +inf, NaN), around the core */
static inline __attribute__((always_inline)) kda_f8 kda_expf8_clamp(kda_f8 x) {
    const float lo = KDA_EXPF_LO, hi = KDA_EXPF_HI;
    const kda_f8 xc = kda_sel8(x > (kda_f8){0} + lo, x, (kda_f8){0} + lo);
    return kda_sel8(xc < (kda_f8){0} + hi, xc, (kda_f8){0} + hi);
}

static inline __attribute__((always_inline)) kda_f8 kda_expf8_special(kda_f8 x, kda_f8 y) {
    const float lo = KDA_EXPF_LO, hi = KDA_EXPF_HI;
    y = kda_sel8(x < (kda_f8){0} + lo, (kda_f8){0}, y);
    y = kda_sel8(x > (kda_f8){0} + hi, (kda_f8){0} + INFINITY, y);
    return kda_sel8(x == x, y, x);
}

static inline __attribute__((always_inline)) kda_f8 kda_expf8(kda_f8 x) {
    return kda_expf8_special(x, kda_expf8_core(kda_expf8_clamp(x)));
}

static inline __attribute__((always_inline)) kda_f8 kda_log1pf8_01(kda_f8 y) {
    const kda_f8 s = y / (2.0f + y);
    const kda_f8 s2 = s * s;
    kda_f8 p = (kda_f8){0} + 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return 2.0f * s * p;
}

static inline __attribute__((always_inline)) kda_f8 kda_softplusf8(kda_f8 x) {
    const kda_f8 z = {0};
    const kda_f8 ax = kda_sel8(x < z, -x, x);
    const kda_f8 m = kda_sel8(x > z, x, z);
    return m + kda_log1pf8_01(kda_expf8(-ax));
}

#endif /* KDA_CPU_FMATH8_H */
