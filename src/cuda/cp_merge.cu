/*
 * Intra-card context parallelism, step 3 (docs/ALGORITHM.md §4): the merge. For a sequence split into pieces
 * 0 .. np − 1 with maps S_out = M_j S_in + E_j from the pre-scan (piece 0's E is already its outgoing state, from
 * the sequence's initial state), the incoming state of every later piece, in order:
 *
 *     S_in(1) = E_0,     S_in(j + 1) = M_j S_in(j) + E_j      (j = 1 .. np − 2)
 *
 * fp32 throughout. One work item per (split sequence, value head, 16 state columns): the columns are independent, so
 * the chain of one head splits over VC / 16 items, and a step is a KC × KC by KC × 16 product. The grid is at most
 * one wave, and a CTA takes items blockIdx, blockIdx + gridDim, ..: the host cannot tell how many sequences the
 * device's plan splits, only that they are at most min(N, slots / 2) (a split sequence has two slots or more), and
 * a grid of every table entry's CTAs (up to the capacity, most of them returning at once) cost more than the chain
 * it served (docs/PERF.md, "The merge's empty CTAs"). Item (r, h, tile) finds the first piece of the r-th split
 * sequence by a scan of the table's split pieces (its first header[2] entries, cp_plan.h; those FIRST), which goes
 * on where the CTA's previous item left it. The CTA's threads are NG groups of KC (NG = 4 where K's class has
 * four 32-row blocks of Mᵀ): group b takes the rows e of Mᵀ_j's blocks
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
    __shared__ int s_count[NTH / 32]; /* the scan's matches per warp */
    __shared__ int64_t s_found;       /* the scan's result: a table index, or −1 */
    pdl_wait(); /* (launched with pdl: the pre-scan has completed) */
    pdl_trigger();
    if (p.header[1] == 0) return; /* the plan split nothing */
    const int VC = p.vc, nct = VC / MERGE_COLS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, grp = tid / KC, tc = (tid % KC) & 3,
              tr = (tid % KC) >> 2;
    const int64_t ne = p.header[2], per_seq = (int64_t)p.hv * nct; /* the split pieces: entries 0 .. slots − 1 */
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
    const int r0 = 4 * tr;
    float *ring = msm;                               /* NST blocks of MERGE_EB × KC */
    float *sS = msm + NST * MERGE_EB * KC;           /* KC × MERGE_COLS */
    float *red = sS + KC * MERGE_COLS;               /* NG × KC × MERGE_COLS */
    const uint32_t bars = smem_u32(red + NG * KC * MERGE_COLS);
    /* Mᵀ_j: in the slot, or the forward's kept map (the backward's chain, when its plan took the forward's pieces) */
    const float *mts = p.maps && p.header[3] ? p.maps : p.slots;
    const int64_t msz = p.maps && p.header[3] ? (int64_t)KC * KC : sz;
    if (tid == 0) {
        for (int i = 0; i < NST; i++) mbar_init(bars + 8 * i, 1);
        mbar_init_fence();
    }
    __syncthreads();
    int64_t qb = 0;                 /* ring blocks of the CTA's earlier items: block q of this item is qb + q */
    int64_t rank = -1, first = -1;  /* the split sequence of the last item and its first piece */
    int64_t scanned = 0, seen = 0;  /* the scan's next block of entries, and the matches before it */
    for (int64_t item = blockIdx.x;; item += gridDim.x) {
        const int64_t r = item / per_seq;
        const int h = (int)(item / nct % p.hv), tile = (int)(item % nct);
        while (r != rank) { /* (uniform) the next block of entries; r's match may be in the block that held rank's */
            if (scanned >= ne) break;
            const int64_t i = scanned + tid;
            int f = 0;
            if (i < ne) f = (p.table[i].flags & KDA_CP_FIRST) && p.table[i].slot >= 0;
            const unsigned m = __ballot_sync(0xffffffffu, f);
            if (lane == 0) s_count[warp] = __popc(m);
            if (tid == 0) s_found = -1;
            __syncthreads();
            int before = 0, total = 0;
            for (int w = 0; w < NTH / 32; w++) {
                before += w < warp ? s_count[w] : 0;
                total += s_count[w];
            }
            if (f && seen + before + __popc(m & ((1u << lane) - 1u)) == r) s_found = i;
            __syncthreads();
            if (s_found >= 0) {
                rank = r;
                first = s_found;
            } else {
                seen += total;
                scanned += NTH;
            }
            __syncthreads(); /* s_found and s_count are written again */
        }
        if (r != rank) break; /* fewer split sequences than r + 1: no later item has one either */
        const kda_cp_piece_t *e = &p.table[first];
        const int64_t np = e->seq_pieces, s0 = e->slot;
        const int c4 = tile * MERGE_COLS;
#define SLOT(j) (p.slots + ((s0 + (j)) * p.hv + h) * sz)
#define MT(j) (mts + ((s0 + (j)) * p.hv + h) * msz)
        /* block q of the item's stream: rows b·EB .. of Mᵀ_j, j = 1 + q / NB, b = q % NB; Q blocks in all; in the
           ring at stage (qb + q) mod NST, its use (qb + q) / NST of that stage's barrier */
        const int64_t Q = np > 2 ? (np - 2) * NB : 0;
#define ISSUE(q)                                                                                                \
    do {                                                                                                        \
        const int st_ = (int)((qb + (q)) % NST);                                                                \
        fence_proxy_async();                                                                                    \
        mbar_expect_tx(bars + 8 * st_, MERGE_EB * KC * 4);                                                      \
        bulk_g2s(smem_u32(ring + st_ * MERGE_EB * KC), MT(1 + (q) / NB) + ((q) % NB) * MERGE_EB * KC,           \
                 MERGE_EB * KC * 4, bars + 8 * st_);                                                            \
    } while (0)
        /* (every thread has read the stages of the CTA's previous item: its last step's barriers came after) */
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
            for (int rr = 0; rr < 4; rr++) acc[rr] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
            for (int rd = 0; rd < ROUNDS; rd++) {
                const int b = rd * NG + grp;
                const int64_t q = (j - 1) * NB + b;
                mbar_wait(bars + 8 * (int)((qb + q) % NST), (uint32_t)(((qb + q) / NST) & 1));
                const float *blk = ring + ((qb + q) % NST) * MERGE_EB * KC;
#pragma unroll 4
                for (int ee = 0; ee < MERGE_EB; ee++) {
                    const float4 m = *(const float4 *)&blk[ee * KC + r0]; /* M[r0 .. r0 + 3][e] */
                    const float4 x = *(const float4 *)&sS[(b * MERGE_EB + ee) * MERGE_COLS + tc * 4];
                    const float mr[4] = {m.x, m.y, m.z, m.w};
#pragma unroll
                    for (int rr = 0; rr < 4; rr++) {
                        acc[rr].x = fmaf(mr[rr], x.x, acc[rr].x);
                        acc[rr].y = fmaf(mr[rr], x.y, acc[rr].y);
                        acc[rr].z = fmaf(mr[rr], x.z, acc[rr].z);
                        acc[rr].w = fmaf(mr[rr], x.w, acc[rr].w);
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
            for (int rr = 0; rr < 4; rr++) *(float4 *)&red[(grp * KC + r0 + rr) * MERGE_COLS + tc * 4] = acc[rr];
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
        qb += Q;
#undef ISSUE
#undef MT
#undef SLOT
    }
}

/* The grid: the work items there can be (the plan's split sequences are at most min(N, slots / 2)), at most as many
   CTAs as are resident at once (by shared memory and threads; 1 per SM at K = 128 and 256, 2 at 64) */
extern "C" int kda_cuda_launch_cp_merge(const kda_cp_params_t *p, int device, void *stream) {
    const int64_t nsplit = p->cap_slots / 2 < p->seqs.num_seqs ? p->cap_slots / 2 : p->seqs.num_seqs;
    const int64_t items = nsplit * p->hv * (p->vc / MERGE_COLS);
    if (items <= 0) return 0;
    const int bytes = merge_smem(p->kc), which = p->kc == 64 ? 0 : p->kc == 128 ? 1 : 2;
    const int threads = MERGE_NG(p->kc) * p->kc;
    const int by_smem = (227 * 1024) / (bytes + 1024), by_threads = 2048 / threads;
    const int64_t resident = (int64_t)(p->sm_count > 0 ? p->sm_count : 1) *
                             (by_smem < by_threads ? (by_smem > 0 ? by_smem : 1) : by_threads);
    const int64_t ctas = items < resident ? items : resident;
    const void *kernels[3] = {(const void *)kda_cp_merge_kernel<64>, (const void *)kda_cp_merge_kernel<128>,
                              (const void *)kda_cp_merge_kernel<256>};
    static int done[3][KDA_MAX_DEVICES];
    return kda_launch_ex(kernels[which], ctas, 1, threads, bytes, p, device, done[which], stream, 1);
}
