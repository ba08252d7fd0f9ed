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

/* A primed forward's incoming states (xcp.h): for pieces j = 1 .. np − 1 of the split sequence, S_in(j) = A S + C
 * with [A | C] = X_{j−1}, the prefix map (KC rows of KC + VC), and S the fold entering the sequence ([hv][K][V]
 * fp32, read as zero past K and V), into slot j's incoming-state tile (KC × VC, [d][v]). A CTA makes a 64 × 64 tile
 * of one (piece, head) on CUDA cores, 4 × 4 outputs a thread, e in chunks of APPLY_E through shared memory with the
 * next chunk loaded into registers meanwhile. A's columns past K are zero in the prefix (M's padding), so only S's
 * rows need a bound; the rows and columns past K and V come out zero, as the slots' padding must. */
#define APPLY_T 64
#define APPLY_E 16
__global__ void __launch_bounds__(256) kda_xcp_apply_kernel(const float *prefix, const float *S, float *slots, int hv,
                                                            int K, int V, int KC, int VC, int64_t slot_floats) {
    __shared__ __align__(16) float sA[APPLY_E][APPLY_T + 4]; /* A's chunk transposed: [e][d] */
    __shared__ __align__(16) float sB[APPLY_E][APPLY_T];     /* S's chunk: [e][v] */
    const int dts = KC / APPLY_T, vts = VC / APPLY_T;
    const int64_t b = blockIdx.x;
    const int vt = (int)(b % vts), dt = (int)(b / vts % dts), h = (int)(b / vts / dts % hv);
    const int64_t j = b / vts / dts / hv + 1;
    const int64_t xw = (int64_t)KC + VC;
    const float *X = prefix + ((j - 1) * hv + h) * (int64_t)KC * xw;
    const float *Sh = S + (int64_t)h * K * V;
    const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16; /* rows 4 tr .., columns 4 tc .. of the tile */
    const int d0 = dt * APPLY_T, v0 = vt * APPLY_T;
    const int ad = tid / 4, ae = 4 * (tid % 4); /* the thread's loads: A[d0 + ad][e0 + ae ..], S[e0 + se][v0 + sv ..] */
    const int se = tid / 16, sv = 4 * (tid % 16);
    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const float4 x = *(const float4 *)&X[(int64_t)(d0 + 4 * tr + r) * xw + KC + v0 + 4 * tc];
        acc[r][0] = x.x, acc[r][1] = x.y, acc[r][2] = x.z, acc[r][3] = x.w;
    }
    float4 pa = *(const float4 *)&X[(int64_t)(d0 + ad) * xw + ae];
    float pb[4];
#pragma unroll
    for (int k = 0; k < 4; k++) pb[k] = se < K && v0 + sv + k < V ? Sh[(int64_t)se * V + v0 + sv + k] : 0.0f;
    for (int e0 = 0; e0 < K; e0 += APPLY_E) {
        __syncthreads(); /* the previous chunk's reads are done */
        sA[ae][ad] = pa.x, sA[ae + 1][ad] = pa.y, sA[ae + 2][ad] = pa.z, sA[ae + 3][ad] = pa.w;
        *(float4 *)&sB[se][sv] = make_float4(pb[0], pb[1], pb[2], pb[3]);
        __syncthreads();
        const int en = e0 + APPLY_E;
        if (en < K) {
            pa = *(const float4 *)&X[(int64_t)(d0 + ad) * xw + en + ae];
#pragma unroll
            for (int k = 0; k < 4; k++)
                pb[k] = en + se < K && v0 + sv + k < V ? Sh[(int64_t)(en + se) * V + v0 + sv + k] : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < APPLY_E; e++) {
            const float4 a = *(const float4 *)&sA[e][4 * tr], s = *(const float4 *)&sB[e][4 * tc];
            const float av[4] = {a.x, a.y, a.z, a.w}, svv[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[r][c] = fmaf(av[r], svv[c], acc[r][c]);
        }
    }
    float *dst = slots + (j * hv + h) * slot_floats + (int64_t)KC * KC + (int64_t)KC * VC;
#pragma unroll
    for (int r = 0; r < 4; r++)
        *(float4 *)&dst[(int64_t)(d0 + 4 * tr + r) * VC + v0 + 4 * tc] =
            make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

/* The primed summary from the last prefix map X = X_{np−1} ([hv][KC][KC + VC]): per head K rows of W = K + V,
 * [A | C] restricted to K, V; A is zero unless the sequence continues from an earlier rank (first_map) */
__global__ void kda_xcp_place_prefix_kernel(float *dst, const float *X, int hv, int K, int V, int KC, int VC,
                                            int first_map) {
    const int64_t W = (int64_t)K + V, e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)hv * K * W) return;
    const int64_t h = e / (K * W), i = e / W % K, c = e % W;
    const float *x = X + (h * KC + i) * ((int64_t)KC + VC);
    dst[e] = c < K ? (first_map ? x[c] : 0.0f) : x[KC + c - K];
}

extern "C" int kda_xcp_launch_apply(const float *prefix, const float *S, float *slots, int64_t np, int hv, int K, int V,
                                    int KC, int VC, void *stream) {
    const int64_t ctas = (np - 1) * hv * (KC / APPLY_T) * (VC / APPLY_T);
    if (ctas <= 0) return 0;
    kda_xcp_apply_kernel<<<(unsigned)ctas, 256, 0, (cudaStream_t)stream>>>(prefix, S, slots, hv, K, V, KC, VC,
                                                                           kda_cuda_cp_slot_floats(KC, VC));
    return (int)cudaGetLastError();
}

extern "C" int kda_xcp_launch_place_prefix(float *dst, const float *X, int hv, int K, int V, int KC, int VC,
                                           int first_map, void *stream) {
    kda_xcp_place_prefix_kernel<<<blocks_for((int64_t)hv * K * (K + V), 256), 256, 0, (cudaStream_t)stream>>>(
        dst, X, hv, K, V, KC, VC, first_map);
    return (int)cudaGetLastError();
}
