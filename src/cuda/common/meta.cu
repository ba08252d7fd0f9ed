/*
 * Varlen scheduling on the device: chunk_offsets[n] = Σ_{m<n} ceil(len_m / C), n = 0..N, from cu_seqlens
 * (clamped as in seq.cuh). One CTA of 1024 threads: each thread sums a contiguous run of sequences, a block
 * scan turns the sums into offsets, each thread writes its run. No host involvement, so the forward stays
 * graph-capturable; the preparation kernel finds its sequence by binary search in these offsets.
 */
#include "common.cuh"
#include "seq.cuh"

#define META_THREADS 1024

__global__ void __launch_bounds__(META_THREADS) kda_meta_kernel(const kda_cuda_seqs_t p) {
    __shared__ int64_t warp_sums[META_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t N = p.num_seqs;
    const int64_t per = (N + META_THREADS - 1) / META_THREADS;
    const int64_t begin = min(N, tid * per), end = min(N, begin + per);

    int64_t local = 0;
    for (int64_t n = begin; n < end; n++) {
        int64_t bos, eos;
        seq_bounds(p, n, &bos, &eos);
        local += (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK;
    }
    /* inclusive scan of `local` over the block */
    int64_t x = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int64_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int64_t w = warp_sums[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int64_t y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    int64_t offset = x - local + (warp > 0 ? warp_sums[warp - 1] : 0); /* exclusive */
    for (int64_t n = begin; n < end; n++) {
        p.chunk_offsets[n] = (int32_t)offset;
        int64_t bos, eos;
        seq_bounds(p, n, &bos, &eos);
        offset += (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK;
    }
    if (tid == META_THREADS - 1) p.chunk_offsets[N] = (int32_t)(x + (warp > 0 ? warp_sums[warp - 1] : 0));
}

extern "C" int kda_cuda_launch_meta(const kda_cuda_seqs_t *s, void *stream) {
    kda_meta_kernel<<<1, META_THREADS, 0, (cudaStream_t)stream>>>(*s);
    return (int)cudaGetLastError();
}
