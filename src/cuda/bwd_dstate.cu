/*
 * Backward, stage 2: the reverse recurrence of the state gradient (docs/ALGORITHM.md §6), dS⁺ = ∂L/∂S at the
 * end of every chunk, fp32 into the workspace, and d_initial_state.
 *
 * One CTA of 256 threads per (sequence, value head, tile of BV value columns), last chunk to first (BV =
 * KDA_BWD_BV = 16, or 32 when the (sequence, head) pairs alone give a CTA per SM: each CTA copies the chunk's
 * panels for its columns, so wider tiles copy them fewer times), from the forward's chunk blocks (prep.cuh: W, QΓ, K̃, Aqk, γ in bf16; QΓ and Aqk carry the scale s) and d_o:
 *
 *     dS ← d_final_state (zeros without it, or for a sequence without a slot)
 *     for each chunk, last first:  dstates[chunk] ← dS                       (dS⁺ of the chunk)
 *                                  dΔ = Aqkᵀ dO + K̃ dS                       (C × 16)
 *                                  dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ          (K × 16)
 *     d_initial_state ← dS
 *
 * dS never reads S: this stage does not depend on stage 1 and d_initial_state stays finite where the initial
 * state is not (§7). dS in shared memory [KC][16], fp32; the chunk's panels copied in byte for byte (the next
 * chunk's block prefetched into L2 meanwhile). The products on the tensor cores (bwd.cuh mma16: tf32, which
 * holds the bf16 panels exactly; dO, dS and dΔ rounded to tf32; fp32 sums): dΔ as 4 · BV/8 tiles of 16 × 8,
 * BV/16 per warp; the dS update as KC/16 · BV/8 tiles, KC · BV/1024 per warp. The first version (CUDA cores,
 * fp32) took ~32 k cycles per chunk step at 2 CTAs/SM (4.66 ms at B2 T8192 H32 on an H100); the same dS⁺ to
 * 1e-6 in the host emulation.
 */
#include "bwd.cuh"
#include "seq.cuh"

#define DS_THREADS 256

template <int KC, int BV>
struct dstate_smem {
    static constexpr int SS = BV + 4;
    unsigned char w[KDA_CHUNK * KC * 2];
    unsigned char qg[KDA_CHUNK * KC * 2];
    unsigned char kt[KDA_CHUNK * KC * 2];
    unsigned char aqk[KDA_PANEL_BYTES];
    float dS[KC * SS];
    float dO[KDA_CHUNK * SS];
    float dD[KDA_CHUNK * SS];
    float gamma[KC];
};

/* A hint that this CTA reads chunk block `blk`'s W, QΓ, K̃ and Aqk panels next: into L2 */
DEV void prefetch_block_l2(const unsigned char *blk, int KC, int tid) {
    const int64_t panels = (int64_t)KDA_CHUNK * KC * 2;
    const int64_t offs[4] = {0, kda_cuda_off_qg(KC), kda_cuda_off_kt(KC), kda_cuda_off_aqk(KC)};
    for (int r = 0; r < 4; r++) {
        const int64_t bytes = r < 3 ? panels : KDA_PANEL_BYTES;
        for (int64_t o = (int64_t)tid * 128; o < bytes; o += (int64_t)DS_THREADS * 128) l2_prefetch(blk + offs[r] + o);
    }
}

/* A tf32 A fragment (bwd.cuh mma16's frag_t a[4]) of a 16 × 16 block of a bf16 panel tile by one ldmatrix: rows
 * r0.., columns c0.. of the tile (ROWS: the fragment's rows are the tile's rows) or of its transpose (the
 * fragment's row i, column k is the tile's (k, i)); exact (bf16 ⊂ tf32). One LDSM.x4 instead of 8 two-byte
 * loads with their swizzle arithmetic each. */
template <int ROWS>
DEV void panel_frag(frag_t a[4], const unsigned char *tile, int r0, int c0, int lane) {
    uint32_t w[4];
    if (ROWS) ldsm_x4(w, smem_u32(tile + pan_off(r0 + (lane & 15), c0 + 8 * (lane >> 4))));
    else ldsm_x4_t(w, smem_u32(tile + pan_off(c0 + (lane & 7) + 8 * (lane >> 4), r0 + 8 * ((lane >> 3) & 1))));
#pragma unroll
    for (int r = 0; r < 4; r++) a[r] = unpack_bf16(w[r]);
}

template <int KC, int BV>
__global__ void __launch_bounds__(DS_THREADS, 2) kda_bwd_dstate_kernel(const kda_bwd_params_t p) {
    constexpr int SS = BV + 4, NTL = BV / 8; /* 8-column tiles */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dstate_smem<KC, BV> &sm = *(dstate_smem<KC, BV> *)smem_raw;
    const int tid = threadIdx.x;
    const int tiles = p.vc / BV;
    const int tile = (int)(blockIdx.x % tiles), h = (int)(blockIdx.x / tiles % p.hv);
    const int64_t n = blockIdx.x / tiles / p.hv;
    const int c0 = tile * BV;
    int64_t bos, eos;
    seq_bounds(p.seqs, n, &bos, &eos);
    const int64_t nc = (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK, chunk0 = nc > 0 ? seq_chunk0(p.seqs, n) : 0;
    const int64_t slot = seq_slot(p.state_indices, NULL, p.num_state_slots, n);

    for (int e = tid; e < KC * BV; e += DS_THREADS) {
        const int d = e / BV, c = e % BV;
        float x = 0.0f;
        if (p.dht && slot >= 0 && d < p.K && c0 + c < p.V) x = load_elem(p.dht, p.dht_dtype, state_elem(p, slot, h, d, c0 + c));
        sm.dS[d * SS + c] = x;
    }
    __syncthreads();

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    static_assert((BV == 16 || BV == 32) && DS_THREADS == 256 && KDA_CHUNK == 64, "dstate: 8 warps, C = 64");
    for (int64_t ci = nc - 1; ci >= 0; ci--) {
        const int64_t cid = chunk0 + ci, t0 = bos + ci * KDA_CHUNK;
        const int clen = (int)min((int64_t)KDA_CHUNK, eos - t0);
        const unsigned char *blk = (const unsigned char *)p.blocks.base + (cid * p.hv + h) * p.blocks.block_bytes;
        float *out = p.dstates + (cid * p.hv + h) * (int64_t)KC * p.vc + c0;
        for (int e = tid; e < KC * BV; e += DS_THREADS) out[(e / BV) * (int64_t)p.vc + e % BV] = sm.dS[(e / BV) * SS + e % BV];
        /* the panels by 16-byte asynchronous copies (no registers; waited for before the barrier) */
        for (int e = tid; e < KDA_CHUNK * KC * 2 / 16; e += DS_THREADS) {
            cp_async16_zfill(smem_u32(sm.w + 16 * e), blk + 16 * e, 16);
            cp_async16_zfill(smem_u32(sm.qg + 16 * e), blk + kda_cuda_off_qg(KC) + 16 * e, 16);
            cp_async16_zfill(smem_u32(sm.kt + 16 * e), blk + kda_cuda_off_kt(KC) + 16 * e, 16);
        }
        for (int e = tid; e < KDA_PANEL_BYTES / 16; e += DS_THREADS)
            cp_async16_zfill(smem_u32(sm.aqk + 16 * e), blk + kda_cuda_off_aqk(KC) + 16 * e, 16);
        cp_async_commit();
        for (int d = tid; d < KC; d += DS_THREADS) sm.gamma[d] = ((const float *)(blk + kda_cuda_off_gamma(KC)))[d];
        {   /* dO: 4 loads issued before any conversion (a round trip per 4 elements, not per element) */
            constexpr int N = KDA_CHUNK * BV / DS_THREADS;
#pragma unroll 1
            for (int j0 = 0; j0 < N; j0 += 4) {
                uint32_t ob[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int e = tid + DS_THREADS * (j0 + j), i = e / BV, c = e % BV;
                    ob[j] = i < clen && c0 + c < p.V
                                ? load_bits(p.d_o, p.do_dtype, ((t0 + i) * p.hv + h) * (int64_t)p.V + c0 + c)
                                : 0u;
                }
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int e = tid + DS_THREADS * (j0 + j);
                    sm.dO[(e / BV) * SS + e % BV] = bits_value(ob[j], p.do_dtype);
                }
            }
        }
        if (ci > 0) /* the next (earlier) chunk's block into L2 while this one is computed */
            prefetch_block_l2(blk - (int64_t)p.hv * p.blocks.block_bytes, KC, tid);
        cp_async_wait_all();
        __syncthreads();
        /* dΔ = Aqkᵀ dO + K̃ dS: warp w computes rows 16 I.. (I = w mod 4) of the column tiles w / 4 + 2u, u <
           BV/16, on the tensor cores (tf32: the bf16 panels exactly, dO and dS rounded); the row block's A fragments
           once for its tiles */
        {
            constexpr int TW = BV / 16; /* tiles per warp */
            const int I = warp & 3;
            float acc[TW][4];
#pragma unroll
            for (int u = 0; u < TW; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.0f;
#pragma unroll 1
            for (int m0 = 16 * I; m0 < KDA_CHUNK; m0 += 16) { /* Aqk lower: rows m ≥ i */
                frag_t a[4]; /* A(i, m) = Aqk[m][i] */
                panel_frag<0>(a, sm.aqk, 16 * I, m0, lane);
                const int k = m0 + 2 * t;
#pragma unroll
                for (int u = 0; u < TW; u++) {
                    const int n = 8 * ((warp >> 2) + 2 * u) + g;
                    mma16(acc[u], a, tf2(sm.dO[k * SS + n], sm.dO[(k + 1) * SS + n]),
                          tf2(sm.dO[(k + 8) * SS + n], sm.dO[(k + 9) * SS + n]));
                }
            }
#pragma unroll 2
            for (int d0 = 0; d0 < KC; d0 += 16) {
                frag_t a[4];
                panel_frag<1>(a, sm.kt, 16 * I, d0, lane);
                const int k = d0 + 2 * t;
#pragma unroll
                for (int u = 0; u < TW; u++) {
                    const int n = 8 * ((warp >> 2) + 2 * u) + g;
                    mma16(acc[u], a, tf2(sm.dS[k * SS + n], sm.dS[(k + 1) * SS + n]),
                          tf2(sm.dS[(k + 8) * SS + n], sm.dS[(k + 9) * SS + n]));
                }
            }
#pragma unroll
            for (int u = 0; u < TW; u++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    sm.dD[(16 * I + g + 8 * (c >> 1)) * SS + 8 * ((warp >> 2) + 2 * u) + 2 * t + (c & 1)] = acc[u][c];
        }
        __syncthreads();
        /* dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ: KC/16 row blocks × NTL column tiles, KC · BV/1024 per warp (each
           element read and written by its owner only) */
#pragma unroll
        for (int u = 0; u < KC * BV / 1024; u++) {
            const int tile = warp * (KC * BV / 1024) + u, rb = tile / NTL, nt = tile % NTL, n = 8 * nt + g;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
            for (int i0 = 0; i0 < KDA_CHUNK; i0 += 16) {
                frag_t aq[4], aw[4]; /* A(d, i) = QΓ[i][d], W[i][d] */
                panel_frag<0>(aq, sm.qg, 16 * rb, i0, lane);
                panel_frag<0>(aw, sm.w, 16 * rb, i0, lane);
                const int k = i0 + 2 * t;
                mma16(acc, aq, tf2(sm.dO[k * SS + n], sm.dO[(k + 1) * SS + n]),
                      tf2(sm.dO[(k + 8) * SS + n], sm.dO[(k + 9) * SS + n]));
                mma16(acc, aw, tf2(-sm.dD[k * SS + n], -sm.dD[(k + 1) * SS + n]),
                      tf2(-sm.dD[(k + 8) * SS + n], -sm.dD[(k + 9) * SS + n]));
            }
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int d = 16 * rb + g + 8 * (c >> 1), col = 8 * nt + 2 * t + (c & 1);
                sm.dS[d * SS + col] = sm.gamma[d] * sm.dS[d * SS + col] + acc[c];
            }
        }
        __syncthreads();
    }
    if (p.dh0 && slot >= 0)
        for (int e = tid; e < KC * BV; e += DS_THREADS) {
            const int d = e / BV, c = e % BV;
            if (d < p.K && c0 + c < p.V) store_elem(p.dh0, p.dh0_dtype, state_elem(p, slot, h, d, c0 + c), sm.dS[d * SS + c]);
        }
}

template <int KC, int BV>
static int launch_dstate(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->seqs.num_seqs * p->hv * (p->vc / BV);
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    const int bytes = (int)sizeof(dstate_smem<KC, BV>);
    return kda_launch((const void *)kda_bwd_dstate_kernel<KC, BV>, ctas, DS_THREADS, bytes, p, device, done, stream);
}

/* The wide tile when the (sequence, head) pairs at that width give at least a CTA per SM (the chains are no longer
 * than with narrow tiles, and each chunk's panels are copied half as often); else the narrow one. */
static int dstate_wide(const kda_bwd_params_t *p) {
    return p->vc >= KDA_BWD_BV_WIDE && p->seqs.num_seqs * p->hv * (p->vc / KDA_BWD_BV_WIDE) >= p->sm_count;
}

extern "C" int kda_bwd_launch_dstate(const kda_bwd_params_t *p, int device, void *stream) {
    if (dstate_wide(p))
        return p->kc == 64 ? launch_dstate<64, KDA_BWD_BV_WIDE>(p, device, stream)
                           : launch_dstate<128, KDA_BWD_BV_WIDE>(p, device, stream);
    return p->kc == 64 ? launch_dstate<64, KDA_BWD_BV>(p, device, stream) : launch_dstate<128, KDA_BWD_BV>(p, device, stream);
}
