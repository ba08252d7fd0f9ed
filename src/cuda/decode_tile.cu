/*
 * CUDA recurrent decode, the tile kernel: one CTA of 128 threads per (sequence n, value head h, tile of BV value
 * columns) for the exact head sizes K ∈ {64, 128} (BV = 4096 / K, V a multiple of BV), fp32 or bf16 states,
 * scalar β. The same recurrence as decode.cu (docs/ALGORITHM.md §1; inputs of §2), per token t:
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
 * Why a second kernel: decode streams the pool (each state read once and written once at ~4 flops per
 * element), and decode.cu's generality (any K and V, persistent items, staged rows) costs it ~1400
 * instructions per warp per tile where the arithmetic is ~200 (docs/PERF.md "Decode kernel, fourth version").
 * Here a CTA issues its tile's loads first (8 vector loads per thread straight into registers), prepares the
 * token's inputs while they fly, makes one pass with both reductions, and stores; six CTAs per SM keep
 * ~96 KB of state in flight. The grid is (tiles, HV, N), tiles fastest, so the CTAs of a head run together
 * and share its input rows in L2.
 *
 * Per token the CTA loads each input row once, element e = tid (+128) per thread: q, k, g (+ dt_bias) of K,
 * the whole v row (the non-finite contract checks all V of it), β; transforms them (gate, α, β) into one of
 * two shared-memory buffers with each warp's partial sums of q², k² and q·k and a non-finite flag; one barrier
 * per token. The next token's rows are loaded into registers during the current token's arithmetic.
 *
 * Thread layout of the tile (a "chunk" is 4 consecutive elements of a memory row; lane l of warp w), as in
 * decode.cu: V-first ([V, K] rows): 8 lanes per row, row j = 16·pass + 4w + (l >> 3), elements
 * i = 4(l & 7) + 32c; K-first ([K, V] rows): lane l holds columns 4(w·CGW + l % CGW) .. +3 and rows
 * i = l / CGW + RG·a. Reductions over K: 3 shuffles within the 8 lanes (V-first), log2(RG) within the warp
 * (K-first).
 *
 * Slots, the non-finite contract and the empty-sequence rules are decode.cu's (its header). The row's own
 * state is loaded before its slot's ownership (claim) is known; a row that does not own the slot drops what
 * it loaded and starts from zeros. A non-finite initial-state column shows as a non-finite a_j: a_j is then
 * made NaN, which makes the column and o_j NaN (finite states whose products overflow fp32 do the same).
 */
#include "decode.cuh"

#define DT_THREADS 128
#define DT_TILE 4096   /* state elements per tile */
#define DT_NA 8        /* chunks per thread */
#define DT_MIN_CTAS 6  /* CTAs per SM the registers must allow (≤ 80 per thread) */

template <int VF, int KD>
struct dt_geom {
    static constexpr int BV = DT_TILE / KD;  /* columns of a tile: 32 (K = 128) or 64 (K = 64) */
    static constexpr int CPR = KD / 32;      /* V-first: chunks of a row per lane */
    static constexpr int NP = DT_NA / CPR;   /* V-first: rows per thread */
    static constexpr int CGW = BV / 16;      /* K-first: column groups per warp */
    static constexpr int RG = 32 / CGW;      /* K-first: lanes (row groups) per column group */
};

/* Inputs of one token after the transform, and each warp's partial sums (q², k², q·k, non-finite flag). */
template <int KD>
struct dt_io {
    float q[KD], k[KD], a[KD], v[DT_TILE / KD];
    float4 part[DT_THREADS / 32];
    float beta;
};

/* A token's raw inputs as loaded by one thread (element e = tid of q, k, g, dt_bias; e and e + 128 of v). */
struct dt_raw {
    float q, k, g, bias, v0, v1, b, A;
};

DEV void dt_fetch(const kda_decode_params_t &p, dt_raw &r, int64_t t, int h, int hq) {
    const int e = threadIdx.x, K = p.kd, V = p.vd;
    r.q = r.k = r.g = r.bias = r.v0 = r.v1 = 0.f;
    if (e < K) {
        r.q = load_elem(p.q, p.dtype, (t * p.hqk + hq) * K + e);
        r.k = load_elem(p.k, p.dtype, (t * p.hqk + hq) * K + e);
        r.g = load_elem(p.g, p.g_dtype, (t * p.hv + h) * K + e);
        if (p.dt_bias) r.bias = p.dt_bias[(int64_t)h * K + e];
    }
    if (e < V) r.v0 = load_elem(p.v, p.dtype, (t * p.hv + h) * V + e);
    if (e + DT_THREADS < V) r.v1 = load_elem(p.v, p.dtype, (t * p.hv + h) * V + e + DT_THREADS);
    r.b = load_elem(p.beta, p.beta_dtype, t * p.hv + h);
}

/* The transform of r into io (this thread's elements, its warp's partial sums). */
template <int KD>
DEV void dt_commit(const kda_decode_params_t &p, dt_io<KD> &io, const dt_raw &r, int j0) {
    const int e = threadIdx.x, K = p.kd, V = p.vd;
    int bad = 0;
    float qq = 0.f, kk = 0.f, qk = 0.f;
    if (e < K) {
        float g = r.g;
        if (p.gate_in_kernel) {
            const float x = g + r.bias;
            g = p.lower_bound != 0.0f ? p.lower_bound * sigmoidf_(r.A * x) : -r.A * softplusf_(x);
        }
        g = g > 0.0f ? 0.0f : g; /* clamp into [KDA_GATE_MIN, 0]; NaN stays NaN */
        g = g < KDA_GATE_MIN ? KDA_GATE_MIN : g;
        bad |= !finite_f(r.q) | !finite_f(r.k) | !finite_f(g);
        io.q[e] = r.q;
        io.k[e] = r.k;
        io.a[e] = ex2(g * LOG2E);
        qq = r.q * r.q;
        kk = r.k * r.k;
        qk = r.q * r.k;
    }
    bad |= (e < V && !finite_f(r.v0)) | (e + DT_THREADS < V && !finite_f(r.v1));
    const int jl = e - j0, jl1 = e + DT_THREADS - j0;
    if (jl >= 0 && jl < DT_TILE / KD) io.v[jl] = r.v0;
    if (jl1 >= 0 && jl1 < DT_TILE / KD) io.v[jl1] = r.v1;
    if (e == 0) {
        float b = r.b;
        if (p.beta_sigmoid) b = (p.neg_eigval ? 2.0f : 1.0f) * sigmoidf_(b);
        io.beta = b;
        bad |= !finite_f(b);
    }
    qq = lanes_sum<1>(qq);
    kk = lanes_sum<1>(kk);
    qk = lanes_sum<1>(qk);
    bad = __any_sync(0xffffffffu, bad);
    if ((e & 31) == 0) io.part[e >> 5] = make_float4(qq, kk, qk, bad ? 1.f : 0.f);
}

/* The tile's chunk a of thread tid: element offset within the head's K×V block. */
template <int VF, int KD>
DEV int dt_chunk(int a, int V, int j0, int tid) {
    typedef dt_geom<VF, KD> G;
    const int lane = tid & 31, w = tid >> 5;
    if (VF) {
        const int jl = 16 * (a / G::CPR) + 4 * w + (lane >> 3), i = 4 * (lane & 7) + 32 * (a % G::CPR);
        return (j0 + jl) * KD + i;
    }
    const int cg = w * G::CGW + lane % G::CGW, i = lane / G::CGW + G::RG * a;
    return i * V + j0 + 4 * cg;
}

template <int SF32>
DEV float4 dt_load4(const void *base, int64_t off) {
    if (SF32) return __ldcs((const float4 *)((const float *)base + off));
    const uint2 u = __ldcs((const uint2 *)((const uint16_t *)base + off));
    const float2 lo = unpack_bf16(u.x), hi = unpack_bf16(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <int SF32>
DEV void dt_store4(void *base, int64_t off, float4 x) {
    if (SF32) {
        __stcs((float4 *)((float *)base + off), x);
    } else {
        uint2 u;
        u.x = pack_bf16(x.x, x.y);
        u.y = pack_bf16(x.z, x.w);
        __stcs((uint2 *)((uint16_t *)base + off), u);
    }
}

template <int VF, int KD, int SF32>
DEV void dt_store_tile(const kda_decode_params_t &p, const float4 S[DT_NA], int64_t slot, int h, int j0) {
    const int64_t base = (slot * p.hv + h) * (int64_t)KD * p.vd;
#pragma unroll
    for (int a = 0; a < DT_NA; a++) dt_store4<SF32>(p.ht, base + dt_chunk<VF, KD>(a, p.vd, j0, threadIdx.x), S[a]);
}

/* One token on the registers' tile from io: the update and o_t (stored). */
template <int VF, int KD>
DEV void dt_token(const kda_decode_params_t &p, const dt_io<KD> &io, float4 S[DT_NA], int64_t t, int h, int j0) {
    typedef dt_geom<VF, KD> G;
    const int V = p.vd, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    float4 ps = io.part[0];
#pragma unroll
    for (int u = 1; u < DT_THREADS / 32; u++) {
        const float4 x = io.part[u];
        ps.x += x.x, ps.y += x.y, ps.z += x.z, ps.w += x.w;
    }
    if (ps.w != 0.f) { /* a non-finite input of this token: the whole tile is NaN from here on */
#pragma unroll
        for (int a = 0; a < DT_NA; a++) S[a] = make_float4(NAN, NAN, NAN, NAN);
    }
    const float sq = p.l2norm ? p.scale / sqrtf(ps.x + 1e-6f) : p.scale;
    const float sk = p.l2norm ? 1.0f / sqrtf(ps.y + 1e-6f) : 1.0f;
    const float kq = sk * ps.z, beta = io.beta;
    if (VF) {
        float ra[G::NP], rb[G::NP];
#pragma unroll
        for (int s = 0; s < G::NP; s++) ra[s] = rb[s] = 0.f;
#pragma unroll
        for (int a = 0; a < DT_NA; a++) {
            const int s = a / G::CPR, i = 4 * (lane & 7) + 32 * (a % G::CPR);
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
            float a_ = row8_sum(ra[s]);
            const float b_ = row8_sum(rb[s]);
            a_ = finite_f(a_) ? a_ : NAN;
            const float d = beta * (io.v[jl] - sk * a_);
            c[s] = sk * d;
            if ((lane & 7) == 0) store_elem(p.o, p.o_dtype, (t * p.hv + h) * V + j0 + jl, sq * (b_ + kq * d));
        }
#pragma unroll
        for (int a = 0; a < DT_NA; a++) {
            const int s = a / G::CPR, i = 4 * (lane & 7) + 32 * (a % G::CPR);
            const float4 kk = *(const float4 *)(io.k + i);
            S[a].x += kk.x * c[s], S[a].y += kk.y * c[s], S[a].z += kk.z * c[s], S[a].w += kk.w * c[s];
        }
    } else {
        const int rg = lane / G::CGW, jl = 4 * (w * G::CGW + lane % G::CGW);
        float4 ra = make_float4(0.f, 0.f, 0.f, 0.f), rb = ra;
#pragma unroll
        for (int a = 0; a < DT_NA; a++) {
            const int i = rg + G::RG * a;
            const float al = io.a[i], kk = io.k[i], qq = io.q[i];
            S[a].x *= al, S[a].y *= al, S[a].z *= al, S[a].w *= al;
            ra.x += kk * S[a].x, ra.y += kk * S[a].y, ra.z += kk * S[a].z, ra.w += kk * S[a].w;
            rb.x += qq * S[a].x, rb.y += qq * S[a].y, rb.z += qq * S[a].z, rb.w += qq * S[a].w;
        }
        float av[4] = {lanes_sum<G::CGW>(ra.x), lanes_sum<G::CGW>(ra.y), lanes_sum<G::CGW>(ra.z),
                       lanes_sum<G::CGW>(ra.w)};
        const float bv[4] = {lanes_sum<G::CGW>(rb.x), lanes_sum<G::CGW>(rb.y), lanes_sum<G::CGW>(rb.z),
                             lanes_sum<G::CGW>(rb.w)};
        float c[4], ov[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            av[u] = finite_f(av[u]) ? av[u] : NAN;
            const float d = beta * (io.v[jl + u] - sk * av[u]);
            c[u] = sk * d;
            ov[u] = sq * (bv[u] + kq * d);
        }
        if (rg == 0) {
#pragma unroll
            for (int u = 0; u < 4; u++) store_elem(p.o, p.o_dtype, (t * p.hv + h) * V + j0 + jl + u, ov[u]);
        }
#pragma unroll
        for (int a = 0; a < DT_NA; a++) {
            const float kk = io.k[rg + G::RG * a];
            S[a].x += kk * c[0], S[a].y += kk * c[1], S[a].z += kk * c[2], S[a].w += kk * c[3];
        }
    }
}

template <int VF, int KD, int SF32>
__global__ void __launch_bounds__(DT_THREADS, DT_MIN_CTAS) kda_decode_tile_kernel(const kda_decode_params_t p) {
    typedef dt_geom<VF, KD> G;
    __shared__ __align__(16) dt_io<KD> io[2];
    const int vt = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int64_t n = blockIdx.z;
    const int j0 = vt * G::BV, hq = h / p.group;
    int64_t bos, eos;
    dec_seq_bounds(p, n, &bos, &eos);
    const int64_t T = eos - bos;
    const int per_token = p.state_indices && p.idx_cols > 0;
    if (per_token && T == 0) return; /* 2-D slots: an empty sequence reads and writes nothing */

    /* the tile's loads first (the slot's ownership is checked while they fly) */
    const int64_t named = dec_named_slot(p, n);
    float4 S[DT_NA];
    if (named >= 0 && p.h0) {
        const int64_t base = (named * p.hv + h) * (int64_t)KD * p.vd;
#pragma unroll
        for (int a = 0; a < DT_NA; a++) S[a] = dt_load4<SF32>(p.h0, base + dt_chunk<VF, KD>(a, p.vd, j0, tid));
    } else {
#pragma unroll
        for (int a = 0; a < DT_NA; a++) S[a] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    dt_raw raw;
    raw.A = p.A_log ? expf(p.A_log[h]) : 1.0f;
    if (T > 0) dt_fetch(p, raw, bos, h, hq);
    const int64_t rslot = named >= 0 && dec_owns(p, n, named) ? named : -1;
    if (rslot < 0) {
#pragma unroll
        for (int a = 0; a < DT_NA; a++) S[a] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

#pragma unroll 1
    for (int64_t t = 0; t < T; t++) {
        const int buf = (int)(t & 1);
        dt_commit<KD>(p, io[buf], raw, j0);
        __syncthreads(); /* io[buf] complete; io[buf ^ 1] free (every thread is past token t − 1) */
        if (t + 1 < T) dt_fetch(p, raw, bos + t + 1, h, hq);
        dt_token<VF, KD>(p, io[buf], S, bos + t, h, j0);
        if (per_token && p.ht) { /* speculative decoding: the state after this token to its own slot */
            const int64_t ws = dec_token_slot(p, n, t);
            if (ws >= 0) dt_store_tile<VF, KD, SF32>(p, S, ws, h, j0);
        }
    }
    if (!per_token && p.ht && rslot >= 0) dt_store_tile<VF, KD, SF32>(p, S, rslot, h, j0);
}

template <int VF, int KD, int SF32>
static int dt_launch(const kda_decode_params_t *p, void *stream) {
    const dim3 grid((unsigned)(p->vd / dt_geom<VF, KD>::BV), (unsigned)p->hv, (unsigned)p->num_seqs);
    kda_decode_tile_kernel<VF, KD, SF32><<<grid, DT_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}

int kda_decode_tile_fits(const kda_decode_params_t *p) {
    if (p->beta_headwise || (p->kd != 64 && p->kd != 128) || p->vd % (DT_TILE / p->kd) || p->vd > 256) return 0;
    if (p->num_seqs > 65535 || p->hv > 65535 || !p->vec) return 0;
    /* the states present share one dtype, fp32 or bf16, and 16-byte (fp32) / 8-byte (bf16) aligned bases */
    const int sdt = p->h0 ? p->h0_dtype : p->ht_dtype;
    if (sdt != KDA_DT_F32 && sdt != KDA_DT_BF16) return 0;
    if (p->h0 && p->ht && p->h0_dtype != p->ht_dtype) return 0;
    const uintptr_t al = sdt == KDA_DT_F32 ? 16 : 8;
    return (!p->h0 || (uintptr_t)p->h0 % al == 0) && (!p->ht || (uintptr_t)p->ht % al == 0);
}

int kda_decode_tile_launch(const kda_decode_params_t *p, void *stream) {
    if (p->num_seqs == 0 || p->hv == 0) return 0;
    const int f32 = (p->h0 ? p->h0_dtype : p->ht_dtype) == KDA_DT_F32;
    if (p->v_first) {
        if (p->kd == 64) return f32 ? dt_launch<1, 64, 1>(p, stream) : dt_launch<1, 64, 0>(p, stream);
        return f32 ? dt_launch<1, 128, 1>(p, stream) : dt_launch<1, 128, 0>(p, stream);
    }
    if (p->kd == 64) return f32 ? dt_launch<0, 64, 1>(p, stream) : dt_launch<0, 64, 0>(p, stream);
    return f32 ? dt_launch<0, 128, 1>(p, stream) : dt_launch<0, 128, 0>(p, stream);
}
