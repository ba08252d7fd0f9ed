/* Emulated CUDA backward stages 3-4 against the fp64 oracle, with exact (fp64) S and dS+ per chunk. */
#include "common.cuh"
#include "bwd.h"
#include <stdio.h>
#include <stdlib.h>
extern "C" { /* C headers without their own guard (this file is compiled by g++ for the kernels' templates) */
#include "synth.h"
#include "compare.h"
}

void run_chunk(const kda_bwd_params_t *p);  /* emu_chunk.emu.cu */
void run_dstate(const kda_bwd_params_t *p); /* emu_dstate.emu.cu */
void run_finish(const kda_bwd_params_t *p); /* emu_finish.emu.cu */
void run_inter(const kda_bwd_params_t *p);  /* emu_inter.emu.cu */
void run_pairs(const kda_bwd_params_t *p);  /* emu_pairs.emu.cu */

/* ---------------------------------------------------------------------------------------------------------
 * The harness
 * ------------------------------------------------------------------------------------------------------- */
/* n floats, each x; n doubles, zero (at least one element, so that an empty sequence's buffers are valid) */
static float *floats(int64_t n, float x) {
    float *p = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    if (!p) { fprintf(stderr, "out of memory (%lld floats)\n", (long long)n); exit(1); }
    for (int64_t i = 0; i < n; i++) p[i] = x;
    return p;
}
static double *zeros(int64_t n) {
    double *p = (double *)calloc((size_t)(n > 0 ? n : 1), sizeof *p);
    if (!p) { fprintf(stderr, "out of memory (%lld doubles)\n", (long long)n); exit(1); }
    return p;
}

static double urand(uint64_t *r) {
    *r = *r * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*r >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}
static double sigm(double x) { return 1 / (1 + exp(-x)); }
static double softplus(double x) { return x > 0 ? x + log1p(exp(-x)) : log1p(exp(x)); }
/* element (row, col) of the bf16 panel at B + off of a synthesized chunk block */
static void put(unsigned char *B, int64_t off, int row, int col, double x) {
    const uint16_t bits = f32_to_bf16_bits((float)x);
    memcpy(B + off + pan_off(row, col), &bits, 2);
}
/* x rounded to `bits` significant bits (nearest even; no range limits): 8 bf16, 11 fp16 with a scale factor */
static double round_bits(double x, int bits) {
    if (x == 0 || !isfinite(x)) return x;
    int e;
    const double m = frexp(x, &e); /* x = m 2^e, 0.5 ≤ |m| < 1 */
    return ldexp(nearbyint(ldexp(m, bits)), e - bits);
}
static double get(const unsigned char *B, int64_t off, int row, int col) {
    uint16_t bits;
    memcpy(&bits, B + off + pan_off(row, col), 2);
    return bf16_bits_to_f32(bits);
}
/* EMU_S_BLOCKS's panel element: exact (its bit off the mask), rounded to sbits from the exact value, or the block's bf16 */
static double pick(int on, int sbits, double exact, const unsigned char *B, int64_t off, int row, int col) {
    return !on ? exact : sbits ? round_bits(exact, sbits) : get(B, off, row, col);
}

/* EMU_EXACT_DKT's operands: 1 Δ fp32 and dS+ exact; 2 Δ fp32, dS+ as the kernel's bf16; 3 Δ bf16, dS+ exact;
 * 4 Δ bf16, dS+ as stage 2's fp16 (11 bits); 5 Δ fp16, dS+ fp16 (11 bits each: an f16 product) */
static float kt_delta(float x, int m) {
    if (m == 3 || m == 4) return bf16_bits_to_f32(f32_to_bf16_bits(x));
    if (m == 5) return (float)(_Float16)x;
    return x;
}
static float kt_ds(float exact, float f16s, int m) {
    if (m == 2) return bf16_bits_to_f32(f32_to_bf16_bits(f16s));
    if (m == 4 || m == 5) return f16s;
    return exact;
}

int main(int argc, char **argv) {
    int K = argc > 1 ? atoi(argv[1]) : 64, V = argc > 2 ? atoi(argv[2]) : 64;
    int gate = argc > 3 ? atoi(argv[3]) : 1;
    int vfirst = argc > 4 ? atoi(argv[4]) : 0;
    int use_blocks = argc > 5 ? atoi(argv[5]) : 0;
    const int mode = argc > 6 ? atoi(argv[6]) : 0;
    static const int64_t lens0[] = {70, 0, 20, 129}, lens1[] = {1}, lens2[] = {64, 65, 127, 0};
    static const int64_t lens3[] = {100, 100, 100}, lens4[] = {300, 1, 190}; /* 4: long enough for CP's merge */
    /* mode 5: EMU_B sequences (default 1) of EMU_T tokens (default 300: bench/bwd_accuracy.py's cases), for EMU_INPUTS */
    const int nb5 = getenv("EMU_B") ? atoi(getenv("EMU_B")) : 1, t5 = getenv("EMU_T") ? atoi(getenv("EMU_T")) : 300;
    int64_t lens5[16];
    if (mode == 5 && (nb5 < 1 || nb5 > 16)) { fprintf(stderr, "EMU_B: 1 to 16\n"); return 1; }
    for (int i = 0; i < 16; i++) lens5[i] = t5;
    const int64_t *lens = mode == 1 ? lens1 : mode == 2 ? lens2 : mode == 3 ? lens3 : mode == 4 ? lens4 : mode == 5 ? lens5 : lens0;
    kda_synth_config_t cfg;
    kda_synth_defaults(&cfg);
    cfg.batch = 1; cfg.num_seqs = mode == 1 ? 1 : mode == 4 ? 3 : 4; cfg.seqlens = lens;
    if (mode == 3) { cfg.num_seqs = 0; cfg.seqlens = NULL; cfg.batch = 3; cfg.seq_len = 100; }
    if (mode == 5) { cfg.num_seqs = 0; cfg.seqlens = NULL; cfg.batch = nb5; cfg.seq_len = t5; }
    cfg.hqk = argc > 7 ? atoi(argv[7]) : 1; cfg.hv = argc > 8 ? atoi(argv[8]) : 2;
    cfg.decay = argc > 9 ? (float)atof(argv[9]) : 1.0f;
    const int neg = argc > 10 ? atoi(argv[10]) : 0;
    cfg.allow_neg_eigval = neg; cfg.k = K; cfg.v = V;
    cfg.dtype = cfg.g_dtype = cfg.beta_dtype = cfg.o_dtype = KDA_FLOAT32;
    cfg.initial_state = 1; cfg.initial_state_dtype = KDA_FLOAT32; cfg.state_v_first = vfirst;
    const int l2 = !getenv("EMU_NO_L2NORM"); /* EMU_NO_L2NORM set: q, k as given */
    cfg.gate = (kda_gate_mode_t)gate; cfg.l2norm = l2; cfg.beta_sigmoid = 1;
    cfg.seed = getenv("EMU_SEED") ? (uint64_t)atoll(getenv("EMU_SEED")) : 3; /* EMU_SEED: other inputs (d_o's stream too) */
    kda_synth_t s; kda_args_t a;
    if (kda_synth_make(&cfg, &s, &a)) return 1;
    if (getenv("EMU_GSCALE")) { /* the raw gate times a factor (bench/bwd_accuracy.py's strong_decay: 8) */
        const float f = (float)atof(getenv("EMU_GSCALE"));
        for (int64_t i = 0; i < s.num_tokens * cfg.hv * K; i++) ((float *)a.g)[i] *= f;
    }
    /* EMU_PAIRS_16=bf16|f16: q, k and g rounded to that format (every stage and the oracle see the rounded
       values); with EMU_PAIRS_16_STORE=1 the pairs kernel reads them as 16-bit tensors (its 16-bit load path),
       else as fp32 (its generic path): the two dumps compare bit for bit */
    const char *p16 = getenv("EMU_PAIRS_16");
    const int p16f = p16 && !strcmp(p16, "f16"), p16s = p16 && getenv("EMU_PAIRS_16_STORE") && atoi(getenv("EMU_PAIRS_16_STORE"));
    const int c16s = p16 && getenv("EMU_CHUNK_16_STORE") && atoi(getenv("EMU_CHUNK_16_STORE"));
    uint16_t *q16 = NULL, *k16 = NULL, *g16 = NULL, *v16 = NULL;
    if (p16) { /* (v too: the chunk kernel reads v with q's dtype) */
        const int64_t nqk = s.num_tokens * cfg.hqk * K, ng = s.num_tokens * cfg.hv * K, nvv = s.num_tokens * cfg.hv * V;
        float *fs[4] = {(float *)a.q, (float *)a.k, (float *)a.g, (float *)a.v};
        const int64_t cnt[4] = {nqk, nqk, ng, nvv};
        uint16_t **out[4] = {&q16, &k16, &g16, &v16};
        for (int j = 0; j < 4; j++) {
            *out[j] = (uint16_t *)malloc((size_t)cnt[j] * 2);
            for (int64_t i = 0; i < cnt[j]; i++) {
                const uint16_t b = p16f ? emu_f16_bits(fs[j][i]) : f32_to_bf16_bits(fs[j][i]);
                (*out[j])[i] = b;
                fs[j][i] = p16f ? f16_bits_to_f32(b) : bf16_bits_to_f32(b);
            }
        }
    }
    int64_t *cu = (int64_t *)malloc((size_t)(s.num_seqs + 1) * sizeof *cu);
    for (int64_t i = 0; i <= s.num_seqs; i++) cu[i] = s.cu_seqlens ? s.cu_seqlens[i] : i * cfg.seq_len;
    a.final_state = NULL;
    const int64_t T = s.num_tokens, N = s.num_seqs, HV = cfg.hv, HQK = cfg.hqk, G = HV / HQK;
    float *d_o = floats(T * HV * V, 0.f), *dht = floats(N * HV * K * V, 0.f);
    uint64_t r = 77 + cfg.seed - 3;
    for (int64_t i = 0; i < T * HV * V; i++) d_o[i] = (float)urand(&r);
    if (getenv("EMU_DS_REC") || getenv("EMU_DS_CP") || getenv("EMU_DO_BF16")) /* bf16 dO values (the dstate recurrence kernel reads bf16) */
        for (int64_t i = 0; i < T * HV * V; i++) d_o[i] = bf16_bits_to_f32(f32_to_bf16_bits(d_o[i]));
    for (int64_t i = 0; i < N * HV * K * V; i++) dht[i] = (float)urand(&r);
    if (getenv("EMU_INPUTS")) { /* another program's inputs (dev/bwd_emu/acc_inputs.py: bench/bwd_accuracy.py's), float32
                                   in this order: q k v g beta A_log dt_bias h0 do dht, the shapes of these arguments */
        FILE *f = fopen(getenv("EMU_INPUTS"), "rb");
        float *dst[10] = {(float *)a.q, (float *)a.k, (float *)a.v, (float *)a.g, (float *)a.beta, (float *)a.A_log,
                          (float *)a.dt_bias, (float *)a.initial_state, d_o, dht};
        const int64_t cnt[10] = {T * HQK * K, T * HQK * K, T * HV * V, T * HV * K, T * HV, HV, HV * K, N * HV * K * V,
                                 T * HV * V, N * HV * K * V};
        for (int i = 0; i < 10; i++)
            if (!f || !dst[i] || fread(dst[i], sizeof(float), (size_t)cnt[i], f) != (size_t)cnt[i]) {
                fprintf(stderr, "EMU_INPUTS: cannot read part %d of %s\n", i, getenv("EMU_INPUTS"));
                return 1;
            }
        fclose(f);
    }
    /* the oracle */
    enum { NG = 8 };
    int64_t n[NG] = {T * HQK * K, T * HQK * K, T * HV * V, T * HV * K, T * HV, N * HV * K * V, HV, HV * K};
    float *ref[NG], *got[NG];
    for (int i = 0; i < NG; i++) { ref[i] = floats(n[i] + 1, 0.f); got[i] = floats(n[i] + 1, NAN); }
    kda_backward_args_t b;
    kda_backward_args_init(&b);
    b.problem = &a; b.d_o = d_o; b.d_o_dtype = KDA_FLOAT32; b.d_final_state = dht;
    b.dq = ref[0]; b.dk = ref[1]; b.dv = ref[2]; b.dg = ref[3]; b.dbeta = ref[4];
    b.d_initial_state = ref[5];
    b.dq_dtype = b.dk_dtype = b.dv_dtype = b.dg_dtype = b.dbeta_dtype = KDA_FLOAT32;
    const int has_a = a.use_gate_in_kernel && a.A_log, has_dt = a.use_gate_in_kernel && a.dt_bias;
    if (has_a) b.dA_log = ref[6];
    if (has_dt) b.ddt_bias = ref[7];
    size_t ws = 0;
    if (kda_backward_workspace_size(kda_test_reference(), &b, &ws)) { printf("%s\n", kda_last_error()); return 1; }
    char *work = (char *)calloc(ws + 16, 1);
    if (kda_backward(kda_test_reference(), &b, work, ws, NULL)) { printf("%s\n", kda_last_error()); return 1; }

    /* exact S at chunk starts and dS+ at chunk ends, fp64 */
    const int KC = K <= 64 ? 64 : K <= 128 ? 128 : 256, VC = V <= 64 ? 64 : V <= 128 ? 128 : 256, C = 64;
    const int NVH = kda_bwd_vhalves(VC); /* the regions that sum over V: a copy per V half */
    int32_t *coff = (int32_t *)calloc((size_t)(N + 1), sizeof *coff);
    for (int64_t i = 0; i < N; i++) coff[i + 1] = coff[i] + (int32_t)((lens[i] + C - 1) / C);
    const int64_t max_chunks = (T + (C - 1) * N) / C, total = coff[N];
    /* fine blocks (QΓ_lo) on the fp32 path as the GPU's fp16 and fp32 inputs; EMU_QG_LO=0 leaves them out */
    const int fine = use_blocks == 1 && !(getenv("EMU_QG_LO") && atoi(getenv("EMU_QG_LO")) == 0) ? KDA_FINE_QG : 0;
    const int64_t bbytes = kda_cuda_block_bytes_fine(KC, VC, fine);
    const int64_t nblocks = max_chunks * HV * bbytes + 16, nstates = max_chunks * HV * KC * VC;
    unsigned char *blocks = (unsigned char *)malloc((size_t)nblocks);
    memset(blocks, 0xff, (size_t)nblocks);
    float *states = floats(nstates, NAN), *dstates = floats(nstates, NAN), *sblk = floats(nstates, NAN);
    /* EMU_S_BLOCKS's exact panels: W, K̃ [C][KC] and U [C][VC] per (chunk, head), fp64 */
    const char *s_blocks = getenv("EMU_S_BLOCKS");
    const int khat = getenv("EMU_S_KHAT") ? atoi(getenv("EMU_S_KHAT")) : 0;
    double *xW = zeros(max_chunks * HV * C * KC), *xK = zeros(max_chunks * HV * C * KC), *xU = zeros(max_chunks * HV * C * VC);
    const float scale = 1.0f / sqrtf((float)K);
    const float *q = (const float *)a.q, *k = (const float *)a.k, *v = (const float *)a.v, *g = (const float *)a.g,
                *be = (const float *)a.beta, *h0 = (const float *)a.initial_state;
    for (int64_t sq = 0; sq < N; sq++)
        for (int h = 0; h < HV; h++) {
            const int64_t bos = cu[sq], eos = cu[sq + 1], L = eos - bos;
            double *qh = zeros(L * K), *kh = zeros(L * K), *al = zeros(L * K), *lamv = zeros(L * K), *bt = zeros(L);
            for (int64_t t = 0; t < L; t++) {
                const int64_t tt = bos + t; const int hq = h / G;
                double sq2 = 0, sk2 = 0;
                for (int d = 0; d < K; d++) { sq2 += pow(q[(tt * HQK + hq) * K + d], 2); sk2 += pow(k[(tt * HQK + hq) * K + d], 2); }
                for (int d = 0; d < K; d++) {
                    qh[t * K + d] = q[(tt * HQK + hq) * K + d] / (l2 ? sqrt(sq2 + 1e-6) : 1.0);
                    kh[t * K + d] = k[(tt * HQK + hq) * K + d] / (l2 ? sqrt(sk2 + 1e-6) : 1.0);
                    double lam = g[(tt * HV + h) * K + d];
                    if (a.use_gate_in_kernel) {
                        const double x = lam + (a.dt_bias ? a.dt_bias[h * K + d] : 0.0), A = a.A_log ? exp(a.A_log[h]) : 1.0;
                        lam = a.lower_bound != 0 ? a.lower_bound * sigm(A * x) : -A * softplus(x);
                    }
                    lam = lam > 0 ? 0 : (lam < -80 ? -80 : lam);
                    al[t * K + d] = exp(lam);
                    lamv[t * K + d] = lam;
                }
                bt[t] = (neg ? 2 : 1) * sigm(be[tt * HV + h]);
            }
            for (int64_t c0 = 0; c0 < L; c0 += C) {
                const int cl = L - c0 < C ? (int)(L - c0) : C;
                unsigned char *B = blocks + ((coff[sq] + c0 / C) * HV + h) * bbytes;
                double *Gm = zeros(C * K), *M = zeros(C * C), *Tm = zeros(C * C), *X = zeros(C * K), *Y = zeros(C * V);
                for (int i = 0; i < cl; i++) for (int d = 0; d < K; d++) Gm[i * K + d] = lamv[(c0 + i) * K + d] + (i ? Gm[(i - 1) * K + d] : 0.0);
                for (int i = cl; i < C; i++) for (int d = 0; d < K; d++) Gm[i * K + d] = Gm[(cl - 1) * K + d];
                for (int i = 0; i < C; i++) for (int j = 0; j < C; j++) {
                    double m = 0, aq = 0;
                    if (i < cl && j <= i) for (int d = 0; d < K; d++) { double e = kh[(c0 + j) * K + d] * exp(Gm[i * K + d] - Gm[j * K + d]); m += kh[(c0 + i) * K + d] * e; aq += qh[(c0 + i) * K + d] * e; }
                    M[i * C + j] = j < i ? bt[c0 + i < L ? c0 + i : 0] * (i < cl ? m : 0) : 0;
                    put(B, kda_cuda_off_aqk(KC), i, j, i < cl ? scale * aq : 0);
                }
                for (int i = 0; i < C; i++) { Tm[i * C + i] = 1; for (int j = 0; j < i; j++) { double acc = 0; for (int m2 = j; m2 < i; m2++) acc += M[i * C + m2] * Tm[m2 * C + j]; Tm[i * C + j] = -acc; } }
                for (int i = 0; i < cl; i++) { for (int d = 0; d < K; d++) X[i * K + d] = bt[c0 + i] * kh[(c0 + i) * K + d] * exp(Gm[i * K + d]); for (int j = 0; j < V; j++) Y[i * V + j] = bt[c0 + i] * v[((bos + c0 + i) * HV + h) * V + j]; }
                for (int i = 0; i < C; i++) {
                    for (int d = 0; d < KC; d++) {
                        double w = 0; if (d < K) for (int m2 = 0; m2 <= i; m2++) w += Tm[i * C + m2] * X[m2 * K + d];
                        put(B, 0, i, d, i < cl ? w : 0);
                        /* EMU_S_KHAT=1: K̃ from k̂ rounded to bf16 first, as the GPU's prep forms it from its k tile */
                        const double kk = i < cl && d < K ? (khat ? round_bits(kh[(c0 + i) * K + d], 8) : kh[(c0 + i) * K + d]) : 0;
                        const double kt = i < cl && d < K ? kk * exp(Gm[(C - 1) * K + d] - Gm[i * K + d]) : 0;
                        const double qgx = i < cl && d < K ? scale * qh[(c0 + i) * K + d] * exp(Gm[i * K + d]) : 0;
                        put(B, kda_cuda_off_qg(KC), i, d, qgx);
                        if (fine) put(B, kda_cuda_off_qglo(KC, VC), i, d, qgx - bf16_bits_to_f32(f32_to_bf16_bits((float)qgx)));
                        put(B, kda_cuda_off_kt(KC), i, d, kt);
                        const int64_t xb = ((coff[sq] + c0 / C) * HV + h) * (int64_t)C * KC + (int64_t)i * KC + d;
                        xW[xb] = i < cl ? w : 0;
                        xK[xb] = kt;
                    }
                    for (int j = 0; j < VC; j++) { double u = 0; if (j < V) for (int m2 = 0; m2 <= i; m2++) u += Tm[i * C + m2] * Y[m2 * V + j]; put(B, kda_cuda_off_u(KC), i, j, i < cl ? u : 0);
                        xU[((coff[sq] + c0 / C) * HV + h) * (int64_t)C * VC + (int64_t)i * VC + j] = i < cl ? u : 0; }
                }
                for (int d = 0; d < KC; d++) ((float *)(B + kda_cuda_off_gamma(KC)))[d] = d < K ? (float)exp(Gm[(C - 1) * K + d]) : 1.0f;
                free(Gm); free(M); free(Tm); free(X); free(Y);
            }
            double *S = zeros(K * V), *Sall = zeros((L + 1) * K * V);
            for (int i = 0; i < K; i++) for (int j = 0; j < V; j++)
                S[i * V + j] = h0[(sq * HV + h) * K * V + (vfirst ? j * K + i : i * V + j)];
            for (int64_t t = 0; t <= L; t++) {
                memcpy(Sall + t * K * V, S, (size_t)(K * V) * sizeof *S);
                if (t % C == 0 && t < L) {
                    float *o = &states[((coff[sq] + t / C) * HV + h) * KC * VC];
                    for (int i = 0; i < KC; i++) for (int j = 0; j < VC; j++) o[i * VC + j] = i < K && j < V ? (float)S[i * V + j] : 0.f;
                }
                if (t == L) break;
                for (int i = 0; i < K; i++) for (int j = 0; j < V; j++) S[i * V + j] *= al[t * K + i];
                for (int j = 0; j < V; j++) {
                    double u = v[((bos + t) * HV + h) * V + j];
                    for (int i = 0; i < K; i++) u -= kh[t * K + i] * S[i * V + j];
                    for (int i = 0; i < K; i++) S[i * V + j] += bt[t] * kh[t * K + i] * u;
                }
            }
            if (s_blocks) { /* a what-if: S at every chunk start by the chunk recurrence from the bf16
                panels, S ← Diag(γ) S + K̃ᵀ (U − W S) in fp64 (the forward's recurrence kernel reads these panels: its S
                carries their rounding, correlated across the chunk), in place of the exact S. EMU_S_BLOCKS is a mask of
                the panels taken in bf16 (1 W, 2 U, 4 K̃; the others exact): 7 as the GPU */
                const int mk = atoi(s_blocks);
                /* EMU_S_BITS=N: the masked panels rounded to N significant bits from the exact values instead (8: bf16's,
                   11: fp16's with a factor); EMU_S_DELTA=N: Δ = U − W S rounded so before K̃ᵀ Δ (the forward's
                   operand) */
                const int sbits = getenv("EMU_S_BITS") ? atoi(getenv("EMU_S_BITS")) : 0;
                const int dbits = getenv("EMU_S_DELTA") ? atoi(getenv("EMU_S_DELTA")) : 0;
                /* EMU_S_SOP=N: S rounded to N bits as W S's operand (the forward packs Sᵀ to bf16 A fragments: 8) */
                const int obits = getenv("EMU_S_SOP") ? atoi(getenv("EMU_S_SOP")) : 0;
                double *Sc = zeros(K * V), *D = zeros(C * V), *pw = zeros(C * K), *pk = zeros(C * K), *pu = zeros(C * V);
                for (int i = 0; i < K; i++) for (int j = 0; j < V; j++)
                    Sc[i * V + j] = h0[(sq * HV + h) * K * V + (vfirst ? j * K + i : i * V + j)];
                for (int64_t c0 = 0; c0 < L; c0 += C) {
                    float *o = &sblk[((coff[sq] + c0 / C) * HV + h) * KC * VC];
                    for (int i = 0; i < KC; i++) for (int j = 0; j < VC; j++) o[i * VC + j] = i < K && j < V ? (float)Sc[i * V + j] : 0.f;
                    const unsigned char *Bk = blocks + ((coff[sq] + c0 / C) * HV + h) * bbytes;
                    const float *gam = (const float *)(Bk + kda_cuda_off_gamma(KC));
                    const int64_t xb = ((coff[sq] + c0 / C) * HV + h) * (int64_t)C; /* the chunk's first panel row */
                    for (int i = 0; i < C; i++) {
                        for (int d = 0; d < K; d++) {
                            pw[i * K + d] = pick(mk & 1, sbits, xW[(xb + i) * KC + d], Bk, 0, i, d);
                            pk[i * K + d] = pick(mk & 4, sbits, xK[(xb + i) * KC + d], Bk, kda_cuda_off_kt(KC), i, d);
                        }
                        for (int j = 0; j < V; j++) pu[i * V + j] = pick(mk & 2, sbits, xU[(xb + i) * VC + j], Bk, kda_cuda_off_u(KC), i, j);
                    }
                    for (int i = 0; i < C; i++) for (int j = 0; j < V; j++) {
                        double u = pu[i * V + j];
                        for (int d = 0; d < K; d++) u -= pw[i * K + d] * (obits ? round_bits(Sc[d * V + j], obits) : Sc[d * V + j]);
                        D[i * V + j] = dbits ? round_bits(u, dbits) : u;
                    }
                    for (int d = 0; d < K; d++) for (int j = 0; j < V; j++) {
                        double x = gam[d] * Sc[d * V + j];
                        for (int i = 0; i < C; i++) x += pk[i * K + d] * D[i * V + j];
                        Sc[d * V + j] = x;
                    }
                }
                free(Sc); free(D); free(pw); free(pk); free(pu);
            }
            double *dS = zeros(K * V);
            for (int i = 0; i < K; i++) for (int j = 0; j < V; j++) dS[i * V + j] = dht[(sq * HV + h) * K * V + (vfirst ? j * K + i : i * V + j)];
            for (int64_t t = L - 1; t >= 0; t--) {
                if (t == L - 1 || (t + 1) % C == 0) {
                    float *o = &dstates[((coff[sq] + t / C) * HV + h) * KC * VC];
                    for (int i = 0; i < KC; i++) for (int j = 0; j < VC; j++) o[i * VC + j] = i < K && j < V ? (float)dS[i * V + j] : 0.f;
                }
                const double *St = &Sall[(t + 1) * K * V], *Sp = &Sall[t * K * V];
                for (int i = 0; i < K; i++) for (int j = 0; j < V; j++) dS[i * V + j] += scale * qh[t * K + i] * d_o[((bos + t) * HV + h) * V + j];
                for (int j = 0; j < V; j++) {
                    double dd = 0; for (int i = 0; i < K; i++) dd += dS[i * V + j] * kh[t * K + i];
                    for (int i = 0; i < K; i++) dS[i * V + j] -= bt[t] * kh[t * K + i] * dd;
                }
                for (int i = 0; i < K; i++) for (int j = 0; j < V; j++) dS[i * V + j] *= al[t * K + i];
                (void)St; (void)Sp;
            }
            free(qh); free(kh); free(al); free(lamv); free(bt); free(S); free(Sall); free(dS);
        }
    float *dqk = floats(T * HV * NVH * 2 * KC, NAN), *part = floats(max_chunks * HV * 2 * KC, NAN);
    float *dcoef = floats(max_chunks * HV * NVH * 2 * C * (C + 4), NAN), *dx = floats(T * HV * NVH * KC, NAN), *rnorm = floats(T * HV * 2, NAN);
    float *dbeta_part = floats(T * HV * 2, NAN);
    kda_bwd_params_t p;
    memset(&p, 0, sizeof p);
    p.pb.seqs.cu_seqlens = s.cu_seqlens; p.pb.seqs.cu_seqlens_64 = 1; p.pb.seqs.num_tokens = T; p.pb.seqs.seq_len = s.cu_seqlens ? T : cfg.seq_len;
    p.pb.seqs.num_seqs = N; p.pb.seqs.chunks_per_row = (p.pb.seqs.seq_len + C - 1) / C; p.pb.seqs.chunk_offsets = s.cu_seqlens ? coff : NULL;
    p.blocks.max_chunks = max_chunks;
    p.states = states; p.dstates = dstates; p.dqk = dqk; p.part = part;
    p.dcoef = dcoef; p.dx = dx; p.rnorm = rnorm; p.dbeta_part = NVH == 2 ? dbeta_part : NULL;
    p.pb.q = a.q; p.pb.k = a.k; p.pb.v = a.v; p.pb.g = a.g; p.pb.beta = a.beta;
    p.pb.A_log = a.use_gate_in_kernel ? a.A_log : NULL; p.pb.dt_bias = a.use_gate_in_kernel ? a.dt_bias : NULL;
    p.pb.h0 = a.initial_state; p.dht = dht; p.d_o = d_o;
    p.dq = got[0]; p.dk = got[1]; p.dv = got[2]; p.dg = got[3]; p.dbeta = got[4];
    p.dh0 = got[5];
    p.dA_log = has_a ? got[6] : NULL; p.ddt_bias = has_dt ? got[7] : NULL;
    p.pb.hqk = HQK; p.pb.hv = HV; p.pb.group = G; p.pb.K = K; p.pb.V = V; p.pb.kc = KC; p.pb.vc = VC; p.pb.v_first = vfirst;
    p.pb.scale = scale; p.pb.lower_bound = a.lower_bound; p.pb.l2norm = l2; p.pb.gate_in_kernel = a.use_gate_in_kernel;
    p.pb.beta_sigmoid = 1; p.pb.neg_eigval = neg;
    (void)total;
    float *st2 = floats(nstates, NAN), *dst2 = floats(nstates, NAN), *h0bad = floats(N * HV * K * V, 0.f);
    /* use_blocks = 2: the split stage 3 of 16-bit inputs (the inter kernel runs) */
    float *delta = floats(max_chunks * HV * C * VC, NAN), *dgam = floats(max_chunks * HV * NVH * KC, NAN);
    p.split = use_blocks == 2;
    p.delta = (unsigned char *)delta; p.dgam = dgam;
    memcpy(h0bad, a.initial_state, (size_t)(N * HV * K * V) * sizeof *h0bad);
    const int inject = argc > 11 ? atoi(argv[11]) : 0;
    if (inject) { h0bad[3 * (vfirst ? K : V) + 7] = INFINITY; p.pb.h0 = h0bad; }
    uint16_t *sb = NULL, *dsh = NULL;
    uint8_t *dse = NULL;
    if (use_blocks) {
        p.blocks.base = blocks; p.blocks.block_bytes = bbytes; p.blocks.fine = fine;
        /* stage 1 (the recurrence kernel) is not emulated: exact S, or (EMU_S_BLOCKS) S from the bf16 panels */
        memcpy(st2, s_blocks ? sblk : states, (size_t)nstates * sizeof *st2);
        if (getenv("EMU_S_NOISE")) { /* a what-if: S times 1 + e u, u uniform with standard deviation 1 (the GPU's S
                                        comes from the forward's recurrence, with its own rounding errors) */
            const double e = atof(getenv("EMU_S_NOISE"));
            uint64_t rn = 991;
            for (int64_t c = 0; c < nstates; c++) st2[c] *= (float)(1.0 + e * 1.7320508 * urand(&rn));
        }
        p.states = st2; p.dstates = dst2;
        if (p.split) { /* the split path's dS+: fp16 in kda_cuda_states_dv's order and the exponents of the factors per
                          (16 columns, lane) (states16.cuh; widened into dst2 for the print) */
            dsh = (uint16_t *)malloc((size_t)nstates * sizeof *dsh);
            dse = (uint8_t *)malloc((size_t)(max_chunks * HV * 2 * VC));
            for (int64_t c = 0; c < nstates; c++) dsh[c] = 0x7e00; /* NaN: what the kernel leaves unwritten */
            memset(dse, 0, (size_t)(max_chunks * HV * 2 * VC));
            p.dstates = NULL; p.dstates_f16 = dsh; p.dstates_exp = dse;
        }
        run_dstate(&p);
        if (dsh) {
            const int64_t per = (int64_t)KC * VC;
            for (int64_t c = 0; c < nstates; c++) {
                int d, v;
                const int e = (int)(c % per), lane = (e >> 3) & 31, vb = (e >> 8) / (KC / 16);
                kda_cuda_states_dv(e, KC, &d, &v);
                dst2[c - e + (int64_t)d * VC + v] = f16_bits_to_f32(dsh[c]) * __uint_as_float((uint32_t)dse[c / per * 2 * VC + vb * 32 + lane] << 23);
            }
        }
        for (int w2 = 0; w2 < 2; w2++) {
            const float *x = w2 ? dst2 : st2, *y = w2 ? dstates : states;
            double num = 0, den = 0; int64_t nf = 0;
            for (int64_t c = 0; c < total * HV * KC * VC; c++) { if (!isfinite(x[c])) nf++; num += pow(x[c] - y[c], 2); den += pow(y[c], 2); }
            printf("%s rel err %.3e nonfinite %lld\n", w2 ? "dstates" : "states", sqrt(num / den), (long long)nf);
        }
        if (p.split) { /* the split path reads S in bf16 (stage 1 or the forward writes it so) */
            sb = (uint16_t *)malloc((size_t)nstates * sizeof *sb);
            const int64_t per = (int64_t)KC * VC; /* kda_cuda_states_dv's order within each (chunk, head) */
            for (int64_t c = 0; c < nstates; c++) {
                int d, v;
                kda_cuda_states_dv((int)(c % per), KC, &d, &v);
                sb[c] = f32_to_bf16_bits(st2[c - c % per + (int64_t)d * VC + v]);
            }
            p.states_bf16 = sb;
            p.states = NULL;
            run_inter(&p);
            if (getenv("EMU_EXACT_DGAM")) /* a what-if: the inter kernel's dγ = rowsum(S ⊙ dS+) from the exact S and dS+ */
                for (int64_t c = 0; c < total; c++)
                    for (int h = 0; h < HV; h++)
                        for (int vh = 0; vh < NVH; vh++)
                            for (int d = 0; d < KC; d++) {
                                const float *S0 = &states[(c * HV + h) * KC * VC + (int64_t)d * VC], *D0 = &dstates[(c * HV + h) * KC * VC + (int64_t)d * VC];
                                double acc = 0;
                                for (int v = vh * (VC / NVH); v < (vh + 1) * (VC / NVH); v++) acc += (double)S0[v] * D0[v];
                                dgam[((c * HV + h) * NVH + vh) * KC + d] = (float)acc;
                            }
            /* what-ifs: dQΓ = dO Sᵀ from the exact S (EMU_EXACT_DQG), dK̃ = Δ dS+ᵀ from the kernel's fp32 Δ and the
               exact dS+ (EMU_EXACT_DKT), in place of the inter kernel's bf16 products */
            const int xq = getenv("EMU_EXACT_DQG") != NULL, xk = getenv("EMU_EXACT_DKT") ? atoi(getenv("EMU_EXACT_DKT")) : 0;
            for (int64_t sq = 0; (xq || xk) && sq < N; sq++)
                for (int64_t t = cu[sq]; t < cu[sq + 1]; t++) {
                    const int64_t c = coff[sq] + (t - cu[sq]) / C;
                    const int i = (int)((t - cu[sq]) % C);
                    for (int h = 0; h < HV; h++)
                        for (int vh = 0; vh < NVH; vh++) {
                            float *row = dqk + ((t * HV + h) * NVH + vh) * (int64_t)(2 * KC);
                            const int VH = VC / NVH; /* the inter kernel's Δ: [C][VH] per (chunk, head, V half) */
                            /* (Δ's fp16 row i and its exponent byte, as the inter kernel wrote them) */
                            const uint16_t *dh = (const uint16_t *)((const unsigned char *)delta + ((c * HV + h) * NVH + vh) * KDA_BWD_DELTA_BYTES(VH));
                            const float df = ldexpf(1.0f, (int)((const uint8_t *)(dh + C * VH))[i] - 127);
                            for (int d = 0; d < KC; d++) {
                                const float *S0 = &states[(c * HV + h) * KC * VC + (int64_t)d * VC], *D0 = &dstates[(c * HV + h) * KC * VC + (int64_t)d * VC];
                                double aq = 0, ak = 0;
                                for (int v = vh * (VC / NVH); v < (vh + 1) * (VC / NVH) && v < V; v++) {
                                    aq += (double)d_o[(t * HV + h) * V + v] * S0[v];
                                    ak += (double)kt_delta(unpack_16x2<1>(dh[i * VH + v - vh * VH]).x * df, xk) * kt_ds(D0[v], dst2[(c * HV + h) * KC * VC + (int64_t)d * VC + v], xk);
                                }
                                if (xq) row[d] = (float)aq;
                                if (xk) row[KC + d] = (float)ak;
                            }
                        }
                }
        }
    }
    /* EMU_CHUNK_16_STORE=1: the chunk kernel reads 16-bit q, k, g and v; EMU_PAIRS_16_STORE=1: the pairs kernel
       16-bit q, k and g (v it does not read) */
    kda_bwd_params_t p16c = p;
    p16c.pb.q = q16, p16c.pb.k = k16, p16c.pb.g = g16, p16c.pb.v = v16;
    p16c.pb.dtype = p16c.pb.g_dtype = p16f ? KDA_DT_F16 : KDA_DT_BF16;
    run_chunk(c16s ? &p16c : &p);
    run_pairs(p16s ? &p16c : &p);
    run_finish(&p);
    const char *names[NG] = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"};
    int bad = 0;
    for (int i = 0; i < NG; i++) {
        if (i == 5 && !use_blocks) continue;
        if ((i == 6 && !has_a) || (i == 7 && !has_dt)) continue;
        double num = 0, den = 0; int64_t nf = 0;
        for (int64_t e = 0; e < n[i]; e++) { double d = got[i][e] - ref[i][e]; if (!isfinite(got[i][e])) nf++; num += d * d; den += (double)ref[i][e] * ref[i][e]; }
        double err = sqrt(num / den);
        printf("%s %.3e (nonfinite %lld)\n", names[i], err, (long long)nf);
        bad |= !(err < (use_blocks ? 3e-2 : 1e-2)) || nf;
    }
    if (inject) {
        int64_t nan_dg = 0, nan_other = 0;
        for (int64_t e = 0; e < n[3]; e++) { int64_t t = e / (HV * K), h = e / K % HV; int want = t < lens[0] && h == 0; if (want) nan_dg += isnan(got[3][e]) != 0; else nan_other += !isfinite(got[3][e]); }
        int64_t nf_dv = 0; for (int64_t e = 0; e < n[2]; e++) nf_dv += !isfinite(got[2][e]);
        printf("inject: dg NaN %lld of %lld expected, other non-finite %lld, dv non-finite %lld\n", (long long)nan_dg, (long long)(lens[0] * K), (long long)nan_other, (long long)nf_dv);
    }
    const char *dump = getenv("EMU_DUMP"); /* the gradients as computed, float32, in names[]' order */
    if (getenv("EMU_DUMP_REF")) { /* the oracle's gradients, then the raw gate, A_log and dt_bias, float32 */
        FILE *rf = fopen(getenv("EMU_DUMP_REF"), "wb");
        for (int i = 0; rf && i < NG; i++) fwrite(ref[i], sizeof(float), (size_t)n[i], rf);
        if (rf) {
            fwrite(a.g, sizeof(float), (size_t)(T * HV * K), rf);
            if (a.A_log) fwrite(a.A_log, sizeof(float), (size_t)HV, rf);
            if (a.dt_bias) fwrite(a.dt_bias, sizeof(float), (size_t)(HV * K), rf);
            fclose(rf);
        }
    }
    FILE *df = dump ? fopen(dump, "wb") : NULL;
    if (dump && !df) { fprintf(stderr, "cannot write %s\n", dump); bad = 1; }
    for (int i = 0; df && i < NG; i++) fwrite(got[i], sizeof(float), (size_t)n[i], df);
    if (df) fclose(df);
    printf(bad ? "FAIL\n" : "OK\n");
    for (int i = 0; i < NG; i++) { free(ref[i]); free(got[i]); }
    free(cu); free(d_o); free(dht); free(work); free(coff); free(blocks); free(states); free(dstates); free(sblk); free(xW); free(xK); free(xU);
    free(sb); free(dsh); free(dse); free(dqk); free(part); free(st2); free(dst2); free(h0bad); free(delta); free(dgam); free(dcoef); free(dx); free(rnorm); free(dbeta_part);
    kda_synth_free(&s);
    return bad;
}
