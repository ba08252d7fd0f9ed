/*
 * Intra-card context parallelism, step 3 (docs/ALGORITHM.md §4): the merge. For a sequence split into pieces
 * 0 .. np − 1 with maps S_out = M_j S_in + E_j from the pre-scan (piece 0's E is already its outgoing state, from
 * the sequence's initial state), the incoming state of every later piece, in order:
 *
 *     S_in(1) = E_0,     S_in(j + 1) = M_j S_in(j) + E_j      (j = 1 .. np − 2)
 *
 * fp32 throughout. One CTA of 256 threads per (split sequence, value head, 32 state columns): the columns are
 * independent, so the chain of one head splits over VC / 32 CTAs. Each thread holds 4 columns of KC / 32 rows
 * (rows tr, tr + 32, ...); the CTA keeps S_in(j) in shared memory and streams Mᵀ_j (stored [e][d] by the
 * pre-scan, so a block of rows e is contiguous) through shared memory in blocks of 32 rows, the next block's
 * global loads in flight in registers while this one is used.
 */
#include "common.cuh"

#define MERGE_THREADS 256
#define MERGE_COLS 32 /* state columns per CTA */
#define MERGE_EB 32   /* rows of Mᵀ per streamed block */

static int merge_smem(int kc) { return (kc * MERGE_COLS + MERGE_EB * kc) * 4; }

/* KC: the K class (a compile-time size: each thread's rows live in registers) */
template <int KC>
__global__ void __launch_bounds__(MERGE_THREADS) kda_cp_merge_kernel(const kda_cp_params_t p) {
    constexpr int R = KC / 32, nb = KC / MERGE_EB, per = MERGE_EB * KC / 4 / MERGE_THREADS; /* float4 per thread */
    extern __shared__ __align__(16) float msm[];
    const int VC = p.vc, nct = VC / MERGE_COLS;
    const int tid = threadIdx.x, tc = tid & 7, tr = tid >> 3;
    const int tile = (int)(blockIdx.x % nct);
    const int64_t rest = blockIdx.x / nct;
    const int h = (int)(rest % p.hv);
    const int64_t piece = rest / p.hv;
    if (piece >= p.header[0]) return;
    const kda_cp_piece_t *e = &p.table[piece];
    if (!(e->flags & KDA_CP_FIRST) || e->slot < 0) return;
    const int64_t np = e->seq_pieces, s0 = e->slot;
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
    const int c0 = tile * MERGE_COLS + tc * 4;
    float *sS = msm;                  /* S_in(j): KC rows × 32 columns */
    float *sM = msm + KC * MERGE_COLS; /* a block of Mᵀ: MERGE_EB rows × KC */
#define SLOT(j) (p.slots + ((s0 + (j)) * p.hv + h) * sz)

    float4 acc[R];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = *(const float4 *)(SLOT(0) + KC * KC + (int64_t)(tr + 32 * i) * VC + c0);
    float4 nxt[per]; /* the next block of Mᵀ */
    if (np > 2)
#pragma unroll
        for (int i = 0; i < per; i++) nxt[i] = *(const float4 *)(SLOT(1) + 4 * (tid + i * MERGE_THREADS));
    for (int64_t j = 1; j < np; j++) {
        float *sj = SLOT(j);
#pragma unroll
        for (int i = 0; i < R; i++) *(float4 *)(sj + KC * KC + KC * VC + (int64_t)(tr + 32 * i) * VC + c0) = acc[i];
        if (j == np - 1) break;
        float4 ej[R]; /* E_j, consumed at the end of the step */
#pragma unroll
        for (int i = 0; i < R; i++) ej[i] = *(const float4 *)(sj + KC * KC + (int64_t)(tr + 32 * i) * VC + c0);
        __syncthreads(); /* the previous step is done with sS */
#pragma unroll
        for (int i = 0; i < R; i++) {
            *(float4 *)&sS[(tr + 32 * i) * MERGE_COLS + tc * 4] = acc[i];
            acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        for (int b = 0; b < nb; b++) {
            __syncthreads(); /* sM free; sS written */
#pragma unroll
            for (int i = 0; i < per; i++) *(float4 *)&sM[4 * (tid + i * MERGE_THREADS)] = nxt[i];
            __syncthreads();
            /* the next block: of this M, or the next piece's first */
            const int64_t jn = b + 1 < nb ? j : j + 1;
            const int bn = b + 1 < nb ? b + 1 : 0;
            if (jn < np - 1)
#pragma unroll
                for (int i = 0; i < per; i++)
                    nxt[i] = *(const float4 *)(SLOT(jn) + (int64_t)bn * MERGE_EB * KC + 4 * (tid + i * MERGE_THREADS));
#pragma unroll 8
            for (int ee = 0; ee < MERGE_EB; ee++) {
                const float4 sv = *(const float4 *)&sS[(b * MERGE_EB + ee) * MERGE_COLS + tc * 4];
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const float m = sM[ee * KC + tr + 32 * i];
                    acc[i].x = fmaf(m, sv.x, acc[i].x);
                    acc[i].y = fmaf(m, sv.y, acc[i].y);
                    acc[i].z = fmaf(m, sv.z, acc[i].z);
                    acc[i].w = fmaf(m, sv.w, acc[i].w);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; i++) {
            acc[i].x += ej[i].x;
            acc[i].y += ej[i].y;
            acc[i].z += ej[i].z;
            acc[i].w += ej[i].w;
        }
    }
#undef SLOT
}

extern "C" int kda_cuda_launch_cp_merge(const kda_cp_params_t *p, int device, void *stream) {
    const int64_t ctas = p->cap_pieces * p->hv * (p->vc / MERGE_COLS);
    if (ctas == 0) return 0;
    const int bytes = merge_smem(p->kc), which = p->kc == 64 ? 0 : p->kc == 128 ? 1 : 2;
    const void *kernels[3] = {(const void *)kda_cp_merge_kernel<64>, (const void *)kda_cp_merge_kernel<128>,
                              (const void *)kda_cp_merge_kernel<256>};
    static int done[3][KDA_MAX_DEVICES];
    cudaError_t err;
    if ((err = kda_smem_limit(kernels[which], bytes, device, done[which])) != cudaSuccess) return (int)err;
    void *args[] = {(void *)p};
    if ((err = cudaLaunchKernel(kernels[which], dim3((unsigned)ctas), dim3(MERGE_THREADS), args, (size_t)bytes,
                                (cudaStream_t)stream)) != cudaSuccess)
        return (int)err;
    return (int)cudaGetLastError();
}
