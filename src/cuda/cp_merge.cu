/*
 * Intra-card context parallelism, step 3 (docs/ALGORITHM.md §4): the merge. For a sequence split into pieces
 * 0 .. np − 1 with maps S_out = M_j S_in + E_j from the pre-scan (piece 0's E is already its outgoing state, from
 * the sequence's initial state), the incoming state of every later piece, in order:
 *
 *     S_in(1) = E_0,     S_in(j + 1) = M_j S_in(j) + E_j      (j = 1 .. np − 2)
 *
 * fp32 throughout. One CTA of KC threads per (split sequence, value head, 16 state columns): the columns are
 * independent, so the chain of one head splits over VC / 16 CTAs, and a step's time is the CTA's KC·KC·16
 * multiply-adds (~2 k cycles at K = 128; the chain is np − 2 steps long). Each thread holds a 4×4 tile of S
 * (rows 4 tr .. 4 tr + 3, columns 4 tc ..); the CTA keeps S_in(j) in shared memory and streams Mᵀ_j (stored [e][d]
 * by the pre-scan, so 32 rows e are one contiguous block) through a ring of shared-memory stages by bulk copies,
 * up to two steps ahead, across the step boundaries.
 */
#include "common.cuh"

#define MERGE_COLS 16 /* state columns per CTA */
#define MERGE_EB 32   /* rows of Mᵀ per streamed block */
/* Ring stages: a step's compute (~1 µs) is shorter than a block's copy latency, so the ring holds about two
 * steps' blocks (128 KB) and the copies run up to that far ahead. */
#define MERGE_NST(KC) ((KC) <= 128 ? 8 * 128 / (KC) : 4)

/* shared memory: the ring of Mᵀ blocks, S_in(j) (KC × 16), the ring's barriers */
static int merge_smem(int kc) {
    return MERGE_NST(kc) * MERGE_EB * kc * 4 + kc * MERGE_COLS * 4 + 8 * MERGE_NST(kc);
}

/* KC: the K class (a compile-time size: each thread's rows live in registers) */
template <int KC>
__global__ void __launch_bounds__(KC) kda_cp_merge_kernel(const kda_cp_params_t p) {
    constexpr int nb = KC / MERGE_EB, MERGE_NST = MERGE_NST(KC);
    extern __shared__ __align__(16) float msm[];
    const int VC = p.vc, nct = VC / MERGE_COLS;
    const int tid = threadIdx.x, tc = tid & 3, tr = tid >> 2;
    const int tile = (int)(blockIdx.x % nct);
    const int64_t rest = blockIdx.x / nct;
    const int h = (int)(rest % p.hv);
    const int64_t piece = rest / p.hv;
    if (piece >= p.header[0]) return;
    const kda_cp_piece_t *e = &p.table[piece];
    if (!(e->flags & KDA_CP_FIRST) || e->slot < 0) return;
    const int64_t np = e->seq_pieces, s0 = e->slot;
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
    const int c0 = tile * MERGE_COLS + tc * 4, r0 = 4 * tr;
    float *ring = msm;                               /* MERGE_NST blocks of MERGE_EB × KC */
    float *sS = msm + MERGE_NST * MERGE_EB * KC;     /* KC × MERGE_COLS */
    const uint32_t bars = smem_u32(sS + KC * MERGE_COLS);
#define SLOT(j) (p.slots + ((s0 + (j)) * p.hv + h) * sz)
    /* block q of the stream: rows b·EB .. of Mᵀ_j, j = 1 + q / nb, b = q % nb; Q blocks in all */
    const int64_t Q = np > 2 ? (np - 2) * nb : 0;
    if (tid == 0) {
        for (int i = 0; i < MERGE_NST; i++) mbar_init(bars + 8 * i, 1);
        mbar_init_fence();
    }
    __syncthreads();
#define ISSUE(q)                                                                                                \
    do {                                                                                                        \
        const int st_ = (int)((q) % MERGE_NST);                                                                 \
        fence_proxy_async();                                                                                    \
        mbar_expect_tx(bars + 8 * st_, MERGE_EB * KC * 4);                                                      \
        bulk_g2s(smem_u32(ring + st_ * MERGE_EB * KC), SLOT(1 + (q) / nb) + ((q) % nb) * MERGE_EB * KC,         \
                 MERGE_EB * KC * 4, bars + 8 * st_);                                                            \
    } while (0)
    if (tid == 0)
        for (int64_t q = 0; q < MERGE_NST - 1 && q < Q; q++) ISSUE(q);

    float4 acc[4];
#pragma unroll
    for (int r = 0; r < 4; r++) acc[r] = *(const float4 *)(SLOT(0) + KC * KC + (int64_t)(r0 + r) * VC + c0);
    for (int64_t j = 1; j < np; j++) {
        float *sj = SLOT(j);
#pragma unroll
        for (int r = 0; r < 4; r++) *(float4 *)(sj + KC * KC + KC * VC + (int64_t)(r0 + r) * VC + c0) = acc[r];
        if (j == np - 1) break;
        float4 ej[4]; /* E_j, consumed at the end of the step */
#pragma unroll
        for (int r = 0; r < 4; r++) ej[r] = *(const float4 *)(sj + KC * KC + (int64_t)(r0 + r) * VC + c0);
        __syncthreads(); /* the previous step is done with sS */
#pragma unroll
        for (int r = 0; r < 4; r++) {
            *(float4 *)&sS[(r0 + r) * MERGE_COLS + tc * 4] = acc[r];
            acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        __syncthreads();
        for (int b = 0; b < nb; b++) {
            const int64_t q = (j - 1) * nb + b;
            /* the stage of block q − 1 is free (every thread passed the barrier after using it) */
            if (tid == 0 && q + MERGE_NST - 1 < Q) ISSUE(q + MERGE_NST - 1);
            mbar_wait(bars + 8 * (int)(q % MERGE_NST), (uint32_t)((q / MERGE_NST) & 1));
            const float *blk = ring + (q % MERGE_NST) * MERGE_EB * KC;
#pragma unroll 4
            for (int ee = 0; ee < MERGE_EB; ee++) {
                const float4 m = *(const float4 *)&blk[ee * KC + r0]; /* M[r0 .. r0 + 3][e] */
                const float4 sv = *(const float4 *)&sS[(b * MERGE_EB + ee) * MERGE_COLS + tc * 4];
                const float mr[4] = {m.x, m.y, m.z, m.w};
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    acc[r].x = fmaf(mr[r], sv.x, acc[r].x);
                    acc[r].y = fmaf(mr[r], sv.y, acc[r].y);
                    acc[r].z = fmaf(mr[r], sv.z, acc[r].z);
                    acc[r].w = fmaf(mr[r], sv.w, acc[r].w);
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            acc[r].x += ej[r].x;
            acc[r].y += ej[r].y;
            acc[r].z += ej[r].z;
            acc[r].w += ej[r].w;
        }
    }
#undef ISSUE
#undef SLOT
}

extern "C" int kda_cuda_launch_cp_merge(const kda_cp_params_t *p, int device, void *stream) {
    const int64_t ctas = p->cap_pieces * p->hv * (p->vc / MERGE_COLS);
    if (ctas == 0) return 0;
    const int bytes = merge_smem(p->kc), which = p->kc == 64 ? 0 : p->kc == 128 ? 1 : 2;
    const void *kernels[3] = {(const void *)kda_cp_merge_kernel<64>, (const void *)kda_cp_merge_kernel<128>,
                              (const void *)kda_cp_merge_kernel<256>};
    static int done[3][KDA_MAX_DEVICES];
    return kda_launch(kernels[which], ctas, p->kc, bytes, p, device, done[which], stream);
}
