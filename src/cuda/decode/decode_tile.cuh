/*
 * CUDA recurrent decode, the tile kernel: one CTA of 128 threads per (sequence n, value head h, tile of BV value
 * columns) for the exact head sizes K ∈ {64, 128} (BV = 4096 / K, V a multiple of BV), fp32 or bf16 states,
 * scalar β. The same recurrence as the staged kernel (decode_staged.cuh; docs/ALGORITHM.md §1; inputs of §2), per
 * token t:
 *
 *     q̂ = s_q q_t, k̂ = s_k k_t         (l2norm: s_q = s / sqrt(Σq² + 1e−6), s_k = 1 / sqrt(Σk² + 1e−6);
 *                                       else s_q = s, s_k = 1)
 *     α = exp(clamp(gate(g_t), KDA_GATE_MIN, 0)),   β = β_t, sigmoid(β_t) or 2 sigmoid(β_t)
 *     S' = Diag(α) S
 *     a_j = Σ_i S'_ij k_i,  b_j = Σ_i S'_ij q_i       (one pass over the tile: both reductions over K)
 *     δ_j = β (v_j − s_k a_j)
 *     S  = S' + (s_k k) δᵀ
 *     o_j = s_q (b_j + s_k δ_j Σ_i k_i q_i)           (= Σ_i q̂_i S_ij after the update)
 *
 * Why a second kernel: decode streams the pool (each state read once and written once at a few flops per
 * element), and the staged kernel's generality (any K and V, persistent items, staged rows) costs it several
 * times the instructions per tile that the arithmetic needs. Here a CTA issues the first token's input loads and
 * its slot's index first, then its tile's loads (8 or 16 vector loads per thread straight into registers),
 * transforms the inputs while the tile flies (they return first: issued behind the tile, they would make every
 * CTA wait for its whole tile before its transform and barrier), makes one pass with both reductions, and
 * stores; four to six CTAs per SM (dt_geom MIN_CTAS) keep 96–128 KB of fp32 state in flight. The grid is
 * (tiles, HV, N), tiles fastest, so the CTAs of a head run together and share its input rows in L2.
 *
 * Per token the CTA loads each input row once, element e = tid (+128) per thread: q, k, g (+ dt_bias) of K,
 * the whole v row (the non-finite contract checks all V of it), β; transforms them (gate, α, β) into one of
 * two shared-memory buffers with each warp's partial sums of q², k² and q·k and a non-finite flag; one barrier
 * per token. The next token's rows are loaded into registers during the current token's arithmetic.
 *
 * Thread layout of the tile (a "chunk" is 4 consecutive elements of a memory row; lane l of warp w), as in
 * the staged kernel: V-first ([V, K] rows): 8 lanes per row, row j = 16·pass + 4w + (l >> 3), elements
 * i = 4(l & 7) + 32c; K-first ([K, V] rows): lane l holds columns 4(w·CGW + l % CGW) .. +3 and rows
 * i = l / CGW + RG·a. Reductions over K: 3 shuffles within the 8 lanes (V-first), log2(RG) within the warp
 * (K-first).
 *
 * Slots, the non-finite contract and the empty-sequence rules are the staged kernel's (its header). The row's own
 * state is loaded before its slot's ownership (claim) is known; a row that does not own the slot drops what
 * it loaded and starts from zeros. A non-finite initial-state column shows as a non-finite a_j: a_j is then
 * made NaN, which makes the column and o_j NaN (finite states whose products overflow fp32 do the same).
 */
#ifndef KDA_CUDA_DECODE_TILE_CUH
#define KDA_CUDA_DECODE_TILE_CUH

#include "decode.cuh"

#define DT_THREADS KDA_DT_THREADS
#define DT_SCAN KDA_DT_SCAN

/* NA four-element chunks of state per thread (8 or 16): a tile of 512·NA elements, BV = 512·NA / K columns. */
template <int VF, int KD, int NA>
struct dt_geom {
    static constexpr int TILE = DT_THREADS * 4 * NA;
    static constexpr int BV = KDA_DT_BV(KD, NA);     /* columns: 32 or 64 (K = 128), 64 or 128 (K = 64) */
    static constexpr int CPR = KD / 32;              /* V-first: chunks of a row per lane */
    static constexpr int NP = NA / CPR;              /* V-first: rows per thread */
    static constexpr int CB = BV / 32;               /* K-first: chunks of a row per lane (columns 4(l & 7) + 32u) */
    static constexpr int RR = KD / 16;               /* K-first: rows per thread (rows (l >> 3) + 4w + 16r) */
    static constexpr int MIN_CTAS = NA == 8 ? 6 : 4; /* per SM: ≤ 80 or ≤ 128 registers per thread */
    static_assert(VF ? NP * CPR == NA : CB * RR == NA, "decode tile geometry");
};

/* Inputs of one token after the transform, each warp's partial sums (q², k², q·k, non-finite flag), and
 * (K-first) each warp's partial reductions over its rows, (a_j, b_j) per column. */
template <int VF, int KD, int NA>
struct dt_io {
    typedef dt_geom<VF, KD, NA> G;
    float q[KD], k[KD], a[KD], v[G::BV];
    float4 part[DT_THREADS / 32];
    float2 red[VF ? 1 : DT_THREADS / 32][VF ? 1 : G::BV];
    float beta;
};

/* A token's raw inputs as loaded by one thread (element e = tid of q, k, g, dt_bias; e and e + 128 of v), as
 * bits: converted only in dt_commit, so that the loads go out back to back. */
struct dt_raw {
    uint32_t q, k, g, v0, v1, b;
    float bias, A;
};

DEV void dt_fetch(const kda_decode_params_t &p, dt_raw &r, int64_t t, int h, int hq) {
    const int e = threadIdx.x, K = p.pb.K, V = p.pb.V;
    r.q = r.k = r.g = r.v0 = r.v1 = 0u; /* the bits of 0 in every dtype */
    r.bias = 0.f;
    if (e < K) {
        r.q = load_bits(p.pb.q, p.pb.dtype, (t * p.pb.hqk + hq) * K + e);
        r.k = load_bits(p.pb.k, p.pb.dtype, (t * p.pb.hqk + hq) * K + e);
        r.g = load_bits(p.pb.g, p.pb.g_dtype, (t * p.pb.hv + h) * K + e);
        if (p.pb.dt_bias) r.bias = p.pb.dt_bias[(int64_t)h * K + e];
    }
    if (e < V) r.v0 = load_bits(p.pb.v, p.pb.dtype, (t * p.pb.hv + h) * V + e);
    if (e + DT_THREADS < V) r.v1 = load_bits(p.pb.v, p.pb.dtype, (t * p.pb.hv + h) * V + e + DT_THREADS);
    r.b = load_bits(p.pb.beta, p.pb.beta_dtype, t * p.pb.hv + h);
}

/* The transform of r into io (this thread's elements, its warp's partial sums). */
template <int VF, int KD, int NA>
DEV void dt_commit(const kda_decode_params_t &p, dt_io<VF, KD, NA> &io, const dt_raw &r, int j0) {
    constexpr int BV = dt_geom<VF, KD, NA>::BV;
    const int e = threadIdx.x, K = p.pb.K, V = p.pb.V;
    int bad = 0;
    float qq = 0.f, kk = 0.f, qk = 0.f;
    if (e < K) {
        const float q = bits_value(r.q, p.pb.dtype), k = bits_value(r.k, p.pb.dtype);
        const float g = dec_gate(p, bits_value(r.g, p.pb.g_dtype), r.bias, r.A);
        bad |= !finite_f(q) | !finite_f(k) | !finite_f(g);
        io.q[e] = q;
        io.k[e] = k;
        io.a[e] = ex2(g * LOG2E);
        qq = q * q;
        kk = k * k;
        qk = q * k;
    }
    const float v0 = bits_value(r.v0, p.pb.dtype), v1 = bits_value(r.v1, p.pb.dtype);
    bad |= (e < V && !finite_f(v0)) | (e + DT_THREADS < V && !finite_f(v1));
    const int jl = e - j0, jl1 = e + DT_THREADS - j0;
    if (jl >= 0 && jl < BV) io.v[jl] = v0;
    if (jl1 >= 0 && jl1 < BV) io.v[jl1] = v1;
    if (e == 0) {
        const float b = dec_beta(p, bits_value(r.b, p.pb.beta_dtype));
        io.beta = b;
        bad |= !finite_f(b);
    }
    qq = lanes_sum<1>(qq);
    kk = lanes_sum<1>(kk);
    qk = lanes_sum<1>(qk);
    bad = __any_sync(0xffffffffu, bad);
    if ((e & 31) == 0) io.part[e >> 5] = make_float4(qq, kk, qk, bad ? 1.f : 0.f);
}

/* V-first: the first element (along K) of chunk cc (< CPR) of a row for lane l: 4(l & 7) + 32cc, or for bf16
 * states 8(l & 7) + 64(cc / 2) + 4(cc % 2): chunks 2m and 2m + 1 side by side, one 16-byte load. */
template <int SF32>
DEV int dt_vf_i(int lane, int cc) {
    return SF32 ? 4 * (lane & 7) + 32 * cc : 8 * (lane & 7) + 64 * (cc >> 1) + 4 * (cc & 1);
}

/* Chunk a of thread tid: element offset within the head's K×V block. Memory rows are whole 128-byte lines per
 * 8 lanes in both layouts (fp32; 64 bytes for bf16). */
template <int VF, int KD, int NA, int SF32>
DEV int dt_chunk(int a, int V, int j0, int tid) {
    typedef dt_geom<VF, KD, NA> G;
    const int lane = tid & 31, w = tid >> 5;
    if (VF) return (j0 + 16 * (a / G::CPR) + 4 * w + (lane >> 3)) * KD + dt_vf_i<SF32>(lane, a % G::CPR);
    return ((lane >> 3) + 4 * w + 16 * (a / G::CB)) * V + j0 + 4 * (lane & 7) + 32 * (a % G::CB);
}

template <int SF32>
DEV float4 dt_load4(const void *base, int64_t off) {
    if (SF32) return __ldcs((const float4 *)((const float *)base + off));
    const uint2 u = __ldcs((const uint2 *)((const uint16_t *)base + off));
    const float2 lo = unpack_bf16(u.x), hi = unpack_bf16(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <int VF, int KD, int NA, int SF32>
DEV void dt_store_tile(const kda_decode_params_t &p, const float4 S[NA], int64_t slot, int h, int j0) {
    const int64_t base = (slot * p.pb.hv + h) * (int64_t)KD * p.pb.V;
    if (VF && !SF32) { /* chunk pairs: 16 bytes */
#pragma unroll
        for (int a = 0; a < NA; a += 2) {
            uint4 u;
            u.x = pack_bf16(S[a].x, S[a].y), u.y = pack_bf16(S[a].z, S[a].w);
            u.z = pack_bf16(S[a + 1].x, S[a + 1].y), u.w = pack_bf16(S[a + 1].z, S[a + 1].w);
            __stcs((uint4 *)((uint16_t *)p.pb.ht + base + dt_chunk<VF, KD, NA, SF32>(a, p.pb.V, j0, threadIdx.x)), u);
        }
    } else {
#pragma unroll
        for (int a = 0; a < NA; a++)
            store4_vec(p.pb.ht, SF32, base + dt_chunk<VF, KD, NA, SF32>(a, p.pb.V, j0, threadIdx.x), S[a]);
    }
}

template <int VF, int KD, int NA, int SF32>
DEV void dt_load_tile(const kda_decode_params_t &p, float4 S[NA], int64_t slot, int h, int j0) {
    const int64_t base = (slot * p.pb.hv + h) * (int64_t)KD * p.pb.V;
    if (VF && !SF32) {
#pragma unroll
        for (int a = 0; a < NA; a += 2) {
            const uint4 u = __ldcs((const uint4 *)((const uint16_t *)p.pb.h0 + base +
                                                   dt_chunk<VF, KD, NA, SF32>(a, p.pb.V, j0, threadIdx.x)));
            const float2 x0 = unpack_bf16(u.x), x1 = unpack_bf16(u.y), x2 = unpack_bf16(u.z), x3 = unpack_bf16(u.w);
            S[a] = make_float4(x0.x, x0.y, x1.x, x1.y);
            S[a + 1] = make_float4(x2.x, x2.y, x3.x, x3.y);
        }
    } else {
#pragma unroll
        for (int a = 0; a < NA; a++)
            S[a] = dt_load4<SF32>(p.pb.h0, base + dt_chunk<VF, KD, NA, SF32>(a, p.pb.V, j0, threadIdx.x));
    }
}

/* p itself, opaque to the compiler: the update pass reloads k̂ from shared memory instead of keeping the first
 * pass's values live across the reductions (16 more registers at 16 chunks per thread, which then spill). */
DEV const float *dt_opaque(const float *p) {
    asm volatile("" : "+l"(p));
    return p;
}

/* δ_j and o_j of column j from its reductions a_j (over k) and b_j (over q): returns s_k δ_j, stores o_j. */
DEV float dt_column(const kda_decode_params_t &p, float a, float b, float v, float beta, float sq, float sk, float kq,
                    int store, int64_t oidx) {
    a = finite_f(a) ? a : NAN; /* a non-finite initial-state column */
    const float d = beta * (v - sk * a);
    if (store) store_elem(p.o, p.o_dtype, oidx, sq * (b + kq * d));
    return sk * d;
}

/* One token on the registers' tile from io: the update and o_t (stored). K-first ends with a second barrier
 * (the warps' partial reductions). */
template <int VF, int KD, int NA, int SF32>
DEV void dt_token(const kda_decode_params_t &p, dt_io<VF, KD, NA> &io, float4 S[NA], int64_t t, int h, int j0) {
    typedef dt_geom<VF, KD, NA> G;
    const int V = p.pb.V, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    float4 ps = io.part[0];
#pragma unroll
    for (int u = 1; u < DT_THREADS / 32; u++) {
        const float4 x = io.part[u];
        ps.x += x.x, ps.y += x.y, ps.z += x.z, ps.w += x.w;
    }
    if (ps.w != 0.f) { /* a non-finite input of this token: the whole tile is NaN from here on */
#pragma unroll
        for (int a = 0; a < NA; a++) S[a] = make_float4(NAN, NAN, NAN, NAN);
    }
    const float sq = p.pb.l2norm ? p.pb.scale / sqrtf(ps.x + 1e-6f) : p.pb.scale;
    const float sk = p.pb.l2norm ? 1.0f / sqrtf(ps.y + 1e-6f) : 1.0f;
    const float kq = sk * ps.z, beta = io.beta;
    const int64_t orow = (t * p.pb.hv + h) * V + j0;
    if (VF) {
        float ra[G::NP], rb[G::NP];
#pragma unroll
        for (int s = 0; s < G::NP; s++) ra[s] = rb[s] = 0.f;
#pragma unroll
        for (int a = 0; a < NA; a++) {
            const int s = a / G::CPR, i = dt_vf_i<SF32>(lane, a % G::CPR);
            const float4 al = *(const float4 *)(io.a + i), kk = *(const float4 *)(io.k + i),
                         qq = *(const float4 *)(io.q + i);
            S[a].x *= al.x, S[a].y *= al.y, S[a].z *= al.z, S[a].w *= al.w;
            ra[s] += (kk.x * S[a].x + kk.y * S[a].y) + (kk.z * S[a].z + kk.w * S[a].w);
            rb[s] += (qq.x * S[a].x + qq.y * S[a].y) + (qq.z * S[a].z + qq.w * S[a].w);
        }
        float c[G::NP];
#pragma unroll
        for (int s = 0; s < G::NP; s++) {
            const int jl = 16 * s + 4 * w + (lane >> 3);
            c[s] =
                dt_column(p, row8_sum(ra[s]), row8_sum(rb[s]), io.v[jl], beta, sq, sk, kq, (lane & 7) == 0, orow + jl);
        }
        const float *ks = dt_opaque(io.k);
#pragma unroll
        for (int a = 0; a < NA; a++) {
            const int s = a / G::CPR, i = dt_vf_i<SF32>(lane, a % G::CPR);
            const float4 kk = *(const float4 *)(ks + i);
            S[a].x += kk.x * c[s], S[a].y += kk.y * c[s], S[a].z += kk.z * c[s], S[a].w += kk.w * c[s];
        }
    } else {
        /* rows (l >> 3) + 4w + 16r, columns 4(l & 7) + 32u: sums over the thread's rows, the warp's 4 row lanes
           (2 shuffles), then the 4 warps through shared memory */
        float4 ra[G::CB], rb[G::CB];
#pragma unroll
        for (int u = 0; u < G::CB; u++) ra[u] = rb[u] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int a = 0; a < NA; a++) {
            const int u = a % G::CB, i = (lane >> 3) + 4 * w + 16 * (a / G::CB);
            const float al = io.a[i], kk = io.k[i], qq = io.q[i];
            S[a].x *= al, S[a].y *= al, S[a].z *= al, S[a].w *= al;
            ra[u].x += kk * S[a].x, ra[u].y += kk * S[a].y, ra[u].z += kk * S[a].z, ra[u].w += kk * S[a].w;
            rb[u].x += qq * S[a].x, rb[u].y += qq * S[a].y, rb[u].z += qq * S[a].z, rb[u].w += qq * S[a].w;
        }
#pragma unroll
        for (int u = 0; u < G::CB; u++) {
            ra[u].x = lanes_sum<8>(ra[u].x), ra[u].y = lanes_sum<8>(ra[u].y);
            ra[u].z = lanes_sum<8>(ra[u].z), ra[u].w = lanes_sum<8>(ra[u].w);
            rb[u].x = lanes_sum<8>(rb[u].x), rb[u].y = lanes_sum<8>(rb[u].y);
            rb[u].z = lanes_sum<8>(rb[u].z), rb[u].w = lanes_sum<8>(rb[u].w);
            if (lane < 8) {
                float4 *r = (float4 *)&io.red[w][4 * lane + 32 * u];
                r[0] = make_float4(ra[u].x, rb[u].x, ra[u].y, rb[u].y);
                r[1] = make_float4(ra[u].z, rb[u].z, ra[u].w, rb[u].w);
            }
        }
        __syncthreads(); /* the warps' partial reductions */
        float c[G::CB][4];
#pragma unroll
        for (int u = 0; u < G::CB; u++) {
            const int jl = 4 * (lane & 7) + 32 * u;
            float2 ab[4];
#pragma unroll
            for (int e = 0; e < 4; e++) ab[e] = make_float2(0.f, 0.f);
#pragma unroll
            for (int x = 0; x < DT_THREADS / 32; x++) {
                const float4 r0 = *(const float4 *)&io.red[x][jl], r1 = *(const float4 *)&io.red[x][jl + 2];
                ab[0].x += r0.x, ab[0].y += r0.y, ab[1].x += r0.z, ab[1].y += r0.w;
                ab[2].x += r1.x, ab[2].y += r1.y, ab[3].x += r1.z, ab[3].y += r1.w;
            }
#pragma unroll
            for (int e = 0; e < 4; e++)
                c[u][e] =
                    dt_column(p, ab[e].x, ab[e].y, io.v[jl + e], beta, sq, sk, kq, w == 0 && lane < 8, orow + jl + e);
        }
        const float *ks = dt_opaque(io.k);
#pragma unroll
        for (int a = 0; a < NA; a++) {
            const int u = a % G::CB;
            const float kk = ks[(lane >> 3) + 4 * w + 16 * (a / G::CB)];
            S[a].x += kk * c[u][0], S[a].y += kk * c[u][1], S[a].z += kk * c[u][2], S[a].w += kk * c[u][3];
        }
    }
}

template <int VF, int KD, int NA, int SF32>
__global__ void __launch_bounds__(DT_THREADS, dt_geom<VF, KD, NA>::MIN_CTAS)
    kda_decode_tile_kernel(const kda_decode_params_t p) {
    typedef dt_geom<VF, KD, NA> G;
    __shared__ __align__(16) dt_io<VF, KD, NA> io[2];
    const int vt = blockIdx.x, h = blockIdx.y;
    const int64_t n = blockIdx.z;
    const int j0 = vt * G::BV, hq = h / p.pb.group;
    int64_t bos, eos;
    dec_seq_bounds(p, n, &bos, &eos);
    const int64_t T = eos - bos;
    const int per_token = p.pb.state_indices && p.idx_cols > 0;
    if (per_token && T == 0) return; /* 2-D slots: an empty sequence reads and writes nothing */

    /* the first token's inputs and the slot's index first, then the tile (the slot's ownership is checked, and
       the inputs transformed, while it flies) */
    dt_raw raw;
    if (T > 0) dt_fetch(p, raw, bos, h, hq);
    raw.A = p.pb.A_log ? expf(p.pb.A_log[h]) : 1.0f;
    int32_t later[DT_SCAN]; /* claim_scan: the indices of rows n + 1 + tid + 128 i */
    if (p.claim_scan) {
#pragma unroll
        for (int i = 0; i < DT_SCAN; i++) {
            const int64_t m = n + 1 + threadIdx.x + i * DT_THREADS;
            later[i] = m < p.pb.seqs.num_seqs ? p.pb.state_indices[m] : -1;
        }
    }
    const int64_t named = dec_named_slot(p, n);
    float4 S[NA];
    if (named >= 0 && p.pb.h0) {
        dt_load_tile<VF, KD, NA, SF32>(p, S, named, h, j0);
    } else {
#pragma unroll
        for (int a = 0; a < NA; a++) S[a] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    int64_t rslot;
    if (p.claim_scan) { /* slots.cu's rule without its launch: the last row naming a slot owns it */
        int hit = 0;
#pragma unroll
        for (int i = 0; i < DT_SCAN; i++) hit |= later[i] == named;
        rslot = named >= 0 && !__syncthreads_or(hit) ? named : -1;
    } else {
        rslot = named >= 0 && dec_owns(p, n, named) ? named : -1;
    }
    if (rslot < 0) {
#pragma unroll
        for (int a = 0; a < NA; a++) S[a] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

#pragma unroll 1
    for (int64_t t = 0; t < T; t++) {
        const int buf = (int)(t & 1);
        dt_commit<VF, KD, NA>(p, io[buf], raw, j0);
        __syncthreads(); /* io[buf] complete; io[buf ^ 1] free (every thread is past token t − 1) */
        if (t + 1 < T) dt_fetch(p, raw, bos + t + 1, h, hq);
        dt_token<VF, KD, NA, SF32>(p, io[buf], S, bos + t, h, j0);
        if (per_token && p.pb.ht) { /* speculative decoding: the state after this token to its own slot */
            const int64_t ws = dec_token_slot(p, n, t);
            if (ws >= 0) dt_store_tile<VF, KD, NA, SF32>(p, S, ws, h, j0);
        }
    }
    if (!per_token && p.pb.ht && rslot >= 0) dt_store_tile<VF, KD, NA, SF32>(p, S, rslot, h, j0);
}

/* The launch of an instance: a CTA per (tile, value head, sequence), tiles fastest. */
template <int VF, int KD, int SF32, int EX, int NA>
static int kda_dec_tile_launch(const kda_decode_params_t *p, int device, void *stream) {
    static_assert(EX == 1, "the tile kernel runs exact head sizes only");
    (void)device;
    if (p->pb.seqs.num_seqs == 0 || p->pb.hv == 0) return 0;
    const dim3 grid((unsigned)(p->pb.V / dt_geom<VF, KD, NA>::BV), (unsigned)p->pb.hv, (unsigned)p->pb.seqs.num_seqs);
    kda_decode_tile_kernel<VF, KD, NA, SF32><<<grid, DT_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}

#endif /* KDA_CUDA_DECODE_TILE_CUH */
