/* The CUDA decode kernel (src/cuda/decode.cu) emulated on the host against the fp64 oracle: kda_decode's
 * arguments as the GPU test builds them (tests/gpu/test_decode_cuda.c run_case), the kernel launched through
 * kda_cuda_decode_run with host pointers, o and the state pool compared; slots no sequence writes must come back
 * bit-identical.
 *   harness K V vfirst sdt mode T hqk hv gate poison headwise ctas accepted dtype varlen dup
 *   sdt: 0 fp32, 2 bf16 state; mode: 0 plain h0/ht, 1 1-D pool, 2 2-D pool (spec decoding, T_max = T + 1);
 *   gate: kda_gate_mode_t; poison: NaN in v of sequence 0's token 1; dtype: input dtype 0 f32 1 f16 2 bf16;
 *   varlen: lengths T, 1, 0, T, 2, … (an empty sequence); dup: sequence 3's slot = sequence 1's. */
#include "common.cuh"
#include "decode.h"
#include <cstdio>
#include <cstdlib>
extern "C" {
#include "synth.h"
#include "compare.h"
}
#include "cpu/dtype.h"
thread_local emu_dim threadIdx, blockIdx;
emu_dim gridDim;
pthread_barrier_t emu_warp_bar[EMU_WARPS];
uint64_t emu_x[EMU_WARPS][32];

/* slots.cu on the host: a slot belongs to the last row naming it */
extern "C" int kda_cuda_launch_claim(const kda_claim_params_t *p, void *) {
    if (!p->claim) return 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t e = 0; e < p->num_seqs * p->cols; e++) {
            const int64_t n = e / p->cols, c = e % p->cols, s = p->state_indices[n * p->stride + c];
            if (s < 0 || s >= p->num_state_slots) continue;
            if (pass == 0) p->claim[s] = -1;
            else if (p->claim[s] < n) p->claim[s] = (int32_t)n;
        }
    return 0;
}

int main(int argc, char **argv) {
    int ai = 1;
#define ARG(d) (argc > ai ? atoi(argv[ai++]) : (ai++, (d)))
    const int K = ARG(128), V = ARG(128), vf = ARG(1), sdt = ARG(0), mode = ARG(1), T = ARG(1);
    const int hqk = ARG(2), hv = ARG(4), gate = ARG(2), poison = ARG(0), headwise = ARG(0), ctas = ARG(0);
    const int accepted = ARG(1), dtype = ARG(2), varlen = ARG(0), dup = ARG(0);
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    static int64_t lens[5];
    const int64_t lens0[5] = {T, 1, 0, T, 2};
    memcpy(lens, lens0, sizeof lens);
    if (varlen) {
        c.num_seqs = 5;
        c.seqlens = lens;
        c.batch = 1;
    } else {
        c.batch = 4;
        c.seq_len = T;
    }
    c.hqk = hqk, c.hv = hv, c.k = K, c.v = V;
    c.initial_state = c.final_state = 1;
    c.gate = (kda_gate_mode_t)gate;
    c.l2norm = c.beta_sigmoid = 1;
    c.allow_neg_eigval = gate == 1;
    c.dtype = (kda_dtype_t)dtype;
    c.g_dtype = c.beta_dtype = KDA_FLOAT32;
    c.o_dtype = dtype == 0 ? KDA_FLOAT32 : KDA_BFLOAT16;
    c.initial_state_dtype = c.final_state_dtype = (kda_dtype_t)sdt;
    c.state_v_first = vf;
    c.seed = 11;
    kda_synth_t s;
    kda_args_t a;
    if (kda_synth_make(&c, &s, &a) != 0) return 1;
    const int64_t N = s.num_seqs, NT = s.num_tokens, per = (int64_t)hv * K * V;
    const size_t esz = kda_dtype_size((kda_dtype_t)sdt);
    std::vector<float> bh;
    if (headwise) {
        bh.resize(NT * hv * V + 1);
        for (int64_t i = 0; i < NT * hv * V; i++) bh[i] = 2.0f * sinf(i * 0.61f + 0.3f);
        a.beta = bh.data(), a.beta_dtype = KDA_FLOAT32, a.beta_headwise = 1;
    }
    if (poison) kda_store_f32(s.v, c.dtype, 1 * hv * V + 2, NAN);
    int64_t slots = 0, cols = 0;
    std::vector<int32_t> idx, nat;
    std::vector<unsigned char> pool, before, ref;
    if (mode) {
        cols = mode == 2 ? T + 1 : 0;
        const int64_t entries = mode == 2 ? N * cols : N;
        slots = entries + 5;
        while (slots % 7 == 0) slots++;
        idx.resize(entries + 1);
        for (int64_t i = 0; i < entries; i++) idx[i] = (int32_t)((i * 7 + 3) % slots);
        for (int64_t i = 0; i < entries; i += 5) idx[i] = -1;
        if (dup) idx[mode == 2 ? 3 * cols : 3] = idx[mode == 2 ? 1 * cols : 1];
        if (mode == 2 && accepted) {
            nat.resize(N + 1);
            for (int64_t n = 0; n < N; n++) nat[n] = (int32_t)(1 + (n * 3) % cols);
        }
        pool.resize(esz * slots * per);
        for (int64_t i = 0; i < slots * per; i++) kda_store_f32(pool.data(), (kda_dtype_t)sdt, i, 0.5f * sinf(i * 0.37f));
        if (poison > 1) kda_store_f32(pool.data(), (kda_dtype_t)sdt, (int64_t)idx[1] * per + 5, INFINITY);
        before = pool, ref = pool;
        a.initial_state = a.final_state = pool.data();
        a.final_state_dtype = (kda_dtype_t)sdt;
        a.state_indices = idx.data();
        a.num_state_slots = slots;
        a.state_indices_cols = cols;
        a.num_accepted_tokens = nat.empty() ? NULL : nat.data();
    }
    /* the emulated kernel */
    kda_problem_t pr;
    if (kda_check_args(NULL, &a, "kda_decode", 0, &pr) != KDA_STATUS_SUCCESS) {
        printf("check: %s\n", kda_last_error());
        return 1;
    }
    std::vector<int32_t> claim(kda_cuda_claim_bytes(&pr) / 4 + 1, 12345);
    if (kda_cuda_decode_run(&pr, 0, 132, ctas, kda_cuda_claim_bytes(&pr) ? claim.data() : NULL, NULL, "kda_decode")) {
        printf("run: %s\n", kda_last_error());
        return 1;
    }
    /* the oracle */
    std::vector<float> o_ref(NT * hv * V + 1), ht_ref(N * per + 1);
    kda_args_t r = a;
    r.o = o_ref.data();
    r.o_dtype = KDA_FLOAT32;
    if (mode) r.initial_state = r.final_state = ref.data();
    else r.final_state = ht_ref.data(), r.final_state_dtype = KDA_FLOAT32;
    std::vector<int32_t> idx_ref = idx;
    if (dup) { /* the oracle reads the claimed meaning: the earlier row's entry counts as negative (slots.cu) */
        idx_ref[mode == 2 ? 1 * cols : 1] = -1;
        r.state_indices = idx_ref.data();
    }
    if (kda_run_host(kda_test_reference(), &r, KDA_ALGO_DECODE) != KDA_STATUS_SUCCESS) {
        printf("oracle: %s\n", kda_last_error());
        return 1;
    }
    const int64_t oe = NT * hv * V;
    int64_t mismatch = 0, o_nan = 0;
    for (int64_t i = 0; i < oe; i++) {
        o_nan += std::isnan(o_ref[i]);
        const float x = kda_load_f32(s.o, c.o_dtype, i);
        mismatch += std::isnan(x) != std::isnan(o_ref[i]);
        if (std::isnan(o_ref[i])) o_ref[i] = 0.f, kda_store_f32(s.o, c.o_dtype, i, 0.f);
    }
    const double eo = kda_rel_err(s.o, c.o_dtype, o_ref.data(), KDA_FLOAT32, oe);
    double es = 0;
    int64_t untouched_changed = 0, written = 0, nan_slots = 0;
    if (mode) {
        for (int64_t sl = 0; sl < slots; sl++) {
            const unsigned char *g = pool.data() + sl * per * esz, *rr = ref.data() + sl * per * esz;
            int w = 0;
            for (int64_t n = 0; n < N; n++) {
                const int64_t len = s.cu_seqlens ? s.cu_seqlens[n + 1] - s.cu_seqlens[n] : c.seq_len;
                if (cols == 0) w |= idx[n] == sl;
                else for (int64_t t = 0; t < len && t < cols; t++) w |= idx[n * cols + t] == sl;
            }
            if (!w) {
                untouched_changed += memcmp(g, before.data() + sl * per * esz, per * esz) != 0;
                continue;
            }
            written++;
            std::vector<float> a1(per), b1(per);
            for (int64_t i = 0; i < per; i++) {
                a1[i] = kda_load_f32(g, (kda_dtype_t)sdt, i), b1[i] = kda_load_f32(rr, (kda_dtype_t)sdt, i);
                if (std::isnan(a1[i]) != std::isnan(b1[i])) mismatch++;
                if (std::isnan(b1[i])) a1[i] = b1[i] = 0.f;
            }
            nan_slots += std::isnan(kda_load_f32(rr, (kda_dtype_t)sdt, 5));
            const double e = kda_rel_err(a1.data(), KDA_FLOAT32, b1.data(), KDA_FLOAT32, per);
            es = e > es ? e : es;
        }
    } else {
        es = kda_rel_err(s.ht, c.final_state_dtype, ht_ref.data(), KDA_FLOAT32, N * per);
    }
    const double tol = sdt == 0 && dtype == 0 ? 5e-6 : 1e-2;
    const int ok = eo <= tol && es <= tol && mismatch == 0 && untouched_changed == 0;
    printf("o_nan %lld o_err %.3e state_err %.3e nan_mismatch %lld untouched_changed %lld written %lld nan_slots %lld %s\n", (long long)o_nan, eo, es,
           (long long)mismatch, (long long)untouched_changed, (long long)written, (long long)nan_slots, ok ? "OK" : "FAIL");
    kda_synth_free(&s);
    return ok ? 0 : 1;
}
