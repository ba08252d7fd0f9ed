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

#include "cli_args.h"
#include "kda.h"
#include "synth.h"

#ifdef KDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

int kda_bench_main(int argc, char **argv); /* tools/bench.c */

static void usage(FILE *f) {
    fprintf(f, "usage: kda demo [options] | kda bench [options] | kda --version | kda --help\n"
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
               "  --lower-bound X                     bound of the lower_bound gates, < 0 [-5]\n"
               "  --scale X                           output scale [0: K^-1/2]\n"
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
    if (m->n == (int)(sizeof m->ptrs / sizeof *m->ptrs) || cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) return -1;
    m->ptrs[m->n++] = d;
    if (cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return -1;
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
 * demo: its options, then the steps of a run: a context, the problem, the timed runs, the oracle, the report
 * ------------------------------------------------------------------------------------------------------- */
#define DEMO_MAX_SEQS 4096

typedef struct {
    kda_synth_config_t c;
    kda_backend_t backend;
    int json, decode, check;
    int threads; /* 0: the context's default */
    int iters;   /* 0: the backend's default */
    int lower_bound_set;
    kda_cp_mode_t cp_mode;
    int64_t cp_piece_len;
    int64_t lens[DEMO_MAX_SEQS];
} demo_opts_t;

static void demo_defaults(demo_opts_t *d) {
    memset(d, 0, sizeof *d);
    kda_synth_config_t *c = &d->c;
    kda_synth_defaults(c);
    c->batch = 1;
    c->seq_len = 2048;
    c->hqk = c->hv = 4;
    c->gate = KDA_GATE_LOWER_BOUND;
    c->l2norm = c->beta_sigmoid = 1;
    c->initial_state = c->final_state = 1;
    c->beta_dtype = KDA_BFLOAT16;
    d->backend = KDA_BACKEND_AUTO;
    d->check = 1;
    d->cp_mode = KDA_CP_AUTO;
}

/* "kda: <message>" on stderr; -1 (a refused option value). */
static int bad_value(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("kda: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return -1;
}

/* Options without a value: 1 when `o` is one (and it is applied), else 0. */
static int demo_flag(const char *o, demo_opts_t *d) {
    kda_synth_config_t *c = &d->c;
    if (!strcmp(o, "--no-l2norm")) c->l2norm = 0;
    else if (!strcmp(o, "--no-beta-sigmoid")) c->beta_sigmoid = 0;
    else if (!strcmp(o, "--neg-eigval")) c->allow_neg_eigval = 1;
    else if (!strcmp(o, "--no-initial-state")) c->initial_state = 0;
    else if (!strcmp(o, "--state-v-first")) c->state_v_first = 1;
    else if (!strcmp(o, "--decode")) d->decode = 1;
    else if (!strcmp(o, "--no-check")) d->check = 0;
    else if (!strcmp(o, "--json")) d->json = 1;
    else return 0;
    return 1;
}

static int demo_takes_value(const char *o) {
    static const char *const names[] = {"--backend",     "--B",           "--T",       "--varlen", "--hqk",   "--hv",
                                        "--K",           "--V",           "--dtype",   "--gate",   "--scale", "--cp",
                                        "--lower-bound", "--state-dtype", "--threads", "--iters",  "--seed"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!strcmp(o, names[i])) return 1;
    return 0;
}

/* --varlen L1,L2,...: up to DEMO_MAX_SEQS lengths whose total fits in int64; B becomes 1. */
static int demo_varlen(const char *o, const char *val, demo_opts_t *d) {
    int n = 0;
    if (kda_arg_i64_list(o, val, 0, INT64_MAX, d->lens, DEMO_MAX_SEQS, &n)) return -1;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (d->lens[i] > INT64_MAX - total)
            return bad_value("%s: the lengths add up to more than %" PRId64 " tokens", o, INT64_MAX);
        total += d->lens[i];
    }
    d->c.num_seqs = n;
    d->c.seqlens = d->lens;
    d->c.batch = 1;
    return 0;
}

/* Options whose value is a word: 0 applied, -1 refused (said on stderr), 1 not one of them. */
static int demo_word(const char *o, const char *val, demo_opts_t *d) {
    kda_synth_config_t *c = &d->c;
    if (!strcmp(o, "--backend")) {
        if (!strcmp(val, "auto")) d->backend = KDA_BACKEND_AUTO;
        else if (!strcmp(val, "cpu")) d->backend = KDA_BACKEND_CPU;
        else if (!strcmp(val, "cuda")) d->backend = KDA_BACKEND_CUDA;
        else if (!strcmp(val, "reference")) d->backend = KDA_BACKEND_REFERENCE;
        else return bad_value("--backend must be auto, cpu, cuda or reference");
    } else if (!strcmp(o, "--dtype")) {
        if (parse_dtype(val, &c->dtype)) return bad_value("--dtype must be bf16, f16 or f32");
        c->g_dtype = c->o_dtype = c->beta_dtype = c->dtype;
    } else if (!strcmp(o, "--state-dtype")) {
        if (parse_dtype(val, &c->initial_state_dtype) || c->initial_state_dtype == KDA_FLOAT16)
            return bad_value("--state-dtype must be f32 or bf16");
        c->final_state_dtype = c->initial_state_dtype;
    } else if (!strcmp(o, "--gate")) {
        if (!strcmp(val, "raw")) c->gate = KDA_GATE_RAW;
        else if (!strcmp(val, "softplus")) c->gate = KDA_GATE_SOFTPLUS;
        else if (!strcmp(val, "lower_bound")) c->gate = KDA_GATE_LOWER_BOUND;
        else if (!strcmp(val, "lower_bound_noa")) c->gate = KDA_GATE_LOWER_BOUND_NO_A;
        else return bad_value("--gate must be raw, softplus, lower_bound or lower_bound_noa");
    } else if (!strcmp(o, "--cp")) {
        if (!strcmp(val, "auto")) d->cp_mode = KDA_CP_AUTO;
        else if (!strcmp(val, "off")) d->cp_mode = KDA_CP_OFF;
        else if (kda_arg_i64(o, val, 1, INT64_MAX, &d->cp_piece_len))
            return bad_value("--cp takes auto, off or a piece length in tokens");
        else d->cp_mode = KDA_CP_ON; /* the library checks the length (a multiple of 64) */
    } else {
        return 1;
    }
    return 0;
}

/* Options whose value is a number: 0 applied, -1 refused (said on stderr), 1 not one of them. */
static int demo_number(const char *o, const char *val, demo_opts_t *d) {
    kda_synth_config_t *c = &d->c;
    if (!strcmp(o, "--B")) return kda_arg_i64(o, val, 0, INT64_MAX, &c->batch);
    if (!strcmp(o, "--T")) return kda_arg_i64(o, val, 0, INT64_MAX, &c->seq_len);
    if (!strcmp(o, "--varlen")) return demo_varlen(o, val, d);
    if (!strcmp(o, "--hqk")) return kda_arg_i32(o, val, 0, INT32_MAX, &c->hqk);
    if (!strcmp(o, "--hv")) return kda_arg_i32(o, val, 0, INT32_MAX, &c->hv);
    if (!strcmp(o, "--K")) return kda_arg_i32(o, val, 0, INT32_MAX, &c->k);
    if (!strcmp(o, "--V")) return kda_arg_i32(o, val, 0, INT32_MAX, &c->v);
    if (!strcmp(o, "--threads")) return kda_arg_int(o, val, 1, INT_MAX, &d->threads);
    if (!strcmp(o, "--iters")) return kda_arg_int(o, val, 1, INT_MAX, &d->iters);
    if (!strcmp(o, "--scale")) return kda_arg_f32(o, val, &c->scale); /* 0: K^-1/2, as in kda_args_t */
    if (!strcmp(o, "--seed")) {
        int64_t seed;
        if (kda_arg_i64(o, val, 0, INT64_MAX, &seed)) return -1;
        c->seed = (uint64_t)seed;
        return 0;
    }
    if (!strcmp(o, "--lower-bound")) {
        if (kda_arg_f32(o, val, &c->lower_bound)) return -1;
        if (c->lower_bound == 0.0f) return bad_value("%s: 0 is libkda's \"unset\"; give the bound, < 0 [-5]", o);
        d->lower_bound_set = 1;
        return 0;
    }
    return 1;
}

/* Every option, in order (a later one overrides an earlier one): 0, or 2 with the reason on stderr. */
static int demo_parse(int argc, char **argv, demo_opts_t *d) {
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i];
        if (demo_flag(o, d)) continue;
        if (!demo_takes_value(o)) {
            fprintf(stderr, "kda: unknown option '%s'\n", o);
            usage(stderr);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kda: %s needs a value\n", o);
            return 2;
        }
        const char *val = argv[++i];
        int r = demo_word(o, val, d);
        if (r > 0) r = demo_number(o, val, d);
        if (r) return 2;
    }
    if (d->lower_bound_set && d->c.gate != KDA_GATE_LOWER_BOUND && d->c.gate != KDA_GATE_LOWER_BOUND_NO_A) {
        bad_value("--lower-bound applies to --gate lower_bound and lower_bound_noa only");
        return 2;
    }
    return 0;
}

/* One run of demo: what each step makes, and what the report reads. */
typedef struct {
    const demo_opts_t *opt;
    kda_context_t *ctx;
    kda_backend_t backend;
    int cuda, nthreads, iters;
    char no_cuda[512]; /* AUTO on the CPU: why CUDA was not used */
    kda_synth_t s;
    kda_args_t host_args, args; /* the problem on the host; on the backend's device */
    devmem_t mem;
    void *ws;
    size_t ws_bytes;
    double ms, tps, oracle_ms, rel_err, state_err;
} demo_run_t;

/* The context (AUTO resolved, and why not CUDA when it was not), its threads, the number of timed runs. */
static int demo_open(demo_run_t *r) {
    const demo_opts_t *d = r->opt;
    kda_status_t st = kda_create(&r->ctx, d->backend, 0);
    if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
    kda_get_backend(r->ctx, &r->backend);
    if (d->backend == KDA_BACKEND_AUTO && r->backend != KDA_BACKEND_CUDA) {
        const char *why = kda_last_error(); /* kda_create leaves it there */
        if (!strncmp(why, "kda_create: ", 12)) why += 12;
        snprintf(r->no_cuda, sizeof r->no_cuda, "%s", why[0] ? why : "no usable CUDA device");
    }
    if (d->threads > 0 && r->backend == KDA_BACKEND_CPU &&
        (st = kda_set_num_threads(r->ctx, d->threads)) != KDA_STATUS_SUCCESS)
        return lib_fail(st);
    kda_get_num_threads(r->ctx, &r->nthreads);
    r->cuda = r->backend == KDA_BACKEND_CUDA;
    r->iters = d->iters > 0 ? d->iters : r->cuda ? 20 : 3;
    return 0;
}

/* args: host_args with every tensor copied to the backend's device (the same pointers on the CPU). */
static int demo_upload(demo_run_t *r) {
    const kda_synth_t *s = &r->s;
    const kda_args_t *h = &r->host_args;
    kda_args_t *a = &r->args;
    devmem_t *m = &r->mem;
    const size_t hv = (size_t)r->opt->c.hv, K = (size_t)r->opt->c.k;
    m->cuda = r->cuda;
    *a = *h;
    int bad = to_device(m, h->q, s->q_bytes, &a->q) || to_device(m, h->k, s->q_bytes, &a->k) ||
              to_device(m, h->v, s->v_bytes, &a->v) || to_device(m, h->g, s->g_bytes, &a->g) ||
              to_device(m, h->beta, s->beta_bytes, &a->beta) || to_device(m, h->o, s->o_bytes, (const void **)&a->o) ||
              to_device(m, h->initial_state, s->h0_bytes, &a->initial_state) ||
              to_device(m, h->final_state, s->ht_bytes, (const void **)&a->final_state) ||
              to_device(m, h->A_log, sizeof(float) * hv, (const void **)&a->A_log) ||
              to_device(m, h->dt_bias, sizeof(float) * hv * K, (const void **)&a->dt_bias) ||
              to_device(m, h->cu_seqlens, sizeof(int64_t) * (size_t)(s->num_seqs + 1), &a->cu_seqlens);
    if (r->cuda && h->cu_seqlens) a->cu_seqlens_host = h->cu_seqlens;
    a->cp_mode = r->opt->cp_mode;
    a->cp_piece_len = r->opt->cp_piece_len;
    return bad;
}

/* The synthetic problem on the host and on the backend's device, and the workspace. */
static int demo_make(demo_run_t *r) {
    const int rc = kda_synth_make(&r->opt->c, &r->s, &r->host_args);
    if (rc == -2) return fail("the problem's sizes overflow 64-bit counts (tokens x heads x head size)");
    if (rc) return fail("out of host memory for the synthetic problem");
    if (demo_upload(r)) return fail("could not copy the problem to the device");
    kda_status_t st = r->opt->decode ? kda_decode_workspace_size(r->ctx, &r->args, &r->ws_bytes)
                                     : kda_forward_workspace_size(r->ctx, &r->args, &r->ws_bytes);
    if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
    r->ws = alloc_ws(&r->mem, r->ws_bytes);
    if (r->ws_bytes && !r->ws) return fail("could not allocate the workspace");
    return 0;
}

static const char *const gate_names[] = {"raw", "softplus", "lower_bound", "lower_bound_noa"};

/* What runs, printed before the runs (a long run shows its progress on stderr meanwhile). */
static void demo_print_setup(const demo_run_t *r) {
    const kda_synth_config_t *c = &r->opt->c;
    const kda_args_t *a = &r->host_args;
    printf("libkda %d.%d.%d  kda demo\n", KDA_VERSION_MAJOR, KDA_VERSION_MINOR, KDA_VERSION_PATCH);
    printf("  backend     %s %s (%d thread%s)\n", kda_backend_name(r->backend), r->opt->decode ? "decode" : "forward",
           r->nthreads, r->nthreads == 1 ? "" : "s");
    if (r->no_cuda[0]) printf("  cuda        not used: %s\n", r->no_cuda);
    if (c->num_seqs > 0)
        printf("  shape       varlen %lld sequences, %lld tokens, HQK %d HV %d K %d V %d\n", (long long)r->s.num_seqs,
               (long long)r->s.num_tokens, c->hqk, c->hv, c->k, c->v);
    else
        printf("  shape       B %lld T %lld HQK %d HV %d K %d V %d\n", (long long)a->batch, (long long)a->seq_len,
               c->hqk, c->hv, c->k, c->v);
    printf("  options     dtype %s, gate %s", dtype_str(c->dtype), gate_names[c->gate]);
    if (a->lower_bound != 0.0f) printf(" (bound %g)", (double)a->lower_bound);
    if (a->scale != 0.0f) printf(", scale %g", (double)a->scale);
    printf(", l2norm %d, beta sigmoid %d, neg eigval %d, states %s%s\n", c->l2norm, c->beta_sigmoid,
           c->allow_neg_eigval, c->initial_state ? dtype_str(c->initial_state_dtype) : "none",
           c->state_v_first ? " V-first" : "");
    printf("  workspace   %zu bytes\n", r->ws_bytes);
    fflush(stdout);
}

/* A warm-up run, then iters timed runs: their median, the throughput, and o and the final state on the host. */
static int demo_time(demo_run_t *r) {
    double *times = (double *)malloc(sizeof(double) * (size_t)r->iters);
    if (!times) return fail("out of host memory for the run times");
    const char *name = kda_backend_name(r->backend), *algo = r->opt->decode ? "decode" : "forward";
    kda_status_t st = KDA_STATUS_SUCCESS;
    for (int it = -1; it < r->iters && st == KDA_STATUS_SUCCESS; it++) {
        if (it < 0) progress_step("warm-up run (%s %s)", name, algo);
        else progress_step("timed run %d of %d (%s %s)", it + 1, r->iters, name, algo);
        const double t0 = sync_now_ms(r->cuda);
        st = r->opt->decode ? kda_decode(r->ctx, &r->args, r->ws, r->ws_bytes, NULL)
                            : kda_forward(r->ctx, &r->args, r->ws, r->ws_bytes, NULL);
        const double t1 = sync_now_ms(r->cuda);
        if (it >= 0) times[it] = t1 - t0;
    }
    if (st == KDA_STATUS_SUCCESS) {
        qsort(times, (size_t)r->iters, sizeof(double), cmp_double);
        r->ms = times[r->iters / 2];
    }
    free(times);
    if (st != KDA_STATUS_SUCCESS) return lib_fail(st);
    const double tokens = (double)r->s.num_tokens;
    r->tps = r->ms > 0 ? tokens / (r->ms * 1e-3) : tokens > 0 ? INFINITY : 0.0;
    if (to_host(&r->mem, r->s.o, r->args.o, r->s.o_bytes) ||
        (r->s.ht && to_host(&r->mem, r->s.ht, r->args.final_state, r->s.ht_bytes)))
        return fail("could not copy the results back");
    return 0;
}

/* The fp64 oracle on the same problem: its time, and the relative errors of o and of the final state. */
static int demo_oracle(demo_run_t *r) {
    const kda_synth_config_t *c = &r->opt->c;
    const int64_t o_elems = r->s.num_tokens * c->hv * c->v, st_elems = r->s.num_seqs * c->hv * (int64_t)c->k * c->v;
    kda_context_t *ref = NULL;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)(o_elems ? o_elems : 1));
    float *ht_ref = (float *)malloc(sizeof(float) * (size_t)(st_elems ? st_elems : 1));
    void *rws = NULL;
    size_t rws_bytes = 0;
    kda_args_t ra = r->host_args;
    ra.o = o_ref;
    ra.o_dtype = KDA_FLOAT32;
    if (ra.final_state) {
        ra.final_state = ht_ref;
        ra.final_state_dtype = KDA_FLOAT32;
    }
    kda_status_t st = kda_create(&ref, KDA_BACKEND_REFERENCE, 0);
    if (st == KDA_STATUS_SUCCESS) st = kda_forward_workspace_size(ref, &ra, &rws_bytes);
    if (st == KDA_STATUS_SUCCESS && rws_bytes) rws = malloc(rws_bytes);
    const int oom = !o_ref || !ht_ref || (rws_bytes && !rws);
    if (st == KDA_STATUS_SUCCESS && !oom) {
        progress_step("the fp64 oracle (1 thread), for the error");
        const double t0 = now_ms();
        st = kda_forward(ref, &ra, rws, rws_bytes, NULL);
        r->oracle_ms = now_ms() - t0;
    }
    if (st == KDA_STATUS_SUCCESS && !oom) {
        r->rel_err = kda_rel_err(r->s.o, c->o_dtype, o_ref, KDA_FLOAT32, o_elems);
        if (r->s.ht) r->state_err = kda_rel_err(r->s.ht, c->final_state_dtype, ht_ref, KDA_FLOAT32, st_elems);
    }
    const int rc = st != KDA_STATUS_SUCCESS ? lib_fail(st) : oom ? fail("out of host memory for the oracle") : 0;
    free(rws);
    free(o_ref);
    free(ht_ref);
    kda_destroy(ref);
    return rc;
}

/* ", "key": x" with fmt, or null when x is not finite (JSON has no NaN or infinity). */
static void json_number(const char *key, double x, const char *fmt) {
    printf(", \"%s\": ", key);
    if (isfinite(x)) printf(fmt, x);
    else fputs("null", stdout);
}

/* The run as one JSON object on one line. B and T are the problem's (T: all tokens with --varlen). */
static void demo_json(const demo_run_t *r) {
    const kda_synth_config_t *c = &r->opt->c;
    const kda_args_t *a = &r->host_args;
    printf("{\"backend\": \"%s\", \"algorithm\": \"%s\", \"threads\": %d, \"B\": %lld, \"T\": %lld, "
           "\"num_seqs\": %lld, \"tokens\": %lld, \"hqk\": %d, \"hv\": %d, \"K\": %d, \"V\": %d, \"dtype\": \"%s\", "
           "\"gate\": \"%s\"",
           kda_backend_name(r->backend), r->opt->decode ? "decode" : "forward", r->nthreads, (long long)a->batch,
           (long long)a->seq_len, (long long)r->s.num_seqs, (long long)r->s.num_tokens, c->hqk, c->hv, c->k, c->v,
           dtype_str(c->dtype), gate_names[c->gate]);
    json_number("lower_bound", a->lower_bound != 0.0f ? a->lower_bound : NAN, "%.9g");
    json_number("scale", a->scale != 0.0f ? a->scale : (float)(1.0 / sqrt((double)(c->k > 0 ? c->k : 1))), "%.9g");
    printf(", \"workspace_bytes\": %zu", r->ws_bytes);
    json_number("ms", r->ms, "%.6f");
    json_number("tokens_per_s", r->tps, "%.6g");
    fputs(", \"cuda_not_used\": ", stdout);
    json_string(r->no_cuda[0] ? r->no_cuda : NULL);
    if (r->opt->check) {
        json_number("oracle_ms", r->oracle_ms, "%.6f");
        json_number("rel_err", r->rel_err, "%.6g");
        json_number("state_rel_err", r->state_err, "%.6g");
    } else {
        fputs(", \"rel_err\": null", stdout);
    }
    fputs("}\n", stdout);
}

static void demo_print_results(const demo_run_t *r) {
    const char *name = kda_backend_name(r->backend);
    printf("  time        %.3f ms (median of %d)\n", r->ms, r->iters);
    printf("  throughput  %.3g tokens/s\n", r->tps);
    if (r->opt->check) {
        /* the ratio as "X took N.Nx longer", N >= 1, whichever was slower */
        if (r->oracle_ms >= r->ms)
            printf("  oracle      %.3f ms (fp64, 1 thread): the oracle took %.1fx longer than %s\n", r->oracle_ms,
                   r->ms > 0 ? r->oracle_ms / r->ms : INFINITY, name);
        else
            printf("  oracle      %.3f ms (fp64, 1 thread): %s took %.1fx longer than the oracle\n", r->oracle_ms, name,
                   r->oracle_ms > 0 ? r->ms / r->oracle_ms : INFINITY);
        printf("  rel err     o %.3g, final state %.3g\n", r->rel_err, r->state_err);
    }
    if (r->opt->json) demo_json(r);
}

static void demo_close(demo_run_t *r) {
    free_ws(&r->mem, r->ws);
    devmem_free(&r->mem);
    kda_synth_free(&r->s);
    kda_destroy(r->ctx);
}

static int demo(int argc, char **argv) {
    static demo_opts_t opt; /* DEMO_MAX_SEQS lengths: off the stack */
    demo_defaults(&opt);
    int rc = demo_parse(argc, argv, &opt);
    if (rc) return rc;
    demo_run_t r;
    memset(&r, 0, sizeof r);
    r.opt = &opt;
    r.oracle_ms = r.rel_err = r.state_err = NAN;
    rc = demo_open(&r);
    if (!rc) {
        progress_start();
        rc = demo_make(&r);
    }
    if (!rc) {
        demo_print_setup(&r);
        rc = demo_time(&r);
    }
    if (!rc && opt.check) rc = demo_oracle(&r);
    progress_stop();
    if (!rc) demo_print_results(&r);
    demo_close(&r);
    return rc;
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
