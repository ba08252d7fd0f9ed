#include "test_util.h"

#include <stdarg.h>
#include <string.h>

#define MAX_TESTS 512

static struct {
    const char *name;
    kda_test_fn fn;
} tests[MAX_TESTS];
static int num_tests;
int kda_test_failures;
/* A binary whose cases are compiled out in this build sets this to the reason: its cases are then skipped. */
__attribute__((weak)) const char *kda_test_skip_missing = NULL;

void kda_test_register(const char *name, kda_test_fn fn) {
    if (num_tests < MAX_TESTS) {
        tests[num_tests].name = name;
        tests[num_tests].fn = fn;
        num_tests++;
    }
}

void kda_test_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "%s:%d: CHECK(%s) failed: ", file, line, cond);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    kda_test_failures++;
}

void kda_test_skip(const char *fmt, ...) {
    va_list ap;
    printf("SKIPPED: ");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    exit(77);
}

int main(int argc, char **argv) {
    int ran = 0;
    for (int i = 0; i < num_tests; i++) {
        if (argc > 1 && strcmp(argv[1], tests[i].name) != 0) continue;
        int before = kda_test_failures;
        tests[i].fn();
        printf("%s %s\n", kda_test_failures == before ? "PASS" : "FAIL", tests[i].name);
        fflush(stdout);
        ran++;
    }
    if (argc > 1 && ran == 0) {
        if (kda_test_skip_missing) {
            printf("SKIPPED: %s\n", kda_test_skip_missing);
            return 77;
        }
        fprintf(stderr, "no test named %s\n", argv[1]);
        return 2;
    }
    return kda_test_failures ? 1 : 0;
}
