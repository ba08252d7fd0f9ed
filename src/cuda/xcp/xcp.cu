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
 * FOLD_LB through a ring of FOLD_NS shared-memory stages by asynchronous copies, FOLD_NS − 1 blocks ahead of the one
 * used across the chain's maps, so that a fold waits on global memory about once, not once a block; S's rows past K
 * are zero, so a block's columns past K add zero terms (acc + 0 · 0 = acc) and the loop over a block has a fixed
 * length. */
#include "common.cuh"

#define FOLD_COLS 8
#define FOLD_THREADS 256
#define FOLD_UNITS 2 /* (row, 4 columns) units a thread: K · FOLD_COLS / 4 / FOLD_THREADS, at most 2 (K ≤ 256) */
#define FOLD_LB 16   /* A's columns a block */
#define FOLD_LP 20   /* floats a row of the block in shared memory: 16-byte rows, a quarter warp's 4 rows apart */
#define FOLD_NS 8    /* stages of A's blocks in shared memory: the block used and FOLD_NS − 1 in flight */

/* shared memory: S (K rows rounded up to FOLD_LB, of FOLD_COLS fp64; the rows past K zero), then the ring of A's
   blocks (K rows of FOLD_LP floats a stage) */
static __host__ __device__ inline int fold_rows(int K) { return (K + FOLD_LB - 1) / FOLD_LB * FOLD_LB; }
static __host__ __device__ inline int fold_smem_bytes(int K) {
    return fold_rows(K) * FOLD_COLS * (int)sizeof(double) + FOLD_NS * K * FOLD_LP * (int)sizeof(float);
}

/* Block q of the chain's stream of A's blocks (map m = 1 + q / nb of the chain, columns FOLD_LB (q mod nb) ..,
   rows 0 .. K − 1) into ring stage q mod FOLD_NS, by the thread's 4-byte copies (A's rows need not be 16-byte
   aligned), zero past K; then a commit even past the stream's end (q ≥ Q), so that a thread's groups count blocks */
DEV void fold_issue(float *ring, const float *sums, int64_t first, int step, int hv, int h, int64_t W, int K, int nb,
                    int64_t q, int64_t Q, int tid) {
    if (q < Q) {
        const int64_t m = 1 + q / nb;
        const int b = (int)(q % nb);
        const float *X = sums + ((first + m * step) * hv + h) * (int64_t)K * W;
        float *st = ring + (int)(q % FOLD_NS) * K * FOLD_LP;
        for (int f = tid; f < K * FOLD_LB; f += FOLD_THREADS) {
            const int i = f / FOLD_LB, l = b * FOLD_LB + f % FOLD_LB, in = l < K;
            cp_async4_zfill(smem_u32(st + i * FOLD_LP + f % FOLD_LB), in ? X + i * W + l : X, in ? 4 : 0);
        }
    }
    cp_async_commit();
}

__global__ void __launch_bounds__(FOLD_THREADS)
    kda_xcp_fold_kernel(const float *sums, int64_t first, int count, int step, int hv, int K, int V, float *out) {
    extern __shared__ double fold_smem[];
    const int tiles = (V + FOLD_COLS - 1) / FOLD_COLS;
    const int h = (int)(blockIdx.x / tiles), c0 = (int)(blockIdx.x % tiles) * FOLD_COLS;
    const int64_t W = (int64_t)K + V;
    const int KP = fold_rows(K), nb = KP / FOLD_LB, tid = threadIdx.x;
    double *S = fold_smem;
    float *ring = (float *)(fold_smem + KP * FOLD_COLS); /* FOLD_NS stages of [i][l], rows of FOLD_LP */
    /* S's rows past K: zero, so that their terms add zero */
    for (int e = K * FOLD_COLS + tid; e < KP * FOLD_COLS; e += FOLD_THREADS) S[e] = 0.0;
    const int64_t Q = (int64_t)(count - 1) * nb; /* the blocks of maps 1 .. count − 1 */
    for (int64_t q = 0; q < FOLD_NS - 1; q++) fold_issue(ring, sums, first, step, hv, h, W, K, nb, q, Q, tid);
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
            const int64_t q = (int64_t)(m - 1) * nb + b; /* committed: blocks 0 .. q + FOLD_NS − 2 */
            cp_async_wait_group<FOLD_NS - 2>();          /* the thread's copies of block q have landed */
            /* every thread's copies of block q too, S of step m − 1, and every read of stage (q − 1) mod FOLD_NS
               (block q − 1's) is done: block q + FOLD_NS − 1 may go there */
            __syncthreads();
            fold_issue(ring, sums, first, step, hv, h, W, K, nb, q + FOLD_NS - 1, Q, tid);
            const float *sA = ring + (int)(q % FOLD_NS) * K * FOLD_LP;
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
        }
        __syncthreads(); /* every thread's reads of S are done */
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

/* kda_smem_limit on the current device (these launchers are not given it) */
static cudaError_t smem_limit_here(const void *kernel, int bytes, int done[KDA_MAX_DEVICES]) {
    int device = -1;
    const cudaError_t err = cudaGetDevice(&device);
    return err != cudaSuccess ? err : kda_smem_limit(kernel, bytes, device, done);
}

extern "C" int kda_xcp_launch_fold(const float *sums, int64_t first, int count, int step, int hv, int K, int V,
                                   float *out, void *stream) {
    const int smem = fold_smem_bytes(K);
    const int64_t ctas = (int64_t)hv * ((V + FOLD_COLS - 1) / FOLD_COLS);
    static int done[KDA_MAX_DEVICES];
    const cudaError_t err = smem_limit_here((const void *)kda_xcp_fold_kernel, smem, done);
    if (err != cudaSuccess) return (int)err;
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
 * m16n8k8 products over e = 0 .. KC − 1 in order. The tile's operands, A's 64 rows and S's KC rows of 64 columns,
 * come into shared memory by asynchronous copies issued at once, C's fragments into registers beside them, so that
 * a CTA waits on memory once (A's rows as 16-byte copies: they are KC + VC wide and 16-byte aligned; S's elements
 * one by one, as its rows need not be); the rows' pads (apply_la, APPLY_LB) put a fragment's 32 loads in 32 banks.
 * A's columns past K are zero in the prefix (M's padding), so only S's rows need a bound; the rows and columns past
 * K and V come out zero, as the slots' padding must. */
#define APPLY_T 64
#define APPLY_LB 72 /* floats a row of S in shared memory: [e][v] */
static __host__ __device__ inline int apply_la(int KC) { return KC + 4; } /* floats a row of A: [d][e] */
static __host__ __device__ inline int apply_smem_bytes(int KC) {
    return (APPLY_T * apply_la(KC) + KC * APPLY_LB) * (int)sizeof(float);
}
__global__ void __launch_bounds__(256, 2)
    kda_xcp_apply_kernel(const float *prefix, const float *S, float *slots, int hv, int K, int V, int KC, int VC,
                         int64_t slot_floats) {
    extern __shared__ __align__(16) float apply_smem[];
    const int LA = apply_la(KC);
    float *sA = apply_smem, *sB = apply_smem + APPLY_T * LA;
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
    for (int q = tid; q < APPLY_T * KC / 4; q += 256) {    /* A: row q / (KC / 4), columns 4 (q mod KC / 4) .. */
        const int r = q / (KC / 4), c = 4 * (q % (KC / 4));
        cp_async16_zfill(smem_u32(sA + r * LA + c), X + (int64_t)(d0 + r) * xw + c, 16);
    }
    for (int f = tid; f < KC * APPLY_T; f += 256) { /* S: row f / 64, column v0 + f mod 64 */
        const int e = f / APPLY_T, v = v0 + f % APPLY_T, in = e < K && v < V;
        cp_async4_zfill(smem_u32(sB + e * APPLY_LB + f % APPLY_T), in ? Sh + (int64_t)e * V + v : Sh, in ? 4 : 0);
    }
    cp_async_commit();
    float2 cf[4][2]; /* C's elements of the thread's C fragments: rows d0 + wr + g (+ 8), columns 8 nt + 2t (+ 1) */
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++)
            cf[nt][hr] = *(const float2 *)(X + (int64_t)(d0 + wr + g + 8 * hr) * xw + KC + v0 + wc + 8 * nt + 2 * t);
    float acc[3][4][4]; /* [Ah Sh, Al Sh, Ah Sl][n8 tile][C fragment] */
#pragma unroll
    for (int pt = 0; pt < 3; pt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) acc[pt][nt][0] = acc[pt][nt][1] = acc[pt][nt][2] = acc[pt][nt][3] = 0.0f;
    cp_async_wait_all();
    __syncthreads(); /* every thread's copies have landed */
#pragma unroll 4
    for (int ks = 0; ks < KC / 8; ks++) {
        const float *a0 = sA + (wr + g) * LA + 8 * ks + t, *a8 = a0 + 8 * LA;
        float ah[4], al[4];
        split_tf32_rz(a0[0], &ah[0], &al[0]);
        split_tf32_rz(a8[0], &ah[1], &al[1]);
        split_tf32_rz(a0[4], &ah[2], &al[2]);
        split_tf32_rz(a8[4], &ah[3], &al[3]);
        const float *b0 = sB + (8 * ks + t) * APPLY_LB + wc + g;
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
            mma_3xtf32(acc[0][nt], acc[1][nt], acc[2][nt], ah, al, b0[8 * nt], b0[4 * APPLY_LB + 8 * nt]);
    }
    float *dst = slots + (j * hv + h) * slot_floats + (int64_t)KC * KC + (int64_t)KC * VC;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = d0 + wr + g + 8 * hr, col = v0 + wc + 8 * nt + 2 * t; /* the C fragment's elements */
            const float y0 = acc[0][nt][2 * hr] + (acc[1][nt][2 * hr] + acc[2][nt][2 * hr]);
            const float y1 = acc[0][nt][2 * hr + 1] + (acc[1][nt][2 * hr + 1] + acc[2][nt][2 * hr + 1]);
            *(float2 *)&dst[(int64_t)row * VC + col] = make_float2(y0 + cf[nt][hr].x, y1 + cf[nt][hr].y);
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
    static int done[KDA_MAX_DEVICES];
    const int bytes = apply_smem_bytes(KC);
    const cudaError_t err = smem_limit_here((const void *)kda_xcp_apply_kernel, bytes, done);
    if (err != cudaSuccess) return (int)err;
    kda_xcp_apply_kernel<<<(unsigned)ctas, 256, bytes, (cudaStream_t)stream>>>(prefix, S, slots, hv, K, V, KC, VC,
                                                                               kda_cuda_cp_slot_floats(KC, VC));
    return (int)cudaGetLastError();
}

extern "C" int kda_xcp_launch_place_prefix(float *dst, const float *X, int hv, int K, int V, int KC, int VC,
                                           int first_map, void *stream) {
    kda_xcp_place_prefix_kernel<<<blocks_for((int64_t)hv * K * (K + V), 256), 256, 0, (cudaStream_t)stream>>>(
        dst, X, hv, K, V, KC, VC, first_map);
    return (int)cudaGetLastError();
}
