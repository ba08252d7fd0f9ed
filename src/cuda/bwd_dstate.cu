/*
 * Backward, stage 2: the reverse recurrence of the state gradient (docs/ALGORITHM.md §6), dS⁺ = ∂L/∂S at the
 * end of every chunk, fp32 into the workspace, and d_initial_state.
 *
 * One CTA of 256 threads per (sequence, value head, tile of KDA_BWD_BV = 16 value columns), last chunk to
 * first, from the forward's chunk blocks (prep.cuh: W, QΓ, K̃, Aqk, γ in bf16; QΓ and Aqk carry the scale s) and d_o:
 *
 *     dS ← d_final_state (zeros without it, or for a sequence without a slot)
 *     for each chunk, last first:  dstates[chunk] ← dS                       (dS⁺ of the chunk)
 *                                  dΔ = Aqkᵀ dO + K̃ dS                       (C × 16)
 *                                  dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ          (K × 16)
 *     d_initial_state ← dS
 *
 * dS never reads S: this stage does not depend on stage 1 and d_initial_state stays finite where the initial
 * state is not (§7). CUDA cores, fp32, dS in shared memory [KC][16]; the chunk's panels copied in byte for
 * byte.
 */
#include "bwd.cuh"
#include "seq.cuh"

#define DS_THREADS 256
#define BV KDA_BWD_BV
#define SS (BV + 4)

template <int KC>
struct dstate_smem {
    unsigned char w[KDA_CHUNK * KC * 2];
    unsigned char qg[KDA_CHUNK * KC * 2];
    unsigned char kt[KDA_CHUNK * KC * 2];
    unsigned char aqk[KDA_PANEL_BYTES];
    float dS[KC * SS];
    float dO[KDA_CHUNK * SS];
    float dD[KDA_CHUNK * SS];
    float gamma[KC];
};

template <int KC>
__global__ void __launch_bounds__(DS_THREADS, 2) kda_bwd_dstate_kernel(const kda_bwd_params_t p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dstate_smem<KC> &sm = *(dstate_smem<KC> *)smem_raw;
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

    const int col = tid % BV, row0 = tid / BV;
    constexpr int RSTEP = DS_THREADS / BV, RI = KDA_CHUNK / RSTEP, RD = KC / RSTEP; /* 16 row groups: 4 rows of dΔ,
                                                                                   KC / 16 rows of dS per thread */
    static_assert(RI == 4 && (RD == 8 || RD == 4), "dstate: 256 threads, 16 columns, C = 64, KC 64 or 128");
    for (int64_t ci = nc - 1; ci >= 0; ci--) {
        const int64_t cid = chunk0 + ci, t0 = bos + ci * KDA_CHUNK;
        const int clen = (int)min((int64_t)KDA_CHUNK, eos - t0);
        const unsigned char *blk = (const unsigned char *)p.blocks.base + (cid * p.hv + h) * p.blocks.block_bytes;
        float *out = p.dstates + (cid * p.hv + h) * (int64_t)KC * p.vc + c0;
        for (int e = tid; e < KC * BV; e += DS_THREADS) out[(e / BV) * (int64_t)p.vc + e % BV] = sm.dS[(e / BV) * SS + e % BV];
        for (int e = tid; e < KDA_CHUNK * KC * 2 / 16; e += DS_THREADS) {
            ((uint4 *)sm.w)[e] = ((const uint4 *)blk)[e];
            ((uint4 *)sm.qg)[e] = ((const uint4 *)(blk + kda_cuda_off_qg(KC)))[e];
            ((uint4 *)sm.kt)[e] = ((const uint4 *)(blk + kda_cuda_off_kt(KC)))[e];
        }
        for (int e = tid; e < KDA_PANEL_BYTES / 16; e += DS_THREADS)
            ((uint4 *)sm.aqk)[e] = ((const uint4 *)(blk + kda_cuda_off_aqk(KC)))[e];
        for (int d = tid; d < KC; d += DS_THREADS) sm.gamma[d] = ((const float *)(blk + kda_cuda_off_gamma(KC)))[d];
        for (int e = tid; e < KDA_CHUNK * BV; e += DS_THREADS) {
            const int i = e / BV, c = e % BV;
            float x = 0.0f;
            if (i < clen && c0 + c < p.V) x = load_elem(p.d_o, p.do_dtype, ((t0 + i) * p.hv + h) * (int64_t)p.V + c0 + c);
            sm.dO[i * SS + c] = x;
        }
        __syncthreads();
        /* dΔ = Aqkᵀ dO + K̃ dS (Aqk lower: rows m ≥ i) for the thread's rows i = row0 + 16 r: the triangle row
           by row, then K̃ dS with each dS element read once for the four rows and K̃ 8 columns per load */
        float acc[RI];
#pragma unroll
        for (int r = 0; r < RI; r++) {
            const int i = row0 + RSTEP * r;
            float a = 0.0f;
            for (int m = i; m < KDA_CHUNK; m++) a += panel_at(sm.aqk, m, i) * sm.dO[m * SS + col];
            acc[r] = a;
        }
#pragma unroll 2
        for (int d0 = 0; d0 < KC; d0 += 8) {
            float s8[8];
#pragma unroll
            for (int j = 0; j < 8; j++) s8[j] = sm.dS[(d0 + j) * SS + col];
#pragma unroll
            for (int r = 0; r < RI; r++) {
                float k8[8];
                panel_run<8>(sm.kt, row0 + RSTEP * r, d0, k8);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[r] += k8[j] * s8[j];
            }
        }
#pragma unroll
        for (int r = 0; r < RI; r++) sm.dD[(row0 + RSTEP * r) * SS + col] = acc[r];
        __syncthreads();
        /* dS ← Diag(γ) dS + QΓᵀ dO − Wᵀ dΔ (owner-only updates) for the thread's RD consecutive rows
           d = RD row0 + j: each dO and dΔ element read once for them, QΓ and W RD columns per load */
        {
            const int d0 = RD * row0;
            float ad[RD];
#pragma unroll
            for (int j = 0; j < RD; j++) ad[j] = sm.gamma[d0 + j] * sm.dS[(d0 + j) * SS + col];
#pragma unroll 2
            for (int i = 0; i < KDA_CHUNK; i++) {
                const float o = sm.dO[i * SS + col], e = sm.dD[i * SS + col];
                float q[RD], w[RD];
                panel_run<RD>(sm.qg, i, d0, q);
                panel_run<RD>(sm.w, i, d0, w);
#pragma unroll
                for (int j = 0; j < RD; j++) ad[j] += q[j] * o - w[j] * e;
            }
#pragma unroll
            for (int j = 0; j < RD; j++) sm.dS[(d0 + j) * SS + col] = ad[j];
        }
        __syncthreads();
    }
    if (p.dh0 && slot >= 0)
        for (int e = tid; e < KC * BV; e += DS_THREADS) {
            const int d = e / BV, c = e % BV;
            if (d < p.K && c0 + c < p.V) store_elem(p.dh0, p.dh0_dtype, state_elem(p, slot, h, d, c0 + c), sm.dS[d * SS + c]);
        }
}

template <int KC>
static int launch_dstate(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->seqs.num_seqs * p->hv * (p->vc / BV);
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    const int bytes = (int)sizeof(dstate_smem<KC>);
    return kda_launch((const void *)kda_bwd_dstate_kernel<KC>, ctas, DS_THREADS, bytes, p, device, done, stream);
}

extern "C" int kda_bwd_launch_dstate(const kda_bwd_params_t *p, int device, void *stream) {
    return p->kc == 64 ? launch_dstate<64>(p, device, stream) : launch_dstate<128>(p, device, stream);
}
