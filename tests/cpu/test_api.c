/*
 * The library's conventions: version, status strings, errors, contexts and backends.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda.h"
#include "test_util.h"

TEST(api_version) {
    CHECK(kda_version() == KDA_VERSION, "kda_version() = %d, header %d", kda_version(), KDA_VERSION);
    CHECK(KDA_VERSION == KDA_VERSION_MAJOR * 10000 + KDA_VERSION_MINOR * 100 + KDA_VERSION_PATCH, "macro");
}

TEST(api_status_strings) {
    CHECK(strcmp(kda_status_string(KDA_STATUS_SUCCESS), "KDA_STATUS_SUCCESS") == 0, "success");
    CHECK(strcmp(kda_status_string(KDA_STATUS_INVALID_VALUE), "KDA_STATUS_INVALID_VALUE") == 0, "invalid");
    CHECK(strcmp(kda_status_string(KDA_STATUS_NOT_SUPPORTED), "KDA_STATUS_NOT_SUPPORTED") == 0, "ns");
    CHECK(kda_status_string((kda_status_t)99) != NULL, "unknown");
    CHECK(kda_dtype_size(KDA_BFLOAT16) == 2 && kda_dtype_size(KDA_INT64) == 8, "dtype sizes");
}

TEST(api_create_cpu_and_threads) {
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    kda_backend_t b;
    CHECK(kda_get_backend(ctx, &b) == KDA_STATUS_SUCCESS && b == KDA_BACKEND_CPU, "backend");
    int n = 0;
    CHECK(kda_get_num_threads(ctx, &n) == KDA_STATUS_SUCCESS && n >= 1, "threads %d", n);
    CHECK(kda_set_num_threads(ctx, 3) == KDA_STATUS_SUCCESS, "set threads");
    CHECK(kda_get_num_threads(ctx, &n) == KDA_STATUS_SUCCESS && n == 3, "threads %d", n);
    CHECK(kda_set_num_threads(ctx, 0) == KDA_STATUS_INVALID_VALUE, "zero threads");
    CHECK(strstr(kda_last_error(), "'num_threads'") != NULL, "%s", kda_last_error());
    CHECK(kda_destroy(ctx) == KDA_STATUS_SUCCESS, "destroy");
    CHECK(kda_destroy(NULL) == KDA_STATUS_SUCCESS, "destroy NULL");
}

TEST(api_create_bad_arguments) {
    kda_context_t *ctx = NULL;
    CHECK(kda_create(NULL, KDA_BACKEND_CPU, 0) == KDA_STATUS_INVALID_VALUE, "NULL ctx");
    CHECK(strstr(kda_last_error(), "'ctx'") != NULL, "%s", kda_last_error());
    CHECK(kda_create(&ctx, (kda_backend_t)17, 0) == KDA_STATUS_INVALID_VALUE, "bad backend");
    CHECK(strstr(kda_last_error(), "'backend'") != NULL, "%s", kda_last_error());
    CHECK(kda_create(&ctx, KDA_BACKEND_CUDA, -1) == KDA_STATUS_INVALID_VALUE, "negative device");
    CHECK(strstr(kda_last_error(), "'device'") != NULL, "%s", kda_last_error());
    CHECK(ctx == NULL, "ctx written on error");
}

/* AUTO always gives a context: CUDA where a device is usable, else the CPU. CUDA alone either works or says
 * why not with NOT_SUPPORTED. */
TEST(api_auto_and_cuda_backend) {
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_AUTO, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    kda_backend_t b;
    kda_get_backend(ctx, &b);
    CHECK(b == KDA_BACKEND_CPU || b == KDA_BACKEND_CUDA, "auto gave %s", kda_backend_name(b));
    char why[512];
    snprintf(why, sizeof why, "%s", kda_last_error()); /* AUTO on the CPU: why CUDA was not used */
    kda_destroy(ctx);
    ctx = NULL;
    kda_status_t st = kda_create(&ctx, KDA_BACKEND_CUDA, 0);
    if (st == KDA_STATUS_SUCCESS) {
        CHECK(b == KDA_BACKEND_CUDA, "CUDA works but AUTO chose %s", kda_backend_name(b));
        int n = -1;
        kda_get_num_threads(ctx, &n);
        CHECK(kda_set_num_threads(ctx, 2) == KDA_STATUS_NOT_SUPPORTED, "threads on CUDA");
        kda_destroy(ctx);
    } else {
        CHECK(st == KDA_STATUS_NOT_SUPPORTED, "CUDA create: %s", kda_status_string(st));
        CHECK(strlen(kda_last_error()) > 0, "no message");
        CHECK(b == KDA_BACKEND_CPU, "no CUDA but AUTO chose %s", kda_backend_name(b));
        CHECK(strcmp(why, kda_last_error()) == 0, "AUTO's reason '%s', CUDA's '%s'", why, kda_last_error());
    }
}

/* A user setting is never ignored: KDA_NUM_THREADS that is not a thread count fails kda_create, naming it. */
TEST(api_bad_num_threads_env) {
    const char *bad[] = {"abc", "0", "-3", "4x", "2000", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("KDA_NUM_THREADS", bad[i], 1);
        kda_context_t *ctx = NULL;
        kda_status_t st = kda_create(&ctx, KDA_BACKEND_CPU, 0);
        CHECK(st == KDA_STATUS_INVALID_VALUE && ctx == NULL, "KDA_NUM_THREADS=%s: %s", bad[i], kda_status_string(st));
        CHECK(strstr(kda_last_error(), "KDA_NUM_THREADS") != NULL, "%s", kda_last_error());
        kda_destroy(ctx);
    }
    setenv("KDA_NUM_THREADS", "3", 1);
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    int n = 0;
    kda_get_num_threads(ctx, &n);
    CHECK(n == 3, "KDA_NUM_THREADS=3 gave %d threads", n);
    kda_destroy(ctx);
    unsetenv("KDA_NUM_THREADS");
}

TEST(api_reference_backend) {
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_REFERENCE, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    kda_backend_t b;
    kda_get_backend(ctx, &b);
    CHECK(b == KDA_BACKEND_REFERENCE, "backend");
    CHECK(strcmp(kda_backend_name(b), "reference") == 0, "name");
    kda_destroy(ctx);
}

TEST(api_args_init_defaults) {
    kda_args_t a;
    memset(&a, 0xff, sizeof a);
    kda_args_init(&a);
    CHECK(a.struct_size == sizeof a, "struct_size");
    CHECK(a.batch == 1 && a.head_dim_k == 128 && a.dtype == KDA_BFLOAT16, "defaults");
    CHECK(a.q == NULL && a.cu_seqlens == NULL && a.lower_bound == 0.0f && a.scale == 0.0f, "zeros");
    CHECK(a.initial_state_dtype == KDA_FLOAT32, "state dtype");
}

/* kda_args_init writes only the caller's struct: an older program's shorter struct is not overrun, a newer
 * program's longer one gets its tail zeroed and every call refuses it by name. */
TEST(api_args_init_sized) {
    unsigned char buf[sizeof(kda_args_t) + 64];
    const size_t short_size = offsetof(kda_args_t, dtype);
    memset(buf, 0xcd, sizeof buf);
    kda_args_init_sized((kda_args_t *)buf, short_size);
    kda_args_t *a = (kda_args_t *)buf;
    CHECK(a->struct_size == short_size && a->batch == 1 && a->head_dim_k == 128, "short struct's defaults");
    for (size_t i = short_size; i < sizeof buf; i++) CHECK(buf[i] == 0xcd, "byte %zu past the struct written", i);

    memset(buf, 0xcd, sizeof buf);
    kda_args_init_sized((kda_args_t *)buf, sizeof buf - 8);
    CHECK(a->struct_size == sizeof buf - 8 && a->dtype == KDA_BFLOAT16, "long struct's defaults");
    for (size_t i = sizeof(kda_args_t); i < sizeof buf - 8; i++) CHECK(buf[i] == 0, "tail byte %zu not zeroed", i);
    for (size_t i = sizeof buf - 8; i < sizeof buf; i++) CHECK(buf[i] == 0xcd, "byte %zu past the struct", i);

    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    size_t ws = 0;
    CHECK(kda_forward_workspace_size(ctx, a, &ws) == KDA_STATUS_NOT_SUPPORTED, "newer struct accepted");
    CHECK(strstr(kda_last_error(), "'struct_size'") != NULL, "%s", kda_last_error());
    a->struct_size = short_size;
    CHECK(kda_forward_workspace_size(ctx, a, &ws) == KDA_STATUS_INVALID_VALUE, "truncated struct accepted");
    CHECK(strstr(kda_last_error(), "'struct_size'") != NULL, "%s", kda_last_error());
    kda_args_t b;
    (kda_args_init)(&b); /* the function, as bindings call it */
    CHECK(b.struct_size == sizeof b && b.o_dtype == KDA_BFLOAT16, "function form");
    kda_destroy(ctx);
}
