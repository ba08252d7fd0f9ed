/*
 * Issue 58: the second hardening round's defects on the C side, one reproducer each (named after the defect),
 * each of which failed before its fix: the pool check's cost in num_state_slots, the unbounded 2-D row stride,
 * kda_set_num_threads / kda_destroy during a call on the same context, the chunked forward's causality in g
 * (the stated tolerance, docs/ALGORITHM.md §7), and a garbage struct_size.
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "compare.h"
#include "contract.h"
#include "internal.h"
#include "test_util.h"

static kda_context_t *cpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) exit(1);
    return ctx;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_next(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

/* A pool of 2^40 one-element states (K = V = HV = 1, float32): address space only (PROT_NONE, not backed),
 * its first 64 KB readable and writable for the slots a call really touches. NULL where it cannot be had. */
#define BIG_SLOTS ((int64_t)1 << 40)
static float *big_pool(void) {
    static float *pool;
    if (!pool) {
        void *m = mmap(NULL, (size_t)BIG_SLOTS * sizeof(float), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED) return NULL;
        if (mprotect(m, 1 << 16, PROT_READ | PROT_WRITE) != 0) return NULL;
        pool = (float *)m;
    }
    return pool;
}

/* Sequences of 1-element heads over a pool: N sequences of lens[n] tokens (NULL: 1 each), inputs 0.5, gate
 * −0.1, β 0.5; state_indices idx (1-D when cols == 0, else rows of `stride` elements, T_max = cols). */
enum { MAXTOK = 40000 };
static int32_t cu_buf[MAXTOK + 1];
static float x_buf[MAXTOK], g_buf[MAXTOK], o_buf[MAXTOK];
static void pool_args(kda_args_t *a, int64_t N, const int *lens, const int32_t *idx, int64_t cols, int64_t stride,
                      float *pool, int64_t slots) {
    kda_args_init(a);
    int64_t T = 0;
    cu_buf[0] = 0;
    for (int64_t n = 0; n < N; n++) cu_buf[n + 1] = (int32_t)(T += lens ? lens[n] : 1);
    for (int64_t t = 0; t < T; t++) x_buf[t] = 0.5f, g_buf[t] = -0.1f;
    a->seq_len = T;
    a->cu_seqlens = cu_buf;
    a->num_seqs = N;
    a->head_dim_k = a->head_dim_v = 1;
    a->dtype = a->g_dtype = a->beta_dtype = a->o_dtype = KDA_FLOAT32;
    a->q = a->k = a->v = a->beta = x_buf;
    a->g = g_buf;
    a->o = o_buf;
    a->initial_state = a->final_state = pool;
    a->state_indices = idx;
    a->num_state_slots = slots;
    a->state_indices_cols = cols;
    a->state_indices_row_stride = stride;
}

static double best_query_time(const kda_args_t *a, kda_algo_t algo, kda_status_t *st) {
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        size_t ws = 0;
        const double t0 = now();
        *st = algo == KDA_ALGO_FORWARD ? kda_forward_workspace_size(cpu(), a, &ws) : kda_decode_workspace_size(cpu(), a, &ws);
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    return best;
}

/* ---------------------------------------------------------------------------------------------------------
 * Item 2. The distinct-slot check cleared a 16 KB bitmap per 2^17 slots of the pool, on every call and every
 * workspace query: 2^40 slots took seconds, 2^52 hours. Now its time and memory do not depend on
 * num_state_slots.
 * ------------------------------------------------------------------------------------------------------- */
TEST(harden_pool_check_is_o_n) {
    float *pool = big_pool();
    if (!pool) SKIP("could not reserve 4 TB of address space for the pool");
    static int32_t idx[5000];
    static const struct {
        int64_t n, cols;
    } cases[] = {{1, 0}, {4, 0}, {5000, 0}, {4, 2}, {1500, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t N = cases[c].n, cols = cases[c].cols;
        static int lens[5000];
        for (int64_t i = 0; i < N * (cols ? cols : 1); i++) idx[i] = (int32_t)i; /* slots inside the first 64 KB */
        for (int64_t n = 0; n < N; n++) lens[n] = cols ? 2 : 1;
        kda_args_t a;
        pool_args(&a, N, lens, idx, cols, 0, pool, BIG_SLOTS);
        for (int algo = 0; algo < 2; algo++) {
            kda_status_t st;
            const double dt = best_query_time(&a, (kda_algo_t)algo, &st);
            printf("N %lld cols %lld %s: workspace query %.3f ms with 2^40 slots\n", (long long)N, (long long)cols,
                   algo ? "decode" : "forward", 1e3 * dt);
            CHECK(st == KDA_STATUS_SUCCESS, "N %lld: %s", (long long)N, kda_last_error());
            CHECK(dt < (N > 2048 ? 0.05 : 0.005), "N %lld cols %lld: the query took %.1f ms with 2^40 slots",
                  (long long)N, (long long)cols, 1e3 * dt);
            const double t0 = now();
            CHECK(kda_run_host(cpu(), &a, (kda_algo_t)algo) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
            CHECK(now() - t0 < 0.5, "the call took %.1f ms", 1e3 * (now() - t0));
        }
    }
    /* the largest pool a K = V = HV = 1 problem may name: still a few operations (the query only) */
    kda_args_t a;
    idx[0] = 2147483647;
    pool_args(&a, 1, NULL, idx, 0, 0, pool, BIG_SLOTS);
    a.num_state_slots = KDA_MAX_ELEMS;
    a.initial_state = NULL; /* the extent of a 2^52-slot final pool covers everything above it: keep it alone */
    a.q = a.k = a.v = a.beta = a.g = a.o = NULL;
    a.seq_len = 0;
    cu_buf[1] = 0;
    kda_status_t st;
    const double dt = best_query_time(&a, KDA_ALGO_DECODE, &st);
    CHECK(st == KDA_STATUS_SUCCESS && dt < 0.005, "2^52 slots: %s, %.1f ms", kda_last_error(), 1e3 * dt);
}

/* The first repeated item of the stream the library checks (the rule of kda_check_state_slots, by brute force):
 * writes the expected message to `want`, or "" when the slots are distinct. */
static void expect_repeat(const kda_args_t *a, const int *lens, char *want, size_t size) {
    enum { MAXI = 20000 };
    static int64_t slot[MAXI], row[MAXI], col[MAXI];
    static int kind[MAXI]; /* 0: 1-D, 1: written, 2: read */
    int64_t n_items = 0;
    want[0] = 0;
    for (int64_t n = 0; n < a->num_seqs; n++) {
        const int32_t *r = a->state_indices + (a->state_indices_cols ? n * a->state_indices_cols : n);
        const int len = a->state_indices_cols ? lens[n] : 0;
        for (int t = 0; t < len; t++) slot[n_items] = r[t], row[n_items] = n, col[n_items] = t, kind[n_items++] = 1;
        if (!a->state_indices_cols) {
            slot[n_items] = r[0], row[n_items] = n, col[n_items] = 0, kind[n_items++] = 0;
            continue;
        }
        const int rd = a->num_accepted_tokens ? a->num_accepted_tokens[n] - 1 : 0;
        int own = 0;
        for (int t = 0; t < len; t++) own |= r[t] == r[rd];
        if (!own) slot[n_items] = r[rd], row[n_items] = n, col[n_items] = rd, kind[n_items++] = 2;
    }
    for (int64_t j = 0; j < n_items; j++) {
        if (slot[j] < 0) continue;
        for (int64_t i = 0; i < j; i++) {
            if (slot[i] != slot[j]) continue;
            if (kind[j] == 0)
                snprintf(want, size, "state_indices[%lld] and state_indices[%lld] are both %lld", (long long)row[i],
                         (long long)row[j], (long long)slot[j]);
            else if (kind[j] == 1)
                snprintf(want, size, "slot %lld (state_indices[%lld][%lld]) is touched twice", (long long)slot[j],
                         (long long)row[j], (long long)col[j]);
            else
                snprintf(want, size, "slot %lld (state_indices[%lld][%lld], the slot sequence %lld reads) is touched "
                         "by another sequence", (long long)slot[j], (long long)row[j], (long long)col[j],
                         (long long)row[j]);
            return;
        }
    }
}

static void check_repeat(const kda_args_t *a, const int *lens, const char *what) {
    char want[256];
    expect_repeat(a, lens, want, sizeof want);
    size_t ws = 0;
    const kda_status_t st = kda_decode_workspace_size(cpu(), a, &ws);
    if (!want[0])
        CHECK(st == KDA_STATUS_SUCCESS, "%s: distinct slots refused: %s", what, kda_last_error());
    else
        CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "'state_indices'") &&
                  strstr(kda_last_error(), want),
              "%s: %s, \"%s\"; expected \"%s\"", what, kda_status_string(st), kda_last_error(), want);
}

/* Still every repeat found, at every position, and the first one reported: 1-D for every pair of positions of
 * small calls and chosen ones of large calls (around the 2048-item hash block and past it), with slots up to
 * 2^31 − 1 of a 2^40-slot pool (the hashed way) and a permutation of a pool of N slots (the bitmap way past
 * 2048 items); 2-D with repeats injected into written, read and unused columns, against the rule by brute
 * force. */
TEST(harden_pool_duplicate_at_every_position) {
    float *pool = big_pool();
    if (!pool) SKIP("could not reserve 4 TB of address space for the pool");
    static int32_t idx[20000];
    static int lens[5000];
    static int32_t acc[5000];
    uint64_t rng = 0x2545f4914f6cdd1dull;
    static const int64_t sizes[] = {2, 3, 16, 100, 2047, 2048, 2049, 4096, 4097, 5000};
    for (int small_pool = 0; small_pool < 2; small_pool++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
            const int64_t N = sizes[z], slots = small_pool ? N : BIG_SLOTS;
            kda_args_t a;
            pool_args(&a, N, NULL, idx, 0, 0, pool, slots);
            /* distinct: n -> n * odd mod 2^31 (a bijection), or mod N by a prime that does not divide N */
            for (int64_t n = 0; n < N; n++)
                idx[n] = small_pool ? (int32_t)(n * 7919 % N) : (int32_t)((uint64_t)n * 0x9E3779B1u % 0x80000000u);
            check_repeat(&a, NULL, "distinct");
            int64_t pairs[64][2], np = 0;
            if (N <= 100) {
                for (int64_t i = 0; i < N; i++)
                    for (int64_t j = i + 1; j < N; j++) {
                        const int32_t keep = idx[j];
                        idx[j] = idx[i];
                        char what[64];
                        snprintf(what, sizeof what, "N %lld pair (%lld, %lld)", (long long)N, (long long)i, (long long)j);
                        check_repeat(&a, NULL, what);
                        idx[j] = keep;
                    }
                continue;
            }
            const int64_t fixed[][2] = {{0, 1}, {0, N - 1}, {N - 2, N - 1}, {2046, 2047}, {2047, 2048}, {1, 2049},
                                        {2048, 4096}, {4095, 4096}, {10, 4500}, {3000, 4000}};
            for (size_t f = 0; f < sizeof fixed / sizeof fixed[0]; f++)
                if (fixed[f][1] < N) pairs[np][0] = fixed[f][0], pairs[np][1] = fixed[f][1], np++;
            while (np < 40) {
                const int64_t i = (int64_t)(rng_next(&rng) % (uint64_t)N), j = (int64_t)(rng_next(&rng) % (uint64_t)N);
                if (i != j) pairs[np][0] = i < j ? i : j, pairs[np][1] = i < j ? j : i, np++;
            }
            for (int64_t k = 0; k < np; k++) {
                const int64_t i = pairs[k][0], j = pairs[k][1];
                const int32_t keep = idx[j];
                idx[j] = idx[i];
                char what[96];
                snprintf(what, sizeof what, "N %lld pool %lld pair (%lld, %lld)", (long long)N, (long long)slots,
                         (long long)i, (long long)j);
                check_repeat(&a, NULL, what);
                /* two repeats: the earlier second occurrence is reported */
                const int64_t i2 = (int64_t)(rng_next(&rng) % (uint64_t)N), j2 = (int64_t)(rng_next(&rng) % (uint64_t)N);
                if (i2 != j2 && i2 != i && i2 != j && j2 != i && j2 != j) {
                    const int32_t keep2 = idx[j2];
                    idx[j2] = idx[i2];
                    check_repeat(&a, NULL, "two repeats");
                    idx[j2] = keep2;
                }
                idx[j] = keep;
            }
            /* negative slots (no slot) any number of times */
            for (int64_t n = 0; n < N; n += 3) idx[n] = -1;
            check_repeat(&a, NULL, "negatives");
        }

    /* 2-D: rows of T_max = 4 columns, lengths in [0, 4], a read column in [1, 4] */
    static const int64_t rows[] = {3, 50, 1000};
    for (int small_pool = 0; small_pool < 2; small_pool++)
        for (size_t z = 0; z < sizeof rows / sizeof rows[0]; z++)
            for (int trial = 0; trial < 40; trial++) {
                const int64_t N = rows[z], cols = 4, slots = small_pool ? (int64_t)1 << 17 : BIG_SLOTS;
                for (int64_t n = 0; n < N; n++) {
                    lens[n] = (int)(rng_next(&rng) % 5);
                    acc[n] = (int32_t)(1 + rng_next(&rng) % 4);
                }
                kda_args_t a;
                pool_args(&a, N, lens, idx, cols, 0, pool, slots);
                a.num_accepted_tokens = trial % 3 ? acc : NULL;
                for (int64_t i = 0; i < N * cols; i++)
                    idx[i] = (int32_t)((uint64_t)i * 0x9E3779B1u % (uint64_t)(small_pool ? slots : 0x80000000u));
                const int repeats = trial % 4; /* 0 to 3 copies of an earlier element into a later one */
                for (int r = 0; r < repeats; r++) {
                    const int64_t i = (int64_t)(rng_next(&rng) % (uint64_t)(N * cols));
                    const int64_t j = (int64_t)(rng_next(&rng) % (uint64_t)(N * cols));
                    idx[i > j ? i : j] = idx[i > j ? j : i];
                }
                if (trial % 5 == 0) idx[rng_next(&rng) % (uint64_t)(N * cols)] = -1;
                char what[96];
                snprintf(what, sizeof what, "2-D N %lld pool %lld trial %d", (long long)N, (long long)slots, trial);
                check_repeat(&a, lens, what);
            }
}

/* ---------------------------------------------------------------------------------------------------------
 * Item 3. state_indices_row_stride had no upper bound: 2^40 with three empty sequences read far outside the
 * indices (SIGSEGV inside the workspace query), 2^62 overflowed the index arithmetic.
 * ------------------------------------------------------------------------------------------------------- */
TEST(harden_row_stride_bounded) {
    static int32_t idx[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static float pool[16];
    static const int lens[3] = {0, 0, 0};
    static const struct {
        int64_t cols, stride;
        const char *arg;
    } bad[] = {
        {1, (int64_t)1 << 40, "'state_indices_row_stride'"}, {1, (int64_t)1 << 62, "'state_indices_row_stride'"},
        {1, INT64_MAX, "'state_indices_row_stride'"},        {1, (int64_t)1 << 39, "'state_indices_row_stride'"},
        {(int64_t)1 << 41, 0, "'state_indices_cols'"},        {(int64_t)1 << 62, 0, "'state_indices_cols'"},
        {(int64_t)1 << 39, 0, "'state_indices_cols'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        for (int algo = 0; algo < 2; algo++) {
            kda_args_t a;
            pool_args(&a, 3, lens, idx, bad[i].cols, bad[i].stride, pool, 16);
            size_t ws = 0;
            kda_status_t st = algo ? kda_decode_workspace_size(cpu(), &a, &ws) : kda_forward_workspace_size(cpu(), &a, &ws);
            CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), bad[i].arg),
                  "cols %lld stride %lld: %s, %s", (long long)bad[i].cols, (long long)bad[i].stride,
                  kda_status_string(st), kda_last_error());
            st = kda_run_host(kda_test_reference(), &a, (kda_algo_t)algo);
            CHECK(st == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), bad[i].arg), "reference: %s",
                  kda_last_error());
        }
    /* a real stride: three rows 5 elements apart, 2 columns each */
    static const int lens2[3] = {2, 1, 0};
    kda_args_t a;
    pool_args(&a, 3, lens2, idx, 2, 5, pool, 16);
    for (int algo = 0; algo < 2; algo++)
        CHECK(kda_run_host(cpu(), &a, (kda_algo_t)algo) == KDA_STATUS_SUCCESS, "stride 5: %s", kda_last_error());
    a.num_seqs = 1; /* one row: any stride up to the bound */
    cu_buf[1] = 2;
    a.seq_len = 2;
    a.state_indices_row_stride = KDA_MAX_TOKENS;
    CHECK(kda_run_host(cpu(), &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "one row, stride 2^40: %s", kda_last_error());
}

/* ---------------------------------------------------------------------------------------------------------
 * Item 4. kda_set_num_threads while another thread ran kda_forward on the same context tore down the pool the
 * call was using (a deadlock in pthread_cond_destroy, a race on the pool's memory). Now it, and kda_destroy,
 * answer KDA_STATUS_CONTEXT_IN_USE and change nothing; other calls may still share the context.
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    kda_context_t *ctx;
    const kda_args_t *args;
    kda_status_t st;
    int started, done;
    char msg[256];
} fwd_job_t;

/* The workspace is queried before `started`: from then on the thread's only call is the forward. */
static void *fwd_thread(void *p) {
    fwd_job_t *j = (fwd_job_t *)p;
    size_t ws = 0;
    j->st = kda_forward_workspace_size(j->ctx, j->args, &ws);
    void *w = malloc(ws ? ws : 1);
    __atomic_store_n(&j->started, 1, __ATOMIC_SEQ_CST);
    if (j->st == KDA_STATUS_SUCCESS) j->st = kda_forward(j->ctx, j->args, w, ws, NULL);
    snprintf(j->msg, sizeof j->msg, "%s", j->st == KDA_STATUS_SUCCESS ? "" : kda_last_error());
    __atomic_store_n(&j->done, 1, __ATOMIC_SEQ_CST);
    free(w);
    return NULL;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "harden_context_in_use: no answer in 300 s (a deadlock)\n";
    if (write(2, msg, sizeof msg - 1) < 0) _exit(1);
    _exit(1);
}

TEST(harden_context_in_use) {
    CHECK(strcmp(kda_status_string(KDA_STATUS_CONTEXT_IN_USE), "KDA_STATUS_CONTEXT_IN_USE") == 0 &&
              KDA_STATUS_CONTEXT_IN_USE == 7,
          "%s", kda_status_string(KDA_STATUS_CONTEXT_IN_USE));
    signal(SIGALRM, on_alarm);
    alarm(300);
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.seq_len = 4096;
    c.hqk = 1;
    c.hv = 4;
    c.k = c.v = 128;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    kda_context_t *ctx = NULL;
    CHECK(kda_create(&ctx, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(kda_set_num_threads(ctx, 2) == KDA_STATUS_SUCCESS, "%s", kda_last_error());

    /* a call in flight, as the counter shows it: both refuse, and change nothing */
    __atomic_fetch_add(&ctx->in_use, 1, __ATOMIC_SEQ_CST);
    kda_status_t st = kda_set_num_threads(ctx, 1);
    CHECK(st == KDA_STATUS_CONTEXT_IN_USE && strstr(kda_last_error(), "kda_set_num_threads") &&
              strstr(kda_last_error(), "in use"),
          "set_num_threads: %s, %s", kda_status_string(st), kda_last_error());
    st = kda_destroy(ctx);
    CHECK(st == KDA_STATUS_CONTEXT_IN_USE && strstr(kda_last_error(), "kda_destroy"), "destroy: %s, %s",
          kda_status_string(st), kda_last_error());
    int n = 0;
    CHECK(kda_get_num_threads(ctx, &n) == KDA_STATUS_SUCCESS && n == 2, "threads %d after the refusals", n);
    size_t ws = 0; /* sharing the context is allowed: a query runs beside the call */
    CHECK(kda_forward_workspace_size(ctx, &a, &ws) == KDA_STATUS_SUCCESS && ws > 0, "query beside: %s",
          kda_last_error());
    __atomic_fetch_sub(&ctx->in_use, 1, __ATOMIC_SEQ_CST);

    /* a real call on another thread: kda_set_num_threads is refused while it runs, and nothing hangs */
    int seen = 0;
    for (int attempt = 0; attempt < 5 && !seen; attempt++) {
        fwd_job_t job = {ctx, &a, KDA_STATUS_INTERNAL_ERROR, 0, 0, {0}};
        pthread_t th;
        CHECK(pthread_create(&th, NULL, fwd_thread, &job) == 0, "pthread_create");
        while (!__atomic_load_n(&job.started, __ATOMIC_SEQ_CST)) sched_yield();
        while (!__atomic_load_n(&ctx->in_use, __ATOMIC_SEQ_CST) && !__atomic_load_n(&job.done, __ATOMIC_SEQ_CST))
            sched_yield();
        st = kda_set_num_threads(ctx, 1);
        if (st == KDA_STATUS_CONTEXT_IN_USE) {
            seen = 1;
            CHECK(strstr(kda_last_error(), "in use") != NULL, "%s", kda_last_error());
            CHECK(kda_get_num_threads(ctx, &n) == KDA_STATUS_SUCCESS && n == 2, "threads %d after the refusal", n);
        } else { /* the call ended first: try again */
            CHECK(st == KDA_STATUS_SUCCESS, "set_num_threads: %s (%s)", kda_status_string(st), kda_last_error());
        }
        pthread_join(th, NULL);
        CHECK(job.st == KDA_STATUS_SUCCESS, "the forward: %s (%s)", kda_status_string(job.st), job.msg);
        CHECK(kda_set_num_threads(ctx, 2) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    }
    CHECK(seen, "the forward never overlapped kda_set_num_threads");
    CHECK(__atomic_load_n(&ctx->in_use, __ATOMIC_SEQ_CST) == 0, "in_use %d after the calls", ctx->in_use);
    CHECK(kda_set_num_threads(ctx, 3) == KDA_STATUS_SUCCESS, "after the call: %s", kda_last_error());
    CHECK(kda_run_host(ctx, &a, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(kda_destroy(ctx) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    alarm(0);
    kda_synth_free(&s);
}

/* ---------------------------------------------------------------------------------------------------------
 * Item 5. The chunked forward's diagonal 16-token block splits e^{G_i − G_j} around its middle row, and takes
 * per-pair exponentials when the block's exponents pass ±KDA_DIAG_RANGE: a gate at token t0 changes that row or
 * that choice for the whole block, so its earlier rows move by float32 rounding. The contract (docs/ALGORITHM.md
 * §7 item 6): the reference backend and the CPU kda_decode exact; the CPU kda_forward exact before t0's block
 * and within KDA_CAUSAL_TOL of the head's largest |o| inside it; never a non-finite value before t0, NaN from t0
 * on for a NaN gate, finite for every other class (clamped). tests/common/causal.c places t0 at every position
 * of the first three blocks and around the 64-token chunk boundary, in one channel or all; the GPU test runs
 * the same on CUDA (gpu_fwd_causal_in_g).
 * ------------------------------------------------------------------------------------------------------- */
static kda_status_t run_on(void *ctx, const kda_args_t *a, kda_algo_t algo) {
    return kda_run_host((kda_context_t *)ctx, a, algo);
}

TEST(harden_fwd_causal_in_g) {
    kda_context_t *cpu8 = NULL;
    CHECK(kda_create(&cpu8, KDA_BACKEND_CPU, 0) == KDA_STATUS_SUCCESS && kda_set_num_threads(cpu8, 8) == 0, "%s",
          kda_last_error());
    const struct {
        const char *name;
        kda_context_t *ctx;
        kda_algo_t algo;
        double tol;
    } runs[] = {{"cpu forward", cpu(), KDA_ALGO_FORWARD, KDA_CAUSAL_TOL},
                {"cpu forward, 8 threads", cpu8, KDA_ALGO_FORWARD, KDA_CAUSAL_TOL},
                {"cpu decode", cpu(), KDA_ALGO_DECODE, 0.0},
                {"reference", kda_test_reference(), KDA_ALGO_FORWARD, 0.0}};
    double worst = 0.0;
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++)
        for (int D = 32; D <= 128; D *= 4) {
            const kda_contract_backend_t be = {runs[r].name, run_on, runs[r].ctx, D, 0.0, 0.0, 0};
            worst = fmax(worst, kda_contract_causal_g(&be, runs[r].algo, runs[r].tol, D == 32 ? 1 : 2));
        }
    printf("largest move of an earlier output of t0's block (CPU kda_forward): %.3g of the head's max |o|\n", worst);
    kda_destroy(cpu8);
}

/* ---------------------------------------------------------------------------------------------------------
 * Item 7. An uninitialised struct (a garbage struct_size) was answered NOT_SUPPORTED "built against a newer
 * libkda"; only a plausible newer size (a multiple of the struct's alignment, up to 64 KB) is that now.
 * ------------------------------------------------------------------------------------------------------- */
TEST(harden_struct_size_garbage) {
    static const size_t garbage[] = {0, 3, 0xdeadbeef, 0xcdcdcdcdcdcdcdcdull, SIZE_MAX, (size_t)1 << 20, 65536 + 8,
                                     sizeof(kda_args_t) + 1, sizeof(kda_args_t) + 4};
    kda_args_t a;
    for (size_t i = 0; i < sizeof garbage / sizeof garbage[0]; i++) {
        kda_args_init(&a);
        a.struct_size = garbage[i];
        size_t n = 0;
        kda_status_t st[3] = {kda_forward_workspace_size(cpu(), &a, &n), kda_decode_workspace_size(cpu(), &a, &n),
                              kda_forward_saved_size(cpu(), &a, &n)};
        for (int k = 0; k < 3; k++)
            CHECK(st[k] == KDA_STATUS_INVALID_VALUE, "struct_size %#zx: %s", garbage[i], kda_status_string(st[k]));
        CHECK(strstr(kda_last_error(), "'struct_size'") && strstr(kda_last_error(), "kda_args_init()"),
              "struct_size %#zx: %s", garbage[i], kda_last_error());
        kda_backward_args_t b;
        kda_backward_args_init(&b);
        kda_args_init(&a);
        b.problem = &a;
        b.struct_size = garbage[i];
        const kda_status_t sb = kda_backward_workspace_size(cpu(), &b, &n);
        CHECK(sb == KDA_STATUS_INVALID_VALUE && strstr(kda_last_error(), "'struct_size'") &&
                  strstr(kda_last_error(), "kda_backward_args_init()"),
              "backward struct_size %#zx: %s, %s", garbage[i], kda_status_string(sb), kda_last_error());
    }
    /* a plausible newer size: NOT_SUPPORTED, as before */
    static const size_t newer[] = {sizeof(kda_args_t) + 8, 4096, 65536};
    for (size_t i = 0; i < sizeof newer / sizeof newer[0]; i++) {
        kda_args_init(&a);
        a.struct_size = newer[i];
        size_t n = 0;
        const kda_status_t st = kda_forward_workspace_size(cpu(), &a, &n);
        CHECK(st == KDA_STATUS_NOT_SUPPORTED && strstr(kda_last_error(), "newer libkda"), "struct_size %zu: %s, %s",
              newer[i], kda_status_string(st), kda_last_error());
        kda_backward_args_t b;
        kda_backward_args_init(&b);
        kda_args_init(&a);
        b.problem = &a;
        b.struct_size = i == 0 ? sizeof(kda_backward_args_t) + 8 : newer[i];
        const kda_status_t sb = kda_backward_workspace_size(cpu(), &b, &n);
        CHECK(sb == KDA_STATUS_NOT_SUPPORTED, "backward struct_size %zu: %s", (size_t)b.struct_size,
              kda_status_string(sb));
    }
    /* the oldest accepted sizes still work */
    kda_args_init_sized(&a, KDA_ARGS_MIN_SIZE);
    a.head_dim_k = a.head_dim_v = 16;
    size_t n = 0;
    CHECK(kda_forward_workspace_size(cpu(), &a, &n) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
}
