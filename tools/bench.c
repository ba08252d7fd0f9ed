/*
 * kda bench — the CPU benchmark (no torch, no GPU): the chunked path (kda_forward on the CPU backend) against
 * the fp64 oracle (reference backend) and the CPU decode path (kda_decode over the whole sequence), for
 * T ∈ {512, 4096, 16384} × H ∈ {2, 16} (HQK = HV = H, K = V = 128, bf16, lower-bound gate), with the chunked
 * path's GFLOP/s against the machine's measured single-precision FMA peak.
 *
 * FLOPs of the chunked path per chunk of c tokens (multiply-add = 2): A and Aqk c²K each, T = (I + A)⁻¹ c³/3,
 * W c²K, U c²V, W S and QΓ S 2cKV each, Aqk Δ c²V, K̃ᵀ Δ 2cKV: 3c²K + 2c²V + 6cKV + c³/3 (exponentials not
 * counted). The peak is a chain-free FMA loop on every thread at once, in the widest vectors the CPU has.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli_args.h"
#include "kda.h"
#include "synth.h"

static double bench_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int bench_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- peak: 12 independent FMA chains of the widest vector, per thread ---------------------------------- */
#define PEAK_ITERS 20000000L
#define PEAK_BODY(VS)                                                                                                  \
    typedef float v_t __attribute__((vector_size(VS)));                                                                \
    v_t acc[12], m, a;                                                                                                 \
    for (int i = 0; i < 12; i++) acc[i] = (v_t){0} + (float)i * 1e-3f;                                                 \
    m = (v_t){0} + 0.999999f;                                                                                          \
    a = (v_t){0} + 1e-7f;                                                                                              \
    for (long it = 0; it < iters; it++) {                                                                              \
        for (int i = 0; i < 12; i++) acc[i] = acc[i] * m + a;                                                          \
    }                                                                                                                  \
    float s = 0;                                                                                                       \
    for (int i = 0; i < 12; i++) s += acc[i][0];                                                                       \
    *sink = s;                                                                                                         \
    return 2.0 * 12 * (VS / 4) * (double)iters;

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static double peak_avx512(long iters, float *sink) { PEAK_BODY(64) }
__attribute__((target("avx2,fma"))) static double peak_avx2(long iters, float *sink) { PEAK_BODY(32) }
#endif
static double peak_generic(long iters, float *sink) {
#if defined(__x86_64__) || defined(__aarch64__)
    PEAK_BODY(16)
#else
    float acc = 0;
    for (long it = 0; it < iters; it++) acc = acc * 0.999999f + 1e-7f;
    *sink = acc;
    return 2.0 * (double)iters;
#endif
}

static double peak_flops(long iters, float *sink) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return peak_avx512(iters, sink);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return peak_avx2(iters, sink);
#endif
    return peak_generic(iters, sink);
}

typedef struct {
    double flops;
    float sink;
} peak_job_t;

static void *peak_thread(void *arg) {
    peak_job_t *j = (peak_job_t *)arg;
    j->flops = peak_flops(PEAK_ITERS, &j->sink);
    return NULL;
}

/* GFLOP/s of `threads` threads running the FMA loop together (best of 3). */
static double measure_peak(int threads) {
    double best = 0;
    peak_job_t jobs[256];
    pthread_t tid[256];
    if (threads > 256) threads = 256;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = bench_now_ms();
        for (int i = 1; i < threads; i++) pthread_create(&tid[i], NULL, peak_thread, &jobs[i]);
        peak_thread(&jobs[0]);
        for (int i = 1; i < threads; i++) pthread_join(tid[i], NULL);
        double ms = bench_now_ms() - t0, f = 0;
        for (int i = 0; i < threads; i++) f += jobs[i].flops;
        if (f / (ms * 1e6) > best) best = f / (ms * 1e6);
    }
    return best;
}

/* ---- one configuration --------------------------------------------------------------------------------- */
static double chunk_flops(int64_t T, int H, int K, int V) {
    double f = 0;
    for (int64_t t0 = 0; t0 < T; t0 += 64) {
        const double c = (double)(T - t0 < 64 ? T - t0 : 64);
        f += 3 * c * c * K + 2 * c * c * V + 6 * c * K * V + c * c * c / 3;
    }
    return f * H;
}

/* Median ms of `iters` calls (after one warm-up) of backend/algorithm on the problem; NAN on error. */
static double time_call(kda_backend_t backend, int decode, int threads, const kda_args_t *a, int iters) {
    kda_context_t *ctx = NULL;
    if (kda_create(&ctx, backend, 0) != KDA_STATUS_SUCCESS) return NAN;
    if (backend == KDA_BACKEND_CPU && threads > 0) kda_set_num_threads(ctx, threads);
    size_t ws_bytes = 0;
    kda_status_t st =
        decode ? kda_decode_workspace_size(ctx, a, &ws_bytes) : kda_forward_workspace_size(ctx, a, &ws_bytes);
    void *ws = ws_bytes ? malloc(ws_bytes) : NULL;
    double times[64], ms = NAN;
    if (iters > 64) iters = 64;
    for (int it = iters > 1 ? -1 : 0; st == KDA_STATUS_SUCCESS && it < iters; it++) {
        double t0 = bench_now_ms();
        st = decode ? kda_decode(ctx, a, ws, ws_bytes, NULL) : kda_forward(ctx, a, ws, ws_bytes, NULL);
        if (it >= 0) times[it] = bench_now_ms() - t0;
    }
    if (st == KDA_STATUS_SUCCESS) {
        qsort(times, (size_t)iters, sizeof(double), bench_cmp);
        ms = times[iters / 2];
    } else {
        fprintf(stderr, "kda bench: %s: %s\n", kda_status_string(st), kda_last_error());
    }
    free(ws);
    kda_destroy(ctx);
    return ms;
}

static void bench_usage(FILE *f) {
    fprintf(f, "usage: kda bench [--threads N] [--iters N] [--T 512,4096,16384] [--H 2,16] [--oracle-max N]\n"
               "                 [--oracle-iters N] [--no-decode] [--json]\n"
               "  CPU chunked path vs the fp64 oracle vs the CPU decode path, K = V = 128, bf16, HQK = HV = H.\n"
               "  --threads N      CPU threads of the chunked and decode paths [KDA_NUM_THREADS or all cores]\n"
               "  --iters N        timed calls per path (1 to 64), median reported [3]\n"
               "  --oracle-iters N timed oracle calls (1 to 64), median reported [1: one call, no warm-up]\n"
               "  --oracle-max N   time the oracle only up to N tokens x heads [65536]; larger rows show '-'\n"
               "  --json           one JSON object per row as well\n");
}

typedef struct {
    int threads, iters, oracle_iters, json, no_decode;
    int64_t Ts[8], Hs[8], oracle_max;
    int nT, nH;
} bench_opts_t;

/* One option (and its value, which *i then skips): 0, 1 for --help (usage printed), or 2 when refused. */
static int bench_option(int argc, char **argv, int *i, bench_opts_t *b) {
    const char *o = argv[*i];
    if (!strcmp(o, "--json")) b->json = 1;
    else if (!strcmp(o, "--no-decode")) b->no_decode = 1;
    else if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
        bench_usage(stdout);
        return 1;
    } else {
        static const char *const valued[] = {"--threads", "--iters", "--oracle-max", "--oracle-iters", "--T", "--H"};
        int known = 0;
        for (size_t j = 0; j < sizeof valued / sizeof *valued; j++) known |= !strcmp(o, valued[j]);
        if (!known || *i + 1 >= argc) {
            if (known) fprintf(stderr, "kda bench: %s needs a value\n", o);
            else fprintf(stderr, "kda bench: unknown option '%s'\n", o);
            bench_usage(stderr);
            return 2;
        }
        const char *val = argv[++*i];
        int bad;
        /* iters: time_call keeps up to 64 times; T x H: the oracle's limit compares their product */
        if (!strcmp(o, "--threads")) bad = kda_arg_int(o, val, 1, INT_MAX, &b->threads);
        else if (!strcmp(o, "--iters")) bad = kda_arg_int(o, val, 1, 64, &b->iters);
        else if (!strcmp(o, "--oracle-iters")) bad = kda_arg_int(o, val, 1, 64, &b->oracle_iters);
        else if (!strcmp(o, "--oracle-max")) bad = kda_arg_i64(o, val, 0, INT64_MAX, &b->oracle_max);
        else if (!strcmp(o, "--T")) bad = kda_arg_i64_list(o, val, 1, INT32_MAX, b->Ts, 8, &b->nT);
        else bad = kda_arg_i64_list(o, val, 1, INT32_MAX, b->Hs, 8, &b->nH);
        if (bad) return 2;
    }
    return 0;
}

/* A JSON number, or null when x is not finite (JSON has no NaN or infinity). */
static void bench_json_number(const char *key, double x, const char *fmt) {
    printf(", \"%s\": ", key);
    if (isfinite(x)) printf(fmt, x);
    else fputs("null", stdout);
}

/* One row of the table (and of JSON): T tokens, H heads. 0, or -1 when the problem could not be made. */
static int bench_row(const bench_opts_t *b, int64_t T, int32_t H, int threads, double peakn) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.seq_len = T;
    c.hqk = c.hv = H;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.initial_state = c.final_state = 1;
    c.beta_dtype = KDA_BFLOAT16;
    kda_synth_t s;
    kda_args_t a;
    if (kda_synth_make(&c, &s, &a) != 0) {
        fprintf(stderr, "kda bench: no host memory for T %lld H %d\n", (long long)T, (int)H);
        return -1;
    }
    const double chunk_ms = time_call(KDA_BACKEND_CPU, 0, threads, &a, b->iters);
    const double dec_ms = b->no_decode ? NAN : time_call(KDA_BACKEND_CPU, 1, threads, &a, b->iters);
    const double ora_ms = T * H <= b->oracle_max ? time_call(KDA_BACKEND_REFERENCE, 0, 0, &a, b->oracle_iters) : NAN;
    const double gf = chunk_flops(T, H, c.k, c.v) / (chunk_ms * 1e6);
    char ora[32] = "-", orax[32] = "-", dec[32] = "-", decx[32] = "-"; /* "-": not timed */
    if (!isnan(ora_ms)) {
        snprintf(ora, sizeof ora, "%.1f", ora_ms);
        snprintf(orax, sizeof orax, "%.1fx", ora_ms / chunk_ms);
    }
    if (!isnan(dec_ms)) {
        snprintf(dec, sizeof dec, "%.1f", dec_ms);
        snprintf(decx, sizeof decx, "%.1fx", dec_ms / chunk_ms);
    }
    printf("  %6lld %3d | %10.1f %8.1f %5.0f%% | %10s %8s | %11s %8s\n", (long long)T, (int)H, chunk_ms, gf,
           100 * gf / peakn, dec, decx, ora, orax);
    if (b->json) {
        printf("{\"T\": %lld, \"H\": %d, \"threads\": %d", (long long)T, (int)H, threads);
        bench_json_number("chunked_ms", chunk_ms, "%.4f");
        bench_json_number("gflops", gf, "%.3f");
        bench_json_number("peak_gflops", peakn, "%.3f");
        bench_json_number("decode_ms", dec_ms, "%.4f");
        bench_json_number("oracle_ms", ora_ms, "%.1f");
        fputs("}\n", stdout);
    }
    fflush(stdout);
    kda_synth_free(&s);
    return 0;
}

int kda_bench_main(int argc, char **argv);
int kda_bench_main(int argc, char **argv) {
    bench_opts_t b = {
        .iters = 3, .oracle_iters = 1, .Ts = {512, 4096, 16384}, .Hs = {2, 16}, .oracle_max = 65536, .nT = 3, .nH = 2};
    for (int i = 0; i < argc; i++) {
        const int rc = bench_option(argc, argv, &i, &b);
        if (rc) return rc == 1 ? 0 : rc;
    }
    int threads = b.threads;
    kda_context_t *ctx = NULL;
    if (kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) return 2;
    if (threads > 0 && kda_set_num_threads(ctx, threads) != KDA_STATUS_SUCCESS) {
        fprintf(stderr, "kda bench: %s\n", kda_last_error());
        return 2;
    }
    kda_get_num_threads(ctx, &threads);
    kda_destroy(ctx);

    const double peak1 = measure_peak(1), peakn = threads > 1 ? measure_peak(threads) : peak1;
    printf("libkda %d.%d.%d  kda bench (CPU, %d threads)\n", KDA_VERSION_MAJOR, KDA_VERSION_MINOR, KDA_VERSION_PATCH,
           threads);
    printf("  measured fp32 FMA peak: %.1f GFLOP/s on 1 thread, %.1f on %d\n", peak1, peakn, threads);
    printf("  K = V = 128, bf16, lower-bound gate, l2norm, initial and final state f32; times are medians\n\n");
    printf("  %6s %3s | %10s %8s %6s | %10s %8s | %11s %8s\n", "T", "H", "chunked ms", "GFLOP/s", "%peak", "decode ms",
           "vs chunk", "oracle ms", "vs chunk");
    for (int ti = 0; ti < b.nT; ti++)
        for (int hi = 0; hi < b.nH; hi++)
            if (bench_row(&b, b.Ts[ti], (int32_t)b.Hs[hi], threads, peakn)) return 2;
    return 0;
}
