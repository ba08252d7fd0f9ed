/*
 * Host conversions between the storage dtypes (float32, float16, bfloat16) and float / double.
 * Round to nearest even on the way down, NaN kept NaN. Used by the CPU backends and the tests.
 */
#ifndef KDA_CPU_DTYPE_H
#define KDA_CPU_DTYPE_H

#include <stdint.h>
#include <string.h>

#include "kda.h"

static inline float kda_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t kda_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float kda_bf16_to_f32(uint16_t h) { return kda_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t kda_f32_to_bf16(float f) {
    uint32_t u = kda_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float kda_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return kda_bits_to_f32(sign | 0x7f800000u | (man << 13)); /* inf / nan */
    if (exp == 0) {                                                            /* zero / subnormal */
        float f = (float)man * (1.0f / 16777216.0f);                           /* man * 2^-24 */
        return sign ? -f : f;
    }
    return kda_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t kda_f32_to_f16(float f) {
    uint32_t u = kda_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* nan */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
        if (a < 0x33000000u) return sign;                    /* below 2^-25: rounds to 0 */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - 0x38000000u; /* rebias 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* Element i of a float tensor of dtype dt. */
static inline float kda_load_f32(const void *p, kda_dtype_t dt, int64_t i) {
    switch (dt) {
    case KDA_FLOAT32:
        return ((const float *)p)[i];
    case KDA_FLOAT16:
        return kda_f16_to_f32(((const uint16_t *)p)[i]);
    default:
        return kda_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

/* Store x as element i of a float tensor of dtype dt. */
static inline void kda_store_f32(void *p, kda_dtype_t dt, int64_t i, float x) {
    switch (dt) {
    case KDA_FLOAT32:
        ((float *)p)[i] = x;
        break;
    case KDA_FLOAT16:
        ((uint16_t *)p)[i] = kda_f32_to_f16(x);
        break;
    default:
        ((uint16_t *)p)[i] = kda_f32_to_bf16(x);
        break;
    }
}

/* n consecutive elements starting at element `off`, converted to float. */
static inline void kda_load_row(float *dst, const void *src, kda_dtype_t dt, int64_t off, int n) {
    if (dt == KDA_FLOAT32) {
        memcpy(dst, (const float *)src + off, (size_t)n * 4);
    } else if (dt == KDA_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = kda_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = kda_f16_to_f32(s[i]);
    }
}

/* n floats stored as consecutive elements starting at element `off`. */
static inline void kda_store_row(void *dst, kda_dtype_t dt, int64_t off, const float *src, int n) {
    if (dt == KDA_FLOAT32) {
        memcpy((float *)dst + off, src, (size_t)n * 4);
    } else if (dt == KDA_BFLOAT16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) d[i] = kda_f32_to_bf16(src[i]);
    } else {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) d[i] = kda_f32_to_f16(src[i]);
    }
}

#endif /* KDA_CPU_DTYPE_H */
