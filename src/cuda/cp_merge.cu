/*
 * Intra-card context parallelism, step 3 (docs/ALGORITHM.md §4): the merge. For a sequence split into pieces
 * 0 .. np − 1 with maps S_out = M_j S_in + E_j from the pre-scan (piece 0's E is already its outgoing state, from
 * the sequence's initial state), the incoming state of every later piece, in order:
 *
 *     S_in(1) = E_0,     S_in(j + 1) = M_j S_in(j) + E_j      (j = 1 .. np − 2)
 *
 * fp32 throughout. One CTA per (split sequence, value head, 16 state columns): the columns are independent, so the
 * chain of one head splits over VC / 16 CTAs, and a step is a KC × KC by KC × 16 product. The CTA's threads are
 * NG groups of KC (NG = 4 where K's class has four 32-row blocks of Mᵀ): group b takes the rows e of Mᵀ_j's blocks
 * b, b + NG, .. (Mᵀ stored [e][d] by the pre-scan, so 32 rows e are one contiguous block), each thread a 4 × 4
 * tile of the partial product (rows 4 tr .. 4 tr + 3, columns 4 tc ..) from S_in(j) in shared memory; then the
 * NG partials are summed in group order (the same bits in every run) with E_j into S_in(j + 1). Mᵀ's blocks
 * stream through a ring of shared-memory stages by bulk copies, issued as soon as a round frees its stages (two
 * steps ahead at K = 128). With one group the step took ~3.7 µs (T65536 H8: 16 pieces, 52 µs on an H100), four
 * times the work of a group of four: the step was the CTA's 128 threads' FMAs and their waits. The backward's
 * chain may take Mᵀ_j from the forward's kept maps instead (kda_cp_params_t.maps, when its plan set header[3]):
 * its chunk map is the forward's transposed, so a piece's Mᵀ is the forward's M (ALGORITHM.md §6).
 */
#include "common.cuh"

#define MERGE_COLS 16 /* state columns per CTA */
#define MERGE_EB 32   /* rows of Mᵀ per streamed block */
#define MERGE_NB(KC) ((KC) / MERGE_EB)                         /* blocks of Mᵀ per step */
#define MERGE_NG(KC) (MERGE_NB(KC) < 4 ? MERGE_NB(KC) : 4)      /* thread groups: 2 (K class 64) or 4 */
/* Ring stages: two steps' blocks (64 KB at K = 128), one at K = 64's four; half a step at 256 (128 KB of 256) */
#define MERGE_NST(KC) ((KC) <= 128 ? 8 : 4)

/* shared memory: the ring of Mᵀ blocks, S_in(j) (KC × 16), the groups' partial products, the ring's barriers */
static int merge_smem(int kc) {
    const int nb = kc / MERGE_EB, ng = nb < 4 ? nb : 4;
    return MERGE_NST(kc) * MERGE_EB * kc * 4 + kc * MERGE_COLS * 4 + ng * kc * MERGE_COLS * 4 + 8 * MERGE_NST(kc);
}

/* KC: the K class (a compile-time size: each thread's rows live in registers) */
template <int KC>
__global__ void __launch_bounds__(MERGE_NG(KC) * KC) kda_cp_merge_kernel(const kda_cp_params_t p) {
    constexpr int NB = MERGE_NB(KC), NG = MERGE_NG(KC), ROUNDS = NB / NG, NST = MERGE_NST(KC), NTH = NG * KC;
    constexpr int NF = KC * MERGE_COLS / 4 / NTH; /* float4s of S per thread in the sum */
    static_assert(NB % NG == 0 && NST % NG == 0 && NF >= 1 && KC * MERGE_COLS / 4 == NF * NTH, "merge tiling");
    extern __shared__ __align__(16) float msm[];
    pdl_wait(); /* (launched with pdl: the pre-scan has completed) */
    pdl_trigger();
    const int VC = p.vc, nct = VC / MERGE_COLS;
    const int tid = threadIdx.x, grp = tid / KC, tc = (tid % KC) & 3, tr = (tid % KC) >> 2;
    const int tile = (int)(blockIdx.x % nct);
    const int64_t rest = blockIdx.x / nct;
    const int h = (int)(rest % p.hv);
    const int64_t piece = rest / p.hv;
    if (piece >= p.header[0]) return;
    const kda_cp_piece_t *e = &p.table[piece];
    if (!(e->flags & KDA_CP_FIRST) || e->slot < 0) return;
    const int64_t np = e->seq_pieces, s0 = e->slot;
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
    const int r0 = 4 * tr, c4 = tile * MERGE_COLS;
    float *ring = msm;                               /* NST blocks of MERGE_EB × KC */
    float *sS = msm + NST * MERGE_EB * KC;           /* KC × MERGE_COLS */
    float *red = sS + KC * MERGE_COLS;               /* NG × KC × MERGE_COLS */
    const uint32_t bars = smem_u32(red + NG * KC * MERGE_COLS);
#define SLOT(j) (p.slots + ((s0 + (j)) * p.hv + h) * sz)
    /* Mᵀ_j: in the slot, or the forward's kept map (the backward's chain, when its plan took the forward's pieces) */
    const float *mts = p.maps && p.header[3] ? p.maps : p.slots;
    const int64_t msz = p.maps && p.header[3] ? (int64_t)KC * KC : sz;
#define MT(j) (mts + ((s0 + (j)) * p.hv + h) * msz)
    /* block q of the stream: rows b·EB .. of Mᵀ_j, j = 1 + q / NB, b = q % NB; Q blocks in all */
    const int64_t Q = np > 2 ? (np - 2) * NB : 0;
    if (tid == 0) {
        for (int i = 0; i < NST; i++) mbar_init(bars + 8 * i, 1);
        mbar_init_fence();
    }
    __syncthreads();
#define ISSUE(q)                                                                                                \
    do {                                                                                                        \
        const int st_ = (int)((q) % NST);                                                                       \
        fence_proxy_async();                                                                                    \
        mbar_expect_tx(bars + 8 * st_, MERGE_EB * KC * 4);                                                      \
        bulk_g2s(smem_u32(ring + st_ * MERGE_EB * KC), MT(1 + (q) / NB) + ((q) % NB) * MERGE_EB * KC,           \
                 MERGE_EB * KC * 4, bars + 8 * st_);                                                            \
    } while (0)
    if (tid == 0)
        for (int64_t q = 0; q < NST && q < Q; q++) ISSUE(q);

    /* the thread's float4s f = tid + NTH u of the KC × 16 tile: row f / 4, columns 4 (f mod 4) .. */
    float4 sv[NF];
#pragma unroll
    for (int u = 0; u < NF; u++) { /* S_in(1) = E_0 */
        const int f = tid + NTH * u, row = f >> 2, col = c4 + 4 * (f & 3);
        sv[u] = *(const float4 *)(SLOT(0) + KC * KC + (int64_t)row * VC + col);
        *(float4 *)(SLOT(1) + KC * KC + KC * VC + (int64_t)row * VC + col) = sv[u];
        *(float4 *)&sS[row * MERGE_COLS + 4 * (f & 3)] = sv[u];
    }
    for (int64_t j = 1; j + 1 < np; j++) {
        float4 ej[NF]; /* E_j, added at the step's end */
#pragma unroll
        for (int u = 0; u < NF; u++) {
            const int f = tid + NTH * u;
            ej[u] = *(const float4 *)(SLOT(j) + KC * KC + (int64_t)(f >> 2) * VC + c4 + 4 * (f & 3));
        }
        __syncthreads(); /* S_in(j) is in sS */
        float4 acc[4];
#pragma unroll
        for (int r = 0; r < 4; r++) acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
        for (int rd = 0; rd < ROUNDS; rd++) {
            const int b = rd * NG + grp;
            const int64_t q = (j - 1) * NB + b;
            mbar_wait(bars + 8 * (int)(q % NST), (uint32_t)((q / NST) & 1));
            const float *blk = ring + (q % NST) * MERGE_EB * KC;
#pragma unroll 4
            for (int ee = 0; ee < MERGE_EB; ee++) {
                const float4 m = *(const float4 *)&blk[ee * KC + r0]; /* M[r0 .. r0 + 3][e] */
                const float4 x = *(const float4 *)&sS[(b * MERGE_EB + ee) * MERGE_COLS + tc * 4];
                const float mr[4] = {m.x, m.y, m.z, m.w};
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    acc[r].x = fmaf(mr[r], x.x, acc[r].x);
                    acc[r].y = fmaf(mr[r], x.y, acc[r].y);
                    acc[r].z = fmaf(mr[r], x.z, acc[r].z);
                    acc[r].w = fmaf(mr[r], x.w, acc[r].w);
                }
            }
            __syncthreads(); /* the round's stages are read: refill them NST blocks on */
            if (tid == 0)
                for (int g2 = 0; g2 < NG; g2++) {
                    const int64_t q2 = (j - 1) * NB + rd * NG + g2 + NST;
                    if (q2 < Q) ISSUE(q2);
                }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) *(float4 *)&red[(grp * KC + r0 + r) * MERGE_COLS + tc * 4] = acc[r];
        __syncthreads();
#pragma unroll
        for (int u = 0; u < NF; u++) { /* S_in(j + 1) = Σ_groups, in order, + E_j */
            const int f = tid + NTH * u, row = f >> 2, cl = 4 * (f & 3);
            float4 x = *(const float4 *)&red[row * MERGE_COLS + cl];
#pragma unroll
            for (int g2 = 1; g2 < NG; g2++) {
                const float4 y = *(const float4 *)&red[(g2 * KC + row) * MERGE_COLS + cl];
                x.x += y.x;
                x.y += y.y;
                x.z += y.z;
                x.w += y.w;
            }
            x.x += ej[u].x;
            x.y += ej[u].y;
            x.z += ej[u].z;
            x.w += ej[u].w;
            *(float4 *)(SLOT(j + 1) + KC * KC + KC * VC + (int64_t)row * VC + c4 + cl) = x;
            *(float4 *)&sS[row * MERGE_COLS + cl] = x;
        }
    }
#undef ISSUE
#undef MT
#undef SLOT
}

extern "C" int kda_cuda_launch_cp_merge(const kda_cp_params_t *p, int device, void *stream) {
    const int64_t ctas = p->cap_pieces * p->hv * (p->vc / MERGE_COLS);
    if (ctas == 0) return 0;
    const int bytes = merge_smem(p->kc), which = p->kc == 64 ? 0 : p->kc == 128 ? 1 : 2;
    const void *kernels[3] = {(const void *)kda_cp_merge_kernel<64>, (const void *)kda_cp_merge_kernel<128>,
                              (const void *)kda_cp_merge_kernel<256>};
    static int done[3][KDA_MAX_DEVICES];
    const int threads = MERGE_NG(p->kc) * p->kc;
    return kda_launch_ex(kernels[which], ctas, 1, threads, bytes, p, device, done[which], stream, 1);
}
