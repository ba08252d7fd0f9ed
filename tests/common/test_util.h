/*
 * A minimal test harness: TEST(name) { ... } registers a case; the binary runs the case named on its command
 * line (CTest registers one test per case, by name, from the TEST( lines of the source) or every case.
 * CHECK records a failure and continues; SKIP ends the case with exit code 77 (CTest: skipped).
 */
#ifndef KDA_TEST_UTIL_H
#define KDA_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>

typedef void (*kda_test_fn)(void);
void kda_test_register(const char *name, kda_test_fn fn);
void kda_test_fail(const char *file, int line, const char *cond, const char *fmt, ...);
void kda_test_skip(const char *fmt, ...);
extern int kda_test_failures;

#define TEST(name)                                                                                          \
    static void test_##name(void);                                                                          \
    __attribute__((constructor)) static void register_##name(void) { kda_test_register(#name, test_##name); } \
    static void test_##name(void)

#define CHECK(cond, ...)                                                                                    \
    do {                                                                                                    \
        if (!(cond)) kda_test_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);                                 \
    } while (0)

#define SKIP(...) kda_test_skip(__VA_ARGS__)

#endif /* KDA_TEST_UTIL_H */
