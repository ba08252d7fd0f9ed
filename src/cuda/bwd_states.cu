/*
 * Backward, stage 1: the state S at the start of every chunk (docs/ALGORITHM.md §3, §6), fp32 into the
 * workspace, for the chunk kernel (bwd_chunk.cu) to differentiate each chunk from.
 *
 * One CTA of 256 threads per (sequence, value head, tile of KDA_BWD_BV = 16 value columns), chunk after
 * chunk, from the forward's chunk blocks (prep.cuh: W, K̃, U, γ in bf16):
 *
 *     S ← initial state (zeros without one; a column holding an inf or NaN becomes NaN whole, §7)
 *     for each chunk:  states[chunk] ← S
 *                      Δ = U − W S                  (C × 16)
 *                      S ← Diag(γ) S + K̃ᵀ Δ          (K × 16; skipped after the last chunk)
 *
 * The same products as the forward's recurrence, on CUDA cores in fp32 (a first version: the recurrence's
 * tensor-core steps are the model for the next one). S lives in shared memory, [KC][16] fp32; each chunk's W
 * and K̃ panels and the U panel holding the tile are copied in byte for byte and read through the panel layout.
 */
#include "bwd.cuh"
#include "seq.cuh"

#define ST_THREADS 256
#define BV KDA_BWD_BV
#define SS (BV + 4) /* fp32 stride of S and Δ rows */

template <int KC>
struct states_smem {
    unsigned char w[KDA_CHUNK * KC * 2];  /* W panels */
    unsigned char kt[KDA_CHUNK * KC * 2]; /* K̃ panels */
    unsigned char u[KDA_PANEL_BYTES];      /* the U panel (64 columns) holding the tile */
    float S[KC * SS];
    float D[KDA_CHUNK * SS];
    float gamma[KC];
    int bad[BV];
};

/* S ← the tile of the initial state; non-finite columns NaN (the per-channel rule of §7) */
template <int KC>
DEV void load_initial_state(const kda_bwd_params_t &p, states_smem<KC> &sm, int64_t slot, int h, int c0, int tid) {
    if (tid < BV) sm.bad[tid] = 0;
    __syncthreads();
    for (int e = tid; e < KC * BV; e += ST_THREADS) {
        const int d = e / BV, c = e % BV;
        float x = 0.0f;
        if (p.h0 && slot >= 0 && d < p.K && c0 + c < p.V) x = load_elem(p.h0, p.h0_dtype, state_elem(p, slot, h, d, c0 + c));
        if (!isfinite(x)) sm.bad[c] = 1; /* benign race: every writer stores 1 */
        sm.S[d * SS + c] = x;
    }
    __syncthreads();
    for (int e = tid; e < KC * BV; e += ST_THREADS)
        if (sm.bad[e % BV]) sm.S[(e / BV) * SS + e % BV] = __int_as_float(0x7fc00000);
}

template <int KC>
__global__ void __launch_bounds__(ST_THREADS, 4) kda_bwd_states_kernel(const kda_bwd_params_t p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    states_smem<KC> &sm = *(states_smem<KC> *)smem_raw;
    const int tid = threadIdx.x;
    const int tiles = p.vc / BV;
    const int tile = (int)(blockIdx.x % tiles), h = (int)(blockIdx.x / tiles % p.hv);
    const int64_t n = blockIdx.x / tiles / p.hv;
    const int c0 = tile * BV;
    int64_t bos, eos;
    seq_bounds(p.seqs, n, &bos, &eos);
    const int64_t nc = (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK, chunk0 = nc > 0 ? seq_chunk0(p.seqs, n) : 0;
    if (nc == 0) return;
    load_initial_state<KC>(p, sm, seq_slot(p.state_indices, NULL, p.num_state_slots, n), h, c0, tid);

    const int col = tid % BV, row0 = tid / BV; /* thread's column; its row group (16 of them) */
    constexpr int RSTEP = ST_THREADS / BV, RI = KDA_CHUNK / RSTEP, RD = KC / RSTEP;
    static_assert(RI == 4 && (RD == 8 || RD == 4), "states: 256 threads, 16 columns, C = 64, KC 64 or 128");
    for (int64_t ci = 0; ci < nc; ci++) {
        const int64_t cid = chunk0 + ci;
        const unsigned char *blk = (const unsigned char *)p.blocks.base + (cid * p.hv + h) * p.blocks.block_bytes;
        float *out = p.states + (cid * p.hv + h) * (int64_t)KC * p.vc + c0;
        for (int e = tid; e < KC * BV; e += ST_THREADS) out[(e / BV) * (int64_t)p.vc + e % BV] = sm.S[(e / BV) * SS + e % BV];
        if (ci == nc - 1) break;
        /* the chunk's panels */
        for (int e = tid; e < KDA_CHUNK * KC * 2 / 16; e += ST_THREADS) {
            ((uint4 *)sm.w)[e] = ((const uint4 *)blk)[e];
            ((uint4 *)sm.kt)[e] = ((const uint4 *)(blk + kda_cuda_off_kt(KC)))[e];
        }
        for (int e = tid; e < KDA_PANEL_BYTES / 16; e += ST_THREADS)
            ((uint4 *)sm.u)[e] = ((const uint4 *)(blk + kda_cuda_off_u(KC) + (int64_t)(c0 / KDA_PANEL_COLS) * KDA_PANEL_BYTES))[e];
        for (int d = tid; d < KC; d += ST_THREADS) sm.gamma[d] = ((const float *)(blk + kda_cuda_off_gamma(KC)))[d];
        __syncthreads();
        /* Δ = U − W S for the thread's rows i = row0 + 16 r: each S element read once for the four rows, W 8
           columns per 16-byte load */
        float acc[RI];
#pragma unroll
        for (int r = 0; r < RI; r++) acc[r] = panel_at(sm.u, row0 + RSTEP * r, c0 % KDA_PANEL_COLS + col);
#pragma unroll 1
        for (int d0 = 0; d0 < KC; d0 += 8) {
            float s8[8];
#pragma unroll
            for (int j = 0; j < 8; j++) s8[j] = sm.S[(d0 + j) * SS + col];
#pragma unroll
            for (int r = 0; r < RI; r++) {
                float w8[8];
                panel_run<8>(sm.w, row0 + RSTEP * r, d0, w8);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[r] -= w8[j] * s8[j];
            }
        }
#pragma unroll
        for (int r = 0; r < RI; r++) sm.D[(row0 + RSTEP * r) * SS + col] = acc[r];
        __syncthreads();
        /* S ← Diag(γ) S + K̃ᵀ Δ (each thread updates only the elements it owns: its RD consecutive rows
           d = RD row0 + j, each Δ element read once for them, K̃ a run per load) */
        {
            const int d0 = RD * row0;
            float ad[RD];
#pragma unroll
            for (int j = 0; j < RD; j++) ad[j] = sm.gamma[d0 + j] * sm.S[(d0 + j) * SS + col];
#pragma unroll 1
            for (int i = 0; i < KDA_CHUNK; i++) {
                const float e = sm.D[i * SS + col];
                float k[RD];
                panel_run<RD>(sm.kt, i, d0, k);
#pragma unroll
                for (int j = 0; j < RD; j++) ad[j] += k[j] * e;
            }
#pragma unroll
            for (int j = 0; j < RD; j++) sm.S[(d0 + j) * SS + col] = ad[j];
        }
        __syncthreads();
    }
}

template <int KC>
static int launch_states(const kda_bwd_params_t *p, int device, void *stream) {
    const int64_t ctas = p->seqs.num_seqs * p->hv * (p->vc / BV);
    if (ctas == 0) return 0;
    static int done[KDA_MAX_DEVICES];
    const int bytes = (int)sizeof(states_smem<KC>);
    return kda_launch((const void *)kda_bwd_states_kernel<KC>, ctas, ST_THREADS, bytes, p, device, done, stream);
}

extern "C" int kda_bwd_launch_states(const kda_bwd_params_t *p, int device, void *stream) {
    return p->kc == 64 ? launch_states<64>(p, device, stream) : launch_states<128>(p, device, stream);
}
