/*
 * Backward, stage 4: what sums over chunks (docs/ALGORITHM.md §6), in a fixed order.
 *
 *   dA_log,  one thread per (value head, channel d): the pairs kernel's partial sums summed over the chunks in
 *   ddt_bias chunk order (∂L/∂dt_bias[d]; the channel's terms of ∂L/∂A_log, then summed over the channels in
 *            order); zeros when there are no tokens
 *
 *   dβ,      V class 256 only, one thread per (token, value head): the chunk kernel's two V halves' parts, half 0 +
 *            half 1, then through β's sigmoid (bwd_chunk.cuh writes dβ itself for the other classes)
 *
 * dq and dk are the pairs kernel's (bwd_pairs.cuh: it sums the G value heads of a query/key head in order and
 * applies the l2norm step).
 * No atomics: two identical calls give identical bytes.
 */
#include "bwd.cuh"

#define FIN_THREADS 256
#define FIN_BATCH 16 /* chunks whose partial sums are loaded at once */

__global__ void __launch_bounds__(FIN_THREADS) kda_bwd_gate_params_kernel(const kda_bwd_params_t p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *al = (float *)smem_raw;             /* [FIN_THREADS] */
    const int h = blockIdx.x, d = threadIdx.x; /* channel d: its ∂L/∂dt_bias[d] and its terms of ∂L/∂A_log */
    const int64_t chunks = p.pb.seqs.cu_seqlens ? (int64_t)p.pb.seqs.chunk_offsets[p.pb.seqs.num_seqs]
                                                : p.pb.seqs.num_seqs * p.pb.seqs.chunks_per_row;
    float a = 0.0f, b = 0.0f;
    if (d < p.pb.kc) {
        /* FIN_BATCH chunks' loads issued before their sums (in chunk order; one at a time would be a chain of
           round trips) */
        const float *part = p.part + (int64_t)h * (2 * p.pb.kc) + d;
        const int64_t stride = (int64_t)p.pb.hv * (2 * p.pb.kc);
        int64_t c = 0;
#pragma unroll 1
        for (; c + FIN_BATCH <= chunks; c += FIN_BATCH) {
            float x[FIN_BATCH], y[FIN_BATCH];
#pragma unroll
            for (int u = 0; u < FIN_BATCH; u++) {
                x[u] = part[(c + u) * stride];
                y[u] = part[(c + u) * stride + p.pb.kc];
            }
#pragma unroll
            for (int u = 0; u < FIN_BATCH; u++) {
                a += x[u];
                b += y[u];
            }
        }
        for (; c < chunks; c++) {
            a += part[c * stride];
            b += part[c * stride + p.pb.kc];
        }
    }
    al[d] = a;
    if (d < p.pb.K && p.ddt_bias) p.ddt_bias[(int64_t)h * p.pb.K + d] = b;
    __syncthreads();
    if (d == 0 && p.dA_log) {
        float s = 0.0f;
        for (int c = 0; c < p.pb.kc; c++) s += al[c];
        p.dA_log[h] = s;
    }
}

__global__ void __launch_bounds__(FIN_THREADS) kda_bwd_dbeta_kernel(const kda_bwd_params_t p) {
    const int64_t e = (int64_t)blockIdx.x * FIN_THREADS + threadIdx.x; /* (token, value head) */
    if (e >= p.pb.seqs.num_tokens * p.pb.hv) return;
    float db = p.dbeta_part[2 * e] + p.dbeta_part[2 * e + 1];
    if (p.pb.beta_sigmoid) {
        const float sg = beta_sigmoid(load_elem(p.pb.beta, p.pb.beta_dtype, e), 0);
        db *= (p.pb.neg_eigval ? 2.0f : 1.0f) * sg * (1.0f - sg);
    }
    store_elem(p.dbeta, p.dbeta_dtype, e, db);
}

extern "C" int kda_bwd_launch_finish(const kda_bwd_params_t *p, int device, void *stream) {
    (void)device;
    const int64_t rows = p->pb.seqs.num_tokens * p->pb.hv;
    if (kda_bwd_vhalves(p->pb.vc) == 2 && rows > 0) {
        kda_bwd_dbeta_kernel<<<(unsigned)((rows + FIN_THREADS - 1) / FIN_THREADS), FIN_THREADS, 0,
                               (cudaStream_t)stream>>>(*p);
        const int err = (int)cudaGetLastError();
        if (err) return err;
    }
    if (p->dA_log || p->ddt_bias) {
        kda_bwd_gate_params_kernel<<<(unsigned)p->pb.hv, FIN_THREADS, FIN_THREADS * sizeof(float),
                                     (cudaStream_t)stream>>>(*p);
        return (int)cudaGetLastError();
    }
    return 0;
}
