/*
 * Backward, stage 4: what sums over value heads and over chunks (docs/ALGORITHM.md §6), in a fixed order.
 *
 *   dq, dk   (G > 1 only: with one value head per query/key head bwd_pairs.cu writes them, bwd.h)
 *            one warp per (token, query/key head): dq̂ = Σ over its G value heads h = hq·G … hq·G + G − 1 (in
 *            that order) of the chunk kernel's per-head dq̂; likewise dk̂; then the l2norm step
 *            dx = r (dy − y (y·dy)), y = r x, r = (Σ x² + 1e−6)^−½, and the store in the gradient's dtype
 *   dA_log,  one thread per (value head, channel d): the pairs kernel's partial sums summed over the chunks in
 *   ddt_bias chunk order (∂L/∂dt_bias[d]; the channel's terms of ∂L/∂A_log, then summed over the channels in
 *            order); zeros when there are no tokens
 *
 * No atomics: two identical calls give identical bytes.
 */
#include "bwd.cuh"
#include "seq.cuh"

#define FIN_THREADS 256
#define FIN_BATCH 16 /* chunks whose partial sums are loaded at once */

/* dy (lanes' columns d = lane + 32 u) → dx through y = x / sqrt(Σx² + eps), in place */
template <int KC>
DEV void l2norm_backward(float dy[KC / 32], const float x[KC / 32]) {
    float ss = 0.0f, xdy = 0.0f;
#pragma unroll
    for (int u = 0; u < KC / 32; u++) {
        ss += x[u] * x[u];
        xdy += x[u] * dy[u];
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) + 1e-6f), ydy = warp_sum(xdy) * r;
#pragma unroll
    for (int u = 0; u < KC / 32; u++) dy[u] = r * (dy[u] - r * x[u] * ydy);
}

template <int KC>
__global__ void __launch_bounds__(FIN_THREADS) kda_bwd_qk_kernel(const kda_bwd_params_t p) {
    constexpr int U = KC / 32;
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (FIN_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= p.seqs.num_tokens * p.hqk) return;
    const int64_t t = row / p.hqk;
    const int hq = (int)(row % p.hqk);
    /* every load before any arithmetic: q and k (l2norm), then the value heads' dq̂ and dk̂ rows, both at once (a
       loop over dq then dk waited for two round trips per row, and a third for the inputs) */
    float dq[U], dk[U], xq[U], xk[U];
    uint32_t bq[U], bk[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int d = lane + 32 * u;
        const bool in = p.l2norm && d < p.K;
        bq[u] = in ? load_bits(p.q, p.dtype, row * p.K + d) : 0u;
        bk[u] = in ? load_bits(p.k, p.dtype, row * p.K + d) : 0u;
        dq[u] = dk[u] = 0.0f;
    }
    for (int h = hq * p.group; h < (hq + 1) * p.group; h++) {
        const float *src = p.dqk + (t * p.hv + h) * (int64_t)(2 * KC);
#pragma unroll
        for (int u = 0; u < U; u++) {
            dq[u] += src[lane + 32 * u];
            dk[u] += src[KC + lane + 32 * u];
        }
    }
    if (p.l2norm) {
        bits_values<U>(xq, bq, p.dtype);
        bits_values<U>(xk, bk, p.dtype);
        l2norm_backward<KC>(dq, xq);
        l2norm_backward<KC>(dk, xk);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int d = lane + 32 * u;
        if (d < p.K) {
            store_elem(p.dq, p.dq_dtype, row * p.K + d, dq[u]);
            store_elem(p.dk, p.dk_dtype, row * p.K + d, dk[u]);
        }
    }
}

__global__ void __launch_bounds__(FIN_THREADS) kda_bwd_gate_params_kernel(const kda_bwd_params_t p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *al = (float *)smem_raw; /* [FIN_THREADS] */
    const int h = blockIdx.x, d = threadIdx.x; /* channel d: its ∂L/∂dt_bias[d] and its terms of ∂L/∂A_log */
    const int64_t chunks = p.seqs.cu_seqlens ? (int64_t)p.seqs.chunk_offsets[p.seqs.num_seqs]
                                             : p.seqs.num_seqs * p.seqs.chunks_per_row;
    float a = 0.0f, b = 0.0f;
    if (d < p.kc) {
        /* FIN_BATCH chunks' loads issued before their sums (in chunk order, as one at a time: a chain of round
           trips, ~0.07 ms of 256 chunks) */
        const float *part = p.part + (int64_t)h * (2 * p.kc) + d;
        const int64_t stride = (int64_t)p.hv * (2 * p.kc);
        int64_t c = 0;
#pragma unroll 1
        for (; c + FIN_BATCH <= chunks; c += FIN_BATCH) {
            float x[FIN_BATCH], y[FIN_BATCH];
#pragma unroll
            for (int u = 0; u < FIN_BATCH; u++) {
                x[u] = part[(c + u) * stride];
                y[u] = part[(c + u) * stride + p.kc];
            }
#pragma unroll
            for (int u = 0; u < FIN_BATCH; u++) {
                a += x[u];
                b += y[u];
            }
        }
        for (; c < chunks; c++) {
            a += part[c * stride];
            b += part[c * stride + p.kc];
        }
    }
    al[d] = a;
    if (d < p.K && p.ddt_bias) p.ddt_bias[(int64_t)h * p.K + d] = b;
    __syncthreads();
    if (d == 0 && p.dA_log) {
        float s = 0.0f;
        for (int c = 0; c < p.kc; c++) s += al[c];
        p.dA_log[h] = s;
    }
}

extern "C" int kda_bwd_launch_finish(const kda_bwd_params_t *p, int device, void *stream) {
    (void)device;
    const int64_t rows = p->seqs.num_tokens * p->hqk, per = FIN_THREADS / 32;
    if (rows > 0 && !kda_bwd_pairs_final(p)) { /* else the pairs kernel wrote dq and dk */
        const unsigned blocks = (unsigned)((rows + per - 1) / per);
        if (p->kc == 64) kda_bwd_qk_kernel<64><<<blocks, FIN_THREADS, 0, (cudaStream_t)stream>>>(*p);
        else kda_bwd_qk_kernel<128><<<blocks, FIN_THREADS, 0, (cudaStream_t)stream>>>(*p);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return (int)err;
    }
    if (p->dA_log || p->ddt_bias) {
        kda_bwd_gate_params_kernel<<<(unsigned)p->hv, FIN_THREADS, FIN_THREADS * sizeof(float), (cudaStream_t)stream>>>(*p);
        return (int)cudaGetLastError();
    }
    return 0;
}
