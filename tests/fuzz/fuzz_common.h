/*
 * What the libFuzzer harnesses of tests/fuzz share: reading the input, buffers allocated at their exact size with
 * a copy to compare against, tensor values (finite, huge and non-finite), the signalling-NaN sentinel that finds
 * unwritten outputs, the contexts, and the check of a refused call (a known status, a message naming an argument,
 * nothing written).
 */
#ifndef KDA_FUZZ_COMMON_H
#define KDA_FUZZ_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda.h"

#define CHECK(cond, ...)                                                                                    \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "contract violation: %s: ", #cond);                                             \
            fprintf(stderr, __VA_ARGS__);                                                                   \
            fprintf(stderr, "\n");                                                                          \
            abort();                                                                                        \
        }                                                                                                   \
    } while (0)

/* ---- reading the input ------------------------------------------------------------------------------------ */
typedef struct {
    const uint8_t *d;
    size_t n, i;
    uint64_t lcg; /* values past the end of the input */
} reader_t;

static inline reader_t reader(const uint8_t *data, size_t size) {
    reader_t r = {data, size, 0, 0x9e3779b97f4a7c15ull ^ size};
    for (size_t i = 0; i < size; i++) r.lcg = r.lcg * 31 + data[i];
    return r;
}

static inline uint8_t r8(reader_t *r) {
    if (r->i < r->n) return r->d[r->i++];
    r->lcg = r->lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (uint8_t)(r->lcg >> 56);
}

#define PICK(r, table) ((table)[r8(r) % (sizeof(table) / sizeof((table)[0]))])

static inline int64_t sat_mul(int64_t a, int64_t b) {
    if (a <= 0 || b <= 0) return 0;
    if (a > INT64_MAX / b) return INT64_MAX;
    return a * b;
}

static inline size_t dsize(kda_dtype_t d) {
    size_t s = kda_dtype_size(d);
    return s ? s : 4; /* an invalid dtype: the call refuses it; allocate as float32 */
}

/* ---- buffers: each at its exact size, with a copy taken before the call ------------------------------------ */
#define FUZZ_MAX_BUFS 32
#define CAP_BYTES ((size_t)1 << 22) /* larger tensors are left NULL: the call must then refuse or write nothing */

typedef struct {
    void *p[FUZZ_MAX_BUFS];
    size_t bytes[FUZZ_MAX_BUFS];
    void *copy[FUZZ_MAX_BUFS];
    const char *const *name; /* name[i] of buffer i, for the messages */
    int n;
} fuzz_bufs_t;

static inline void *fuzz_alloc(fuzz_bufs_t *b, int i, int64_t elems, size_t es) {
    if (elems <= 0 || elems > (int64_t)(CAP_BYTES / (es ? es : 1))) return NULL;
    b->bytes[i] = (size_t)elems * es;
    b->p[i] = malloc(b->bytes[i]);
    return b->p[i];
}

static inline void fuzz_snapshot(fuzz_bufs_t *b) {
    for (int i = 0; i < b->n; i++) {
        b->copy[i] = b->p[i] ? malloc(b->bytes[i]) : NULL;
        if (b->p[i]) memcpy(b->copy[i], b->p[i], b->bytes[i]);
    }
}

/* Buffer i back to its contents before the call. */
static inline void fuzz_restore(fuzz_bufs_t *b, int i) {
    if (b->p[i]) memcpy(b->p[i], b->copy[i], b->bytes[i]);
}

static inline int fuzz_unchanged(const fuzz_bufs_t *b, int i) {
    return !b->p[i] || memcmp(b->p[i], b->copy[i], b->bytes[i]) == 0;
}

static inline void fuzz_free(fuzz_bufs_t *b) {
    for (int i = 0; i < b->n; i++) {
        free(b->p[i]);
        free(b->copy[i]);
    }
}

/* ---- values ----------------------------------------------------------------------------------------------- */
/* A value of a float tensor: a table of finite, huge and non-finite values; `tame` keeps |x| <= 2 and no huge
 * value (a non-finite one now and then), `finite` (with tame) no non-finite one either. */
static inline float fuzz_value(reader_t *r, int tame, int finite) {
    static const float any[] = {0.0f, 1.0f, -1.0f, 0.5f, -0.25f, 2.0f, 1e30f, -1e30f, INFINITY, -INFINITY, NAN,
                                1e-30f, 3.0f, -3.0f, 65504.0f, 1e5f};
    static const float gentle[] = {0.0f, 1.0f, -1.0f, 0.5f, -0.25f, 2.0f, 0.75f, -2.0f};
    static const float special[] = {INFINITY, -INFINITY, NAN};
    if (!tame) return PICK(r, any);
    uint8_t u = r8(r);
    return u < 250 || finite ? gentle[u % 8] : special[u % 3];
}

static inline void fuzz_fill(reader_t *r, void *p, kda_dtype_t dt, int64_t n, int tame, int finite) {
    for (int64_t i = 0; i < n; i++) {
        const float x = fuzz_value(r, tame, finite);
        uint32_t u;
        memcpy(&u, &x, 4);
        if (dt == KDA_BFLOAT16) {
            uint16_t h = (uint16_t)(u >> 16);
            memcpy((char *)p + 2 * i, &h, 2);
        } else if (dt == KDA_FLOAT16) {
            uint16_t h = isnan(x) ? 0x7e00 : isinf(x) || fabsf(x) > 65504.0f ? (x < 0 ? 0xfc00 : 0x7c00)
                         : (uint16_t)0x3c00; /* finite values other than ±inf: 1.0 is enough here */
            if (x == 0.0f) h = 0;
            memcpy((char *)p + 2 * i, &h, 2);
        } else {
            memcpy((char *)p + 4 * i, &x, 4);
        }
    }
}

/* A signalling NaN that arithmetic never produces (quiet NaNs only), to find unwritten outputs. */
static inline void fuzz_sentinel(void *p, kda_dtype_t dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (dt == KDA_FLOAT32) {
            const uint32_t u = 0x7f80dead;
            memcpy((char *)p + 4 * i, &u, 4);
        } else {
            const uint16_t u = dt == KDA_FLOAT16 ? 0x7c01 : 0x7f81;
            memcpy((char *)p + 2 * i, &u, 2);
        }
    }
}

static inline int fuzz_is_sentinel(const void *p, kda_dtype_t dt, int64_t i) {
    if (dt == KDA_FLOAT32) {
        uint32_t u;
        memcpy(&u, (const char *)p + 4 * i, 4);
        return u == 0x7f80dead;
    }
    uint16_t u;
    memcpy(&u, (const char *)p + 2 * i, 2);
    return u == (dt == KDA_FLOAT16 ? 0x7c01 : 0x7f81);
}

static inline int fuzz_is_nan_at(const void *p, kda_dtype_t dt, int64_t i) {
    if (dt == KDA_FLOAT32) {
        float x;
        memcpy(&x, (const char *)p + 4 * i, 4);
        return isnan(x);
    }
    uint16_t u;
    memcpy(&u, (const char *)p + 2 * i, 2);
    return dt == KDA_FLOAT16 ? (u & 0x7fff) > 0x7c00 : (u & 0x7fff) > 0x7f80;
}

static inline int fuzz_is_finite_at(const void *p, kda_dtype_t dt, int64_t i) {
    if (dt == KDA_FLOAT32) {
        float x;
        memcpy(&x, (const char *)p + 4 * i, 4);
        return isfinite(x);
    }
    uint16_t u;
    memcpy(&u, (const char *)p + 2 * i, 2);
    return dt == KDA_FLOAT16 ? (u & 0x7c00) != 0x7c00 : (u & 0x7f80) != 0x7f80;
}

/* ---- contexts: made once (thread start-up is not what is fuzzed); 0 the CPU (2 threads), 1 the reference -- */
static inline kda_context_t *fuzz_context(int which) {
    static kda_context_t *ctx[2];
    if (!ctx[which]) {
        CHECK(kda_create(&ctx[which], which ? KDA_BACKEND_REFERENCE : KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS,
              "kda_create: %s", kda_last_error());
        if (!which) CHECK(kda_set_num_threads(ctx[which], 2) == KDA_STATUS_SUCCESS, "threads");
    }
    return ctx[which];
}

/* A workspace of `mode`: 0 exact, 1 one byte short, 2 NULL, 3 exact at an odd address; *mem is what to free. */
static inline void *fuzz_workspace(size_t need, int mode, size_t *bytes, char **mem) {
    CHECK(need < ((size_t)1 << 34), "workspace of %zu bytes for a small problem", need);
    *bytes = mode == 1 && need > 0 ? need - 1 : need;
    *mem = mode == 2 ? NULL : (char *)malloc(*bytes + 1);
    return *mem && mode == 3 ? *mem + 1 : *mem;
}

/* A refused call: a known status, "<fn>: argument '<name>': ...", and every buffer as it was before the call. */
static inline void fuzz_check_error(kda_status_t st, const char *fn, const fuzz_bufs_t *b) {
    CHECK(st == KDA_STATUS_INVALID_VALUE || st == KDA_STATUS_NOT_SUPPORTED ||
              st == KDA_STATUS_INSUFFICIENT_WORKSPACE,
          "%s: unexpected status %s: %s", fn, kda_status_string(st), kda_last_error());
    const char *msg = kda_last_error();
    const size_t fl = strlen(fn);
    CHECK(strncmp(msg, fn, fl) == 0 && strncmp(msg + fl, ": argument '", 12) == 0,
          "%s: message does not name an argument: \"%s\"", fn, msg);
    for (int i = 0; i < b->n; i++)
        CHECK(fuzz_unchanged(b, i), "%s: %s written on error (%s)", fn, b->name[i], msg);
}

#endif /* KDA_FUZZ_COMMON_H */
