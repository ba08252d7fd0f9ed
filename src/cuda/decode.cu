/*
 * CUDA recurrent decode (kda_decode for few tokens per sequence): the token recurrence of docs/ALGORITHM.md §1
 * with the state held in fp32 registers, fp32 arithmetic. One CTA of 128 threads per (sequence n, value head h,
 * tile of BV value columns); the CTA reads its K×BV tile of the state once, runs the sequence's tokens, and
 * writes the tile back (in place in a pool, or to another pool). Per token t, with the inputs of §2:
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
 * State slots: the tile is read from slot r_n (1-D state_indices[n]; 2-D state_indices[n][a_n − 1] with a_n
 * = num_accepted_tokens[n] clamped into [1, T_max]; none: n), or zeros when r_n is negative or outside the
 * pool; it is written after the last token to r_n (1-D, none), or after every token t to state_indices[n][t]
 * (2-D; nothing for a negative or out-of-pool entry, nothing for tokens past T_max). Device contents are never
 * validated here (that needs a host sync): the clamps above are all the kernel does with bad indices.
 *
 * Non-finite contract: a token whose q, k, v, β (all V of them) or gate (after the clamp) has a non-finite
 * value turns the tile into NaN before that token, so o_t, later outputs and the state are NaN; earlier
 * outputs are unchanged. A non-finite value in the initial state poisons the tiles that hold it (each CTA
 * sees only its tile: with V > BV the other tiles of the head are not poisoned — a known deviation).
 *
 * Thread layout (a "chunk" is 4 consecutive elements of a memory row: one 16-byte fp32 / 8-byte bf16 access):
 *   V-first ([V, K] rows, K contiguous): warp w, lane l hold rows j = j0 + w + 4s (s < SJ) and K elements
 *     i = 4l + 128r + c (r < RI, c < 4); reductions over K: a warp all-reduce (5 shuffles per value).
 *   K-first ([K, V] rows, V contiguous): thread (ti = tid / 8, tj = tid % 8) holds rows i = ti + 16a (a < NA)
 *     and columns j = j0 + 4tj + c; reductions over K: 2 shuffles, then the 4 warps through shared memory.
 * Every input of a token is in shared memory (128 threads load q, k, gate, v, β; the state loads are issued
 * first, so they are in flight while the inputs arrive); padding past K / V is zero, so masked elements stay 0.
 */
#include <string.h>

#include "common.cuh"
#include "decode.h"

#define DEC_THREADS 128

struct dec_smem {
    float q[2][256], k[2][256], a[2][256], v[2][256], b[2][256];
    float red_d[4][32], red_o[4][32]; /* K-first: per-warp partial sums of d and o */
};

DEV int finite_f(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

DEV float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Four consecutive state elements starting at element `off` of a state tensor of dtype dt (vectorised when
 * `vec`), masked by `valid` (number of the four that exist, 0..4). */
DEV float4 load4(const void *base, int dt, int64_t off, int valid, int vec) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (valid <= 0) return r;
    if (vec && valid == 4) {
        if (dt == KDA_DT_F32) return __ldcs((const float4 *)((const float *)base + off));
        const uint2 u = __ldcs((const uint2 *)((const uint16_t *)base + off));
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
        if (dt == KDA_DT_F32) {
            __stcs((float4 *)((float *)base + off), x);
        } else {
            uint2 u;
            u.x = pack_bf16(x.x, x.y);
            u.y = pack_bf16(x.z, x.w);
            __stcs((uint2 *)((uint16_t *)base + off), u);
        }
        return;
    }
    store_elem(base, dt, off, x.x);
    if (valid > 1) store_elem(base, dt, off + 1, x.y);
    if (valid > 2) store_elem(base, dt, off + 2, x.z);
    if (valid > 3) store_elem(base, dt, off + 3, x.w);
}

DEV int clamp_valid(int n) { return n < 0 ? 0 : (n > 4 ? 4 : n); }

/* Chunk a of thread tid in the V tile starting at column j0: its element offset within a head's state
 * block (*off) and how many of its 4 elements exist (the return value, 0..4). */
template <int VF, int RI>
DEV int chunk_at(int a, int K, int V, int j0, int tid, int64_t *off) {
    if (VF) {
        const int s = a / RI, r = a % RI;
        const int j = j0 + (tid >> 5) + 4 * s, i = 4 * (tid & 31) + 128 * r;
        *off = (int64_t)j * K + i;
        return j < V ? clamp_valid(K - i) : 0;
    }
    const int i = (tid >> 3) + 16 * a, j = j0 + 4 * (tid & 7);
    *off = (int64_t)i * V + j;
    return i < K ? clamp_valid(V - j) : 0;
}

/* The slot of sequence n read at the start (-1: zeros). */
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
    return (s < 0 || s >= p.num_state_slots) ? -1 : s;
}

DEV int64_t dec_token_slot(const kda_decode_params_t &p, int64_t n, int64_t t) {
    if (t >= p.idx_cols) return -1;
    const int64_t s = p.state_indices[n * p.idx_stride + t];
    return (s < 0 || s >= p.num_state_slots) ? -1 : s;
}

/* A token's raw inputs as this thread holds them between fetch_token (global loads, issued a token ahead so
 * that their latency hides behind the current token's arithmetic) and commit_token (transforms, shared memory):
 * elements e = tid and tid + 128 of q, k, g (K long), v and β (V long, or one β). */
struct tok_raw {
    float q[2], k[2], g[2], v[2], b[2];
};

DEV void fetch_token(const kda_decode_params_t &p, tok_raw &r, int64_t t, int h, int hq) {
    const int K = p.kd, V = p.vd, tid = threadIdx.x;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int e = tid + u * DEC_THREADS;
        r.q[u] = r.k[u] = r.g[u] = r.v[u] = r.b[u] = 0.f;
        if (e < K) {
            r.q[u] = load_elem(p.q, p.dtype, (t * p.hqk + hq) * K + e);
            r.k[u] = load_elem(p.k, p.dtype, (t * p.hqk + hq) * K + e);
            r.g[u] = load_elem(p.g, p.g_dtype, (t * p.hv + h) * K + e);
        }
        if (e < V) r.v[u] = load_elem(p.v, p.dtype, (t * p.hv + h) * V + e);
        if (p.beta_headwise ? e < V : e == 0)
            r.b[u] = load_elem(p.beta, p.beta_dtype, p.beta_headwise ? (t * p.hv + h) * V + e : t * p.hv + h);
    }
}

/* Gate (with bias[], this thread's dt_bias elements, and A), clamp, α = e^g, β transform into buffer `buf`;
 * returns nonzero if any of this thread's inputs is non-finite (the non-finite contract). */
DEV int commit_token(const kda_decode_params_t &p, dec_smem &sm, int buf, const tok_raw &r, const float bias[2],
                     float A) {
    const int K = p.kd, V = p.vd, tid = threadIdx.x;
    int bad = 0;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int e = tid + u * DEC_THREADS;
        float a = 1.f, b = r.b[u];
        if (e < K) {
            float g = r.g[u];
            if (p.gate_in_kernel) {
                const float x = g + bias[u];
                g = p.lower_bound != 0.0f ? p.lower_bound * sigmoidf_(A * x) : -A * softplusf_(x);
            }
            g = g > 0.0f ? 0.0f : g; /* clamp into [KDA_GATE_MIN, 0]; NaN stays NaN */
            g = g < KDA_GATE_MIN ? KDA_GATE_MIN : g;
            bad |= !finite_f(r.q[u]) | !finite_f(r.k[u]) | !finite_f(g);
            a = ex2(g * LOG2E);
        }
        if (e < V) bad |= !finite_f(r.v[u]);
        if (p.beta_headwise ? e < V : e == 0) {
            if (p.beta_sigmoid) b = (p.neg_eigval ? 2.0f : 1.0f) * sigmoidf_(b);
            bad |= !finite_f(b);
        }
        sm.q[buf][e] = r.q[u];
        sm.k[buf][e] = r.k[u];
        sm.a[buf][e] = a;
        sm.v[buf][e] = r.v[u];
        sm.b[buf][e] = b;
    }
    return bad;
}

/* Scale factors of q̂ and k̂ for buffer `buf` (every warp computes them for itself from shared memory). */
DEV void token_norms(const kda_decode_params_t &p, const dec_smem &sm, int buf, float *sq, float *sk) {
    if (!p.l2norm) {
        *sq = p.scale;
        *sk = 1.0f;
        return;
    }
    const int lane = threadIdx.x & 31;
    float a = 0.f, b = 0.f;
    for (int e = lane; e < p.kd; e += 32) {
        const float x = sm.q[buf][e], y = sm.k[buf][e];
        a += x * x;
        b += y * y;
    }
    a = warp_sum(a);
    b = warp_sum(b);
    *sq = p.scale / sqrtf(a + 1e-6f);
    *sk = 1.0f / sqrtf(b + 1e-6f);
}

/* VF = 1: V-first, NA = SJ * RI chunks; VF = 0: K-first, NA rows (RI unused). */
template <int VF, int NA, int RI>
__global__ void __launch_bounds__(DEC_THREADS, NA <= 4 ? 7 : (NA <= 8 ? 5 : 3)) kda_decode_kernel(const kda_decode_params_t p) {
    __shared__ __align__(16) dec_smem sm;
    constexpr int SJ = VF ? NA / RI : 1;
    const int K = p.kd, V = p.vd;
    const int BV = p.bv, ntiles = (V + BV - 1) / BV;
    const int64_t blk = blockIdx.x;
    const int vt = (int)(blk % ntiles);
    const int h = (int)((blk / ntiles) % p.hv);
    const int64_t n = blk / ((int64_t)ntiles * p.hv);
    const int hq = h / p.group;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int j0 = vt * BV;

    int64_t bos, eos;
    if (!p.cu_seqlens) {
        bos = n * p.seq_len;
        eos = bos + p.seq_len;
    } else {
        int64_t a0 = p.cu_seqlens_64 ? ((const int64_t *)p.cu_seqlens)[n] : ((const int32_t *)p.cu_seqlens)[n];
        int64_t a1 = p.cu_seqlens_64 ? ((const int64_t *)p.cu_seqlens)[n + 1]
                                     : ((const int32_t *)p.cu_seqlens)[n + 1];
        a0 = a0 < 0 ? 0 : (a0 > p.num_tokens ? p.num_tokens : a0);
        a1 = a1 < a0 ? a0 : (a1 > p.num_tokens ? p.num_tokens : a1);
        bos = a0;
        eos = a1;
    }
    const int per_token = p.state_indices && p.idx_cols > 0;
    if (per_token && eos == bos) return; /* 2-D: nothing is read or written for an empty sequence */

    const int64_t head_elems = (int64_t)K * V;
    /* the state tile: issue every load first */
    float4 S[NA];
    const int64_t rslot = dec_read_slot(p, n);
    if (p.h0 && rslot >= 0) {
        const int64_t base = (rslot * p.hv + h) * head_elems;
#pragma unroll
        for (int a = 0; a < NA; a++) {
            int64_t off;
            const int nv = chunk_at<VF, RI>(a, K, V, j0, tid, &off);
            S[a] = load4(p.h0, p.h0_dtype, base + off, nv, p.vec);
        }
    } else {
#pragma unroll
        for (int a = 0; a < NA; a++) S[a] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    int bad_state = 0;
    int64_t t = bos;
    int buf = 0;
    /* per head constants of the gate: A = e^{A_log[h]} (1 without), this thread's dt_bias elements */
    const float A = p.A_log ? expf(p.A_log[h]) : 1.0f;
    float bias[2] = {0.f, 0.f};
    if (p.dt_bias) {
        if (tid < K) bias[0] = p.dt_bias[(int64_t)h * K + tid];
        if (tid + DEC_THREADS < K) bias[1] = p.dt_bias[(int64_t)h * K + tid + DEC_THREADS];
    }
    tok_raw raw;
    int bad = 0;
    if (eos > bos) {
        fetch_token(p, raw, t, h, hq);
        bad = commit_token(p, sm, 0, raw, bias, A);
    }
#pragma unroll
    for (int a = 0; a < NA; a++)
        bad_state |= !finite_f(S[a].x) | !finite_f(S[a].y) | !finite_f(S[a].z) | !finite_f(S[a].w);
    bad = __syncthreads_or(bad | bad_state);

    for (; t < eos; t++) {
        if (bad) {
#pragma unroll
            for (int a = 0; a < NA; a++) S[a] = make_float4(NAN, NAN, NAN, NAN);
        }
        if (t + 1 < eos) fetch_token(p, raw, t + 1, h, hq); /* in flight during this token's arithmetic */
        float sq, sk;
        token_norms(p, sm, buf, &sq, &sk);
        const float *qs = sm.q[buf], *ks = sm.k[buf], *as = sm.a[buf], *vs = sm.v[buf], *bs = sm.b[buf];

        if (VF) {
            /* decay and d = Sᵀk̂ per row j */
            float d[SJ];
#pragma unroll
            for (int s = 0; s < SJ; s++) d[s] = 0.f;
#pragma unroll
            for (int a = 0; a < NA; a++) {
                const int s = a / RI, r = a % RI, i = 4 * lane + 128 * r;
                const float4 al = *(const float4 *)(as + i), kk = *(const float4 *)(ks + i);
                S[a].x *= al.x;
                S[a].y *= al.y;
                S[a].z *= al.z;
                S[a].w *= al.w;
                d[s] += (kk.x * S[a].x + kk.y * S[a].y) + (kk.z * S[a].z + kk.w * S[a].w);
            }
            float o[SJ];
#pragma unroll
            for (int s = 0; s < SJ; s++) {
                const int j = j0 + w + 4 * s;
                const int jj = j < V ? j : 0;
                const float dd = warp_sum(d[s]) * sk;
                d[s] = (j < V) ? bs[p.beta_headwise ? jj : 0] * (vs[jj] - dd) : 0.f; /* δ_j */
                o[s] = 0.f;
            }
#pragma unroll
            for (int a = 0; a < NA; a++) {
                const int s = a / RI, r = a % RI, i = 4 * lane + 128 * r;
                const float4 kk = *(const float4 *)(ks + i), qq = *(const float4 *)(qs + i);
                const float dl = d[s] * sk;
                S[a].x += kk.x * dl;
                S[a].y += kk.y * dl;
                S[a].z += kk.z * dl;
                S[a].w += kk.w * dl;
                o[s] += (qq.x * S[a].x + qq.y * S[a].y) + (qq.z * S[a].z + qq.w * S[a].w);
            }
#pragma unroll
            for (int s = 0; s < SJ; s++) {
                const float os = warp_sum(o[s]) * sq;
                const int j = j0 + w + 4 * s;
                if (lane == s && j < V) store_elem(p.o, p.o_dtype, (t * p.hv + h) * V + j, os);
            }
        } else {
            const int ti = tid >> 3, tj = tid & 7;
            float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma unroll
            for (int a = 0; a < NA; a++) {
                const int i = ti + 16 * a;
                const float al = as[i], kk = ks[i];
                S[a].x *= al;
                S[a].y *= al;
                S[a].z *= al;
                S[a].w *= al;
                d0 += kk * S[a].x;
                d1 += kk * S[a].y;
                d2 += kk * S[a].z;
                d3 += kk * S[a].w;
            }
#pragma unroll
            for (int o = 8; o < 32; o <<= 1) {
                d0 += __shfl_xor_sync(0xffffffffu, d0, o);
                d1 += __shfl_xor_sync(0xffffffffu, d1, o);
                d2 += __shfl_xor_sync(0xffffffffu, d2, o);
                d3 += __shfl_xor_sync(0xffffffffu, d3, o);
            }
            if (lane < 8) *(float4 *)&sm.red_d[w][4 * tj] = make_float4(d0, d1, d2, d3);
            __syncthreads();
            float dl[4];
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int j = j0 + 4 * tj + c, jj = j < V ? j : 0;
                const float dd = (sm.red_d[0][4 * tj + c] + sm.red_d[1][4 * tj + c]) +
                                 (sm.red_d[2][4 * tj + c] + sm.red_d[3][4 * tj + c]);
                dl[c] = j < V ? bs[p.beta_headwise ? jj : 0] * (vs[jj] - dd * sk) * sk : 0.f; /* k̂ δ factor */
            }
            float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
            for (int a = 0; a < NA; a++) {
                const int i = ti + 16 * a;
                const float kk = ks[i], qq = qs[i];
                S[a].x += kk * dl[0];
                S[a].y += kk * dl[1];
                S[a].z += kk * dl[2];
                S[a].w += kk * dl[3];
                o0 += qq * S[a].x;
                o1 += qq * S[a].y;
                o2 += qq * S[a].z;
                o3 += qq * S[a].w;
            }
#pragma unroll
            for (int o = 8; o < 32; o <<= 1) {
                o0 += __shfl_xor_sync(0xffffffffu, o0, o);
                o1 += __shfl_xor_sync(0xffffffffu, o1, o);
                o2 += __shfl_xor_sync(0xffffffffu, o2, o);
                o3 += __shfl_xor_sync(0xffffffffu, o3, o);
            }
            if (lane < 8) *(float4 *)&sm.red_o[w][4 * tj] = make_float4(o0, o1, o2, o3);
            __syncthreads();
            if (tid < 8) {
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int j = j0 + 4 * tj + c;
                    const float os = (sm.red_o[0][4 * tj + c] + sm.red_o[1][4 * tj + c]) +
                                     (sm.red_o[2][4 * tj + c] + sm.red_o[3][4 * tj + c]);
                    if (j < V) store_elem(p.o, p.o_dtype, (t * p.hv + h) * V + j, os * sq);
                }
            }
        }

        /* speculative decoding: the state after this token to its own slot */
        if (per_token && p.ht) {
            const int64_t ws = dec_token_slot(p, n, t - bos);
            if (ws >= 0) {
                const int64_t base = (ws * p.hv + h) * head_elems;
#pragma unroll
                for (int a = 0; a < NA; a++) {
                    int64_t off;
                    const int nv = chunk_at<VF, RI>(a, K, V, j0, tid, &off);
                    store4(p.ht, p.ht_dtype, base + off, nv, p.vec, S[a]);
                }
            }
        }
        /* the next token's inputs into the other buffer, one barrier */
        if (t + 1 < eos) {
            buf ^= 1;
            bad = __syncthreads_or(bad | commit_token(p, sm, buf, raw, bias, A));
        }
    }

    if (!per_token && p.ht && rslot >= 0) {
        if (bad) {
#pragma unroll
            for (int a = 0; a < NA; a++) S[a] = make_float4(NAN, NAN, NAN, NAN);
        }
        const int64_t base = (rslot * p.hv + h) * head_elems;
#pragma unroll
        for (int a = 0; a < NA; a++) {
            int64_t off;
            const int nv = chunk_at<VF, RI>(a, K, V, j0, tid, &off);
            store4(p.ht, p.ht_dtype, base + off, nv, p.vec, S[a]);
        }
    }
}

static void decode_plan(kda_decode_params_t *p) {
    const int row = p->v_first ? p->kd : p->vd; /* contiguous elements of a state row */
    const int h0_ok = !p->h0 || ((uintptr_t)p->h0 % (p->h0_dtype == KDA_DT_F32 ? 16 : 8)) == 0;
    const int ht_ok = !p->ht || ((uintptr_t)p->ht % (p->ht_dtype == KDA_DT_F32 ? 16 : 8)) == 0;
    p->vec = row % 4 == 0 && h0_ok && ht_ok;
    if (p->v_first) {
        /* 16 columns per CTA when 32 would leave SMs idle (small N) */
        const int64_t ctas32 = p->num_seqs * p->hv * ((p->vd + 31) / 32);
        p->bv = ctas32 < 2 * (int64_t)p->sm_count ? 16 : 32;
        /* a test's or benchmark's forced tile width (kda_tuning_t.decode_bv): the same bits either way, each
           output being a warp reduction over K that does not depend on the tile */
        if (p->forced_bv == 16 || p->forced_bv == 32) p->bv = p->forced_bv;
        const int ri = p->kd > 128 ? 2 : 1;
        p->na = p->bv / 4 * ri;
    } else {
        p->bv = 32;
        p->na = p->kd <= 64 ? 4 : (p->kd <= 128 ? 8 : 16);
    }
}

template <int VF, int NA, int RI>
static int launch(const kda_decode_params_t *p, void *stream) {
    const int64_t ctas = p->num_seqs * p->hv * ((p->vd + p->bv - 1) / p->bv);
    if (ctas == 0) return 0;
    kda_decode_kernel<VF, NA, RI><<<(unsigned)ctas, DEC_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}

static int launch_decode(const kda_decode_params_t *p, void *stream) {
    if (p->v_first) {
        const int ri = p->kd > 128 ? 2 : 1;
        if (ri == 1) return p->na == 4 ? launch<1, 4, 1>(p, stream) : launch<1, 8, 1>(p, stream);
        return p->na == 8 ? launch<1, 8, 2>(p, stream) : launch<1, 16, 2>(p, stream);
    }
    if (p->na == 4) return launch<0, 4, 1>(p, stream);
    if (p->na == 8) return launch<0, 8, 1>(p, stream);
    return launch<0, 16, 1>(p, stream);
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

extern "C" kda_status_t kda_cuda_decode_run(const kda_problem_t *pr, int device, int sm_count, int forced_bv,
                                            void *stream, const char *fn) {
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
    c.sm_count = sm_count;
    c.forced_bv = forced_bv;
    decode_plan(&c);
    if (c.num_seqs * c.hv * ((c.vd + c.bv - 1) / c.bv) >= ((int64_t)1 << 31))
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'num_seqs': %lld sequences of %d heads exceed one "
                         "launch", fn, (long long)c.num_seqs, c.hv);

    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
    if (e != cudaSuccess) return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    const int err = launch_decode(&c, stream);
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the decode kernel: %s", fn,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}
