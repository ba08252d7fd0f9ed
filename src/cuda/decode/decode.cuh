/*
 * Device pieces shared by the two decode kernels (decode_staged.cuh: persistent CTAs walking staged tiles, any
 * shape; decode_tile.cuh: one CTA per tile, the exact head sizes): warp reductions, a sequence's bounds and the
 * state slots of the pool (docs/ALGORITHM.md §1; the slot rules are in decode_staged.cuh's header).
 */
#ifndef KDA_CUDA_DECODE_CUH
#define KDA_CUDA_DECODE_CUH

#include "common.cuh"
#include "decode.h"

DEV int finite_f(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

/* Sum over the lanes whose lane bits from `from` up differ (xor shuffles from `from` to 16). */
template <int FROM>
DEV float lanes_sum(float x) {
#pragma unroll
    for (int o = FROM; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
template <int FROM>
DEV int lanes_or(int x) {
#pragma unroll
    for (int o = FROM; o < 32; o <<= 1) x |= __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
/* Sum over the 8 lanes of a V-first row (lane bits 0..2). */
DEV float row8_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    return x;
}
DEV int row8_or(int x) {
    x |= __shfl_xor_sync(0xffffffffu, x, 1);
    x |= __shfl_xor_sync(0xffffffffu, x, 2);
    x |= __shfl_xor_sync(0xffffffffu, x, 4);
    return x;
}

/* Four consecutive state elements at element off as one streaming store: 16 bytes of fp32 (f32) or 8 of bf16
 * (the base and off aligned to them). */
DEV void store4_vec(void *base, int f32, int64_t off, float4 x) {
    if (f32) {
        __stcs((float4 *)((float *)base + off), x);
    } else {
        uint2 u;
        u.x = pack_bf16(x.x, x.y);
        u.y = pack_bf16(x.z, x.w);
        __stcs((uint2 *)((uint16_t *)base + off), u);
    }
}

/* Tokens [bos, eos) of sequence n (cu_seqlens clamped into [0, num_tokens]; never trusted further). */
DEV void dec_seq_bounds(const kda_decode_params_t &p, int64_t n, int64_t *bos, int64_t *eos) {
    if (!p.pb.seqs.cu_seqlens) {
        *bos = n * p.pb.seqs.seq_len;
        *eos = *bos + p.pb.seqs.seq_len;
        return;
    }
    int64_t a0 = p.pb.seqs.cu_seqlens_64 ? ((const int64_t *)p.pb.seqs.cu_seqlens)[n]
                                         : ((const int32_t *)p.pb.seqs.cu_seqlens)[n];
    int64_t a1 = p.pb.seqs.cu_seqlens_64 ? ((const int64_t *)p.pb.seqs.cu_seqlens)[n + 1]
                                         : ((const int32_t *)p.pb.seqs.cu_seqlens)[n + 1];
    a0 = a0 < 0 ? 0 : (a0 > p.pb.seqs.num_tokens ? p.pb.seqs.num_tokens : a0);
    a1 = a1 < a0 ? a0 : (a1 > p.pb.seqs.num_tokens ? p.pb.seqs.num_tokens : a1);
    *bos = a0;
    *eos = a1;
}

/* The pool entry row n reads before its index is checked against claim (1-D state_indices[n]; 2-D
 * state_indices[n][a_n − 1], a_n clamped into [1, T_max]; none: n); −1 outside the pool. */
DEV int64_t dec_named_slot(const kda_decode_params_t &p, int64_t n) {
    if (!p.pb.state_indices) return n;
    int64_t s;
    if (p.idx_cols == 0) {
        s = p.pb.state_indices[n];
    } else {
        int64_t col = p.num_accepted ? (int64_t)p.num_accepted[n] - 1 : 0;
        col = col < 0 ? 0 : (col >= p.idx_cols ? p.idx_cols - 1 : col);
        s = p.pb.state_indices[n * p.idx_stride + col];
    }
    return s < 0 || s >= p.pb.num_state_slots ? -1 : s;
}

/* Whether slot s (in the pool) counts for row n: a later row naming it too owns it (slots.cu). */
DEV int dec_owns(const kda_decode_params_t &p, int64_t n, int64_t s) { return !p.claim || p.claim[s] == (int32_t)n; }

/* The slot row n reads and (1-D, none) writes, or −1. */
DEV int64_t dec_read_slot(const kda_decode_params_t &p, int64_t n) {
    const int64_t s = dec_named_slot(p, n);
    return s >= 0 && dec_owns(p, n, s) ? s : -1;
}

/* 2-D indices: the slot the state after token t (of the sequence) goes to, or −1. */
DEV int64_t dec_token_slot(const kda_decode_params_t &p, int64_t n, int64_t t) {
    if (t >= p.idx_cols) return -1;
    const int64_t s = p.pb.state_indices[n * p.idx_stride + t];
    if (s < 0 || s >= p.pb.num_state_slots) return -1;
    return dec_owns(p, n, s) ? s : -1;
}

/* The log decay of §2 from a raw gate value g (+ dt_bias), clamped into [KDA_GATE_MIN, 0] (NaN stays NaN);
 * A = e^{A_log[h]} for the in-kernel gates. */
DEV float dec_gate(const kda_decode_params_t &p, float g, float bias, float A) {
    if (p.pb.gate_in_kernel) {
        const float x = g + bias;
        g = p.pb.lower_bound != 0.0f ? p.pb.lower_bound * sigmoidf_(A * x) : -A * softplusf_(x);
    }
    g = g > 0.0f ? 0.0f : g;
    return g < KDA_GATE_MIN ? KDA_GATE_MIN : g;
}

/* β from its raw value: as given, sigmoid(β), or 2 sigmoid(β) (allow_neg_eigval). */
DEV float dec_beta(const kda_decode_params_t &p, float b) {
    return p.pb.beta_sigmoid ? beta_sigmoid(b, p.pb.neg_eigval) : b;
}

#endif /* KDA_CUDA_DECODE_CUH */
