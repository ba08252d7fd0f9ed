/*
 * The library's conventions: version, status strings, errors, contexts and backends.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
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
    CHECK(a.cp_mode == KDA_CP_AUTO && a.cp_piece_len == 0, "context parallelism: auto");
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

/* Intra-card context parallelism (issue 9): an older program's struct, which ends before cp_mode, reads as
 * KDA_CP_AUTO; the CPU and reference backends accept every valid setting and give the same bits with each. */
TEST(api_cp_fields_old_struct_is_auto) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.seq_len = 200;
    c.final_state = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    a.struct_size = offsetof(kda_args_t, cp_mode);
    a.cp_mode = (kda_cp_mode_t)77; /* past the old struct: never read */
    a.cp_piece_len = -5;
    CHECK(kda_run_host(ctx, &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "old struct: %s", kda_last_error());
    a.struct_size = sizeof a;
    CHECK(kda_run_host(ctx, &a, KDA_ALGO_FORWARD) == KDA_STATUS_INVALID_VALUE, "cp_mode 77 accepted");
    CHECK(strstr(kda_last_error(), "'cp_mode'") != NULL, "%s", kda_last_error());
    kda_destroy(ctx);
    kda_synth_free(&s);
}

static void cp_settings_same_bits(kda_backend_t backend) {
    static const int64_t lens[] = {300, 0, 64, 129};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 4;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 2;
    c.k = 64;
    c.v = 32;
    c.initial_state = c.final_state = 1;
    c.gate = KDA_GATE_LOWER_BOUND;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, backend, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *o0 = malloc(s.o_bytes), *h0 = malloc(s.ht_bytes);
    static const kda_cp_mode_t modes[] = {KDA_CP_AUTO, KDA_CP_OFF, KDA_CP_ON, KDA_CP_ON, KDA_CP_ON};
    static const int64_t lens_on[] = {0, 0, 64, 128, KDA_CP_MAX_PIECE_LEN};
    for (int algo = 0; algo < 2; algo++)
        for (int i = 0; i < 5; i++) {
            a.cp_mode = modes[i];
            a.cp_piece_len = lens_on[i];
            kda_synth_poison(s.o, c.o_dtype, (int64_t)(s.o_bytes / 2));
            CHECK(kda_run_host(ctx, &a, algo ? KDA_ALGO_DECODE : KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS,
                  "mode %d len %lld: %s", (int)modes[i], (long long)lens_on[i], kda_last_error());
            if (i == 0) {
                memcpy(o0, s.o, s.o_bytes);
                memcpy(h0, s.ht, s.ht_bytes);
            } else {
                CHECK(memcmp(o0, s.o, s.o_bytes) == 0, "%s: o differs with mode %d len %lld",
                      kda_backend_name(backend), (int)modes[i], (long long)lens_on[i]);
                CHECK(memcmp(h0, s.ht, s.ht_bytes) == 0, "%s: final state differs with mode %d len %lld",
                      kda_backend_name(backend), (int)modes[i], (long long)lens_on[i]);
            }
        }
    free(o0);
    free(h0);
    kda_destroy(ctx);
    kda_synth_free(&s);
}

TEST(api_cp_fields_ignored_cpu) { cp_settings_same_bits(KDA_BACKEND_CPU); }
TEST(api_cp_fields_ignored_reference) { cp_settings_same_bits(KDA_BACKEND_REFERENCE); }

/* kda_args_t.saved: the CPU backends keep nothing (kda_forward_saved_size answers 0); a buffer given anyway is
 * accepted and left untouched, and the forward's bits are those without it. */
TEST(api_saved_cpu_keeps_nothing) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.seq_len = 100;
    c.final_state = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    CHECK(a.saved == NULL && a.saved_bytes == 0, "saved: default NULL, 0");
    static const kda_backend_t backends[] = {KDA_BACKEND_CPU, KDA_BACKEND_REFERENCE};
    for (int i = 0; i < 2; i++) {
        kda_context_t *ctx = NULL;
        CHECK(kda_create(&ctx, backends[i], 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        size_t n = 123;
        CHECK(kda_forward_saved_size(ctx, &a, &n) == KDA_STATUS_SUCCESS && n == 0, "%s: saved size %zu (%s)",
              kda_backend_name(backends[i]), n, kda_last_error());
        CHECK(kda_forward_saved_size(ctx, &a, NULL) == KDA_STATUS_INVALID_VALUE &&
                  strstr(kda_last_error(), "'saved_bytes'") != NULL, "NULL size: %s", kda_last_error());
        a.saved = NULL;
        CHECK(kda_run_host(ctx, &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
        void *o0 = malloc(s.o_bytes);
        memcpy(o0, s.o, s.o_bytes);
        unsigned char buf[64];
        memset(buf, 0x5a, sizeof buf);
        a.saved = buf;
        a.saved_bytes = sizeof buf;
        kda_synth_poison(s.o, c.o_dtype, (int64_t)(s.o_bytes / 2));
        CHECK(kda_run_host(ctx, &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "with saved: %s", kda_last_error());
        CHECK(memcmp(o0, s.o, s.o_bytes) == 0, "%s: o differs with saved", kda_backend_name(backends[i]));
        int untouched = 1;
        for (size_t j = 0; j < sizeof buf; j++) untouched &= buf[j] == 0x5a;
        CHECK(untouched, "%s: saved was written", kda_backend_name(backends[i]));
        a.saved = NULL;
        a.saved_bytes = 0;
        free(o0);
        kda_destroy(ctx);
    }
    kda_synth_free(&s);
}
