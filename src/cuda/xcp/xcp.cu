/*
 * Context parallelism across ranks on the device (docs/ALGORITHM.md §4a; the host side is xcp/launch.c): the fold
 * of a chain of gathered summaries and the small copies the summary passes need. A summary holds per value head
 * X = [A | C], K rows of K + V fp32 elements; the fold over the chain's ranks j, in order, is
 *     S ← 0;   S ← A_j S + C_j
 * (the first map's A is not read: S is still 0), into a [HV][K][V] fp32 state. One CTA per (value head,
 * FOLD_COLS columns of S): the columns are independent, so they stay in shared memory across the chain; a step is a
 * K × K by K × FOLD_COLS product on CUDA cores, accumulated in fp64 (R − 1 steps at most, each K² · V products
 * per head: small beside the forward they feed).
 */
#include "common.cuh"

#define FOLD_COLS 8
#define FOLD_THREADS 256

__global__ void __launch_bounds__(FOLD_THREADS)
    kda_xcp_fold_kernel(const float *sums, int64_t first, int count, int step, int hv, int K, int V, float *out) {
    extern __shared__ double fold_smem[]; /* S and the next S: 2 × K × FOLD_COLS */
    const int tiles = (V + FOLD_COLS - 1) / FOLD_COLS;
    const int h = (int)(blockIdx.x / tiles), c0 = (int)(blockIdx.x % tiles) * FOLD_COLS;
    const int64_t W = (int64_t)K + V;
    double *S = fold_smem, *next = fold_smem + K * FOLD_COLS;
    for (int m = 0; m < count; m++) {
        const float *X = sums + ((first + (int64_t)m * step) * hv + h) * (int64_t)K * W;
        for (int e = threadIdx.x; e < K * FOLD_COLS; e += FOLD_THREADS) {
            const int i = e / FOLD_COLS, c = e % FOLD_COLS;
            double acc = c0 + c < V ? (double)X[i * W + K + c0 + c] : 0.0;
            for (int l = 0; m > 0 && l < K; l++) acc += (double)X[i * W + l] * S[l * FOLD_COLS + c];
            next[e] = acc;
        }
        __syncthreads(); /* every thread's S read before the next step writes it */
        double *x = S;
        S = next;
        next = x;
    }
    for (int e = threadIdx.x; e < K * FOLD_COLS; e += FOLD_THREADS) {
        const int i = e / FOLD_COLS, c = e % FOLD_COLS;
        if (c0 + c < V) out[((int64_t)h * K + i) * V + c0 + c] = (float)S[e];
    }
}

/* Ones on the diagonal of each head's first K columns: x[(h K + i) W + i] = 1 (the rest is left as it is) */
__global__ void kda_xcp_identity_kernel(float *x, int hv, int K, int64_t W) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < (int64_t)hv * K) x[e * W + e % K] = 1.0f;
}

/* One slot's state of a pool into a dense [HV][K][V] (or [HV][V][K]) buffer of the same dtype (elems elements of
 * es = 2 or 4 bytes, copied as 16-bit halves): the slot that state_indices[0] names, or zeros where it names none
 * (negative, or past the pool) */
__global__ void kda_xcp_gather_kernel(uint16_t *dst, const uint16_t *pool, const int32_t *index, int64_t slots,
                                      int64_t halves) {
    const int64_t s = *index;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < halves; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = s >= 0 && s < slots ? pool[s * halves + i] : (uint16_t)0;
}

/* A [HV][K][C] fp32 state (tr: [HV][C][K], read transposed) into columns col0 .. col0 + C − 1 of the summary's
 * K rows of W elements per head; tr with a K-major K × K map M places Mᵀ */
__global__ void kda_xcp_place_kernel(float *dst, int64_t W, int col0, const float *src, int hv, int K, int C, int tr) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)hv * K * C) return;
    const int64_t h = e / ((int64_t)K * C), r = e % ((int64_t)K * C);
    const int i = (int)(r / C), j = (int)(r % C);
    dst[(h * K + i) * W + col0 + j] = tr ? src[(h * C + j) * K + i] : src[(h * K + i) * C + j];
}

static unsigned blocks_for(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

extern "C" int kda_xcp_launch_fold(const float *sums, int64_t first, int count, int step, int hv, int K, int V,
                                   float *out, void *stream) {
    const int smem = 2 * K * FOLD_COLS * (int)sizeof(double);
    const int64_t ctas = (int64_t)hv * ((V + FOLD_COLS - 1) / FOLD_COLS);
    kda_xcp_fold_kernel<<<(unsigned)ctas, FOLD_THREADS, smem, (cudaStream_t)stream>>>(sums, first, count, step, hv, K,
                                                                                      V, out);
    return (int)cudaGetLastError();
}

extern "C" int kda_xcp_launch_identity(float *x, int hv, int K, int64_t W, void *stream) {
    kda_xcp_identity_kernel<<<blocks_for((int64_t)hv * K, 256), 256, 0, (cudaStream_t)stream>>>(x, hv, K, W);
    return (int)cudaGetLastError();
}

extern "C" int kda_xcp_launch_gather(void *dst, const void *pool, const int32_t *index, int64_t slots, int64_t elems,
                                     int es, void *stream) {
    const int64_t halves = elems * (es / 2);
    const unsigned ctas = blocks_for(halves, 256) < 1024 ? blocks_for(halves, 256) : 1024;
    kda_xcp_gather_kernel<<<ctas, 256, 0, (cudaStream_t)stream>>>((uint16_t *)dst, (const uint16_t *)pool, index, slots,
                                                                  halves);
    return (int)cudaGetLastError();
}

extern "C" int kda_xcp_launch_place(float *dst, int64_t W, int col0, const float *src, int hv, int K, int C, int tr,
                                    void *stream) {
    kda_xcp_place_kernel<<<blocks_for((int64_t)hv * K * C, 256), 256, 0, (cudaStream_t)stream>>>(dst, W, col0, src, hv,
                                                                                                 K, C, tr);
    return (int)cudaGetLastError();
}
