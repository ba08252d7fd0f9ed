/*
 * Option values of the kda CLI (kda_cli.c, bench.c), one parser per type. Each reads the whole text as one value
 * of its type and range, or prints "kda: <option>: ..." on stderr and returns -1 leaving *out unchanged: empty
 * text, leading blanks, trailing characters and values out of range are refused, never wrapped, clamped or
 * read as 0.
 */
#ifndef KDA_CLI_ARGS_H
#define KDA_CLI_ARGS_H

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The integer at s (base 10) ending at *end, in [lo, hi]; 0, or -1 saying "'text' is not <what> in [lo, hi]". */
static inline int kda_arg_i64_at(const char *opt, const char *text, const char *what, const char *s, char **end,
                                 int64_t lo, int64_t hi, int64_t *out) {
    errno = 0;
    long long x = (*s && !isspace((unsigned char)*s)) ? strtoll(s, end, 10) : 0;
    if (!*s || isspace((unsigned char)*s) || *end == s || errno == ERANGE || x < lo || x > hi) {
        fprintf(stderr, "kda: %s: '%s' is not %s in [%" PRId64 ", %" PRId64 "]\n", opt, text, what, lo, hi);
        return -1;
    }
    *out = (int64_t)x;
    return 0;
}

static inline int kda_arg_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end = (char *)s;
    int64_t x;
    if (kda_arg_i64_at(opt, s, "an integer", s, &end, lo, hi, &x)) return -1;
    if (*end) {
        fprintf(stderr, "kda: %s: '%s' is not an integer in [%" PRId64 ", %" PRId64 "]\n", opt, s, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static inline int kda_arg_i32(const char *opt, const char *s, int32_t lo, int32_t hi, int32_t *out) {
    int64_t x;
    if (kda_arg_i64(opt, s, lo, hi, &x)) return -1;
    *out = (int32_t)x;
    return 0;
}

static inline int kda_arg_int(const char *opt, const char *s, int lo, int hi, int *out) {
    int64_t x;
    if (kda_arg_i64(opt, s, lo, hi, &x)) return -1;
    *out = (int)x;
    return 0;
}

/* A comma-separated list of 1 to max integers in [lo, hi], e.g. "100,0,37" (no empty item); *n its length. */
static inline int kda_arg_i64_list(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out, int max,
                                   int *n) {
    static const char list[] = "a comma-separated list of integers";
    int k = 0;
    const char *p = s;
    for (;;) {
        char *end = (char *)p;
        if (k == max) {
            fprintf(stderr, "kda: %s: more than %d values\n", opt, max);
            return -1;
        }
        if (kda_arg_i64_at(opt, s, list, p, &end, lo, hi, &out[k])) return -1;
        k++;
        if (!*end) break;
        if (*end != ',') {
            fprintf(stderr, "kda: %s: '%s' is not %s in [%" PRId64 ", %" PRId64 "]\n", opt, s, list, lo, hi);
            return -1;
        }
        p = end + 1;
    }
    *n = k;
    return 0;
}

/* A finite float32 value. A nonzero number that rounds to 0.0f is refused: libkda reads 0 as "unset". */
static inline int kda_arg_f32(const char *opt, const char *s, float *out) {
    char *end = (char *)s;
    errno = 0;
    const double x = (*s && !isspace((unsigned char)*s)) ? strtod(s, &end) : 0.0;
    if (end == s || *end) {
        fprintf(stderr, "kda: %s: '%s' is not a number\n", opt, s);
        return -1;
    }
    if (!isfinite(x) || fabs(x) > FLT_MAX) {
        fprintf(stderr, "kda: %s: '%s' is not a finite float32 value (|x| <= %g)\n", opt, s, (double)FLT_MAX);
        return -1;
    }
    const float f = (float)x;
    if (f == 0.0f && (x != 0.0 || errno == ERANGE)) {
        fprintf(stderr,
                "kda: %s: '%s' rounds to 0 in float32, which libkda reads as unset (the smallest nonzero "
                "magnitude is %g)\n",
                opt, s, (double)FLT_TRUE_MIN);
        return -1;
    }
    *out = f;
    return 0;
}

#endif /* KDA_CLI_ARGS_H */
