/*
 * CUDA recurrent decode, the staged kernel (kda_decode for few tokens per sequence, any K and V up to 256, and
 * what only the recurrent path has: headwise β, 2-D state_indices): the token recurrence of docs/ALGORITHM.md §1
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
 * Decode is a stream over the states: each tile is read once and written once, at a few flops per byte; what
 * bounds the kernel is its instructions per tile and their latencies more than its bytes, so:
 *   - a tile is DEC_TILE = 4096 state elements (BV = 4096 / KC columns of the K class KC: 64, 32 or 16);
 *   - persistent CTAs of 128 threads walk the tiles (item i = blockIdx.x + k·gridDim.x); each CTA keeps the
 *     next NS − 1 tiles in flight in a ring of NS shared-memory stages (dec_stages: 3 for fp32, 4 for bf16),
 *     by bulk copies completing on one mbarrier per stage (cp.async where rows are not 16-byte aligned), and
 *     a tile's slot index, bounds, β and A are read one item before its copy is issued (the descriptor ring);
 *   - the first p.ts (≤ DEC_TS) tokens' input rows travel in the stage with the tile (cp.async of element pairs
 *     by the thread that later transforms them); later tokens' rows are loaded into registers a token ahead;
 *     each token's inputs are transformed into shared memory behind the one barrier each token has;
 *   - exact instances (EX: K = KC, whole tiles, aligned rows, the final state in the stage's dtype) fold the
 *     offsets and drop the masks;
 *   - the state goes from its stage into registers (8 four-element chunks per thread), the tokens run there,
 *     and it is stored from registers (streaming stores).
 *
 * State slots: the tile is read from slot r_n (1-D state_indices[n]; 2-D state_indices[n][a_n − 1] with a_n
 * = num_accepted_tokens[n] clamped into [1, T_max]; none: n), or zeros when r_n is negative or outside the
 * pool; it is written after the last token to r_n (1-D, none), or after every token t to state_indices[n][t]
 * (2-D; nothing for a negative or out-of-pool entry, nothing for tokens past T_max; an empty sequence reads and
 * writes nothing). Device contents are never validated here (that needs a host sync): the clamps above are
 * all the kernel does with bad indices.
 *
 * Non-finite contract (ALGORITHM.md §7): a token whose q, k, v, β (all V of them) or gate (after the clamp)
 * has a non-finite value turns the tile into NaN before that token, so o_t, later outputs and the state are
 * NaN (every tile of the head sees the same inputs); earlier outputs are unchanged. A non-finite value in
 * column j of the initial state makes column j NaN from the first token (value channel j of o and of the
 * state; the recurrence never mixes columns).
 *
 * Thread layout (a "chunk" is 4 consecutive elements of a memory row; lane l of warp w):
 *   V-first ([V, K] rows, K contiguous): 8 lanes per row; row j = 16·pass + 4w + (l >> 3), elements
 *     i = 4(l & 7) + 32c (c < KC / 32); reductions over K: 3 shuffles within the 8 lanes.
 *   K-first ([K, V] rows, V contiguous): CGW = BV / 16 column groups per warp; lane l holds columns
 *     4(w·CGW + l % CGW) .. +3 and rows i = l / CGW + RG·a (RG = 32 / CGW, a < 8); reductions over K:
 *     log2(RG) shuffles within the warp. The stage's rows are padded to 5BV/4 elements (no bank conflicts).
 */
#ifndef KDA_CUDA_DECODE_STAGED_CUH
#define KDA_CUDA_DECODE_STAGED_CUH

#include "common.cuh"
#include "decode.cuh"

#define DEC_THREADS KDA_DEC_THREADS
#define DEC_TILE KDA_DEC_TILE /* state elements per tile */
#define DEC_NA KDA_DEC_NA     /* four-element chunks of a tile per thread */
#define DEC_TS KDA_DEC_TS     /* tokens of an item that can travel in its stage */

/* Inputs of the current and the next token (double-buffered), and the ring of tile descriptors. */
template <int KC>
struct dec_io {
    float q[2][KC], k[2][KC], a[2][KC], v[2][KDA_MAX_HEAD_DIM], b[2][KDA_MAX_HEAD_DIM];
};

struct dec_item {
    int64_t n, bos, eos, rslot;
    int h, vt, valid;      /* valid: an item of this launch that reads or writes anything */
    int hq;                /* the q/k head of value head h */
    float beta[DEC_TS], A; /* the staged tokens' raw β (scalar β) and e^{A_log[h]} */
};

/* Four consecutive state elements at element `off` of a state tensor of dtype dt (vectorised when `vec`),
 * masked by `valid` (how many of the four exist, 0..4). */
DEV float4 load4(const void *base, int dt, int64_t off, int valid, int vec) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (valid <= 0) return r;
    if (vec && valid == 4) {
        if (dt == KDA_DT_F32) return *(const float4 *)((const float *)base + off);
        const uint2 u = *(const uint2 *)((const uint16_t *)base + off);
        const float2 lo = unpack_bf16(u.x), hi = unpack_bf16(u.y);
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    r.x = load_elem(base, dt, off);
    if (valid > 1) r.y = load_elem(base, dt, off + 1);
    if (valid > 2) r.z = load_elem(base, dt, off + 2);
    if (valid > 3) r.w = load_elem(base, dt, off + 3);
    return r;
}

DEV void store4(void *base, int dt, int64_t off, int valid, int vec, float4 x) {
    if (valid <= 0) return;
    if (vec && valid == 4) {
        store4_vec(base, dt == KDA_DT_F32, off, x);
        return;
    }
    store_elem(base, dt, off, x.x);
    if (valid > 1) store_elem(base, dt, off + 1, x.y);
    if (valid > 2) store_elem(base, dt, off + 2, x.z);
    if (valid > 3) store_elem(base, dt, off + 3, x.w);
}

DEV int clamp_valid(int n) { return n < 0 ? 0 : (n > 4 ? 4 : n); }

/* ---------------------------------------------------------------------------------------------------------
 * Tile geometry: where chunk a of thread tid lies in the head's state block (global element offset and how
 * many of its 4 elements exist) and in the stage (element offset).
 * ------------------------------------------------------------------------------------------------------- */
template <int VF, int KC>
struct dec_geom {
    static constexpr int BV = KDA_DEC_BV(KC);           /* columns of a tile */
    static constexpr int CPR = KC / 32;                 /* V-first: chunks of a row per lane */
    static constexpr int CGW = BV / 16;                 /* K-first: column groups per warp */
    static constexpr int RG = 32 / CGW;                 /* K-first: lanes (row groups) per column group */
    static constexpr int ROW = KDA_DEC_ROW(VF, KC);     /* stage elements per row */
    static constexpr int ELEMS = KDA_DEC_ELEMS(VF, KC); /* stage elements */
    static_assert(DEC_TILE % KC == 0 && KC % 32 == 0 && BV % 16 == 0, "decode tile geometry");
    static_assert(VF ? (BV / 16) * CPR == DEC_NA : RG * DEC_NA == KC, "decode: 8 chunks per thread");
};

/* EX (exact): K = KC and whole tiles (V a multiple of BV), so every chunk exists and offsets fold. */
template <int VF, int KC, int EX>
DEV int chunk_at(int a, int K, int V, int j0, int tid, int *goff, int *soff) {
    typedef dec_geom<VF, KC> G;
    const int lane = tid & 31, w = tid >> 5;
    if (EX) K = KC;
    if (VF) {
        const int pass = a / G::CPR, c = a % G::CPR;
        const int jl = 16 * pass + 4 * w + (lane >> 3), i = 4 * (lane & 7) + 32 * c;
        *soff = jl * G::ROW + i;
        *goff = (j0 + jl) * K + i;
        return EX ? 4 : (j0 + jl < V ? clamp_valid(K - i) : 0);
    }
    const int cg = w * G::CGW + lane % G::CGW, i = lane / G::CGW + G::RG * a;
    *soff = i * G::ROW + 4 * cg;
    *goff = i * V + j0 + 4 * cg;
    return EX ? 4 : (i < K ? clamp_valid(V - j0 - 4 * cg) : 0);
}

/* Chunk r (memory order, r < DEC_NA) of the tile as copied by thread tid: consecutive threads take
 * consecutive chunks of a row (coalesced). */
template <int VF, int KC>
DEV int copy_chunk_at(int r, int K, int V, int j0, int tid, int *goff, int *soff) {
    typedef dec_geom<VF, KC> G;
    const int q = tid + DEC_THREADS * r;
    if (VF) {
        const int jl = q / (KC / 4), i = 4 * (q % (KC / 4));
        *soff = jl * G::ROW + i;
        *goff = (j0 + jl) * K + i;
        return j0 + jl < V ? clamp_valid(K - i) : 0;
    }
    const int i = q / (G::BV / 4), jl = 4 * (q % (G::BV / 4));
    *soff = i * G::ROW + jl;
    *goff = i * V + j0 + jl;
    return i < K ? clamp_valid(V - j0 - jl) : 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * Items: (sequence, value head, tile), tile fastest. The descriptor holds what the copies and the first
 * token need that is not a row: bounds, slot, β (scalar β) and A = e^{A_log[h]} of the first token.
 * ------------------------------------------------------------------------------------------------------- */
DEV dec_item make_item(const kda_decode_params_t &p, int64_t it, int ntiles) {
    dec_item d;
    d.valid = 0;
    d.n = d.bos = d.eos = 0;
    d.rslot = -1;
    d.h = d.vt = 0;
    d.hq = 0;
#pragma unroll
    for (int u = 0; u < DEC_TS; u++) d.beta[u] = 0.f;
    d.A = 1.f;
    const int64_t nitems = p.pb.seqs.num_seqs * p.pb.hv * ntiles;
    if (it >= nitems) return d;
    if (nitems < ((int64_t)1 << 31)) { /* 32-bit division: a few instructions instead of a 64-bit routine */
        const uint32_t i32 = (uint32_t)it, r = i32 / (uint32_t)ntiles, hv = (uint32_t)p.pb.hv;
        d.vt = (int)(i32 - r * (uint32_t)ntiles);
        d.n = r / hv;
        d.h = (int)(r - (uint32_t)d.n * hv);
    } else {
        d.vt = (int)(it % ntiles);
        d.h = (int)((it / ntiles) % p.pb.hv);
        d.n = it / ((int64_t)ntiles * p.pb.hv);
    }
    dec_seq_bounds(p, d.n, &d.bos, &d.eos);
    /* 2-D slots: nothing is read or written for an empty sequence */
    if (p.pb.state_indices && p.idx_cols > 0 && d.eos == d.bos) return d;
    d.valid = 1;
    d.rslot = dec_read_slot(p, d.n);
    d.hq = d.h / p.pb.group;
    if (d.eos > d.bos) {
        if (!p.beta_headwise) {
#pragma unroll
            for (int u = 0; u < DEC_TS; u++)
                if (u < p.ts && d.bos + u < d.eos)
                    d.beta[u] = load_elem(p.pb.beta, p.pb.beta_dtype, (d.bos + u) * p.pb.hv + d.h);
        }
        if (p.pb.A_log) d.A = expf(p.pb.A_log[d.h]);
    }
    return d;
}

/* Copy item d's state tile into stage buffer `st`. With p.bulk, bulk copies (the Hopper copy engine, one per
 * row, or one for the whole tile when rows are unpadded) completing on the stage's mbarrier `bar`: the copy
 * engine keeps any number of bytes in flight, where per-thread copies are bounded by the SM's outstanding
 * requests; the stage then holds stale data past K and V, which load_tile masks.
 * Otherwise cp.async (zero-filled past K and V; waited for with the rows' group), or without 4-element aligned
 * rows (p.vec == 0) element by element. Thread 0 always arrives on `bar` (0 bytes when nothing is copied). */
template <int VF, int KC, int SF32>
DEV void issue_stage(const kda_decode_params_t &p, const dec_item &d, unsigned char *st, uint32_t bar) {
    typedef dec_geom<VF, KC> G;
    constexpr int ES = SF32 ? 4 : 2;
    const int has = d.valid && d.rslot >= 0 && p.pb.h0;
    const int K = p.pb.K, V = p.pb.V, tid = threadIdx.x, j0 = d.vt * G::BV;
    const int64_t base = has ? (d.rslot * p.pb.hv + d.h) * (int64_t)K * V : 0;
    if (p.bulk) {
        const char *h0 = (const char *)p.pb.h0;
        if (VF) {
            const int rows = has ? (V - j0 < G::BV ? V - j0 : G::BV) : 0;
            if (tid == 0) mbar_expect_tx(bar, (uint32_t)(rows * K * ES));
            if (K == KC) {
                if (tid == 0 && rows) bulk_g2s(smem_u32(st), h0 + (base + (int64_t)j0 * K) * ES, rows * K * ES, bar);
            } else if (tid < rows) {
                bulk_g2s(smem_u32(st + tid * G::ROW * ES), h0 + (base + (int64_t)(j0 + tid) * K) * ES, K * ES, bar);
            }
        } else {
            const int cols = has ? (V - j0 < G::BV ? V - j0 : G::BV) : 0, rows = cols ? K : 0;
            if (tid == 0) mbar_expect_tx(bar, (uint32_t)(rows * cols * ES));
            for (int i = tid; i < rows; i += DEC_THREADS)
                bulk_g2s(smem_u32(st + i * G::ROW * ES), h0 + (base + (int64_t)i * V + j0) * ES, cols * ES, bar);
        }
        return;
    }
    if (tid == 0) mbar_expect_tx(bar, 0);
    if (!has) return;
#pragma unroll
    for (int r = 0; r < DEC_NA; r++) {
        int goff, soff;
        const int nv = copy_chunk_at<VF, KC>(r, K, V, j0, tid, &goff, &soff);
        if (p.vec) {
            if (SF32)
                cp_async16_zfill(smem_u32((float *)st + soff), (const float *)p.pb.h0 + (nv ? base + goff : 0),
                                 nv ? 16 : 0);
            else
                cp_async8_zfill(smem_u32((uint16_t *)st + soff), (const uint16_t *)p.pb.h0 + (nv ? base + goff : 0),
                                nv ? 8 : 0);
        } else {
            const float4 x = load4(p.pb.h0, p.pb.h0_dtype, base + goff, nv, 0);
            if (SF32) {
                *(float4 *)((float *)st + soff) = x;
            } else {
                uint2 u;
                u.x = pack_bf16(x.x, x.y);
                u.y = pack_bf16(x.z, x.w);
                *(uint2 *)((uint16_t *)st + soff) = u;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Token inputs. Thread tid owns elements e = 2 tid and 2 tid + 1 of every input row (q, k, g, dt_bias: K long;
 * v and headwise β: V long): it copies them, transforms them and writes them to shared memory, so the first
 * token's rows can travel in the stage with the tile (cp.async, waited for by the thread that copied) and
 * later tokens' rows in registers, one token ahead.
 * ------------------------------------------------------------------------------------------------------- */
struct tok_raw {
    float q[2], k[2], g[2], v[2], b[2], bias[2];
    float A;
};

DEV void zero_token(tok_raw &r) {
#pragma unroll
    for (int u = 0; u < 2; u++) r.q[u] = r.k[u] = r.g[u] = r.v[u] = r.b[u] = r.bias[u] = 0.f;
    r.A = 1.f;
}

DEV int dt_size(int dt) { return dt == KDA_DT_F32 ? 4 : 2; }

/* Element pair (e, e + 1) of a row of `len` elements at element `row` of tensor `base` into shared memory at
 * `dst` (cp.async of 4 or 8 bytes; an element past the row's end is zero; nothing when e >= len: the row's
 * region holds only the row). */
DEV void copy_pair(uint32_t dst, const void *base, int dt, int64_t row, int e, int len) {
    if (e >= len) return;
    const int es = dt_size(dt), n = len - e > 2 ? 2 : len - e;
    const char *src = (const char *)base + (row + e) * es;
    if (es == 4) cp_async8_zfill(dst, src, n * 4);
    else cp_async4_zfill(dst, src, n * 2);
}

DEV float2 smem_pair(const unsigned char *src, int dt, int e, int len) {
    if (e >= len) return make_float2(0.f, 0.f); /* not copied (copy_pair) */
    if (dt == KDA_DT_F32) return *(const float2 *)src;
    const uint32_t u = *(const uint32_t *)src;
    if (dt == KDA_DT_BF16) return unpack_bf16(u);
    return make_float2(f16_bits_to_f32((uint16_t)(u & 0xffffu)), f16_bits_to_f32((uint16_t)(u >> 16)));
}

/* The first p.ts tokens of item d: their rows into the stage's input region (token u's block at p.raw_rows +
 * u·p.raw_tok; without aligned pairs, read_rows loads them later instead, synchronously: the rare path). */
DEV void issue_rows(const kda_decode_params_t &p, const dec_item &d, unsigned char *st) {
    if (!d.valid || d.eos == d.bos || !p.vec_in) return;
    const int K = p.pb.K, V = p.pb.V, e = 2 * threadIdx.x, h = d.h, hq = d.hq;
    const int n = d.eos - d.bos < p.ts ? (int)(d.eos - d.bos) : p.ts;
    for (int u = 0; u < n; u++) {
        unsigned char *in = st + p.raw_rows + u * p.raw_tok;
        const int64_t t = d.bos + u;
        copy_pair(smem_u32(in + p.raw_q + e * dt_size(p.pb.dtype)), p.pb.q, p.pb.dtype, (t * p.pb.hqk + hq) * K, e, K);
        copy_pair(smem_u32(in + p.raw_k + e * dt_size(p.pb.dtype)), p.pb.k, p.pb.dtype, (t * p.pb.hqk + hq) * K, e, K);
        copy_pair(smem_u32(in + p.raw_g + e * dt_size(p.pb.g_dtype)), p.pb.g, p.pb.g_dtype, (t * p.pb.hv + h) * K, e,
                  K);
        copy_pair(smem_u32(in + p.raw_v + e * dt_size(p.pb.dtype)), p.pb.v, p.pb.dtype, (t * p.pb.hv + h) * V, e, V);
        if (p.beta_headwise)
            copy_pair(smem_u32(in + p.raw_b + e * dt_size(p.pb.beta_dtype)), p.pb.beta, p.pb.beta_dtype,
                      (t * p.pb.hv + h) * V, e, V);
    }
    if (p.pb.dt_bias) copy_pair(smem_u32(st + p.raw_bias + e * 4), p.pb.dt_bias, KDA_DT_F32, (int64_t)h * K, e, K);
}

DEV void fetch_token(const kda_decode_params_t &p, tok_raw &r, int64_t t, int h) {
    const int K = p.pb.K, V = p.pb.V, hq = h / p.pb.group;
    r.A = p.pb.A_log ? expf(p.pb.A_log[h]) : 1.0f;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int e = 2 * threadIdx.x + u;
        r.q[u] = r.k[u] = r.g[u] = r.v[u] = r.b[u] = r.bias[u] = 0.f;
        if (e < K) {
            r.q[u] = load_elem(p.pb.q, p.pb.dtype, (t * p.pb.hqk + hq) * K + e);
            r.k[u] = load_elem(p.pb.k, p.pb.dtype, (t * p.pb.hqk + hq) * K + e);
            r.g[u] = load_elem(p.pb.g, p.pb.g_dtype, (t * p.pb.hv + h) * K + e);
            if (p.pb.dt_bias) r.bias[u] = p.pb.dt_bias[(int64_t)h * K + e];
        }
        if (e < V) r.v[u] = load_elem(p.pb.v, p.pb.dtype, (t * p.pb.hv + h) * V + e);
        if (p.beta_headwise ? e < V : e == 0)
            r.b[u] =
                load_elem(p.pb.beta, p.pb.beta_dtype, p.beta_headwise ? (t * p.pb.hv + h) * V + e : t * p.pb.hv + h);
    }
}

/* Token u of item d into r: from the stage (u < p.ts, after this thread's cp.async wait) or, on the rare path,
 * from global memory. */
DEV void read_rows(const kda_decode_params_t &p, const dec_item &d, const unsigned char *st, tok_raw &r, int u) {
    if (!d.valid || d.eos == d.bos) {
        zero_token(r);
        return;
    }
    if (!p.vec_in) {
        fetch_token(p, r, d.bos + u, d.h);
        return;
    }
    const unsigned char *in = st + p.raw_rows + u * p.raw_tok;
    const int e = 2 * threadIdx.x, K = p.pb.K, V = p.pb.V;
    float2 x = smem_pair(in + p.raw_q + e * dt_size(p.pb.dtype), p.pb.dtype, e, K);
    r.q[0] = x.x, r.q[1] = x.y;
    x = smem_pair(in + p.raw_k + e * dt_size(p.pb.dtype), p.pb.dtype, e, K);
    r.k[0] = x.x, r.k[1] = x.y;
    x = smem_pair(in + p.raw_g + e * dt_size(p.pb.g_dtype), p.pb.g_dtype, e, K);
    r.g[0] = x.x, r.g[1] = x.y;
    x = smem_pair(in + p.raw_v + e * dt_size(p.pb.dtype), p.pb.dtype, e, V);
    r.v[0] = x.x, r.v[1] = x.y;
    if (p.beta_headwise) {
        x = smem_pair(in + p.raw_b + e * dt_size(p.pb.beta_dtype), p.pb.beta_dtype, e, V);
        r.b[0] = x.x, r.b[1] = x.y;
    } else {
        float b = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_TS; w++) b = w == u ? d.beta[w] : b;
        r.b[0] = e == 0 ? b : 0.f;
        r.b[1] = 0.f;
    }
    if (p.pb.dt_bias) {
        x = smem_pair(st + p.raw_bias + e * 4, KDA_DT_F32, e, K);
        r.bias[0] = x.x, r.bias[1] = x.y;
    } else {
        r.bias[0] = r.bias[1] = 0.f;
    }
    r.A = d.A;
}

/* Gate, clamp, α = e^g, β transform into buffer `buf`; returns nonzero if any of this thread's inputs is
 * non-finite (the non-finite contract). */
template <int KC>
DEV int commit_token(const kda_decode_params_t &p, dec_io<KC> &io, int buf, const tok_raw &r) {
    const int K = p.pb.K, V = p.pb.V;
    int bad = 0;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int e = 2 * threadIdx.x + u;
        float a = 1.f, b = r.b[u];
        if (e < K) {
            const float g = dec_gate(p, r.g[u], r.bias[u], r.A);
            bad |= !finite_f(r.q[u]) | !finite_f(r.k[u]) | !finite_f(g);
            a = ex2(g * LOG2E);
        }
        if (e < V) bad |= !finite_f(r.v[u]);
        if (p.beta_headwise ? e < V : e == 0) {
            b = dec_beta(p, b);
            bad |= !finite_f(b);
        }
        if (e < KC) {
            io.q[buf][e] = r.q[u];
            io.k[buf][e] = r.k[u];
            io.a[buf][e] = a;
        }
        io.v[buf][e] = r.v[u];
        io.b[buf][e] = b;
    }
    return bad;
}
/* Scale factors of q̂ and k̂ for buffer `buf` (every warp computes them for itself from shared memory). */
template <int KC>
DEV void token_norms(const kda_decode_params_t &p, const dec_io<KC> &io, int buf, float *sq, float *sk) {
    if (!p.pb.l2norm) {
        *sq = p.pb.scale;
        *sk = 1.0f;
        return;
    }
    const int lane = threadIdx.x & 31;
    float a = 0.f, b = 0.f;
    for (int e = lane; e < p.pb.K; e += 32) {
        const float x = io.q[buf][e], y = io.k[buf][e];
        a += x * x;
        b += y * y;
    }
    a = lanes_sum<1>(a);
    b = lanes_sum<1>(b);
    *sq = p.pb.scale / sqrtf(a + 1e-6f);
    *sk = 1.0f / sqrtf(b + 1e-6f);
}

/* acc += s·x, element by element */
DEV void axpy4(float4 &acc, float s, const float4 &x) {
    acc.x += s * x.x;
    acc.y += s * x.y;
    acc.z += s * x.z;
    acc.w += s * x.w;
}
/* lanes_sum of each element */
template <int FROM>
DEV float4 lanes_sum4(float4 x) {
    x.x = lanes_sum<FROM>(x.x);
    x.y = lanes_sum<FROM>(x.y);
    x.z = lanes_sum<FROM>(x.z);
    x.w = lanes_sum<FROM>(x.w);
    return x;
}

/* ---------------------------------------------------------------------------------------------------------
 * One token on the registers' tile: decay, d = Sᵀk̂, δ, S += k̂δᵀ, o = Sᵀq̂ (stored)
 * ------------------------------------------------------------------------------------------------------- */
template <int VF, int KC, int EX>
DEV void token_step(const kda_decode_params_t &p, const dec_io<KC> &io, int buf, float4 S[DEC_NA], int64_t t, int h,
                    int j0) {
    typedef dec_geom<VF, KC> G;
    const int V = p.pb.V, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    float sq, sk;
    token_norms(p, io, buf, &sq, &sk);
    const float *qs = io.q[buf], *ks = io.k[buf], *as = io.a[buf], *vs = io.v[buf], *bs = io.b[buf];
    if (VF) {
        constexpr int NP = DEC_NA / G::CPR; /* rows per 8 lanes */
        float d[NP], o[NP];
#pragma unroll
        for (int s = 0; s < NP; s++) d[s] = o[s] = 0.f;
#pragma unroll
        for (int a = 0; a < DEC_NA; a++) {
            const int s = a / G::CPR, i = 4 * (lane & 7) + 32 * (a % G::CPR);
            const float4 al = *(const float4 *)(as + i), kk = *(const float4 *)(ks + i);
            S[a].x *= al.x;
            S[a].y *= al.y;
            S[a].z *= al.z;
            S[a].w *= al.w;
            d[s] += (kk.x * S[a].x + kk.y * S[a].y) + (kk.z * S[a].z + kk.w * S[a].w);
        }
#pragma unroll
        for (int s = 0; s < NP; s++) {
            const int j = j0 + 16 * s + 4 * w + (lane >> 3), jj = (EX || j < V) ? j : 0;
            const float dd = row8_sum(d[s]) * sk;
            d[s] = (EX || j < V) ? bs[p.beta_headwise ? jj : 0] * (vs[jj] - dd) * sk : 0.f; /* k̂ δ_j factor */
        }
#pragma unroll
        for (int a = 0; a < DEC_NA; a++) {
            const int s = a / G::CPR, i = 4 * (lane & 7) + 32 * (a % G::CPR);
            const float4 kk = *(const float4 *)(ks + i), qq = *(const float4 *)(qs + i);
            S[a].x += kk.x * d[s];
            S[a].y += kk.y * d[s];
            S[a].z += kk.z * d[s];
            S[a].w += kk.w * d[s];
            o[s] += (qq.x * S[a].x + qq.y * S[a].y) + (qq.z * S[a].z + qq.w * S[a].w);
        }
#pragma unroll
        for (int s = 0; s < NP; s++) {
            const float os = row8_sum(o[s]) * sq;
            const int j = j0 + 16 * s + 4 * w + (lane >> 3);
            if ((lane & 7) == 0 && (EX || j < V)) store_elem(p.o, p.o_dtype, (t * p.pb.hv + h) * V + j, os);
        }
    } else {
        const int rg = lane / G::CGW, j = j0 + 4 * (w * G::CGW + lane % G::CGW);
        float4 d = make_float4(0.f, 0.f, 0.f, 0.f); /* d_j of the thread's 4 columns */
#pragma unroll
        for (int a = 0; a < DEC_NA; a++) {
            const int i = rg + G::RG * a;
            const float al = as[i], kk = ks[i];
            S[a].x *= al, S[a].y *= al, S[a].z *= al, S[a].w *= al;
            axpy4(d, kk, S[a]);
        }
        d = lanes_sum4<G::CGW>(d);
        float dl[4];
        const float dd[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int jc = j + c, jj = (EX || jc < V) ? jc : 0;
            dl[c] = (EX || jc < V) ? bs[p.beta_headwise ? jj : 0] * (vs[jj] - dd[c] * sk) * sk : 0.f;
        }
        const float4 dk = make_float4(dl[0], dl[1], dl[2], dl[3]); /* the k̂ δ_j factors */
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int a = 0; a < DEC_NA; a++) {
            const int i = rg + G::RG * a;
            const float kk = ks[i], qq = qs[i];
            axpy4(S[a], kk, dk);
            axpy4(o, qq, S[a]);
        }
        o = lanes_sum4<G::CGW>(o);
        if (rg == 0) {
            const float os[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
            for (int c = 0; c < 4; c++)
                if (EX || j + c < V) store_elem(p.o, p.o_dtype, (t * p.pb.hv + h) * V + j + c, os[c] * sq);
        }
    }
}

/* Store the registers' tile to slot `slot` of the final-state tensor (EX: its dtype is the stage's, SF32). */
template <int VF, int KC, int SF32, int EX>
DEV void store_tile(const kda_decode_params_t &p, const float4 S[DEC_NA], int64_t slot, int h, int j0) {
    const int64_t base = (slot * p.pb.hv + h) * (int64_t)(EX ? KC : p.pb.K) * p.pb.V;
#pragma unroll
    for (int a = 0; a < DEC_NA; a++) {
        int goff, soff;
        const int nv = chunk_at<VF, KC, EX>(a, p.pb.K, p.pb.V, j0, threadIdx.x, &goff, &soff);
        if (EX) {
            if (SF32) {
                __stcs((float4 *)p.pb.ht + (base + goff) / 4, S[a]);
            } else {
                uint2 u;
                u.x = pack_bf16(S[a].x, S[a].y);
                u.y = pack_bf16(S[a].z, S[a].w);
                __stcs((uint2 *)p.pb.ht + (base + goff) / 4, u);
            }
        } else {
            store4(p.pb.ht, p.pb.ht_dtype, base + goff, nv, p.vec, S[a]);
        }
    }
}

/* The initial state of an item from its stage into registers; a non-finite element poisons its column. The
 * test accumulates x·0 (NaN exactly when some x is ±∞ or NaN): one FMA per element. */
template <int VF, int KC, int SF32, int EX>
DEV void load_tile(const kda_decode_params_t &p, const unsigned char *st, int has_state, float4 S[DEC_NA], int j0) {
    typedef dec_geom<VF, KC> G;
    const int tid = threadIdx.x;
    if (!has_state) {
#pragma unroll
        for (int a = 0; a < DEC_NA; a++) S[a] = make_float4(0.f, 0.f, 0.f, 0.f);
        return;
    }
    float z[4] = {0.f, 0.f, 0.f, 0.f}; /* V-first: per row pass; K-first: per column of the chunk */
#pragma unroll
    for (int a = 0; a < DEC_NA; a++) {
        int goff, soff;
        const int nv = chunk_at<VF, KC, EX>(a, p.pb.K, p.pb.V, j0, tid, &goff, &soff);
        if (SF32) {
            S[a] = *(const float4 *)((const float *)st + soff);
        } else {
            const uint2 u = *(const uint2 *)((const uint16_t *)st + soff);
            const float2 lo = unpack_bf16(u.x), hi = unpack_bf16(u.y);
            S[a] = make_float4(lo.x, lo.y, hi.x, hi.y);
        }
        if (!EX) { /* past K or V: zero (bulk copies leave stale data there) */
            if (nv < 1) S[a].x = 0.f;
            if (nv < 2) S[a].y = 0.f;
            if (nv < 3) S[a].z = 0.f;
            if (nv < 4) S[a].w = 0.f;
        }
        if (VF) {
            float &zz = z[a / G::CPR];
            zz = fmaf(S[a].x, 0.f, zz);
            zz = fmaf(S[a].y, 0.f, zz);
            zz = fmaf(S[a].z, 0.f, zz);
            zz = fmaf(S[a].w, 0.f, zz);
        } else {
            z[0] = fmaf(S[a].x, 0.f, z[0]);
            z[1] = fmaf(S[a].y, 0.f, z[1]);
            z[2] = fmaf(S[a].z, 0.f, z[2]);
            z[3] = fmaf(S[a].w, 0.f, z[3]);
        }
    }
    int bad[4];
#pragma unroll
    for (int c = 0; c < 4; c++) bad[c] = VF ? row8_or(z[c] != z[c]) : lanes_or<G::CGW>(z[c] != z[c]);
#pragma unroll
    for (int a = 0; a < DEC_NA; a++) {
        if (VF) {
            if (bad[a / G::CPR]) S[a] = make_float4(NAN, NAN, NAN, NAN);
        } else {
            if (bad[0]) S[a].x = NAN;
            if (bad[1]) S[a].y = NAN;
            if (bad[2]) S[a].z = NAN;
            if (bad[3]) S[a].w = NAN;
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernel: VF layout, KC K class, SF32 stage dtype (the initial state's: fp32 or bf16). A stage is the
 * tile (dec_geom ELEMS elements) followed by the first token's input rows (p.raw_*), p.stage_bytes in all.
 * ------------------------------------------------------------------------------------------------------- */
/* Stages: KDA_DEC_STAGES, 3 (fp32) or 4 (bf16) tiles, so that three CTAs of 128 threads share an SM (the kernel
 * is bound by its instructions and their latencies more than by bytes in flight: the copy engine keeps the tiles
 * coming; four CTAs would leave 128 registers a thread, where the kernel spills). */
template <int VF, int KC, int SF32>
struct dec_stages {
    static constexpr int N = KDA_DEC_STAGES(SF32);
};

template <int VF, int KC, int SF32, int EX>
__global__ void __launch_bounds__(DEC_THREADS, 3) kda_decode_kernel(const kda_decode_params_t p) {
    typedef dec_geom<VF, KC> G;
    constexpr int NS = dec_stages<VF, KC, SF32>::N;
    extern __shared__ __align__(16) unsigned char smem[];
    dec_io<KC> &io = *(dec_io<KC> *)(smem + NS * p.stage_bytes);
    dec_item *ring = (dec_item *)(smem + NS * p.stage_bytes + sizeof(dec_io<KC>));
    uint64_t *bars = (uint64_t *)(ring + NS); /* one mbarrier per stage: its tile's bulk copies */
    const int ntiles = (p.pb.V + G::BV - 1) / G::BV;
    const int64_t nitems = p.pb.seqs.num_seqs * p.pb.hv * ntiles, grid = gridDim.x;
    const int tid = threadIdx.x;
    const int per_token = p.pb.state_indices && p.idx_cols > 0;
#define STAGE(k) (smem + (int)((k) % NS) * p.stage_bytes)
#define ROWS(k) STAGE(k) /* p.raw_* count from the stage start */
#define BAR(k) smem_u32(bars + (int)((k) % NS))
#define BAR_WAIT(k) mbar_wait(BAR(k), (uint32_t)(((k) / NS) & 1))
    if (tid == 0) {
        for (int s = 0; s < NS; s++) mbar_init(smem_u32(bars + s), 1);
        mbar_init_fence();
    }
    __syncthreads();

    /* prologue: the first NS − 1 items' tiles and first rows in flight, the first token committed */
    tok_raw raw;
#pragma unroll 1
    for (int s = 0; s < NS - 1; s++) {
        const dec_item d = make_item(p, blockIdx.x + s * grid, ntiles);
        issue_stage<VF, KC, SF32>(p, d, STAGE(s), BAR(s));
        issue_rows(p, d, ROWS(s));
        cp_async_commit();
        if (tid == 0) ring[s] = d;
    }
    dec_item dnext = make_item(p, blockIdx.x + (NS - 1) * grid, ntiles);
    cp_async_wait_group<NS - 2>();
    BAR_WAIT(0);
    __syncthreads(); /* the ring */
    read_rows(p, ring[0], ROWS(0), raw, 0);
    int buf = 0;
    int bad = __syncthreads_or(commit_token(p, io, buf, raw));

#pragma unroll 1
    for (int64_t k = 0; blockIdx.x + k * grid < nitems; k++) {
        const dec_item cur = ring[k % NS];
        /* the tile NS − 1 items ahead into the stage item k − 1 used; the descriptor after it */
        fence_proxy_async(); /* item k − 1's reads of that stage before the copy engine's writes */
        issue_stage<VF, KC, SF32>(p, dnext, STAGE(k + NS - 1), BAR(k + NS - 1));
        issue_rows(p, dnext, ROWS(k + NS - 1));
        cp_async_commit();
        if (tid == 0) ring[(k + NS - 1) % NS] = dnext;
        dnext = make_item(p, blockIdx.x + (k + NS) * grid, ntiles);

        const int j0 = cur.vt * G::BV;
        float4 S[DEC_NA];
        load_tile<VF, KC, SF32, EX>(p, STAGE(k), cur.valid && p.pb.h0 && cur.rslot >= 0, S, j0);
        const int64_t T = cur.valid ? cur.eos - cur.bos : 0;
#pragma unroll 1
        for (int64_t t = 0;; t++) {
            const int more = t + 1 < T;
            if (more) { /* the next token: staged, or loads in flight during this token */
                if (t + 1 < p.ts) read_rows(p, cur, ROWS(k), raw, (int)t + 1);
                else fetch_token(p, raw, cur.bos + t + 1, cur.h);
            }
            if (t < T) {
                if (bad) {
#pragma unroll
                    for (int a = 0; a < DEC_NA; a++) S[a] = make_float4(NAN, NAN, NAN, NAN);
                }
                token_step<VF, KC, EX>(p, io, buf, S, cur.bos + t, cur.h, j0);
                if (per_token && p.pb.ht) { /* speculative decoding: the state after this token to its own slot */
                    const int64_t ws = dec_token_slot(p, cur.n, t);
                    if (ws >= 0) store_tile<VF, KC, SF32, EX>(p, S, ws, cur.h, j0);
                }
            }
            if (!more) {
                if (cur.valid && !per_token && p.pb.ht && cur.rslot >= 0)
                    store_tile<VF, KC, SF32, EX>(p, S, cur.rslot, cur.h, j0);
                /* the next item's first token: its rows came with its tile (this thread's copies) */
                cp_async_wait_group<NS - 2>();
                if (blockIdx.x + (k + 1) * grid < nitems) {
                    BAR_WAIT(k + 1);
                    read_rows(p, ring[(k + 1) % NS], ROWS(k + 1), raw, 0);
                } else {
                    zero_token(raw);
                }
            }
            buf ^= 1;
            bad = __syncthreads_or(commit_token(p, io, buf, raw)); /* also publishes the stage and the ring */
            if (!more) break;
        }
    }
    cp_async_wait_group<0>();
#undef STAGE
#undef ROWS
#undef BAR
#undef BAR_WAIT
}

/* The launch of an instance: its shared memory (the stages, the inputs, the descriptor ring and its mbarriers),
 * its registers per thread (asked once per device) and so its CTAs (launch.c). */
template <int VF, int KC, int SF32, int EX, int NA>
static int kda_dec_staged_launch(const kda_decode_params_t *p, int device, void *stream) {
    static_assert(NA == DEC_NA, "the staged kernel holds DEC_NA chunks per thread");
    constexpr int NS = dec_stages<VF, KC, SF32>::N;
    static int done[KDA_MAX_DEVICES];
    static int regs[KDA_MAX_DEVICES];
    const void *fn = (const void *)kda_decode_kernel<VF, KC, SF32, EX>;
    kda_decode_params_t c = *p;
    c.smem_bytes = NS * c.stage_bytes + (int)sizeof(dec_io<KC>) + NS * (int)(sizeof(dec_item) + 8);
    cudaError_t e = kda_smem_limit(fn, c.smem_bytes, device, done);
    if (e != cudaSuccess) return (int)e;
    const int known = device >= 0 && device < KDA_MAX_DEVICES;
    int r = known ? regs[device] : 0;
    if (r <= 0) {
        cudaFuncAttributes attr;
        e = cudaFuncGetAttributes(&attr, fn);
        if (e != cudaSuccess) return (int)e;
        r = attr.numRegs > 0 ? attr.numRegs : 255;
        if (known) regs[device] = r;
    }
    const int64_t ctas = kda_decode_staged_ctas(&c, r);
    if (ctas == 0) return 0;
    kda_decode_kernel<VF, KC, SF32, EX><<<(unsigned)ctas, DEC_THREADS, c.smem_bytes, (cudaStream_t)stream>>>(c);
    return (int)cudaGetLastError();
}

#endif /* KDA_CUDA_DECODE_STAGED_CUH */
