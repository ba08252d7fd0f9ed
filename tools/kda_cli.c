/*
 * kda — the libkda command line.
 *
 *   kda demo [options]   run a synthetic problem on a backend: configuration, time, throughput, and the
 *                        relative error against the fp64 oracle; --json adds one JSON object as the last line
 *   kda bench [options]  the CPU benchmark (tools/bench.c): chunked vs oracle vs decode, GFLOP/s vs peak
 *   kda --version        print the library version (also: kda version)
 *   kda --help           usage
 *
 * Arguments are checked by the library itself: a bad one exits with status 2 and the library's message.
 * A run that lasts longer than a second shows what it is doing on one progress line on stderr, when stderr is a
 * terminal (never in a pipe or a log).
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kda.h"
#include "synth.h"

#ifdef KDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

int kda_bench_main(int argc, char **argv); /* tools/bench.c */

static void usage(FILE *f) {
    fprintf(f,
            "usage: kda demo [options] | kda bench [options] | kda --version | kda --help\n"
            "  (kda bench --help: the CPU benchmark's options)\n"
            "\n"
            "demo options (defaults in brackets):\n"
            "  --backend auto|cpu|cuda|reference   [auto: CUDA when a GPU is usable, else CPU]\n"
            "  --B N --T N                         batch rows and tokens per row [1, 2048]\n"
            "  --varlen L1,L2,...                  variable-length sequences (B becomes 1)\n"
            "  --hqk N --hv N                      query/key heads and value heads [4, 4]\n"
            "  --K N --V N                         head sizes [128, 128]\n"
            "  --dtype bf16|f16|f32                q, k, v, g, o dtype [bf16]\n"
            "  --gate raw|softplus|lower_bound|lower_bound_noa   gate mode [lower_bound, -5, safe]\n"
            "  --lower-bound X                     bound of the sigmoid gate [-5]\n"
            "  --no-l2norm --no-beta-sigmoid --neg-eigval --no-initial-state --state-v-first\n"
            "  --state-dtype f32|bf16              initial/final state dtype [f32]\n"
            "  --decode                            the recurrent algorithm (kda_decode) instead of the chunked one\n"
            "  --cp auto|off|N                     intra-card context parallelism (CUDA): the library's choice,\n"
            "                                      never, or pieces of N tokens (a multiple of 64) [auto]\n"
            "  --threads N                         CPU threads [KDA_NUM_THREADS or all cores]\n"
            "  --iters N                           timed runs, median reported [CPU 3, CUDA 20]\n"
            "  --no-check                          skip the oracle (its time and the error)\n"
            "  --seed N                            input seed [1]\n"
            "  --json                              print a JSON object as the last line\n");
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* ---------------------------------------------------------------------------------------------------------
 * Progress: a thread that, once a run has lasted a second, rewrites one line on stderr every 0.25 s with the
 * current step and the time spent, while the main thread is inside a long library call. Only on a terminal.
 * ------------------------------------------------------------------------------------------------------- */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
    int on, stop, shown;
    double t0;
    char step[160];
} progress = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static void progress_clear_locked(void) {
    if (progress.shown) fputs("\r\033[K", stderr);
    progress.shown = 0;
}

static void *progress_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&progress.lock);
    while (!progress.stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&progress.wake, &progress.lock, &ts);
        const double s = (now_ms() - progress.t0) * 1e-3;
        if (progress.stop || s < 1.0 || !progress.step[0]) continue;
        fprintf(stderr, "\r\033[Kkda: %s ... %.1f s", progress.step, s);
        fflush(stderr);
        progress.shown = 1;
    }
    progress_clear_locked();
    pthread_mutex_unlock(&progress.lock);
    return NULL;
}

static void progress_start(void) {
    progress.t0 = now_ms();
    progress.on = isatty(STDERR_FILENO) && pthread_create(&progress.thread, NULL, progress_main, NULL) == 0;
}

/* The step now running, e.g. "timed run 2 of 3 (cpu forward)". */
static void progress_step(const char *fmt, ...) {
    if (!progress.on) return;
    pthread_mutex_lock(&progress.lock);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(progress.step, sizeof progress.step, fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&progress.lock);
}

/* Ends the progress line (before anything is printed on stdout, which may be the same terminal). */
static void progress_stop(void) {
    if (!progress.on) return;
    pthread_mutex_lock(&progress.lock);
    progress.stop = 1;
    pthread_cond_signal(&progress.wake);
    pthread_mutex_unlock(&progress.lock);
    pthread_join(progress.thread, NULL);
    progress.on = 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int parse_dtype(const char *s, kda_dtype_t *d) {
    if (!strcmp(s, "bf16")) *d = KDA_BFLOAT16;
    else if (!strcmp(s, "f16")) *d = KDA_FLOAT16;
    else if (!strcmp(s, "f32")) *d = KDA_FLOAT32;
    else return -1;
    return 0;
}

static const char *dtype_str(kda_dtype_t d) { return d == KDA_FLOAT32 ? "f32" : d == KDA_FLOAT16 ? "f16" : "bf16"; }

static int fail(const char *what) {
    progress_stop();
    fprintf(stderr, "kda: %s\n", what);
    return 2;
}

static int lib_fail(kda_status_t st) {
    progress_stop();
    fprintf(stderr, "kda: %s: %s\n", kda_status_string(st), kda_last_error());
    return 2;
}

/* ---------------------------------------------------------------------------------------------------------
 * Buffers on the backend's device: host memory, or CUDA device copies of the synthetic host tensors
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int cuda;
    void *ptrs[16];
    int n;
} devmem_t;

static int to_device(devmem_t *m, const void *host, size_t bytes, const void **dev) {
    if (!m->cuda || !host) {
        *dev = host;
        return 0;
    }
#ifdef KDA_HAS_CUDA
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) return -1;
    if (cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return -1;
    m->ptrs[m->n++] = d;
    *dev = d;
    return 0;
#else
    (void)bytes;
    return -1;
#endif
}

static void *alloc_ws(devmem_t *m, size_t bytes) {
    if (!bytes) return NULL;
    if (!m->cuda) return malloc(bytes);
#ifdef KDA_HAS_CUDA
    void *d = NULL;
    if (cudaMalloc(&d, bytes) != cudaSuccess) return NULL;
    return d;
#else
    (void)bytes;
    return NULL;
#endif
}

static void free_ws(devmem_t *m, void *p) {
    if (!p) return;
    if (!m->cuda) {
        free(p);
        return;
    }
#ifdef KDA_HAS_CUDA
    cudaFree(p);
#endif
}

static int to_host(devmem_t *m, void *host, const void *dev, size_t bytes) {
    if (!m->cuda || host == dev) return 0;
#ifdef KDA_HAS_CUDA
    return cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
#else
    (void)bytes;
    return -1;
#endif
}

static void devmem_free(devmem_t *m) {
#ifdef KDA_HAS_CUDA
    for (int i = 0; i < m->n; i++) cudaFree(m->ptrs[i]);
#endif
    m->n = 0;
}

static double sync_now_ms(int cuda) {
#ifdef KDA_HAS_CUDA
    if (cuda) cudaDeviceSynchronize();
#else
    (void)cuda;
#endif
    return now_ms();
}

/* A JSON string (null for NULL), escaped. */
static void json_string(const char *s) {
    if (!s) {
        fputs("null", stdout);
        return;
    }
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') printf("\\%c", *s);
        else if ((unsigned char)*s < 0x20) printf("\\u%04x", *s);
        else putchar(*s);
    }
    putchar('"');
}

/* ---------------------------------------------------------------------------------------------------------
 * demo
 * ------------------------------------------------------------------------------------------------------- */
static int demo(int argc, char **argv) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.seq_len = 2048;
    c.hqk = c.hv = 4;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.initial_state = c.final_state = 1;
    c.beta_dtype = KDA_BFLOAT16;
    kda_backend_t backend = KDA_BACKEND_AUTO;
    int json = 0, decode = 0, check = 1, threads = 0, iters = 0;
    int64_t lens[4096];
    kda_cp_mode_t cp_mode = KDA_CP_AUTO;
    int64_t cp_piece_len = 0;

    for (int i = 0; i < argc; i++) {
        const char *o = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE                                                                                          \
    do {                                                                                                    \
        if (!val) {                                                                                         \
            fprintf(stderr, "kda: %s needs a value\n", o);                                                  \
            return 2;                                                                                       \
        }                                                                                                   \
        i++;                                                                                                \
    } while (0)
#define INT_VALUE(dst)                                                                                      \
    do {                                                                                                    \
        NEED_VALUE;                                                                                         \
        char *end;                                                                                          \
        long long x = strtoll(val, &end, 10);                                                               \
        if (*end || x < 0) {                                                                                \
            fprintf(stderr, "kda: %s: '%s' is not a non-negative integer\n", o, val);                       \
            return 2;                                                                                       \
        }                                                                                                   \
        dst = x;                                                                                            \
    } while (0)
        if (!strcmp(o, "--backend")) {
            NEED_VALUE;
            if (!strcmp(val, "auto")) backend = KDA_BACKEND_AUTO;
            else if (!strcmp(val, "cpu")) backend = KDA_BACKEND_CPU;
            else if (!strcmp(val, "cuda")) backend = KDA_BACKEND_CUDA;
            else if (!strcmp(val, "reference")) backend = KDA_BACKEND_REFERENCE;
            else return fail("--backend must be auto, cpu, cuda or reference");
        } else if (!strcmp(o, "--B")) INT_VALUE(c.batch);
        else if (!strcmp(o, "--T")) INT_VALUE(c.seq_len);
        else if (!strcmp(o, "--hqk")) INT_VALUE(c.hqk);
        else if (!strcmp(o, "--hv")) INT_VALUE(c.hv);
        else if (!strcmp(o, "--K")) INT_VALUE(c.k);
        else if (!strcmp(o, "--V")) INT_VALUE(c.v);
        else if (!strcmp(o, "--threads")) INT_VALUE(threads);
        else if (!strcmp(o, "--iters")) INT_VALUE(iters);
        else if (!strcmp(o, "--seed")) INT_VALUE(c.seed);
        else if (!strcmp(o, "--varlen")) {
            NEED_VALUE;
            int n = 0;
            const char *p = val;
            while (*p) {
                char *end;
                long long x = strtoll(p, &end, 10);
                if (end == p || x < 0 || n >= 4096) return fail("--varlen takes non-negative lengths like 100,0,37");
                lens[n++] = x;
                p = *end == ',' ? end + 1 : end;
                if (*end && *end != ',') return fail("--varlen takes non-negative lengths like 100,0,37");
            }
            c.num_seqs = n;
            c.seqlens = lens;
            c.batch = 1;
        } else if (!strcmp(o, "--dtype")) {
            NEED_VALUE;
            if (parse_dtype(val, &c.dtype)) return fail("--dtype must be bf16, f16 or f32");
            c.g_dtype = c.o_dtype = c.beta_dtype = c.dtype;
        } else if (!strcmp(o, "--state-dtype")) {
            NEED_VALUE;
            if (parse_dtype(val, &c.initial_state_dtype) || c.initial_state_dtype == KDA_FLOAT16)
                return fail("--state-dtype must be f32 or bf16");
            c.final_state_dtype = c.initial_state_dtype;
        } else if (!strcmp(o, "--gate")) {
            NEED_VALUE;
            if (!strcmp(val, "raw")) c.gate = KDA_GATE_RAW;
            else if (!strcmp(val, "softplus")) c.gate = KDA_GATE_SOFTPLUS;
            else if (!strcmp(val, "lower_bound")) c.gate = KDA_GATE_LOWER_BOUND;
            else if (!strcmp(val, "lower_bound_noa")) c.gate = KDA_GATE_LOWER_BOUND_NO_A;
            else return fail("--gate must be raw, softplus, lower_bound or lower_bound_noa");
        } else if (!strcmp(o, "--lower-bound")) {
            NEED_VALUE;
            char *end;
            c.lower_bound = strtof(val, &end);
            if (*end) return fail("--lower-bound takes a number");
        } else if (!strcmp(o, "--no-l2norm")) c.l2norm = 0;
        else if (!strcmp(o, "--no-beta-sigmoid")) c.beta_sigmoid = 0;
        else if (!strcmp(o, "--neg-eigval")) c.allow_neg_eigval = 1;
        else if (!strcmp(o, "--no-initial-state")) c.initial_state = 0;
        else if (!strcmp(o, "--state-v-first")) c.state_v_first = 1;
        else if (!strcmp(o, "--decode")) decode = 1;
        else if (!strcmp(o, "--cp")) {
            NEED_VALUE;
            if (!strcmp(val, "auto")) cp_mode = KDA_CP_AUTO;
            else if (!strcmp(val, "off")) cp_mode = KDA_CP_OFF;
            else {
                char *end;
                cp_piece_len = strtoll(val, &end, 10);
                if (end == val || *end) return fail("--cp takes auto, off or a piece length in tokens");
                cp_mode = KDA_CP_ON; /* the library checks the length (a multiple of 64) */
            }
        }
        else if (!strcmp(o, "--no-check")) check = 0;
        else if (!strcmp(o, "--json")) json = 1;
        else {
            fprintf(stderr, "kda: unknown option '%s'\n", o);
            usage(stderr);
            return 2;
        }
#undef INT_VALUE
#undef NEED_VALUE
    }

    kda_context_t *ctx = NULL;
    const kda_backend_t asked = backend;
    kda_status_t st = kda_create(&ctx, backend, 0);
    if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
    kda_get_backend(ctx, &backend);
    char no_cuda[512] = ""; /* AUTO on the CPU: why CUDA was not used (kda_create leaves it in kda_last_error) */
    if (asked == KDA_BACKEND_AUTO && backend != KDA_BACKEND_CUDA) {
        const char *why = kda_last_error();
        if (!strncmp(why, "kda_create: ", 12)) why += 12;
        snprintf(no_cuda, sizeof no_cuda, "%s", why[0] ? why : "no usable CUDA device");
    }
    progress_start();
    if (threads > 0 && backend == KDA_BACKEND_CPU && (st = kda_set_num_threads(ctx, threads)) != KDA_STATUS_SUCCESS)
        return lib_fail(st);
    int nthreads = 0;
    kda_get_num_threads(ctx, &nthreads);
    const int cuda = backend == KDA_BACKEND_CUDA;
    if (iters <= 0) iters = cuda ? 20 : 3;

    kda_synth_t s;
    kda_args_t host_args;
    if (kda_synth_make(&c, &s, &host_args) != 0) return fail("out of host memory for the synthetic problem");

    /* the same problem on the backend's device */
    devmem_t mem = {cuda, {0}, 0};
    kda_args_t args = host_args;
    const size_t q_bytes = s.q_bytes;
    int bad = to_device(&mem, s.q, q_bytes, &args.q) || to_device(&mem, s.k, q_bytes, &args.k) ||
              to_device(&mem, s.v, s.v_bytes, &args.v) || to_device(&mem, s.g, s.g_bytes, &args.g) ||
              to_device(&mem, s.beta, s.beta_bytes, &args.beta) ||
              to_device(&mem, s.o, s.o_bytes, (const void **)&args.o) ||
              to_device(&mem, s.h0, s.h0_bytes, &args.initial_state) ||
              to_device(&mem, s.ht, s.ht_bytes, (const void **)&args.final_state) ||
              to_device(&mem, s.A_log, sizeof(float) * (size_t)c.hv, (const void **)&args.A_log) ||
              to_device(&mem, s.dt_bias, sizeof(float) * (size_t)c.hv * (size_t)c.k, (const void **)&args.dt_bias) ||
              to_device(&mem, s.cu_seqlens, sizeof(int64_t) * (size_t)(s.num_seqs + 1), &args.cu_seqlens);
    if (bad) return fail("could not copy the problem to the device");
    if (!host_args.A_log) args.A_log = NULL;
    if (!host_args.dt_bias) args.dt_bias = NULL;
    if (!host_args.initial_state) args.initial_state = NULL;
    if (!host_args.final_state) args.final_state = NULL;
    if (!host_args.cu_seqlens) args.cu_seqlens = NULL;
    if (cuda && host_args.cu_seqlens) args.cu_seqlens_host = host_args.cu_seqlens;
    args.cp_mode = cp_mode;
    args.cp_piece_len = cp_piece_len;

    size_t ws_bytes = 0;
    st = decode ? kda_decode_workspace_size(ctx, &args, &ws_bytes) : kda_forward_workspace_size(ctx, &args, &ws_bytes);
    if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
    void *ws = alloc_ws(&mem, ws_bytes);
    if (ws_bytes && !ws) return fail("could not allocate the workspace");

    /* what runs, printed before the runs (a long run shows its progress on stderr meanwhile) */
    const char *algo = decode ? "decode" : "forward";
    const char *gates[] = {"raw", "softplus", "lower_bound", "lower_bound_noa"};
    printf("libkda %d.%d.%d  kda demo\n", KDA_VERSION_MAJOR, KDA_VERSION_MINOR, KDA_VERSION_PATCH);
    printf("  backend     %s %s (%d thread%s)\n", kda_backend_name(backend), algo, nthreads, nthreads == 1 ? "" : "s");
    if (no_cuda[0]) printf("  cuda        not used: %s\n", no_cuda);
    if (c.num_seqs > 0)
        printf("  shape       varlen %lld sequences, %lld tokens, HQK %d HV %d K %d V %d\n", (long long)c.num_seqs,
               (long long)s.num_tokens, c.hqk, c.hv, c.k, c.v);
    else
        printf("  shape       B %lld T %lld HQK %d HV %d K %d V %d\n", (long long)c.batch, (long long)c.seq_len, c.hqk,
               c.hv, c.k, c.v);
    printf("  options     dtype %s, gate %s, l2norm %d, beta sigmoid %d, neg eigval %d, states %s%s\n",
           dtype_str(c.dtype), gates[c.gate], c.l2norm, c.beta_sigmoid, c.allow_neg_eigval,
           c.initial_state ? dtype_str(c.initial_state_dtype) : "none", c.state_v_first ? " V-first" : "");
    printf("  workspace   %zu bytes\n", ws_bytes);
    fflush(stdout);

    /* warm up, then time */
    double *times = (double *)malloc(sizeof(double) * (size_t)iters);
    for (int it = -1; it < iters; it++) {
        if (it < 0) progress_step("warm-up run (%s %s)", kda_backend_name(backend), algo);
        else progress_step("timed run %d of %d (%s %s)", it + 1, iters, kda_backend_name(backend), algo);
        double t0 = sync_now_ms(cuda);
        st = decode ? kda_decode(ctx, &args, ws, ws_bytes, NULL) : kda_forward(ctx, &args, ws, ws_bytes, NULL);
        double t1 = sync_now_ms(cuda);
        if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
        if (it >= 0) times[it] = t1 - t0;
    }
    qsort(times, (size_t)iters, sizeof(double), cmp_double);
    const double ms = times[iters / 2];
    if (to_host(&mem, s.o, args.o, s.o_bytes) || (s.ht && to_host(&mem, s.ht, args.final_state, s.ht_bytes)))
        return fail("could not copy the results back");

    /* the oracle */
    const int64_t o_elems = s.num_tokens * c.hv * c.v, st_elems = s.num_seqs * c.hv * (int64_t)c.k * c.v;
    double rel_err = NAN, state_err = NAN, oracle_ms = NAN;
    if (check) {
        kda_context_t *ref = NULL;
        if ((st = kda_create(&ref, KDA_BACKEND_REFERENCE, 0)) != KDA_STATUS_SUCCESS) return lib_fail(st);
        float *o_ref = (float *)malloc(sizeof(float) * (size_t)(o_elems ? o_elems : 1));
        float *ht_ref = (float *)malloc(sizeof(float) * (size_t)(st_elems ? st_elems : 1));
        kda_args_t ra = host_args;
        ra.o = o_ref;
        ra.o_dtype = KDA_FLOAT32;
        if (ra.final_state) {
            ra.final_state = ht_ref;
            ra.final_state_dtype = KDA_FLOAT32;
        }
        size_t rws_bytes = 0;
        kda_forward_workspace_size(ref, &ra, &rws_bytes);
        void *rws = malloc(rws_bytes);
        progress_step("the fp64 oracle (1 thread), for the error");
        double t0 = now_ms();
        st = kda_forward(ref, &ra, rws, rws_bytes, NULL);
        oracle_ms = now_ms() - t0;
        if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
        rel_err = kda_rel_err(s.o, c.o_dtype, o_ref, KDA_FLOAT32, o_elems);
        if (s.ht) state_err = kda_rel_err(s.ht, c.final_state_dtype, ht_ref, KDA_FLOAT32, st_elems);
        free(rws);
        free(o_ref);
        free(ht_ref);
        kda_destroy(ref);
    }

    progress_stop();
    const double tokens = (double)s.num_tokens;
    const double tps = ms > 0 ? tokens / (ms * 1e-3) : 0.0;
    printf("  time        %.3f ms (median of %d)\n", ms, iters);
    printf("  throughput  %.3g tokens/s\n", tps);
    if (check) {
        /* the ratio as "X took N.Nx longer", N >= 1, whichever was slower */
        if (oracle_ms >= ms)
            printf("  oracle      %.3f ms (fp64, 1 thread): the oracle took %.1fx longer than %s\n", oracle_ms,
                   ms > 0 ? oracle_ms / ms : INFINITY, kda_backend_name(backend));
        else
            printf("  oracle      %.3f ms (fp64, 1 thread): %s took %.1fx longer than the oracle\n", oracle_ms,
                   kda_backend_name(backend), oracle_ms > 0 ? ms / oracle_ms : INFINITY);
        printf("  rel err     o %.3g, final state %.3g\n", rel_err, state_err);
    }
    if (json) {
        printf("{\"backend\": \"%s\", \"algorithm\": \"%s\", \"threads\": %d, \"B\": %lld, \"T\": %lld, \"num_seqs\": %lld, "
               "\"tokens\": %lld, \"hqk\": %d, \"hv\": %d, \"K\": %d, \"V\": %d, \"dtype\": \"%s\", \"gate\": \"%s\", "
               "\"workspace_bytes\": %zu, \"ms\": %.6f, \"tokens_per_s\": %.6g, \"cuda_not_used\": ",
               kda_backend_name(backend), decode ? "decode" : "forward", nthreads, (long long)c.batch,
               (long long)c.seq_len, (long long)s.num_seqs, (long long)s.num_tokens, c.hqk, c.hv, c.k, c.v,
               dtype_str(c.dtype), gates[c.gate], ws_bytes, ms, tps);
        json_string(no_cuda[0] ? no_cuda : NULL);
        if (check)
            printf(", \"oracle_ms\": %.6f, \"rel_err\": %.6g, \"state_rel_err\": %s%.6g", oracle_ms, rel_err,
                   "", isnan(state_err) ? 0.0 : state_err);
        else
            printf(", \"rel_err\": null");
        printf("}\n");
    }
    free(times);
    free_ws(&mem, ws);
    devmem_free(&mem);
    kda_synth_free(&s);
    kda_destroy(ctx);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("libkda %d.%d.%d (header %d, library %d)\n", KDA_VERSION_MAJOR, KDA_VERSION_MINOR, KDA_VERSION_PATCH,
               KDA_VERSION, kda_version());
        return 0;
    }
    if (!strcmp(argv[1], "demo")) return demo(argc - 2, argv + 2);
    if (!strcmp(argv[1], "bench")) return kda_bench_main(argc - 2, argv + 2);
    fprintf(stderr, "kda: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
