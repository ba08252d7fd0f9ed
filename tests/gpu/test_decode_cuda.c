/*
 * The CUDA decode kernels (src/cuda/decode/: tile, staged) against the fp64 oracle: every option, head
 * sizes 1..256 in both state layouts, GVA, MTP (several tokens per sequence), vLLM state pools updated in place
 * (1-D and the 2-D slots of speculative decoding), headwise β, the non-finite contract, CUDA-graph capture, and the GPU time
 * of one N1 H32 decode step measured from C. Untouched pool slots are filled with a byte pattern and must
 * come back bit-identical. Skipped (exit 77) without a usable CUDA device.
 *
 * Each case prints "case ... o_err ... state_err ..." so that a run's log is the accuracy table.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "dtype.h"
#include "internal.h" /* kda_set_tuning: force the V-first tile width */
#include "test_util.h"

#ifdef KDA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "gpu_util.h"

static kda_context_t *gpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CUDA, 0) != KDA_STATUS_SUCCESS) SKIP("no CUDA device: %s", kda_last_error());
    return ctx;
}


/* How the states are passed. */
typedef enum { ST_PLAIN = 0, ST_POOL_1D = 1, ST_POOL_2D = 2 } st_mode_t;

typedef struct {
    kda_synth_config_t c;
    st_mode_t mode;
    int headwise;   /* β [B, T, HV, V] */
    int t_max;      /* ST_POOL_2D: columns of the index rows (>= every length) */
    int accepted;   /* ST_POOL_2D: pass num_accepted_tokens */
    int poison;     /* 1: a NaN in v of token 1 of sequence 0 */
} dcase_t;

static double worst_o, worst_state;

/* Run one case on the GPU (kda_decode, or kda_forward when `forward`) and on the oracle; compare o, the states
 * written, and the bytes of every slot not written. Returns the worst relative error. */
static void run_case(const char *name, const dcase_t *dc, double tol, int forward) {
    (void)gpu();
    const kda_synth_config_t *c = &dc->c;
    kda_synth_t s;
    kda_args_t a;
    if (kda_synth_make(c, &s, &a) != 0) exit(1);
    const int64_t N = s.num_seqs, NT = s.num_tokens;
    const int64_t per = (int64_t)c->hv * c->k * c->v;
    const kda_dtype_t sdt = c->initial_state_dtype;
    const size_t esz = kda_dtype_size(sdt);

    /* headwise β */
    float *bh = NULL;
    if (dc->headwise) {
        bh = (float *)malloc(sizeof(float) * (size_t)(NT * c->hv * c->v + 1));
        for (int64_t i = 0; i < NT * c->hv * c->v; i++) bh[i] = dc->c.beta_sigmoid ? 2.0f * sinf(i * 0.61f + 0.3f)
                                                                                 : 0.5f + 0.45f * sinf(i * 0.61f);
        a.beta = bh;
        a.beta_dtype = KDA_FLOAT32;
        a.beta_headwise = 1;
    }
    if (dc->poison) {
        kda_store_f32(s.v, c->dtype, 1 * c->hv * c->v + 2, NAN); /* token 1 = sequence 0's second token */
    }

    /* states: a pool of slots in place, or the synthesiser's h0 / ht */
    int64_t slots = 0;
    int32_t *idx = NULL, *nat = NULL;
    int64_t cols = 0;
    void *pool = NULL, *pool_before = NULL, *pool_ref = NULL;
    if (dc->mode != ST_PLAIN) {
        cols = dc->mode == ST_POOL_2D ? dc->t_max : 0;
        const int64_t entries = dc->mode == ST_POOL_2D ? N * cols : N;
        slots = entries + 5;
        while (slots % 7 == 0) slots++; /* i -> (7 i + 3) mod slots is then one-to-one */
        idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(entries + 1));
        /* a permutation of the slots, some entries negative */
        for (int64_t i = 0; i < entries; i++) idx[i] = (int32_t)((i * 7 + 3) % slots);
        for (int64_t i = 0; i < entries; i += 5) idx[i] = -1;
        if (dc->mode == ST_POOL_2D && dc->accepted) {
            nat = (int32_t *)malloc(sizeof(int32_t) * (size_t)(N + 1));
            for (int64_t n = 0; n < N; n++) nat[n] = (int32_t)(1 + (n * 3) % cols);
        }
        const size_t bytes = esz * (size_t)(slots * per);
        pool = malloc(bytes);
        pool_before = malloc(bytes);
        pool_ref = malloc(bytes);
        for (int64_t i = 0; i < slots * per; i++) kda_store_f32(pool, sdt, i, 0.5f * sinf((float)i * 0.37f));
        memcpy(pool_before, pool, bytes);
        memcpy(pool_ref, pool, bytes);
        a.initial_state = pool;
        a.final_state = pool;
        a.final_state_dtype = sdt;
        a.state_indices = idx;
        a.num_state_slots = slots;
        a.state_indices_cols = cols;
        a.num_accepted_tokens = nat;
    }

    /* device copy of the arguments */
    kda_args_t d = a;
    d.q = to_dev(s.q, s.q_bytes);
    d.k = to_dev(s.k, s.q_bytes);
    d.v = to_dev(s.v, s.v_bytes);
    d.g = to_dev(s.g, s.g_bytes);
    d.beta = dc->headwise ? to_dev(bh, sizeof(float) * (size_t)(NT * c->hv * c->v + 1)) : to_dev(s.beta, s.beta_bytes);
    d.o = to_dev(s.o, s.o_bytes);
    if (a.A_log) d.A_log = (const float *)to_dev(a.A_log, sizeof(float) * (size_t)c->hv);
    if (a.dt_bias) d.dt_bias = (const float *)to_dev(a.dt_bias, sizeof(float) * (size_t)c->hv * c->k);
    if (a.cu_seqlens) d.cu_seqlens = to_dev(s.cu_seqlens, sizeof(int64_t) * (size_t)(N + 1));
    size_t pool_bytes = esz * (size_t)(slots * per);
    if (dc->mode != ST_PLAIN) {
        d.initial_state = d.final_state = to_dev(pool, pool_bytes);
        d.state_indices = (const int32_t *)to_dev(idx, sizeof(int32_t) * (size_t)(cols ? N * cols : N));
        if (nat) d.num_accepted_tokens = (const int32_t *)to_dev(nat, sizeof(int32_t) * (size_t)N);
    } else {
        if (a.initial_state) d.initial_state = to_dev(s.h0, s.h0_bytes);
        if (a.final_state) d.final_state = to_dev(s.ht, s.ht_bytes);
    }

    size_t need = 0;
    kda_status_t st = forward ? kda_forward_workspace_size(gpu(), &d, &need) : kda_decode_workspace_size(gpu(), &d, &need);
    void *ws = NULL;
    if (st == KDA_STATUS_SUCCESS && need) CUDA_OK(cudaMalloc(&ws, need));
    if (st == KDA_STATUS_SUCCESS)
        st = forward ? kda_forward(gpu(), &d, ws, need, NULL) : kda_decode(gpu(), &d, ws, need, NULL);
    CHECK(st == KDA_STATUS_SUCCESS, "%s: %s: %s", name, kda_describe(c), kda_last_error());
    CUDA_OK(cudaDeviceSynchronize());

    /* the oracle */
    const int64_t o_elems = NT * c->hv * c->v;
    float *o_ref = (float *)malloc(sizeof(float) * (size_t)(o_elems + 1));
    float *ht_ref = NULL;
    kda_args_t r = a;
    r.o = o_ref;
    r.o_dtype = KDA_FLOAT32;
    if (dc->mode != ST_PLAIN) {
        r.initial_state = r.final_state = pool_ref;
    } else if (a.final_state) {
        ht_ref = (float *)malloc(sizeof(float) * (size_t)(N * per + 1));
        r.final_state = ht_ref;
        r.final_state_dtype = KDA_FLOAT32;
    }
    CHECK(kda_run_host(kda_test_reference(), &r, KDA_ALGO_DECODE) == KDA_STATUS_SUCCESS, "oracle: %s",
          kda_last_error());

    if (st == KDA_STATUS_SUCCESS) {
        CUDA_OK(cudaMemcpy(s.o, d.o, s.o_bytes, cudaMemcpyDeviceToHost));
        double eo, es = 0.0;
        if (dc->poison) {
            /* NaN exactly where the oracle has NaN; the rest close */
            int64_t mismatch = 0;
            for (int64_t i = 0; i < o_elems; i++)
                mismatch += isnan(kda_load_f32(s.o, c->o_dtype, i)) != isnan(o_ref[i]);
            CHECK(mismatch == 0, "%s: %lld outputs NaN on one side only", name, (long long)mismatch);
            for (int64_t i = 0; i < o_elems; i++)
                if (isnan(o_ref[i])) {
                    o_ref[i] = 0.0f;
                    kda_store_f32(s.o, c->o_dtype, i, 0.0f);
                }
        }
        eo = kda_rel_err(s.o, c->o_dtype, o_ref, KDA_FLOAT32, o_elems);
        CHECK(dc->poison || kda_count_nonfinite(s.o, c->o_dtype, o_elems) == 0, "%s: o not finite or unwritten",
              name);
        if (dc->mode != ST_PLAIN) {
            void *got = malloc(pool_bytes);
            CUDA_OK(cudaMemcpy(got, d.final_state, pool_bytes, cudaMemcpyDeviceToHost));
            int64_t changed_untouched = 0;
            for (int64_t sl = 0; sl < slots; sl++) {
                /* written: the oracle's pool differs from the one before, or the slot is a write target */
                int written = 0;
                for (int64_t n = 0; n < N && !written; n++) {
                    int64_t bos = s.cu_seqlens ? s.cu_seqlens[n] : n * c->seq_len;
                    int64_t eos = s.cu_seqlens ? s.cu_seqlens[n + 1] : bos + c->seq_len;
                    if (cols == 0) written = idx[n] == sl;
                    else
                        for (int64_t t = 0; t < eos - bos; t++) written |= idx[n * cols + t] == sl;
                }
                const char *gs = (const char *)got + sl * per * esz;
                if (!written) {
                    changed_untouched += memcmp(gs, (const char *)pool_before + sl * per * esz, per * esz) != 0;
                    continue;
                }
                const char *rs = (const char *)pool_ref + sl * per * esz;
                if (dc->poison && isnan(kda_load_f32(rs, sdt, 0))) {
                    CHECK(kda_count_nonfinite(gs, sdt, per) == per, "%s: poisoned slot %lld not all NaN", name,
                          (long long)sl);
                    continue;
                }
                double e = kda_rel_err(gs, sdt, rs, sdt, per);
                es = e > es ? e : es;
            }
            CHECK(changed_untouched == 0, "%s: %lld untouched slots changed", name, (long long)changed_untouched);
            free(got);
        } else if (a.final_state) {
            CUDA_OK(cudaMemcpy(s.ht, d.final_state, s.ht_bytes, cudaMemcpyDeviceToHost));
            es = kda_rel_err(s.ht, c->final_state_dtype, ht_ref, KDA_FLOAT32, N * per);
        }
        printf("case %-32s o_err %.3e state_err %.3e  %s%s\n", name, eo, es, kda_describe(c),
               dc->headwise ? " headwise" : "");
        CHECK(eo <= tol, "%s: o rel err %.3g > %.3g (%s)", name, eo, tol, kda_describe(c));
        CHECK(es <= tol, "%s: state rel err %.3g > %.3g (%s)", name, es, tol, kda_describe(c));
        if (eo > worst_o) worst_o = eo;
        if (es > worst_state) worst_state = es;
    }

    cudaFree((void *)d.q);
    cudaFree((void *)d.k);
    cudaFree((void *)d.v);
    cudaFree((void *)d.g);
    cudaFree((void *)d.beta);
    cudaFree(d.o);
    cudaFree((void *)d.A_log);
    cudaFree((void *)d.dt_bias);
    cudaFree((void *)d.cu_seqlens);
    cudaFree((void *)d.initial_state);
    if (d.final_state != d.initial_state) cudaFree(d.final_state);
    cudaFree((void *)d.state_indices);
    cudaFree((void *)d.num_accepted_tokens);
    cudaFree(ws);
    free(o_ref);
    free(ht_ref);
    free(bh);
    free(idx);
    free(nat);
    free(pool);
    free(pool_before);
    free(pool_ref);
    kda_synth_free(&s);
}

static dcase_t base_case(int k, int v) {
    dcase_t dc;
    memset(&dc, 0, sizeof dc);
    kda_synth_defaults(&dc.c);
    dc.c.batch = 3;
    dc.c.seq_len = 1;
    dc.c.hqk = 1;
    dc.c.hv = 2;
    dc.c.k = k;
    dc.c.v = v;
    dc.c.initial_state = dc.c.final_state = 1;
    dc.c.gate = KDA_GATE_LOWER_BOUND;
    dc.c.l2norm = dc.c.beta_sigmoid = 1;
    dc.c.seed = 5;
    return dc;
}

/* Tolerance: fp32 arithmetic against fp64; bf16/fp16 outputs or states round to ~4e-3. */
static double tol_of(const kda_synth_config_t *c) {
    const int narrow = c->o_dtype != KDA_FLOAT32 || c->initial_state_dtype != KDA_FLOAT32 ||
                       c->final_state_dtype != KDA_FLOAT32;
    return narrow ? 1e-2 : 5e-5;
}

/* Every head size pair, both layouts, options rotating: one-token decode with plain states, then MTP with a
 * 1-D pool. */
TEST(gpu_decode_head_sizes_options) {
    static const int sizes[][2] = {{16, 16}, {60, 60}, {64, 64}, {100, 100}, {128, 128}, {256, 256}, {64, 128},
                                   {128, 64}, {1, 1}, {3, 200}, {256, 17}};
    unsigned i = 0;
    for (unsigned z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
        for (int vf = 0; vf < 2; vf++)
            for (int variant = 0; variant < 2; variant++, i++) {
                dcase_t dc = base_case(sizes[z][0], sizes[z][1]);
                unsigned h = (i + 1) * 2654435761u;
                dc.c.state_v_first = vf;
                dc.c.gate = (kda_gate_mode_t)(h % 4);
                dc.c.l2norm = (h >> 3) % 2;
                const int bmode = (int)((h >> 5) % 3);
                dc.c.beta_sigmoid = bmode > 0;
                dc.c.allow_neg_eigval = bmode == 2;
                dc.c.dtype = (h >> 7) % 3 == 0 ? KDA_FLOAT32 : ((h >> 7) % 3 == 1 ? KDA_FLOAT16 : KDA_BFLOAT16);
                dc.c.g_dtype = (h >> 9) % 2 ? KDA_FLOAT32 : KDA_BFLOAT16;
                dc.c.beta_dtype = (h >> 10) % 2 ? KDA_FLOAT32 : KDA_BFLOAT16;
                dc.c.o_dtype = (h >> 11) % 2 ? KDA_FLOAT32 : KDA_BFLOAT16;
                dc.c.initial_state_dtype = dc.c.final_state_dtype = (h >> 12) % 3 == 0 ? KDA_BFLOAT16 : KDA_FLOAT32;
                dc.c.seed = i;
                if (variant == 1) { /* MTP: 3 tokens per sequence, 1-D pool in place */
                    dc.c.seq_len = 3;
                    dc.mode = ST_POOL_1D;
                }
                char name[64];
                snprintf(name, sizeof name, "k%d_v%d_%s_%s", sizes[z][0], sizes[z][1],
                         vf ? "vfirst" : "kfirst", variant ? "mtp_pool" : "plain");
                run_case(name, &dc, tol_of(&dc.c), 0);
            }
    printf("worst o_err %.3e, worst state_err %.3e\n", worst_o, worst_state);
}

/* fp32 everything, both layouts: the decode kernel's own error against fp64 (FLA's kernel is fp32 too). */
TEST(gpu_decode_fp32_accuracy) {
    for (int vf = 0; vf < 2; vf++) {
        dcase_t dc = base_case(128, 128);
        dc.c.batch = 8;
        dc.c.hv = 4;
        dc.c.dtype = dc.c.g_dtype = dc.c.beta_dtype = dc.c.o_dtype = KDA_FLOAT32;
        dc.c.state_v_first = vf;
        dc.mode = ST_POOL_1D;
        run_case(vf ? "fp32_vfirst" : "fp32_kfirst", &dc, 5e-5, 0);
    }
}

TEST(gpu_decode_gva_4x) {
    for (int vf = 0; vf < 2; vf++) {
        dcase_t dc = base_case(128, 128);
        dc.c.batch = 5;
        dc.c.hqk = 2;
        dc.c.hv = 8;
        dc.c.state_v_first = vf;
        dc.mode = ST_POOL_1D;
        run_case(vf ? "gva4_vfirst" : "gva4_kfirst", &dc, tol_of(&dc.c), 0);
    }
}

/* MTP: several tokens per sequence, varlen with an empty sequence, in place. */
TEST(gpu_decode_mtp_varlen) {
    static const int64_t lens[] = {4, 1, 0, 3, 4, 2};
    for (int vf = 0; vf < 2; vf++) {
        dcase_t dc = base_case(128, 128);
        dc.c.num_seqs = 6;
        dc.c.seqlens = lens;
        dc.c.batch = 1;
        dc.c.hv = 4;
        dc.c.state_v_first = vf;
        dc.mode = ST_POOL_1D;
        run_case(vf ? "mtp_varlen_vfirst" : "mtp_varlen_kfirst", &dc, tol_of(&dc.c), 0);
    }
}

/* Speculative decoding: 2-D slots, num_accepted_tokens, state after every token, fp32 and bf16 pools. */
TEST(gpu_decode_spec_2d) {
    static const int64_t lens[] = {4, 4, 2, 0, 3};
    for (int vf = 0; vf < 2; vf++)
        for (int bf = 0; bf < 2; bf++)
            for (int acc = 0; acc < 2; acc++) {
                dcase_t dc = base_case(128, 128);
                dc.c.num_seqs = 5;
                dc.c.seqlens = lens;
                dc.c.batch = 1;
                dc.c.hv = 4;
                dc.c.state_v_first = vf;
                dc.c.initial_state_dtype = dc.c.final_state_dtype = bf ? KDA_BFLOAT16 : KDA_FLOAT32;
                dc.mode = ST_POOL_2D;
                dc.t_max = 4;
                dc.accepted = acc;
                char name[64];
                snprintf(name, sizeof name, "spec_%s_%s%s", vf ? "vfirst" : "kfirst", bf ? "bf16" : "fp32",
                         acc ? "_accepted" : "");
                run_case(name, &dc, tol_of(&dc.c), 0);
            }
}

/* Headwise β on decode (1-D pool, spec decoding) and through kda_forward (which takes the recurrent kernel). */
TEST(gpu_decode_beta_headwise) {
    static const int64_t lens[] = {3, 4, 1};
    for (int vf = 0; vf < 2; vf++) {
        dcase_t dc = base_case(64, 128);
        dc.c.batch = 4;
        dc.c.seq_len = 2;
        dc.c.hv = 2;
        dc.c.state_v_first = vf;
        dc.headwise = 1;
        dc.mode = ST_POOL_1D;
        run_case(vf ? "headwise_pool_vfirst" : "headwise_pool_kfirst", &dc, tol_of(&dc.c), 0);
        dc.c.beta_sigmoid = 0;
        dc.mode = ST_PLAIN;
        run_case(vf ? "headwise_forward_vfirst" : "headwise_forward_kfirst", &dc, tol_of(&dc.c), 1);
        dc = base_case(128, 128);
        dc.c.num_seqs = 3;
        dc.c.seqlens = lens;
        dc.c.batch = 1;
        dc.c.state_v_first = vf;
        dc.headwise = 1;
        dc.mode = ST_POOL_2D;
        dc.t_max = 4;
        dc.accepted = 1;
        run_case(vf ? "headwise_spec_vfirst" : "headwise_spec_kfirst", &dc, tol_of(&dc.c), 0);
    }
}

/* The kernels on the exact head sizes: by default the tile kernel (decode_tile.cuh) with 8 chunks per thread on
 * small grids and fp32 V-first states; forced here onto the staged kernel (decode_staged.cuh, its exact instances)
 * and onto the tile kernel with 8 and 16 chunks per thread: plain and MTP with a 1-D pool, spec decoding with 2-D slots, GVA,
 * fp32 and bf16 states, both layouts, K = 64 and 128 (V = 128: two 64-column tiles, one 128-column tile). */
TEST(gpu_decode_forced_kernels_exact) {
    static const int64_t lens[] = {4, 1, 0, 3, 4, 2};
    static const int kernels[] = {1, 3, 4};
    for (unsigned ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
        const int kernel = kernels[ki];
        kda_tuning_t t = {0};
        t.decode_kernel = kernel;
        kda_set_tuning(gpu(), &t);
        for (int k = 64; k <= 128; k += 64)
            for (int vf = 0; vf < 2; vf++)
                for (int bf = 0; bf < 2; bf++)
                    for (int mode = 0; mode < 3; mode++) {
                        dcase_t dc = base_case(k, 128);
                        dc.c.num_seqs = 6;
                        dc.c.seqlens = lens;
                        dc.c.batch = 1;
                        dc.c.hqk = 2;
                        dc.c.hv = 4;
                        dc.c.state_v_first = vf;
                        dc.c.initial_state_dtype = dc.c.final_state_dtype = bf ? KDA_BFLOAT16 : KDA_FLOAT32;
                        dc.c.seed = 40 + mode;
                        dc.mode = mode == 0 ? ST_PLAIN : (mode == 1 ? ST_POOL_1D : ST_POOL_2D);
                        dc.t_max = 4;
                        dc.accepted = 1;
                        char name[64];
                        snprintf(name, sizeof name, "%s_k%d_%s_%s_%s", kernel == 1 ? "staged" : "tile16", k,
                                 vf ? "vfirst" : "kfirst", bf ? "bf16" : "fp32",
                                 mode == 0 ? "plain" : (mode == 1 ? "pool" : "spec"));
                        run_case(name, &dc, tol_of(&dc.c), 0);
                    }
    }
    kda_set_tuning(gpu(), NULL);
}

/* Persistent CTAs: with 1 and 7 CTAs each walks many tiles through its ring of stages (items of several
 * sequences, heads and tiles, an empty sequence among them), in both layouts; every case must match the
 * oracle as with the default grid. */
TEST(gpu_decode_persistent_ctas) {
    static const int sizes[][2] = {{128, 128}, {256, 256}, {64, 100}, {100, 60}};
    static const int64_t lens[] = {2, 0, 3, 1, 2};
    for (int ctas = 1; ctas <= 7; ctas += 6) {
        kda_tuning_t t = {0};
        t.decode_ctas = ctas;
        kda_set_tuning(gpu(), &t);
        for (unsigned z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
            for (int vf = 0; vf < 2; vf++) {
                dcase_t dc = base_case(sizes[z][0], sizes[z][1]);
                dc.c.num_seqs = 5;
                dc.c.seqlens = lens;
                dc.c.batch = 1;
                dc.c.hv = 4;
                dc.c.state_v_first = vf;
                dc.c.dtype = dc.c.g_dtype = dc.c.beta_dtype = dc.c.o_dtype = KDA_FLOAT32;
                dc.mode = ST_POOL_1D;
                char name[64];
                snprintf(name, sizeof name, "ctas%d_%s_k%d_v%d", ctas, vf ? "vfirst" : "kfirst", sizes[z][0],
                         sizes[z][1]);
                run_case(name, &dc, 5e-5, 0);
            }
        }
    }
    kda_set_tuning(gpu(), NULL);
}

/* The non-finite contract: a NaN in v of token 1 of sequence 0 makes its outputs from token 1 on and its slot
 * NaN (all V tiles: v is checked whole), everything else as without it. */
TEST(gpu_decode_nonfinite_v) {
    static const int64_t lens[] = {3, 2};
    for (int vf = 0; vf < 2; vf++) {
        dcase_t dc = base_case(128, 128);
        dc.c.num_seqs = 2;
        dc.c.seqlens = lens;
        dc.c.batch = 1;
        dc.c.dtype = dc.c.g_dtype = dc.c.beta_dtype = dc.c.o_dtype = KDA_FLOAT32;
        dc.c.state_v_first = vf;
        dc.mode = ST_POOL_1D;
        dc.poison = 1;
        run_case(vf ? "nonfinite_v_vfirst" : "nonfinite_v_kfirst", &dc, 5e-5, 0);
    }
}

/* Long bf16 sequences through kda_decode take the chunked kernels (KDA_DECODE_MAX_TOKENS_PER_SEQ); fp32 ones
 * stay on the recurrent kernel at fp32 accuracy (FLA's test_fused_recurrent: T up to 1024, fp32). */
TEST(gpu_decode_long_sequences_chunked) {
    dcase_t dc = base_case(128, 128);
    dc.c.batch = 2;
    dc.c.seq_len = 100;
    dc.mode = ST_POOL_1D;
    run_case("long_seq_bf16_chunked", &dc, 1e-2, 0);
    dc = base_case(100, 100);
    dc.c.batch = 2;
    dc.c.seq_len = 300;
    dc.c.hqk = 2;
    dc.c.hv = 4;
    dc.c.dtype = dc.c.g_dtype = dc.c.beta_dtype = dc.c.o_dtype = KDA_FLOAT32;
    run_case("long_seq_fp32_recurrent", &dc, 1e-4, 0);
}

/* A decode step captured in a CUDA graph: two replays = two direct calls, bit for bit, pool in place. */
TEST(gpu_decode_cuda_graph_capture) {
    (void)gpu();
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 16;
    c.seq_len = 1;
    c.hqk = 4;
    c.hv = 8;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.state_v_first = 1;
    kda_synth_t s;
    kda_args_t a;
    if (kda_synth_make(&c, &s, &a) != 0) exit(1);
    const int slots = 40;
    const int64_t per = (int64_t)c.hv * c.k * c.v;
    const size_t pool_bytes = sizeof(float) * (size_t)(slots * per);
    float *pool = (float *)malloc(pool_bytes), *p1 = (float *)malloc(pool_bytes), *p2 = (float *)malloc(pool_bytes);
    for (int64_t i = 0; i < slots * per; i++) pool[i] = 0.3f * cosf((float)i * 0.013f);
    int32_t idx[16];
    for (int i = 0; i < 16; i++) idx[i] = (i * 7 + 1) % slots; /* distinct slots (i * 5 + 1 repeated slot 1 at i = 8:
                                                                two sequences updating one slot in place race) */
    idx[3] = -1;
    kda_args_t d = a;
    d.q = to_dev(s.q, s.q_bytes);
    d.k = to_dev(s.k, s.q_bytes);
    d.v = to_dev(s.v, s.v_bytes);
    d.g = to_dev(s.g, s.g_bytes);
    d.beta = to_dev(s.beta, s.beta_bytes);
    d.o = to_dev(s.o, s.o_bytes);
    d.A_log = (const float *)to_dev(a.A_log, sizeof(float) * (size_t)c.hv);
    d.dt_bias = (const float *)to_dev(a.dt_bias, sizeof(float) * (size_t)c.hv * c.k);
    void *dpool = to_dev(pool, pool_bytes);
    d.initial_state = d.final_state = dpool;
    d.state_indices = (const int32_t *)to_dev(idx, sizeof idx);
    d.num_state_slots = slots;
    size_t need = 1; /* the slot-ownership array (16 rows could name one slot): one int32 per slot, 256-aligned */
    CHECK(kda_decode_workspace_size(gpu(), &d, &need) == KDA_STATUS_SUCCESS && need > 0 && need <= (size_t)(512 + 4 * slots),
          "workspace %zu: %s", need, kda_last_error());
    void *ws = NULL;
    CUDA_OK(cudaMalloc(&ws, need));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    /* direct: two steps */
    CHECK(kda_decode(gpu(), &d, ws, need, st) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(kda_decode(gpu(), &d, ws, need, st) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CUDA_OK(cudaStreamSynchronize(st));
    void *o1 = malloc(s.o_bytes), *o2 = malloc(s.o_bytes);
    CUDA_OK(cudaMemcpy(p1, dpool, pool_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o1, d.o, s.o_bytes, cudaMemcpyDeviceToHost));
    /* graph: reset the pool, capture one step, replay twice */
    CUDA_OK(cudaMemcpy(dpool, pool, pool_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d.o, 0xff, s.o_bytes));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    kda_status_t cs = kda_decode(gpu(), &d, ws, need, st);
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    CHECK(cs == KDA_STATUS_SUCCESS, "capture: %s", kda_last_error());
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    CUDA_OK(cudaMemcpy(p2, dpool, pool_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o2, d.o, s.o_bytes, cudaMemcpyDeviceToHost));
    CHECK(memcmp(p1, p2, pool_bytes) == 0, "graph replays: pool differs from the direct calls");
    CHECK(memcmp(o1, o2, s.o_bytes) == 0, "graph replays: o differs from the direct calls");
    CHECK(memcmp(p1 + 3 * per, pool + 3 * per, sizeof(float) * (size_t)per) != 0 || idx[0] != 3,
          "sanity: slot 3 is not written");
    printf("case %-32s replay == direct: %s\n", "graph_capture", memcmp(p1, p2, pool_bytes) == 0 ? "yes" : "no");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    cudaFree((void *)d.q);
    cudaFree((void *)d.k);
    cudaFree((void *)d.v);
    cudaFree((void *)d.g);
    cudaFree((void *)d.beta);
    cudaFree(d.o);
    cudaFree((void *)d.A_log);
    cudaFree((void *)d.dt_bias);
    cudaFree(dpool);
    cudaFree(ws);
    cudaFree((void *)d.state_indices);
    free(pool);
    free(p1);
    free(p2);
    free(o1);
    free(o2);
    kda_synth_free(&s);
}

/* Duplicate slots in device-only state_indices (slots.cu, include/kda.h): of the rows naming one slot, the last
 * owns it and the others behave as if their entry were negative. Five sequences over a pool of 4 slots updated
 * in place, indices {1, 3, 1, 0, 1}: two runs give the same bytes (o and pool), and the same bytes as indices
 * {−1, 3, −1, 0, 1}. kda_decode with one token per sequence (the recurrent kernel), kda_forward with 100 tokens
 * (the chunked kernels), and the 2-D slots of speculative decoding: rows {1, 2}, {1, 3}, {2, 0} behave as
 * {−1, −1}, {1, 3}, {2, 0} (slot 1 belongs to row 1, slot 2 to row 2). */
static void dup_run(const kda_synth_config_t *c, const int32_t *idx, int64_t n_idx, int64_t cols, int forward,
                    void *pool_out, void *o_out, size_t *pool_bytes_out, size_t *o_bytes_out) {
    kda_synth_t s;
    kda_args_t a;
    if (kda_synth_make(c, &s, &a) != 0) exit(1);
    const int64_t slots = 4, per = (int64_t)c->hv * c->k * c->v;
    const size_t pool_bytes = sizeof(float) * (size_t)(slots * per);
    float *pool = (float *)malloc(pool_bytes);
    for (int64_t i = 0; i < slots * per; i++) pool[i] = 0.2f * sinf((float)i * 0.011f);
    kda_args_t d = a;
    d.q = to_dev(s.q, s.q_bytes);
    d.k = to_dev(s.k, s.q_bytes);
    d.v = to_dev(s.v, s.v_bytes);
    d.g = to_dev(s.g, s.g_bytes);
    d.beta = to_dev(s.beta, s.beta_bytes);
    d.o = to_dev(s.o, s.o_bytes);
    if (a.A_log) d.A_log = (const float *)to_dev(a.A_log, sizeof(float) * (size_t)c->hv);
    if (a.dt_bias) d.dt_bias = (const float *)to_dev(a.dt_bias, sizeof(float) * (size_t)c->hv * c->k);
    void *dpool = to_dev(pool, pool_bytes);
    d.initial_state = d.final_state = dpool;
    d.initial_state_dtype = d.final_state_dtype = KDA_FLOAT32;
    d.state_indices = (const int32_t *)to_dev(idx, sizeof(int32_t) * (size_t)n_idx);
    d.state_indices_cols = cols;
    d.num_state_slots = slots;
    size_t need = 0;
    kda_status_t st = forward ? kda_forward_workspace_size(gpu(), &d, &need) : kda_decode_workspace_size(gpu(), &d, &need);
    CHECK(st == KDA_STATUS_SUCCESS, "workspace: %s", kda_last_error());
    void *ws = NULL;
    if (need) CUDA_OK(cudaMalloc(&ws, need));
    st = forward ? kda_forward(gpu(), &d, ws, need, NULL) : kda_decode(gpu(), &d, ws, need, NULL);
    CHECK(st == KDA_STATUS_SUCCESS, "run: %s", kda_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(pool_out, dpool, pool_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o_out, d.o, s.o_bytes, cudaMemcpyDeviceToHost));
    *pool_bytes_out = pool_bytes;
    *o_bytes_out = s.o_bytes;
    cudaFree(ws);
    cudaFree(dpool);
    cudaFree((void *)d.q);
    cudaFree((void *)d.k);
    cudaFree((void *)d.v);
    cudaFree((void *)d.g);
    cudaFree((void *)d.beta);
    cudaFree(d.o);
    cudaFree((void *)d.A_log);
    cudaFree((void *)d.dt_bias);
    cudaFree((void *)d.state_indices);
    free(pool);
    kda_synth_free(&s);
}

static void dup_case(const char *name, const kda_synth_config_t *c, const int32_t *idx, const int32_t *ref, int64_t n_idx,
                     int64_t cols, int forward) {
    const size_t cap = (size_t)64 << 20;
    unsigned char *p1 = (unsigned char *)malloc(cap), *p2 = (unsigned char *)malloc(cap), *p3 = (unsigned char *)malloc(cap);
    unsigned char *o1 = (unsigned char *)malloc(cap), *o2 = (unsigned char *)malloc(cap), *o3 = (unsigned char *)malloc(cap);
    size_t pb = 0, ob = 0;
    dup_run(c, idx, n_idx, cols, forward, p1, o1, &pb, &ob);
    dup_run(c, idx, n_idx, cols, forward, p2, o2, &pb, &ob);
    dup_run(c, ref, n_idx, cols, forward, p3, o3, &pb, &ob);
    const int same = memcmp(p1, p2, pb) == 0 && memcmp(o1, o2, ob) == 0;
    const int rule = memcmp(p1, p3, pb) == 0 && memcmp(o1, o3, ob) == 0;
    printf("case %-28s two runs equal: %s; equal to the negative-entry run: %s\n", name, same ? "yes" : "no",
           rule ? "yes" : "no");
    CHECK(same, "%s: two runs with duplicate slots differ", name);
    CHECK(rule, "%s: duplicate slots do not behave as the documented negative entries", name);
    free(p1);
    free(p2);
    free(p3);
    free(o1);
    free(o2);
    free(o3);
}

TEST(gpu_duplicate_slots_deterministic) {
    (void)gpu();
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 5;
    c.seq_len = 1;
    c.hqk = 2;
    c.hv = 4;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.seed = 29;
    static const int32_t idx[5] = {1, 3, 1, 0, 1}, ref[5] = {-1, 3, -1, 0, 1};
    dup_case("decode_1d", &c, idx, ref, 5, 0, 0);
    c.seq_len = 100; /* the chunked kernels */
    dup_case("forward_1d_chunked", &c, idx, ref, 5, 0, 1);
    c.batch = 3;
    c.seq_len = 2; /* 2-D slots: the recurrent kernel */
    static const int32_t idx2[6] = {1, 2, 1, 3, 2, 0}, ref2[6] = {-1, -1, 1, 3, 2, 0};
    dup_case("decode_2d_spec", &c, idx2, ref2, 6, 2, 0);
}

/* GPU time of one decode step from C: N sequences, H32, K = V = 128, bf16 inputs, fp32 V-first pool in place,
 * in-kernel gate + l2norm + β sigmoid; cudaEvents around 1000 back-to-back calls and around 20 replays of a
 * graph of 50 captured calls. Returns the graph time per call in µs. */
static double time_decode(int64_t N, int v_first, int bf16, const char *label) {
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = N;
    c.seq_len = 1;
    c.hqk = c.hv = 32;
    c.gate = KDA_GATE_LOWER_BOUND;
    c.l2norm = c.beta_sigmoid = 1;
    c.state_v_first = v_first;
    c.initial_state_dtype = c.final_state_dtype = bf16 ? KDA_BFLOAT16 : KDA_FLOAT32;
    kda_synth_t s;
    kda_args_t a;
    if (kda_synth_make(&c, &s, &a) != 0) exit(1);
    const int64_t slots = 2 * N + 1, per = (int64_t)c.hv * c.k * c.v;
    const size_t es = bf16 ? 2 : 4;
    kda_args_t d = a;
    d.q = to_dev(s.q, s.q_bytes);
    d.k = to_dev(s.k, s.q_bytes);
    d.v = to_dev(s.v, s.v_bytes);
    d.g = to_dev(s.g, s.g_bytes);
    d.beta = to_dev(s.beta, s.beta_bytes);
    d.o = to_dev(s.o, s.o_bytes);
    d.A_log = (const float *)to_dev(a.A_log, sizeof(float) * (size_t)c.hv);
    d.dt_bias = (const float *)to_dev(a.dt_bias, sizeof(float) * (size_t)c.hv * c.k);
    void *dpool = NULL;
    CUDA_OK(cudaMalloc(&dpool, es * (size_t)(slots * per)));
    CUDA_OK(cudaMemset(dpool, 0, es * (size_t)(slots * per)));
    int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)N);
    for (int64_t n = 0; n < N; n++) idx[n] = (int32_t)(2 * n + 1);
    d.initial_state = d.final_state = dpool;
    d.state_indices = (const int32_t *)to_dev(idx, sizeof(int32_t) * (size_t)N);
    d.num_state_slots = slots;
    size_t need = 0; /* N > 1: the slot-ownership array */
    CHECK(kda_decode_workspace_size(gpu(), &d, &need) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    void *ws = NULL;
    if (need) CUDA_OK(cudaMalloc(&ws, need));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (int i = 0; i < 20; i++) CHECK(kda_decode(gpu(), &d, ws, need, st) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    const int calls = 1000;
    CUDA_OK(cudaEventRecord(e0, st));
    for (int i = 0; i < calls; i++) kda_decode(gpu(), &d, ws, need, st);
    CUDA_OK(cudaEventRecord(e1, st));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms_direct = 0.f;
    CUDA_OK(cudaEventElapsedTime(&ms_direct, e0, e1));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 50; i++) kda_decode(gpu(), &d, ws, need, st);
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaEventRecord(e0, st));
    for (int i = 0; i < 20; i++) CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaEventRecord(e1, st));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms_graph = 0.f;
    CUDA_OK(cudaEventElapsedTime(&ms_graph, e0, e1));
    const double us_direct = 1000.0 * ms_direct / calls, us_graph = 1000.0 * ms_graph / (20 * 50);
    const double bytes = 2.0 * (double)N * per * es;
    printf("timing%s N%lld H32 K=V=128 %s %s pool: %.2f us/call back to back, %.2f us/call in a graph "
           "(%.2f TB/s of state read + write)\n", label, (long long)N, bf16 ? "bf16" : "fp32",
           v_first ? "V-first" : "K-first", us_direct, us_graph, bytes / (us_graph * 1e-6) / 1e12);
    CUDA_OK(cudaMemcpy(s.o, d.o, s.o_bytes, cudaMemcpyDeviceToHost));
    CHECK(kda_count_nonfinite(s.o, c.o_dtype, s.num_tokens * c.hv * c.v) == 0, "timing run: o not finite");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(st);
    cudaFree((void *)d.q);
    cudaFree((void *)d.k);
    cudaFree((void *)d.v);
    cudaFree((void *)d.g);
    cudaFree((void *)d.beta);
    cudaFree(d.o);
    cudaFree((void *)d.A_log);
    cudaFree((void *)d.dt_bias);
    cudaFree(dpool);
    cudaFree(ws);
    cudaFree((void *)d.state_indices);
    free(idx);
    kda_synth_free(&s);
    return us_graph;
}

/* Issue 10's latency bar: N1 H32 at most 10 µs of GPU time per call. Also prints N32 / N256 for the record. */
TEST(gpu_decode_time_n1_h32) {
    (void)gpu();
    const double us = time_decode(1, 1, 0, "");
    time_decode(1, 0, 0, "");
    time_decode(32, 1, 0, "");
    time_decode(256, 1, 0, "");
    time_decode(256, 0, 0, "");
    CHECK(us <= 10.0, "N1 H32: %.2f us per call > 10 us", us);
}

/* The decode kernels' variants side by side in one process: the staged kernel, the
 * tile kernel with 8 and 16 chunks per thread, and the default choice; fp32 and bf16 pools, both layouts. */
TEST(gpu_decode_time_variants) {
    static const struct { int kernel; const char *label; } var[] = {
        {1, " [staged]"}, {3, " [tile 8]"}, {4, " [tile 16]"}, {0, " [default]"}};
    for (int r = 0; r < 2; r++)
        for (int bf = 0; bf < 2; bf++)
            for (int vf = 1; vf >= 0; vf--)
                for (unsigned i = 0; i < sizeof var / sizeof var[0]; i++) {
                    kda_tuning_t t = {0};
                    t.decode_kernel = var[i].kernel;
                    kda_set_tuning(gpu(), &t);
                    time_decode(r == 0 ? 256 : 32, vf, bf, var[i].label);
                }
    kda_set_tuning(gpu(), NULL);
}

#else
/* Built without CUDA: every case CTest names from this file is skipped. */
const char *kda_test_skip_missing = "libkda was built without CUDA (no nvcc when CMake configured it, or KDA_WITH_CUDA=OFF)";
#endif
