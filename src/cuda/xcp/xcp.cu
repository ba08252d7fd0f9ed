/*
 * Context parallelism across ranks on the device (docs/ALGORITHM.md §4a; the host side is xcp/launch.c): the fold
 * of a chain of gathered summaries, the primed forward's apply, and the small copies the summary passes need. A
 * summary holds per value head X = [A | C], K rows of K + V fp32 elements; the fold over the chain's ranks j, in
 * order, is
 *     S ← 0;   S ← A_j S + C_j
 * (the first map's A is not read: S is still 0), into a [HV][K][V] fp32 state. One CTA per (value head,
 * FOLD_COLS columns of S): the columns are independent, so they stay in shared memory across the chain (fp64); a
 * step is a K × K by K × FOLD_COLS product on CUDA cores, each output accumulated in fp64 from C over l = 0 .. K − 1
 * in order, a thread 4 columns of a row (one load of A and two of S per 4 products). A's columns come in blocks of
 * FOLD_LB through shared memory by coalesced loads, the next block held in registers while the current one is
 * used, so a step waits on global memory once a block, not once a term; S's rows past K are zero, so a block's
 * columns past K add zero terms (acc + 0 · 0 = acc) and the loop over a block has a fixed length.
 */
#include "common.cuh"

#define FOLD_COLS 8
#define FOLD_THREADS 256
#define FOLD_UNITS 2 /* (row, 4 columns) units a thread: K · FOLD_COLS / 4 / FOLD_THREADS, at most 2 (K ≤ 256) */
#define FOLD_LB 16   /* A's columns a block */
#define FOLD_LP 20   /* floats a row of the block in shared memory: 16-byte rows, a quarter warp's 4 rows apart */
#define FOLD_PF 16   /* A's elements a thread loads for a block: K · FOLD_LB / FOLD_THREADS, at most 16 */

/* shared memory: S (K rows rounded up to FOLD_LB, of FOLD_COLS fp64; the rows past K zero), then a block of A */
static __host__ __device__ inline int fold_rows(int K) { return (K + FOLD_LB - 1) / FOLD_LB * FOLD_LB; }
static __host__ __device__ inline int fold_smem_bytes(int K) {
    return fold_rows(K) * FOLD_COLS * (int)sizeof(double) + K * FOLD_LP * (int)sizeof(float);
}

/* A's block b (columns FOLD_LB·b .., rows 0 .. K − 1) into the thread's registers: element f = tid + FOLD_THREADS u
   is (i, l) = (f / FOLD_LB, f % FOLD_LB), zero past K */
DEV void fold_load(float pf[FOLD_PF], const float *X, int64_t W, int K, int b, int tid) {
#pragma unroll
    for (int u = 0; u < FOLD_PF; u++) {
        const int f = tid + FOLD_THREADS * u, i = f / FOLD_LB, l = b * FOLD_LB + f % FOLD_LB;
        pf[u] = i < K && l < K ? X[i * W + l] : 0.0f;
    }
}

__global__ void __launch_bounds__(FOLD_THREADS)
    kda_xcp_fold_kernel(const float *sums, int64_t first, int count, int step, int hv, int K, int V, float *out) {
    extern __shared__ double fold_smem[];
    const int tiles = (V + FOLD_COLS - 1) / FOLD_COLS;
    const int h = (int)(blockIdx.x / tiles), c0 = (int)(blockIdx.x % tiles) * FOLD_COLS;
    const int64_t W = (int64_t)K + V;
    const int KP = fold_rows(K), nb = KP / FOLD_LB, tid = threadIdx.x;
    double *S = fold_smem;
    float *sA = (float *)(fold_smem + KP * FOLD_COLS); /* [i][l], rows of FOLD_LP */
    /* S's rows past K: zero, so that their terms add zero */
    for (int e = K * FOLD_COLS + tid; e < KP * FOLD_COLS; e += FOLD_THREADS) S[e] = 0.0;
    float pf[FOLD_PF]; /* the next block of A (fold_load) */
    if (count > 1) fold_load(pf, sums + ((first + (int64_t)step) * hv + h) * (int64_t)K * W, W, K, 0, tid);
    for (int m = 0; m < count; m++) {
        const float *X = sums + ((first + (int64_t)m * step) * hv + h) * (int64_t)K * W;
        double acc[FOLD_UNITS][4]; /* unit u = tid + FOLD_THREADS r: row u / 2, columns c0 + 4 (u % 2) .. + 3 */
#pragma unroll
        for (int r = 0; r < FOLD_UNITS; r++) {
            const int u = tid + FOLD_THREADS * r, i = u >> 1, c = c0 + 4 * (u & 1);
#pragma unroll
            for (int k = 0; k < 4; k++) acc[r][k] = i < K && c + k < V ? (double)X[i * W + K + c + k] : 0.0;
        }
        for (int b = 0; m > 0 && b < nb; b++) {
#pragma unroll
            for (int u = 0; u < FOLD_PF; u++) {
                const int f = tid + FOLD_THREADS * u;
                if (f < K * FOLD_LB) sA[(f / FOLD_LB) * FOLD_LP + f % FOLD_LB] = pf[u];
            }
            __syncthreads(); /* the block is in shared memory (and S, written before, too) */
            if (b + 1 < nb) fold_load(pf, X, W, K, b + 1, tid);
            else if (m + 1 < count) fold_load(pf, X + (int64_t)step * hv * K * W, W, K, 0, tid);
#pragma unroll
            for (int r = 0; r < FOLD_UNITS; r++) {
                const int u = tid + FOLD_THREADS * r, i = u >> 1;
                if (i >= K) continue;
                const float *ar = sA + i * FOLD_LP;
                const double *sr = S + b * FOLD_LB * FOLD_COLS + 4 * (u & 1);
#pragma unroll
                for (int l4 = 0; l4 < FOLD_LB; l4 += 4) {
                    const float4 a4 = *(const float4 *)(ar + l4);
                    const float av[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const double x = (double)av[q];
                        const double2 s01 = *(const double2 *)(sr + (l4 + q) * FOLD_COLS),
                                      s23 = *(const double2 *)(sr + (l4 + q) * FOLD_COLS + 2);
                        acc[r][0] += x * s01.x, acc[r][1] += x * s01.y, acc[r][2] += x * s23.x, acc[r][3] += x * s23.y;
                    }
                }
            }
            __syncthreads(); /* every thread's reads of the block and of S are done */
        }
#pragma unroll
        for (int r = 0; r < FOLD_UNITS; r++) {
            const int u = tid + FOLD_THREADS * r, i = u >> 1;
            if (i < K)
#pragma unroll
                for (int k = 0; k < 4; k++) S[i * FOLD_COLS + 4 * (u & 1) + k] = acc[r][k];
        }
        __syncthreads(); /* S of step m before step m + 1 reads it (or the output below) */
    }
    for (int e = tid; e < K * FOLD_COLS; e += FOLD_THREADS) {
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
    const int smem = fold_smem_bytes(K);
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
 * of one (piece, head) on the tensor cores, ~fp32 as the CP merge does it (3xTF32, split_tf32_rz: A S ≈ Ah Sh +
 * (Al Sh + Ah Sl), three accumulators): warp w the rows 16 (w mod 4) .., columns 32 (w / 4) .. of the tile, as
 * m16n8k8 products over e = 0 .. KC − 1. The operands come in chunks of APPLY_E values of e through shared memory
 * by coalesced loads (A's rows as float4: they are KC wide and 16-byte aligned), the next chunk held in registers
 * while the current one is used; the rows' pads (APPLY_LA, APPLY_LB) put a fragment's 32 loads in 32 banks. A's
 * columns past K are zero in the prefix (M's padding), so only S's rows need a bound; the rows and columns past K
 * and V come out zero, as the slots' padding must. */
#define APPLY_T 64
#define APPLY_E 32
#define APPLY_LA 36 /* floats a row of A's chunk: [d][e] */
#define APPLY_LB 72 /* floats a row of S's chunk: [e][v] */
__global__ void __launch_bounds__(256) kda_xcp_apply_kernel(const float *prefix, const float *S, float *slots, int hv,
                                                            int K, int V, int KC, int VC, int64_t slot_floats) {
    __shared__ __align__(16) float sA[APPLY_T * APPLY_LA];
    __shared__ __align__(16) float sB[APPLY_E * APPLY_LB];
    const int dts = KC / APPLY_T, vts = VC / APPLY_T;
    const int64_t b = blockIdx.x;
    const int vt = (int)(b % vts), dt = (int)(b / vts % dts), h = (int)(b / vts / dts % hv);
    const int64_t j = b / vts / dts / hv + 1;
    const int64_t xw = (int64_t)KC + VC;
    const float *X = prefix + ((j - 1) * hv + h) * (int64_t)KC * xw;
    const float *Sh = S + (int64_t)h * K * V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int d0 = dt * APPLY_T, v0 = vt * APPLY_T;
    const int wr = 16 * (warp & 3), wc = 32 * (warp >> 2); /* the warp's rows and columns in the tile */
    /* the thread's loads of a chunk: A's float4s q = tid + 256 u (row q / 8, e 4 (q % 8) ..), S's elements
       f = tid + 256 u (e f / 64, v f % 64) */
    float4 pa[2];
    float pb[8];
#define APPLY_LOAD(e0_)                                                                                                \
    do {                                                                                                               \
        for (int u_ = 0; u_ < 2; u_++) {                                                                               \
            const int q_ = tid + 256 * u_;                                                                             \
            pa[u_] = *(const float4 *)&X[(int64_t)(d0 + q_ / 8) * xw + (e0_) + 4 * (q_ % 8)];                          \
        }                                                                                                              \
        for (int u_ = 0; u_ < 8; u_++) {                                                                               \
            const int f_ = tid + 256 * u_, e_ = (e0_) + f_ / 64, v_ = v0 + f_ % 64;                                    \
            pb[u_] = e_ < K && v_ < V ? Sh[(int64_t)e_ * V + v_] : 0.0f;                                               \
        }                                                                                                              \
    } while (0)
    float acc[3][4][4]; /* [Ah Sh, Al Sh, Ah Sl][n8 tile][C fragment] */
#pragma unroll
    for (int pt = 0; pt < 3; pt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) acc[pt][nt][0] = acc[pt][nt][1] = acc[pt][nt][2] = acc[pt][nt][3] = 0.0f;
    APPLY_LOAD(0);
    for (int e0 = 0; e0 < KC; e0 += APPLY_E) {
        __syncthreads(); /* the previous chunk's reads are done */
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int q = tid + 256 * u;
            *(float4 *)&sA[(q / 8) * APPLY_LA + 4 * (q % 8)] = pa[u];
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int f = tid + 256 * u;
            sB[(f / 64) * APPLY_LB + f % 64] = pb[u];
        }
        __syncthreads();
        if (e0 + APPLY_E < KC) APPLY_LOAD(e0 + APPLY_E);
#pragma unroll
        for (int ks = 0; ks < APPLY_E / 8; ks++) {
            const float *a0 = sA + (wr + g) * APPLY_LA + 8 * ks + t, *a8 = a0 + 8 * APPLY_LA;
            float ah[4], al[4];
            split_tf32_rz(a0[0], &ah[0], &al[0]);
            split_tf32_rz(a8[0], &ah[1], &al[1]);
            split_tf32_rz(a0[4], &ah[2], &al[2]);
            split_tf32_rz(a8[4], &ah[3], &al[3]);
            const float *b0 = sB + (8 * ks + t) * APPLY_LB + wc + g;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                float bh0, bl0, bh1, bl1;
                split_tf32_rz(b0[8 * nt], &bh0, &bl0);
                split_tf32_rz(b0[4 * APPLY_LB + 8 * nt], &bh1, &bl1);
                mma_tf32(acc[0][nt], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
                mma_tf32(acc[1][nt], al[0], al[1], al[2], al[3], bh0, bh1);
                mma_tf32(acc[2][nt], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
            }
        }
    }
#undef APPLY_LOAD
    float *dst = slots + (j * hv + h) * slot_floats + (int64_t)KC * KC + (int64_t)KC * VC;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = d0 + wr + g + 8 * hr, col = v0 + wc + 8 * nt + 2 * t; /* the C fragment's elements */
            const float2 c = *(const float2 *)(X + (int64_t)row * xw + KC + col);
            const float y0 = acc[0][nt][2 * hr] + (acc[1][nt][2 * hr] + acc[2][nt][2 * hr]);
            const float y1 = acc[0][nt][2 * hr + 1] + (acc[1][nt][2 * hr + 1] + acc[2][nt][2 * hr + 1]);
            *(float2 *)&dst[(int64_t)row * VC + col] = make_float2(y0 + c.x, y1 + c.y);
        }
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
