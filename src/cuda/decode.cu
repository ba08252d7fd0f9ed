/*
 * CUDA recurrent decode (kda_decode for few tokens per sequence): the token recurrence of docs/ALGORITHM.md §1
 * with the state in fp32 registers and fp32 arithmetic. Per token t of a (sequence n, value head h), on a
 * tile of BV value columns of the K×V state, with the inputs of §2:
 *
 *     q̂ = s · q_t / ‖q_t‖,  k̂ = k_t / ‖k_t‖       (l2norm optional; ‖x‖ = sqrt(Σx² + 1e−6))
 *     g = clamp(gate(g_t), KDA_GATE_MIN, 0),  α = exp(g)   (gate of §2; the clamp keeps NaN)
 *     β = β_t, sigmoid(β_t) or 2 sigmoid(β_t)      (a scalar, or a V-vector with beta_headwise)
 *     S ← Diag(α) S
 *     d = Sᵀ k̂                                     (a reduction over K for each column j)
 *     δ = β ⊙ (v_t − d)
 *     S ← S + k̂ δᵀ
 *     o_t = Sᵀ q̂                                   (a second reduction over K)
 *
 * Decode is a stream over the states: each tile is read once and written once, at a few flops per byte. The
 * second version (persistent CTAs, a ring of shared-memory stages filled by bulk copies, one barrier per
 * token) was bound by its per-tile latency chain at 12 warps per SM: its bf16 states took as long as fp32
 * (docs/PERF.md "Decode kernel, third version"). This one is FLA's parallelism written our way: many small
 * independent tiles, no shared memory, no barriers, so the SM's resident warps keep the bytes in flight.
 *   - One WARP per tile of K × BV state (DEC_TILE = 1024 elements: BV = 1024 / KC = 16, 8, 4 columns for the
 *     K class KC = 64, 128, 256; 32 fp32 registers per lane); CTAs of 4 independent warps, at most 96
 *     registers per thread (__launch_bounds__(128, 5): 20 warps per SM, 80 KB of fp32 tiles in flight per SM;
 *     KC = 256: 4 CTAs, 128 registers, 16 warps). At 64 registers (32 warps) every instance spilled.
 *   - Item i = (sequence, value head, tile), tile fastest, is warp i of the grid (grid-stride when the grid is
 *     bounded by kda_tuning_t.decode_ctas).
 *   - A warp issues all of its tile's loads and the first token's input loads before it uses any of them;
 *     later tokens' inputs are loaded at the top of their token (the other warps of the SM hide that latency).
 *   - Exact instances (EX: K = KC, V a multiple of BV, aligned rows, both states of the instance's dtype) use
 *     vector loads and stores without masks; the general instance works element by element with masks.
 *
 * Lane layout (lane l; R = KC / 32 rows per lane, the same for both state layouts): lane l owns rows
 * i = R·l .. R·l + R − 1 and all BV columns of the tile, S[r][c] = S_{R·l+r, j0+c}.
 *   V-first ([V, K] rows, K contiguous): per column a vector of the lane's R rows (16 bytes fp32 at R = 4);
 *   K-first ([K, V] rows, V contiguous): per row a vector of the tile's BV columns.
 * The inputs q, k, g (and dt_bias) of the lane's rows are one vector load each; Σx² of the l2norm is a lane sum
 * and 5 xor shuffles. The reductions over K (d and o) are a transposed butterfly (col_reduce): log2(BV) halving
 * steps (BV/2 + BV/4 + … shuffles) leave each lane one column's partial sum, 5 − log2(BV) more shuffles finish
 * it; lane l then holds column c(l) = l / (32 / BV) (7 + 2 shuffles for BV = 8 instead of 40). δ is computed
 * by the lanes of its column and broadcast (BV shuffles); o_j is stored by the first lane of column j.
 *
 * State slots: the tile is read from slot r_n (1-D state_indices[n]; 2-D state_indices[n][a_n − 1] with a_n
 * = num_accepted_tokens[n] clamped into [1, T_max]; none: n), or zeros when r_n is negative or outside the
 * pool; it is written after the last token to r_n (1-D, none), or after every token t to state_indices[n][t]
 * (2-D; nothing for a negative or out-of-pool entry, nothing for tokens past T_max; an empty sequence reads and
 * writes nothing). A slot that a later row also names counts as negative (the claim array of slots.cu). Device
 * contents are never validated here (that needs a host sync): the clamps above are all the kernel does with
 * bad indices.
 *
 * Non-finite contract (ALGORITHM.md §7): a token whose q, k, v (all V of them), β (all V of them, after the
 * sigmoid) or gate (after the clamp) has a non-finite value turns the tile into NaN before that token, so o_t,
 * later outputs and the state are NaN (every tile of the head checks the same whole rows); earlier outputs are
 * unchanged. A non-finite value in column j of the initial state makes column j NaN from the first token
 * (value channel j of o and of the state; the recurrence never mixes columns).
 */
#include <string.h>

#include "common.cuh"
#include "decode.h"

#define DEC_THREADS 128
#define DEC_WARPS (DEC_THREADS / 32)
#define DEC_TILE 1024 /* state elements per tile: 32 per lane */
#define FULL 0xffffffffu
#ifndef DEC_MIN_CTAS /* a build-time experiment only (-DDEC_MIN_CTAS=6: 80 registers, 24 warps per SM); no result */
#define DEC_MIN_CTAS 5 /* depends on it */
#endif

template <int KC>
struct dec_geom {
    static constexpr int R = KC / 32;          /* rows per lane */
    static constexpr int BV = DEC_TILE / KC;   /* columns per tile */
    static constexpr int LPC = 32 / BV;        /* lanes per column after a col_reduce */
    /* CTAs per SM the register budget must allow (__launch_bounds__): 5 (96 registers, 20 warps per SM); 4 for
     * KC = 256, whose 8 rows of q, k, g per lane are in flight beside the tile */
    static constexpr int MIN_CTAS = KC == 256 ? 4 : DEC_MIN_CTAS;
    static_assert(KC % 32 == 0 && DEC_TILE % KC == 0 && BV >= 2, "decode tile geometry");
};

struct dec_item {
    int64_t n, bos, eos, rslot;
    int h, vt, valid; /* valid: an item of this launch that reads or writes anything */
};

DEV int finite_f(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

/* ---------------------------------------------------------------------------------------------------------
 * Vectors of N consecutive elements (N a power of two): fp32 as float4 / float2, 16-bit as uint4 / uint2 /
 * uint32 (bf16, or fp16 with F16). The state's go through the streaming path (__ldcs / __stcs).
 * ------------------------------------------------------------------------------------------------------- */
template <int N>
DEV void ld_f32(const float *p, float *x) {
    if (N >= 4) {
#pragma unroll
        for (int u = 0; u < N / 4; u++) {
            const float4 y = __ldcs((const float4 *)p + u);
            x[4 * u] = y.x, x[4 * u + 1] = y.y, x[4 * u + 2] = y.z, x[4 * u + 3] = y.w;
        }
    } else if (N == 2) {
        const float2 y = __ldcs((const float2 *)p);
        x[0] = y.x, x[1] = y.y;
    } else {
        x[0] = __ldcs(p);
    }
}

template <int N>
DEV void ld_16(const uint16_t *p, int f16, float *x) {
    uint32_t w[N >= 2 ? N / 2 : 1];
    if (N >= 8) {
#pragma unroll
        for (int u = 0; u < N / 8; u++) {
            const uint4 y = __ldcs((const uint4 *)p + u);
            w[4 * u] = y.x, w[4 * u + 1] = y.y, w[4 * u + 2] = y.z, w[4 * u + 3] = y.w;
        }
    } else if (N == 4) {
        const uint2 y = __ldcs((const uint2 *)p);
        w[0] = y.x, w[1] = y.y;
    } else if (N == 2) {
        w[0] = __ldcs((const unsigned int *)p);
    } else {
        w[0] = __ldcs((const unsigned short *)p);
    }
#pragma unroll
    for (int u = 0; u < (N >= 2 ? N / 2 : 1); u++) {
        const float2 y = f16 ? unpack_16x2<1>(w[u]) : unpack_16x2<0>(w[u]);
        x[2 * u] = y.x;
        if (N >= 2) x[2 * u + 1] = y.y;
    }
}

template <int N>
DEV void st_f32(float *p, const float *x) {
    if (N >= 4) {
#pragma unroll
        for (int u = 0; u < N / 4; u++)
            __stcs((float4 *)p + u, make_float4(x[4 * u], x[4 * u + 1], x[4 * u + 2], x[4 * u + 3]));
    } else if (N == 2) {
        __stcs((float2 *)p, make_float2(x[0], x[1]));
    } else {
        __stcs(p, x[0]);
    }
}

template <int N>
DEV void st_bf16(uint16_t *p, const float *x) {
    if (N >= 8) {
#pragma unroll
        for (int u = 0; u < N / 8; u++)
            __stcs((uint4 *)p + u, make_uint4(pack_bf16(x[8 * u], x[8 * u + 1]), pack_bf16(x[8 * u + 2], x[8 * u + 3]),
                                              pack_bf16(x[8 * u + 4], x[8 * u + 5]),
                                              pack_bf16(x[8 * u + 6], x[8 * u + 7])));
    } else if (N == 4) {
        __stcs((uint2 *)p, make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3])));
    } else {
        __stcs((unsigned int *)p, pack_bf16(x[0], x[1]));
    }
}

/* N consecutive input elements at element `off` of a tensor of runtime dtype; `nv` of them exist (the rest are
 * zero). One vector load when `vec` (the offset is then a multiple of N) and all exist. */
template <int N>
DEV void ld_row(const void *base, int dt, int64_t off, int nv, int vec, float *x) {
    if (vec && nv >= N) {
        if (dt == KDA_DT_F32) ld_f32<N>((const float *)base + off, x);
        else ld_16<N>((const uint16_t *)base + off, dt == KDA_DT_F16, x);
        return;
    }
#pragma unroll
    for (int u = 0; u < N; u++) x[u] = u < nv ? load_elem(base, dt, off + u) : 0.f;
}

/* ---------------------------------------------------------------------------------------------------------
 * Warp reductions
 * ------------------------------------------------------------------------------------------------------- */
DEV float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    return x;
}

/* Column sums of a warp's partial sums x[0..BV) (each lane: its rows' part of every column), transposed: at the
 * halving step over lane bit o, the lane with bit o set keeps the upper half of its columns and sends the lower
 * half to its partner, which does the opposite; after log2(BV) steps each lane holds one column's sum over 32 /
 * BV lanes, which 5 − log2(BV) xor shuffles complete. Returns the sum of column c(lane) = lane / (32 / BV);
 * x is clobbered. */
template <int BV>
DEV float col_reduce(float *x, int lane) {
    int o = 16;
#pragma unroll
    for (int n = BV; n > 1; n >>= 1, o >>= 1) {
        const int up = lane & o;
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            const float send = up ? x[i] : x[i + n / 2], keep = up ? x[i + n / 2] : x[i];
            x[i] = keep + __shfl_xor_sync(FULL, send, o);
        }
    }
#pragma unroll
    for (; o >= 1; o >>= 1) x[0] += __shfl_xor_sync(FULL, x[0], o);
    return x[0];
}

/* ---------------------------------------------------------------------------------------------------------
 * Items: (sequence, value head, tile), tile fastest.
 * ------------------------------------------------------------------------------------------------------- */
DEV int64_t dec_read_slot(const kda_decode_params_t &p, int64_t n) {
    if (!p.state_indices) return n;
    int64_t s;
    if (p.idx_cols == 0) {
        s = p.state_indices[n];
    } else {
        int64_t col = p.num_accepted ? (int64_t)p.num_accepted[n] - 1 : 0;
        col = col < 0 ? 0 : (col >= p.idx_cols ? p.idx_cols - 1 : col);
        s = p.state_indices[n * p.idx_stride + col];
    }
    if (s < 0 || s >= p.num_state_slots) return -1;
    return p.claim && p.claim[s] != (int32_t)n ? -1 : s; /* a later row names it too: slots.cu */
}

DEV int64_t dec_token_slot(const kda_decode_params_t &p, int64_t n, int64_t t) {
    if (t >= p.idx_cols) return -1;
    const int64_t s = p.state_indices[n * p.idx_stride + t];
    if (s < 0 || s >= p.num_state_slots) return -1;
    return p.claim && p.claim[s] != (int32_t)n ? -1 : s;
}

DEV dec_item make_item(const kda_decode_params_t &p, int64_t it, int ntiles) {
    dec_item d;
    d.valid = 0;
    d.n = d.bos = d.eos = 0;
    d.rslot = -1;
    d.h = d.vt = 0;
    const int64_t nitems = p.num_seqs * p.hv * ntiles;
    if (nitems < ((int64_t)1 << 31)) { /* 32-bit division: a few instructions instead of a 64-bit routine */
        const uint32_t i32 = (uint32_t)it, r = i32 / (uint32_t)ntiles, hv = (uint32_t)p.hv;
        d.vt = (int)(i32 - r * (uint32_t)ntiles);
        d.n = r / hv;
        d.h = (int)(r - (uint32_t)d.n * hv);
    } else {
        d.vt = (int)(it % ntiles);
        d.h = (int)((it / ntiles) % p.hv);
        d.n = it / ((int64_t)ntiles * p.hv);
    }
    if (!p.cu_seqlens) {
        d.bos = d.n * p.seq_len;
        d.eos = d.bos + p.seq_len;
    } else {
        int64_t a0 = p.cu_seqlens_64 ? ((const int64_t *)p.cu_seqlens)[d.n] : ((const int32_t *)p.cu_seqlens)[d.n];
        int64_t a1 = p.cu_seqlens_64 ? ((const int64_t *)p.cu_seqlens)[d.n + 1]
                                     : ((const int32_t *)p.cu_seqlens)[d.n + 1];
        a0 = a0 < 0 ? 0 : (a0 > p.num_tokens ? p.num_tokens : a0);
        a1 = a1 < a0 ? a0 : (a1 > p.num_tokens ? p.num_tokens : a1);
        d.bos = a0;
        d.eos = a1;
    }
    /* 2-D slots: nothing is read or written for an empty sequence */
    if (p.state_indices && p.idx_cols > 0 && d.eos == d.bos) return d;
    d.valid = 1;
    d.rslot = dec_read_slot(p, d.n);
    return d;
}

/* ---------------------------------------------------------------------------------------------------------
 * The state tile in registers: S[r][c] = S_{R·lane + r, j0 + c} of the head's K × V block
 * ------------------------------------------------------------------------------------------------------- */
/* Load the tile of the head block at element `base` (none: zeros). EX: the initial state's dtype is the
 * instance's (SF32: fp32, else bf16), K = KC, V a multiple of BV, aligned rows: vector loads, no masks. */
template <int VF, int KC, int SF32, int EX>
DEV void load_state(const kda_decode_params_t &p, int has, int64_t base, int j0, int lane, float (*S)[DEC_TILE / KC]) {
    typedef dec_geom<KC> G;
    constexpr int R = G::R, BV = G::BV;
    const int K = EX ? KC : p.kd, V = p.vd, i0 = R * lane;
    if (!has) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < BV; c++) S[r][c] = 0.f;
        return;
    }
    if (EX) {
        if (VF) {
#pragma unroll
            for (int c = 0; c < BV; c++) {
                float x[R];
                const int64_t off = base + (int64_t)(j0 + c) * KC + i0;
                if (SF32) ld_f32<R>((const float *)p.h0 + off, x);
                else ld_16<R>((const uint16_t *)p.h0 + off, 0, x);
#pragma unroll
                for (int r = 0; r < R; r++) S[r][c] = x[r];
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int64_t off = base + (int64_t)(i0 + r) * V + j0;
                if (SF32) ld_f32<BV>((const float *)p.h0 + off, S[r]);
                else ld_16<BV>((const uint16_t *)p.h0 + off, 0, S[r]);
            }
        }
    } else { /* 32-bit offsets from the head block's address */
        const void *hb = (const char *)p.h0 + base * (p.h0_dtype == KDA_DT_F32 ? 4 : 2);
        int o0 = VF ? j0 * K + i0 : i0 * V + j0, ri = VF ? 1 : V, ci = VF ? K : 1;
        asm volatile("" : "+r"(o0), "+r"(ri), "+r"(ci)); /* offsets from here: not hoisted as 32 invariants */
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < BV; c++) {
                const int i = i0 + r, j = j0 + c;
                S[r][c] = i < K && j < V ? load_elem(hb, p.h0_dtype, o0 + r * ri + c * ci) : 0.f;
            }
    }
}

/* Store the tile to the head block at element `base` of the final state (EX: of the instance's dtype). */
template <int VF, int KC, int SF32, int EX>
DEV void store_state(const kda_decode_params_t &p, int64_t base, int j0, int lane, float (*S)[DEC_TILE / KC]) {
    typedef dec_geom<KC> G;
    constexpr int R = G::R, BV = G::BV;
    const int K = EX ? KC : p.kd, V = p.vd, i0 = R * lane;
    if (EX) {
        if (VF) {
#pragma unroll
            for (int c = 0; c < BV; c++) {
                float x[R];
#pragma unroll
                for (int r = 0; r < R; r++) x[r] = S[r][c];
                const int64_t off = base + (int64_t)(j0 + c) * KC + i0;
                if (SF32) st_f32<R>((float *)p.ht + off, x);
                else st_bf16<R>((uint16_t *)p.ht + off, x);
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int64_t off = base + (int64_t)(i0 + r) * V + j0;
                if (SF32) st_f32<BV>((float *)p.ht + off, S[r]);
                else st_bf16<BV>((uint16_t *)p.ht + off, S[r]);
            }
        }
    } else {
        void *hb = (char *)p.ht + base * (p.ht_dtype == KDA_DT_F32 ? 4 : 2);
        int o0 = VF ? j0 * K + i0 : i0 * V + j0, ri = VF ? 1 : V, ci = VF ? K : 1;
        asm volatile("" : "+r"(o0), "+r"(ri), "+r"(ci)); /* offsets from here: not hoisted as 32 invariants */
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < BV; c++) {
                const int i = i0 + r, j = j0 + c;
                if (i < K && j < V) store_elem(hb, p.ht_dtype, o0 + r * ri + c * ci, S[r][c]);
            }
    }
}

/* A non-finite element in column c of the initial state makes the column NaN (§7.3). x·0 is NaN exactly when
 * x is ±∞ or NaN: one FMA per element and a vote per column. */
template <int KC>
DEV void poison_columns(float (*S)[DEC_TILE / KC]) {
    typedef dec_geom<KC> G;
#pragma unroll
    for (int c = 0; c < G::BV; c++) {
        float z = 0.f;
#pragma unroll
        for (int r = 0; r < G::R; r++) z = fmaf(S[r][c], 0.f, z);
        if (__any_sync(FULL, z != z)) {
#pragma unroll
            for (int r = 0; r < G::R; r++) S[r][c] = NAN;
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * A token's inputs, as the lane needs them: q, k, g of its R rows (raw), v and β of its column c(lane), and
 * whether any element of the token's v / headwise β rows is non-finite (bad, this lane's share).
 * ------------------------------------------------------------------------------------------------------- */
template <int KC>
struct dec_tok {
    float q[KC / 32], k[KC / 32], g[KC / 32]; /* g: + dt_bias with the in-kernel gate */
    float v, b, A;                            /* A = e^{A_log[h]} (in-kernel gate) */
    int bad;
};

/* Issue the loads of token t (the values are used only in token_step, so they stay in flight meanwhile). */
template <int KC, int EX>
DEV void load_token(const kda_decode_params_t &p, const dec_item &d, int64_t t, int j0, int lane, int vec_in,
                    dec_tok<KC> &x) {
    typedef dec_geom<KC> G;
    constexpr int R = G::R;
    const int K = EX ? KC : p.kd, V = p.vd, i0 = R * lane, nv = K - i0;
    const int hq = d.h / p.group;
    ld_row<R>(p.q, p.dtype, (t * p.hqk + hq) * K + i0, nv, vec_in, x.q);
    ld_row<R>(p.k, p.dtype, (t * p.hqk + hq) * K + i0, nv, vec_in, x.k);
    ld_row<R>(p.g, p.g_dtype, (t * p.hv + d.h) * K + i0, nv, vec_in, x.g);
    x.A = 1.f;
    if (p.gate_in_kernel) { /* reloaded per token (cache hits): fewer registers live across tokens */
        if (p.A_log) x.A = expf(p.A_log[d.h]);
        if (p.dt_bias) {
            float bias[R];
            ld_row<R>(p.dt_bias, KDA_DT_F32, (int64_t)d.h * K + i0, nv, vec_in, bias);
#pragma unroll
            for (int r = 0; r < R; r++) x.g[r] += bias[r];
        }
    }
    const int j = j0 + lane / G::LPC, jj = EX || j < V ? j : 0;
    const int64_t vrow = (t * p.hv + d.h) * V;
    x.v = load_elem(p.v, p.dtype, vrow + jj);
    x.b = load_elem(p.beta, p.beta_dtype, p.beta_headwise ? vrow + jj : t * p.hv + d.h);
    /* the whole v (and headwise β) row: a token with a non-finite element poisons every tile of the head; x·0
     * is NaN exactly for ±∞ and NaN (4 loads in flight at a time: registers) */
    float z = 0.f;
#pragma unroll 4
    for (int u = 0; u < KDA_MAX_HEAD_DIM / 32; u++) {
        const int e = lane + 32 * u;
        if (e < V) z = fmaf(load_elem(p.v, p.dtype, vrow + e), 0.f, z);
    }
    if (p.beta_headwise) {
#pragma unroll 4
        for (int u = 0; u < KDA_MAX_HEAD_DIM / 32; u++) {
            const int e = lane + 32 * u;
            if (e < V) {
                float b = load_elem(p.beta, p.beta_dtype, vrow + e);
                if (p.beta_sigmoid) b = (p.neg_eigval ? 2.0f : 1.0f) * sigmoidf_(b);
                z = fmaf(b, 0.f, z);
            }
        }
    }
    const int bad = z != z;
    x.bad = bad;
}

/* ---------------------------------------------------------------------------------------------------------
 * One token on the tile: gate, norms, poisoning, decay, d = Sᵀk̂, δ, S += k̂δᵀ, o = Sᵀq̂ (stored)
 * ------------------------------------------------------------------------------------------------------- */
template <int KC, int EX>
DEV void token_step(const kda_decode_params_t &p, const dec_item &d, int64_t t, int j0, int lane, dec_tok<KC> &x,
                    float (*S)[DEC_TILE / KC]) {
    typedef dec_geom<KC> G;
    constexpr int R = G::R, BV = G::BV;
    const int K = EX ? KC : p.kd, V = p.vd, i0 = R * lane;
    int bad = x.bad;
    float al[R], sq2 = 0.f, sk2 = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        float g = x.g[r];
        if (p.gate_in_kernel) g = p.lower_bound != 0.0f ? p.lower_bound * sigmoidf_(x.A * g) : -x.A * softplusf_(g);
        g = g > 0.0f ? 0.0f : g; /* clamp into [KDA_GATE_MIN, 0]; NaN stays NaN */
        g = g < KDA_GATE_MIN ? KDA_GATE_MIN : g;
        if (!EX && i0 + r >= K) g = 0.f; /* rows past K: α = 1 on zeros */
        bad |= !finite_f(x.q[r]) | !finite_f(x.k[r]) | !finite_f(g);
        al[r] = ex2(g * LOG2E);
        sq2 += x.q[r] * x.q[r];
        sk2 += x.k[r] * x.k[r];
    }
    float b = x.b;
    if (p.beta_sigmoid) b = (p.neg_eigval ? 2.0f : 1.0f) * sigmoidf_(b);
    bad |= !finite_f(b); /* scalar β: the same in every lane; headwise: this column's, and the row in x.bad */
    float sq = p.scale, sk = 1.0f;
    if (p.l2norm) {
        sq = p.scale / sqrtf(warp_sum(sq2) + 1e-6f);
        sk = 1.0f / sqrtf(warp_sum(sk2) + 1e-6f);
    }
    if (__any_sync(FULL, bad)) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < BV; c++) S[r][c] = NAN;
    }
    float *kh = x.k, part[BV]; /* k̂ in place */
#pragma unroll
    for (int c = 0; c < BV; c++) part[c] = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        kh[r] *= sk;
#pragma unroll
        for (int c = 0; c < BV; c++) {
            S[r][c] *= al[r];
            part[c] = fmaf(kh[r], S[r][c], part[c]);
        }
    }
    const int j = j0 + lane / G::LPC, live = EX || j < V;
    const float dj = col_reduce<BV>(part, lane);
    const float delta = live ? b * (x.v - dj) : 0.f;
#pragma unroll
    for (int c = 0; c < BV; c++) {
        const float dc = __shfl_sync(FULL, delta, c * G::LPC);
        part[c] = 0.f;
#pragma unroll
        for (int r = 0; r < R; r++) S[r][c] = fmaf(kh[r], dc, S[r][c]);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float qh = x.q[r] * sq;
#pragma unroll
        for (int c = 0; c < BV; c++) part[c] = fmaf(qh, S[r][c], part[c]);
    }
    const float oj = col_reduce<BV>(part, lane);
    if (lane % G::LPC == 0 && live) store_elem(p.o, p.o_dtype, (t * p.hv + d.h) * V + j, oj);
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernel: VF layout, KC K class, SF32 state dtype of the exact instance, EX exact (see the top).
 * ------------------------------------------------------------------------------------------------------- */
template <int VF, int KC, int SF32, int EX>
DEV void decode_tile(const kda_decode_params_t &p, const dec_item &d, int lane, int vec_in) {
    typedef dec_geom<KC> G;
    constexpr int R = G::R, BV = G::BV;
    const int K = EX ? KC : p.kd, j0 = d.vt * BV;
    const int64_t per_head = (int64_t)K * p.vd, T = d.eos - d.bos;
    const int per_token = p.state_indices && p.idx_cols > 0;
    float S[R][BV];
    load_state<VF, KC, SF32, EX>(p, d.rslot >= 0 && p.h0 != NULL, (d.rslot * p.hv + d.h) * per_head, j0, lane, S);
    dec_tok<KC> x;
    if (T > 0) load_token<KC, EX>(p, d, d.bos, j0, lane, vec_in, x);
    poison_columns<KC>(S);
#pragma unroll 1
    for (int64_t t = 0; t < T; t++) {
        if (t > 0) load_token<KC, EX>(p, d, d.bos + t, j0, lane, vec_in, x);
        token_step<KC, EX>(p, d, d.bos + t, j0, lane, x, S);
        if (per_token && p.ht) { /* speculative decoding: the state after this token to its own slot */
            const int64_t ws = dec_token_slot(p, d.n, t);
            if (ws >= 0) store_state<VF, KC, SF32, EX>(p, (ws * p.hv + d.h) * per_head, j0, lane, S);
        }
    }
    if (!per_token && p.ht && d.rslot >= 0)
        store_state<VF, KC, SF32, EX>(p, (d.rslot * p.hv + d.h) * per_head, j0, lane, S);
}

/* dec_geom MIN_CTAS CTAs of 128 threads per SM: at most 96 registers per thread, 20 warps per SM (at 64
 * registers, 32 warps, every instance spilled 50-900 bytes: the 32 state registers, the first token's inputs in
 * flight beside the tile's loads, and the reductions' partial sums do not fit beside the addresses). */
template <int VF, int KC, int SF32, int EX>
__global__ void __launch_bounds__(DEC_THREADS, dec_geom<KC>::MIN_CTAS) kda_decode_kernel(const kda_decode_params_t p) {
    const int lane = threadIdx.x & 31, ntiles = (p.vd + dec_geom<KC>::BV - 1) / dec_geom<KC>::BV;
    const int64_t nitems = p.num_seqs * p.hv * ntiles, stride = (int64_t)gridDim.x * DEC_WARPS;
    /* vector loads of the lane's R input rows: rows of whole vectors and aligned bases (decode_plan) */
    const int vec_in = p.vec_in && (EX || p.kd % (KC / 32) == 0);
#pragma unroll 1
    for (int64_t it = (int64_t)blockIdx.x * DEC_WARPS + (threadIdx.x >> 5); it < nitems; it += stride) {
        const dec_item d = make_item(p, it, ntiles);
        if (d.valid) decode_tile<VF, KC, SF32, EX>(p, d, lane, vec_in);
    }
}

template <int VF, int KC, int SF32, int EX>
static int launch(const kda_decode_params_t *p, void *stream) {
    const int64_t items = p->num_seqs * p->hv * ((p->vd + dec_geom<KC>::BV - 1) / dec_geom<KC>::BV);
    if (items == 0) return 0;
    int64_t ctas = (items + DEC_WARPS - 1) / DEC_WARPS;
    if (p->forced_ctas > 0 && p->forced_ctas < ctas) ctas = p->forced_ctas;
    if (ctas > ((int64_t)1 << 30)) ctas = (int64_t)1 << 30; /* the warps then walk the items grid-stride */
    kda_decode_kernel<VF, KC, SF32, EX><<<(unsigned)ctas, DEC_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}

/* The exact instance of the state dtype sdt (fp32 or bf16): K = KC, whole tiles, aligned 4-element rows, both
 * states (those present) of dtype sdt. Everything else (fp16 states, mixed dtypes, masks): the general one. */
template <int VF, int KC>
static int launch_kc(const kda_decode_params_t *p, void *stream) {
    const int sdt = p->h0 ? p->h0_dtype : (p->ht ? p->ht_dtype : KDA_DT_F32);
    const int ex = p->kd == KC && p->vd % dec_geom<KC>::BV == 0 && p->vec && (!p->h0 || p->h0_dtype == sdt) &&
                   (!p->ht || p->ht_dtype == sdt) && (sdt == KDA_DT_F32 || sdt == KDA_DT_BF16);
    if (!ex) return launch<VF, KC, 1, 0>(p, stream);
    return sdt == KDA_DT_F32 ? launch<VF, KC, 1, 1>(p, stream) : launch<VF, KC, 0, 1>(p, stream);
}

static int launch_decode(const kda_decode_params_t *p, void *stream) {
    const int kc = kda_cuda_size_class(p->kd);
    if (p->v_first) {
        if (kc == 64) return launch_kc<1, 64>(p, stream);
        if (kc == 128) return launch_kc<1, 128>(p, stream);
        return launch_kc<1, 256>(p, stream);
    }
    if (kc == 64) return launch_kc<0, 64>(p, stream);
    if (kc == 128) return launch_kc<0, 128>(p, stream);
    return launch_kc<0, 256>(p, stream);
}

static void decode_plan(kda_decode_params_t *p) {
    /* state rows of whole 4-element vectors and 16-byte aligned bases (the exact instances load up to 16 bytes
     * of a row at once, in both dtypes: 8 bf16 columns of a K-first row, 8 bf16 rows at K class 256) */
    const int row = p->v_first ? p->kd : p->vd;
    const int h0_ok = !p->h0 || (uintptr_t)p->h0 % 16 == 0;
    const int ht_ok = !p->ht || (uintptr_t)p->ht % 16 == 0;
    p->vec = row % 4 == 0 && h0_ok && ht_ok;
    /* q, k, g, dt_bias: the lane's R elements as one or two vectors (at most 16 bytes each) when the bases are
     * 16-byte aligned (the kernel checks that K is a multiple of R) */
#define VEC_OK(ptr) ((uintptr_t)(ptr) % 16 == 0)
    p->vec_in = VEC_OK(p->q) && VEC_OK(p->k) && VEC_OK(p->g) && VEC_OK(p->dt_bias);
#undef VEC_OK
}

/* ---------------------------------------------------------------------------------------------------------
 * Host side: the choice of kernel and the launch
 * ------------------------------------------------------------------------------------------------------- */
extern "C" int kda_cuda_decode_fits(const kda_problem_t *p, int is_decode) {
    const kda_args_t *a = &p->a;
    if (a->beta_headwise || (a->state_indices && a->state_indices_cols > 0)) return 1;
    if (!is_decode) return 0;
    /* fp32 / fp16 inputs keep fp32 arithmetic at any length (the chunked kernels round to bf16) */
    if (a->dtype != KDA_BFLOAT16) return 1;
    return p->num_tokens <= (int64_t)KDA_DECODE_MAX_TOKENS_PER_SEQ * p->num_seqs;
}

extern "C" size_t kda_cuda_claim_bytes(const kda_problem_t *p) {
    if (!p->a.state_indices || p->num_seqs < 2) return 0; /* one row cannot collide with another */
    return ((size_t)p->a.num_state_slots * sizeof(int32_t) + 255) & ~(size_t)255;
}

extern "C" kda_status_t kda_cuda_decode_run(const kda_problem_t *pr, int device, int sm_count, int forced_ctas,
                                            int32_t *claim, void *stream, const char *fn) {
    const kda_args_t *a = &pr->a;
    kda_decode_params_t c;
    memset(&c, 0, sizeof c);
    c.q = a->q;
    c.k = a->k;
    c.v = a->v;
    c.g = a->g;
    c.beta = a->beta;
    c.o = a->o;
    c.h0 = a->initial_state;
    c.ht = a->final_state;
    c.A_log = a->use_gate_in_kernel ? a->A_log : NULL;
    c.dt_bias = a->use_gate_in_kernel ? a->dt_bias : NULL;
    c.cu_seqlens = a->cu_seqlens;
    c.cu_seqlens_64 = a->cu_seqlens_dtype == KDA_INT64;
    c.state_indices = a->state_indices;
    c.num_accepted = a->num_accepted_tokens;
    c.claim = claim;
    c.idx_cols = a->state_indices ? a->state_indices_cols : 0;
    c.idx_stride = pr->idx_stride;
    c.num_state_slots = a->state_indices ? a->num_state_slots : pr->num_seqs;
    c.dtype = (int)a->dtype;
    c.g_dtype = (int)a->g_dtype;
    c.beta_dtype = (int)a->beta_dtype;
    c.o_dtype = (int)a->o_dtype;
    c.h0_dtype = (int)a->initial_state_dtype;
    c.ht_dtype = (int)a->final_state_dtype;
    c.num_tokens = pr->num_tokens;
    c.seq_len = a->seq_len;
    c.num_seqs = pr->num_seqs;
    c.hqk = a->num_qk_heads;
    c.hv = a->num_v_heads;
    c.group = pr->group;
    c.kd = a->head_dim_k;
    c.vd = a->head_dim_v;
    c.scale = pr->scale;
    c.lower_bound = pr->has_lower_bound ? a->lower_bound : 0.0f;
    c.l2norm = a->use_qk_l2norm != 0;
    c.gate_in_kernel = a->use_gate_in_kernel != 0;
    c.beta_sigmoid = a->use_beta_sigmoid != 0;
    c.neg_eigval = a->allow_neg_eigval != 0;
    c.v_first = a->state_v_first != 0;
    c.beta_headwise = a->beta_headwise != 0;
    (void)sm_count;
    c.forced_ctas = forced_ctas;
    decode_plan(&c);

    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
    if (e != cudaSuccess) return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    kda_claim_params_t cl = {a->state_indices, pr->num_seqs, c.idx_cols > 0 ? c.idx_cols : 1,
                             c.idx_cols > 0 ? c.idx_stride : 1, c.num_state_slots, claim};
    int err = kda_cuda_launch_claim(&cl, stream);
    if (err == 0) err = launch_decode(&c, stream);
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the decode kernel: %s", fn,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}
