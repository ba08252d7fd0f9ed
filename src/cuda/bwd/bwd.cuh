/*
 * Device helpers shared by the backward's kernels (bwd_*.cu): an element of a state tensor, the tf32 products
 * (with the 3-product form of the diagonal blocks), a warp's sum, an L2 prefetch, the decay factors and the gate.
 */
#ifndef KDA_CUDA_BWD_CUH
#define KDA_CUDA_BWD_CUH

#include "bwd.h"
#include "common.cuh"

/* Element (d, c) of head h's state in slot `slot` of a [slots][hv][K][V] (V-first: [V][K]) tensor */
DEV int64_t state_elem(const kda_bwd_params_t &p, int64_t slot, int h, int d, int c) {
    const int64_t base = (slot * p.pb.hv + h) * (int64_t)p.pb.K * p.pb.V;
    return base + (p.pb.v_first ? (int64_t)c * p.pb.K + d : (int64_t)d * p.pb.V + c);
}

/* ∂L/∂S at the end of sequence n, element (d, c) of head h (0 past K or V): cross-rank CP's fold for the last
 * sequence where set, else d_final_state at the sequence's slot */
DEV float dstate_end(const kda_bwd_params_t &p, int64_t n, int64_t slot, int h, int d, int c) {
    if (d >= p.pb.K || c >= p.pb.V) return 0.0f;
    if (p.dht_last && n == p.pb.seqs.num_seqs - 1) return p.dht_last[((int64_t)h * p.pb.K + d) * p.pb.V + c];
    return p.dht && slot >= 0 ? load_elem(p.dht, p.dht_dtype, state_elem(p, slot, h, d, c)) : 0.0f;
}

/* tf32 tensor-core products of the backward (bwd_chunk.cuh, bwd_dstate.cuh): a k-step of 16 is two m16n8k8 tf32
 * products; a lane feeds its k pair (2t, 2t + 1) into the slots t and t + 4 of one of them (the sum over k does
 * not depend on the order), so that its fragments are read as in the bf16 m16n8k16 layout: A rows g, g + 8 at
 * k 2t, 2t + 1 (and + 8), B column g (lane = 4g + t). */
typedef float2 frag_t; /* a lane's k pair of one operand row/column, tf32 */
DEV frag_t tf2(float lo, float hi) { return make_float2(to_tf32(lo), to_tf32(hi)); }
/* c += A B over a k-step of 16: a[0..3] = A(g, 2t..), A(g + 8, 2t..), A(g, 2t + 8..), A(g + 8, 2t + 8..);
 * b0 = B(2t.., g), b1 = B(2t + 8.., g) */
DEV void mma16(float c[4], const frag_t a[4], frag_t b0, frag_t b1) {
    mma_tf32(c, a[0].x, a[1].x, a[0].y, a[1].y, b0.x, b0.y);
    mma_tf32(c, a[2].x, a[3].x, a[2].y, a[3].y, b1.x, b1.y);
}

/* A hint that the line at p will be read soon: into L2 (no-op in a host emulation) */
DEV void l2_prefetch(const void *p) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;
#endif
}

/* Σ over the warp's 32 lanes, the same order on every lane */
DEV float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* e^x for the decay factors (x ≤ 0: differences of cumulative log decays), with the SFU: relative error below
 * ~1e-6 wherever the result is above 1e-30, and flushed to 0 below 2^-126 (ex2.approx.ftz: one FMUL and the
 * MUFU; __expf's denormal handling added a compare and two predicated FMULs to every factor) */
DEV float gexp(float x) { return ex2(x * LOG2E); }

/* The gate's form as one number, so that a kernel can branch once around a loop instead of per element */
#define GATE_NONE 0     /* ĝ = g */
#define GATE_LOWER 1    /* ĝ = lower_bound · σ(A (g + dt_bias)) */
#define GATE_SOFTPLUS 2 /* ĝ = −A softplus(g + dt_bias) */
DEV int gate_mode(const kda_bwd_params_t &p) {
    return !p.pb.gate_in_kernel ? GATE_NONE : p.pb.lower_bound != 0.0f ? GATE_LOWER : GATE_SOFTPLUS;
}

/* ĝ from the gate input x = g (+ dt_bias), clamped to [KDA_GATE_MIN, 0] (NaN → the minimum), for gate form MODE.
 * The gate's and β's functions are the forward's, by the SFU (common.cuh; ~1e-7 relative against gradient errors
 * of ~1e-3: libm's expf, log1pf and divisions were ~9 % of the chunk kernel's stall samples, with the gate
 * backward's code) */
template <int MODE>
DEV float gate_clamped(float lower_bound, float A, float x) {
    float y = MODE == GATE_NONE ? x : MODE == GATE_LOWER ? lower_bound * sigmoidf_(A * x) : -A * softplusf_(x);
    y = y > KDA_GATE_MIN ? y : KDA_GATE_MIN;
    return y < 0.0f ? y : 0.0f;
}

/* The gate's backward for one element, form MODE: dĝ → ∂L/∂x (returned), with its ∂L/∂A_log term added to *dAl
 * (none without a gate in the kernel); zero where the clamp held ĝ (NaN stays NaN) */
template <int MODE>
DEV float gate_backward(float lower_bound, float A, float x, float dgh, float *dAl) {
    if (MODE == GATE_NONE) return dgh * (x <= 0.0f && x >= KDA_GATE_MIN ? 1.0f : 0.0f);
    if (MODE == GATE_LOWER) {
        const float sg = sigmoidf_(A * x), lam = lower_bound * sg, ds = lower_bound * sg * (1.0f - sg) * A;
        const float gi = dgh * (lam <= 0.0f && lam >= KDA_GATE_MIN ? 1.0f : 0.0f);
        *dAl += gi * ds * x;
        return gi * ds;
    }
    const float sp = softplusf_(x), lam = -A * sp;
    const float gi = dgh * (lam <= 0.0f && lam >= KDA_GATE_MIN ? 1.0f : 0.0f);
    *dAl += -gi * A * sp;
    return gi * (-A * sigmoidf_(x));
}

template <int NT>
DEV void zero_acc(float (*acc)[4]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
}

/* The diagonal blocks of the pair products hold their largest terms (e^{G_i − G_j} near 1), and dĝ sums them
 * with cancellation: there each operand x is split into tf32 parts hi + lo (lo = x − hi, rounded), and
 * A B ≈ Ah Bh + Ah Bl + Al Bh (3 products, ~fp32 accurate). In the emulation, tf32 there left dg, dA_log,
 * ddt_bias 5-40x less accurate than fp32 diagonal blocks (ddt_bias 9.8e-3 against 2.5e-4 at K = V = 128). */
DEV void split2(frag_t x, frag_t *hi, frag_t *lo) {
    split_tf32(x.x, &hi->x, &lo->x);
    split_tf32(x.y, &hi->y, &lo->y);
}
/* c += A B, A given as parts (ah, al), B unrounded (b0, b1); the 3-product form when x3, else Ah B */
DEV void mma16_x3(float c[4], const frag_t ah[4], const frag_t al[4], frag_t b0, frag_t b1, int x3) {
    frag_t bh0, bl0, bh1, bl1;
    split2(b0, &bh0, &bl0);
    split2(b1, &bh1, &bl1);
    if (x3) {
        mma16(c, al, bh0, bh1);
        mma16(c, ah, bl0, bl1);
    }
    mma16(c, ah, bh0, bh1);
}

/* The reference rows of 16-row block B for the split e^{G_i − G_j} = e^{G_i − R} e^{R − G_j} of the NC channels
 * of G (row stride LD): its middle row when the block's exponents stay within ±KDA_DIAG_RANGE (every factor of
 * the block's pairs then ≤ e^{KDA_DIAG_RANGE}, those with earlier or later blocks ≤ 1); otherwise the diagonal
 * block's pairs take one exponential each and the others are split around the block's first row (pairs with
 * earlier tokens) or last row (with later ones), every factor ≤ 1. Each channel's factors are its own, so a
 * kernel that holds some of the channels decides for those. Warp-uniform. */
template <int LD, int NC>
DEV int block_split(const float *G, int B, int lane) {
    const float *Gf = G + (16 * B) * LD, *Gm = G + (16 * B + 7) * LD, *Gl = G + (16 * B + 15) * LD;
    float range = 0.0f;
    for (int d = lane; d < NC; d += 32) range = fmaxf(range, fmaxf(Gf[d] - Gm[d], Gm[d] - Gl[d]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) range = fmaxf(range, __shfl_xor_sync(0xffffffffu, range, o));
    return range <= KDA_DIAG_RANGE; /* NaN: not split */
}

/* The bits of src[base + r · stride] (dtype), r < N, without conversion (load_bits); 0 for r ≥ valid. The dtype
 * test once, outside the loads (per element it was a compare and a branch between every two loads). */
template <int N>
DEV void load_bits_n(uint32_t (&b)[N], const void *src, int dtype, int64_t base, int64_t stride, int valid) {
    if (dtype == KDA_DT_F32) {
        const uint32_t *s = (const uint32_t *)src + base;
#pragma unroll
        for (int r = 0; r < N; r++) b[r] = r < valid ? s[r * stride] : 0u;
    } else {
        const uint16_t *s = (const uint16_t *)src + base;
#pragma unroll
        for (int r = 0; r < N; r++) b[r] = r < valid ? (uint32_t)s[r * stride] : 0u;
    }
}

#endif /* KDA_CUDA_BWD_CUH */
