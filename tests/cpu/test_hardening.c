/*
 * Issue 15: the six defects found by fuzzing and sanitizers, one reproducer each, and the non-finite input
 * contract (docs/ALGORITHM.md, "Non-finite and out-of-range inputs") on the CPU backends. Under the sanitizer
 * build (.ci/run, clang -fsanitize=address,undefined,float-cast-overflow) the first case is the UB check.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "compare.h"
#include "contract.h"
#include "cpu/fmath.h"
#include "cuda/common/kda_cuda.h" /* kda_fastdiv_make, kda_fastdiv: plain C, checked here where CI runs */
#include "internal.h"
#include "test_util.h"

static kda_context_t *cpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) exit(1);
    return ctx;
}

static kda_context_t *backend(int which) { return which == 0 ? cpu() : kda_test_reference(); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------------------------------------------------
 * 1. NaN into kda_expf: its exponent was converted float -> int32 from a NaN (UB). Reached by a NaN raw gate in
 *    kda_decode, a NaN gate with use_gate_in_kernel, a NaN β logit with use_beta_sigmoid.
 * ------------------------------------------------------------------------------------------------------- */
TEST(hard_expf_nan_defined) {
    volatile float nan_in = NAN;
    CHECK(isnan(kda_expf(nan_in)), "kda_expf(NaN) = %g", (double)kda_expf(nan_in));
    CHECK(kda_expf(-INFINITY) == 0.0f && kda_expf(INFINITY) == INFINITY, "kda_expf(+-inf)");
    CHECK(isnan(kda_sigmoidf(nan_in)) && isnan(kda_softplusf(nan_in)), "sigmoid/softplus of NaN");
    CHECK(fabsf(kda_expf(-1.0f) - 0.36787944f) < 1e-6f, "kda_expf(-1)");

    /* through the API: each path on each CPU backend gives NaN from the token on, and nothing earlier */
    for (int mode = 0; mode < 3; mode++) {
        kda_synth_config_t c;
        kda_synth_defaults(&c);
        c.batch = 1;
        c.seq_len = 6;
        c.k = c.v = 16;
        c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
        c.gate = mode == 1 ? KDA_GATE_SOFTPLUS : KDA_GATE_RAW;
        c.beta_sigmoid = mode == 2;
        kda_synth_t s;
        kda_args_t a;
        CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
        if (mode < 2) ((float *)s.g)[3 * c.k + 1] = NAN; /* token 3 */
        else ((float *)s.beta)[3] = NAN;
        for (int algo = 0; algo < 2; algo++)
            for (int b = 0; b < 2; b++) {
                kda_synth_poison(s.o, KDA_FLOAT32, 6 * c.v);
                CHECK(kda_run_host(backend(b), &a, (kda_algo_t)algo) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
                const float *o = (const float *)s.o;
                CHECK(kda_count_nonfinite(o, KDA_FLOAT32, 3 * c.v) == 0, "mode %d algo %d backend %d: early NaN",
                      mode, algo, b);
                for (int i = 3 * c.v; i < 6 * c.v; i++)
                    CHECK(isnan(o[i]), "mode %d algo %d backend %d: o[%d] = %g, not NaN", mode, algo, b, i, o[i]);
            }
        kda_synth_free(&s);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * 2. seq_len = 0 left batch and num_v_heads unbounded: batch = 2^62 overflowed and returned SUCCESS, 2^40
 *    would run for days on empty work.
 * ------------------------------------------------------------------------------------------------------- */
TEST(hard_seq_len_zero_batch_bounded) {
    for (int algo = 0; algo < 2; algo++) {
        kda_args_t a;
        kda_args_init(&a);
        a.seq_len = 0;
        a.head_dim_k = a.head_dim_v = 1;
        a.batch = (int64_t)1 << 62;
        size_t ws = 0;
        kda_status_t st = algo ? kda_decode_workspace_size(cpu(), &a, &ws) : kda_forward_workspace_size(cpu(), &a, &ws);
        CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "'batch'"), "batch 2^62: %s, %s",
              kda_status_string(st), kda_last_error());
        a.batch = (int64_t)1 << 30;
        a.num_v_heads = 1 << 30;
        st = algo ? kda_decode_workspace_size(cpu(), &a, &ws) : kda_forward_workspace_size(cpu(), &a, &ws);
        CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "'batch'"), "batch 2^30 x 2^30 heads: %s",
              kda_last_error());
        /* the largest accepted: nothing to write, so the call returns at once */
        a.num_v_heads = 1;
        a.batch = (int64_t)1 << 40;
        for (int b = 0; b < 2; b++) {
            const double t0 = now();
            CHECK(kda_run_host(backend(b), &a, (kda_algo_t)algo) == KDA_STATUS_SUCCESS, "batch 2^40: %s",
                  kda_last_error());
            CHECK(now() - t0 < 1.0, "batch 2^40 of empty sequences took %.1f s", now() - t0);
        }
        /* varlen: num_seqs is bounded the same way */
        int32_t cu[2] = {0, 0};
        a.batch = 1;
        a.cu_seqlens = cu;
        a.num_seqs = (int64_t)1 << 62;
        st = algo ? kda_decode_workspace_size(kda_test_reference(), &a, &ws)
                  : kda_forward_workspace_size(kda_test_reference(), &a, &ws);
        CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "'num_seqs'"), "num_seqs 2^62: %s",
              kda_last_error());
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * 3. Duplicate state_indices above 4096 sequences were accepted (a data race on the pool).
 * ------------------------------------------------------------------------------------------------------- */
TEST(hard_duplicate_slots_above_4096) {
    enum { N = 5000, D = 4 };
    static int32_t cu[N + 1], idx[N];
    static float x[N * D], gate[N * D], beta[N], o[N * D], pool[N * D * D];
    for (int n = 0; n <= N; n++) cu[n] = n;
    for (int i = 0; i < N * D; i++) {
        x[i] = 0.5f;
        gate[i] = -0.1f;
    }
    for (int n = 0; n < N; n++) beta[n] = 0.5f;
    for (int i = 0; i < N * D * D; i++) pool[i] = 0.01f * (float)(i % 7);
    kda_args_t a;
    kda_args_init(&a);
    a.seq_len = N;
    a.head_dim_k = a.head_dim_v = D;
    a.cu_seqlens = cu;
    a.num_seqs = N;
    a.dtype = a.g_dtype = a.beta_dtype = a.o_dtype = KDA_FLOAT32;
    a.q = a.k = a.v = x;
    a.g = gate;
    a.beta = beta;
    a.o = o;
    a.initial_state = a.final_state = pool;
    a.state_indices = idx;
    a.num_state_slots = N;
    for (int algo = 0; algo < 2; algo++) {
        for (int n = 0; n < N; n++) idx[n] = n % 2; /* the reproducer: slots 0 and 1, alternating */
        memset(o, 0x7f, sizeof o);
        float before = pool[0];
        kda_status_t st = kda_run_host(cpu(), &a, (kda_algo_t)algo);
        CHECK(st == KDA_STATUS_INVALID_VALUE, "alternating slots: %s", kda_status_string(st));
        CHECK(strstr(kda_last_error(), "'state_indices'") && strstr(kda_last_error(), "state_indices[0] and "
              "state_indices[2]"), "message: %s", kda_last_error());
        CHECK(pool[0] == before && o[0] != 0.0f, "written on error");
        /* the last pair only */
        for (int n = 0; n < N; n++) idx[n] = n;
        idx[N - 1] = 17;
        CHECK(kda_run_host(cpu(), &a, (kda_algo_t)algo) == KDA_STATUS_INVALID_VALUE &&
                  strstr(kda_last_error(), "state_indices[17] and state_indices[4999]"),
              "late duplicate: %s", kda_last_error());
        /* distinct (and negative = no slot, any number of times): accepted */
        for (int n = 0; n < N; n++) idx[n] = n % 3 == 0 ? -1 : N - 1 - n;
        CHECK(kda_run_host(cpu(), &a, (kda_algo_t)algo) == KDA_STATUS_SUCCESS, "distinct: %s", kda_last_error());
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * 4. Aliasing: only o == q/k/v/g was refused. (More cases, by argument, are BAD lines in test_bad_input.c.)
 * ------------------------------------------------------------------------------------------------------- */
TEST(hard_alias_by_address_ranges) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 2;
    c.seq_len = 5;
    c.k = c.v = 8;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    struct {
        const char *what, *arg;
        void *o, *ht;
    } cases[] = {
        {"o == beta", "'o'", (void *)s.beta, s.ht},
        {"o == initial_state", "'o'", s.h0, s.ht},
        {"o == v + 1", "'o'", (float *)s.v + 1, s.ht},
        {"o inside q's last element", "'o'", (char *)s.q + s.q_bytes - 2, s.ht},
        {"o == final_state", "'o'", s.ht, s.ht},
        {"final_state == q", "'final_state'", s.o, (void *)s.q},
        {"final_state == initial_state + 1", "'final_state'", s.o, (float *)s.h0 + 1},
        {"final_state == g", "'final_state'", s.o, (void *)s.g},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kda_args_t b = a;
        b.o = cases[i].o;
        b.final_state = cases[i].ht;
        for (int algo = 0; algo < 2; algo++) {
            kda_status_t st = kda_run_host(cpu(), &b, (kda_algo_t)algo);
            CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), cases[i].arg) &&
                      strstr(kda_last_error(), "overlaps"),
                  "%s: %s, %s", cases[i].what, kda_status_string(st), kda_last_error());
        }
    }
    /* adjacent but not overlapping, and the in-place pool: accepted */
    kda_args_t b = a;
    b.final_state = (void *)b.initial_state;
    CHECK(kda_run_host(cpu(), &b, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "in place: %s", kda_last_error());
    float *both = (float *)malloc(s.o_bytes * 2);
    b = a;
    b.v = both;
    b.o = both + s.o_bytes / sizeof(float);
    memcpy(both, s.v, s.v_bytes);
    CHECK(kda_run_host(cpu(), &b, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "adjacent v|o: %s", kda_last_error());
    free(both);
    kda_synth_free(&s);
}

/* ---------------------------------------------------------------------------------------------------------
 * 5. CPU kda_forward causality: one non-finite or huge value at token t turned up to 3 earlier tokens' outputs
 *    into NaN (0 · inf in the 4-row tiles of the triangular products).
 * ------------------------------------------------------------------------------------------------------- */
TEST(hard_fwd_causality_huge_and_nonfinite) {
    static const float values[] = {1e30f, -1e30f, INFINITY, NAN};
    for (int in = 0; in < 4; in++)       /* q, k, v, beta */
        for (int vi = 0; vi < 4; vi++)
            for (int t = 1; t < 8; t++) { /* every position in and after the first 4-row tile */
                kda_synth_config_t c;
                kda_synth_defaults(&c);
                c.batch = 1;
                c.seq_len = 8;
                c.k = c.v = 16;
                c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
                kda_synth_t s;
                kda_args_t a;
                CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
                CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
                float clean[8 * 16];
                memcpy(clean, s.o, sizeof clean);
                float *x = in == 0 ? (float *)s.q : in == 1 ? (float *)s.k : in == 2 ? (float *)s.v : (float *)s.beta;
                x[in == 3 ? t : t * 16 + 2] = values[vi];
                CHECK(kda_run_host(cpu(), &a, KDA_ALGO_FORWARD) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
                const float *o = (const float *)s.o;
                for (int i = 0; i < t * 16; i++)
                    CHECK(o[i] == clean[i], "input %d = %g at token %d: o[%d] = %g, was %g", in, (double)values[vi],
                          t, i, (double)o[i], (double)clean[i]);
                kda_synth_free(&s);
            }
}

/* ---------------------------------------------------------------------------------------------------------
 * 6. kda_set_num_threads failing reported "kda_create: could not start ... CPU threads".
 * ------------------------------------------------------------------------------------------------------- */
TEST(hard_set_num_threads_failure_message) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    SKIP("needs an address-space limit, which the sanitizers' shadow memory does not allow");
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    SKIP("needs an address-space limit, which the sanitizers' shadow memory does not allow");
#endif
#endif
    /* a setting of this test program (scripts/aarch64-check.sh sets it), not of the library */
    if (getenv("KDA_TEST_EMULATED"))
        SKIP("under an emulator: the address-space limit also binds qemu-user's own reservation of the guest's "
             "address space (the child did not finish in 20 minutes)");
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) { /* the child: too little address space for 1023 thread stacks */
        struct rlimit rl = {(rlim_t)1 << 30, (rlim_t)1 << 30};
        if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(77);
        kda_status_t st = kda_set_num_threads(ctx, 1024);
        if (st == KDA_STATUS_SUCCESS) _exit(77); /* the limit did not bite here */
        const char *want = "kda_set_num_threads: could not start 1024 CPU threads";
        if (st != KDA_STATUS_ALLOC_FAILED || strncmp(kda_last_error(), want, strlen(want)) != 0) {
            fprintf(stderr, "status %s, message \"%s\"\n", kda_status_string(st), kda_last_error());
            _exit(1);
        }
        int n = 0; /* the context keeps its old threads */
        _exit(kda_get_num_threads(ctx, &n) == KDA_STATUS_SUCCESS && n >= 1 ? 0 : 2);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork");
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) SKIP("could not make thread creation fail here");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status %d", status);
    kda_destroy(ctx);
}

/* ---------------------------------------------------------------------------------------------------------
 * The CUDA chunk preparation's CTA → (chunk, head, query head) step divides by multiplies (kda_fastdiv, the same
 * function the kernel calls, with host-made magic numbers): exact for every dividend below 2^31, on every divisor up
 * to 4096, on powers of two and their neighbours, and on random ones, each with the edge dividends and random ones.
 * ------------------------------------------------------------------------------------------------------- */
static int fastdiv_ok(int64_t d, uint32_t n) { return kda_fastdiv(n, kda_fastdiv_make(d)) == n / (uint32_t)d; }

TEST(hard_cuda_fastdiv_exact) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    long bad = 0, checked = 0;
    for (int i = 0; i < 4096 + 3 * 31 + 2000; i++) {
        int64_t d;
        if (i < 4096) d = i + 1;
        else if (i < 4096 + 3 * 31) d = ((int64_t)1 << ((i - 4096) / 3)) + (i - 4096) % 3 - 1; /* 2^k − 1, 2^k, 2^k + 1 */
        else {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            d = (int64_t)(x % 0x7fffffffu) + 1;
        }
        if (d < 1) continue;
        const uint32_t edge[] = {0, 1, (uint32_t)d - 1, (uint32_t)d, (uint32_t)d + 1, 0x7ffffffeu, 0x7fffffffu,
                                 (uint32_t)(0x7fffffff / d) * (uint32_t)d, (uint32_t)(0x7fffffff / d) * (uint32_t)d - 1};
        for (unsigned e = 0; e < sizeof edge / sizeof edge[0]; e++)
            if (edge[e] <= 0x7fffffffu) bad += !fastdiv_ok(d, edge[e]), checked++;
        for (int r = 0; r < 64; r++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            bad += !fastdiv_ok(d, (uint32_t)(x & 0x7fffffffu)), checked++;
        }
    }
    printf("fastdiv: %ld quotients checked, %ld wrong\n", checked, bad);
    CHECK(bad == 0, "%ld of %ld fastdiv quotients wrong", bad, checked);
    const kda_fastdiv_t z = kda_fastdiv_make(0);
    CHECK(z.m == 0, "divisor 0: m %u", z.m);
}

/* ---------------------------------------------------------------------------------------------------------
 * The contract table on the CPU backends: kda_forward (chunked) and kda_decode (recurrent) against each other
 * and the oracle, for every input class, in both state layouts and with a state pool; t = 30 shares a 4-row
 * tile with tokens 28, 29; t = 66 is in the second chunk.
 * ------------------------------------------------------------------------------------------------------- */
static kda_status_t run_cpu(void *user, const kda_args_t *args, kda_algo_t algo) {
    return kda_run_host((kda_context_t *)user, args, algo);
}

TEST(contract_cpu_forward_decode_agree) {
    kda_contract_backend_t be = {"cpu", run_cpu, cpu(), 32, 1e-4, 1e-5, 0};
    kda_contract_check(&be, 30);
    kda_contract_check(&be, 66);
}

/* The chunked path's split schedule (fewer (sequence, head) tasks than threads: preps over chunks, the
 * recurrence over column slices; 8 threads for the contract problem's 4 tasks), where a poisoned value channel
 * lies in one slice of its head's columns. */
TEST(contract_cpu_split_schedule) {
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(kda_set_num_threads(ctx, 8) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    kda_contract_backend_t be = {"cpu, 8 threads", run_cpu, ctx, 32, 1e-4, 1e-5, 0};
    kda_contract_check(&be, 30);
    kda_destroy(ctx);
}

TEST(contract_reference_backend) {
    kda_contract_backend_t be = {"reference", run_cpu, kda_test_reference(), 16, 1e-9, 1e-12, 0};
    kda_contract_check(&be, 30);
}
