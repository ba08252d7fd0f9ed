/*
 * Intra-card context parallelism, step 3 (docs/ALGORITHM.md §4): the merge. For a sequence split into pieces
 * 0 .. np − 1 with maps S_out = M_j S_in + E_j from the pre-scan (piece 0's E is already its outgoing state, from
 * the sequence's initial state), the incoming state of every later piece, in order:
 *
 *     S_in(1) = E_0,     S_in(j + 1) = M_j S_in(j) + E_j      (j = 1 .. np − 2)
 *
 * One work item per (split sequence, value head, 16 state columns): the columns are independent, so the chain of one
 * head splits over VC / 16 items, and a step is a KC × KC by KC × 16 product. The grid is at most one wave, and a
 * CTA takes items blockIdx, blockIdx + gridDim, ..: the host cannot tell how many sequences the device's plan
 * splits, only that they are at most min(N, slots / 2) (a split sequence has two slots or more), and a grid of
 * every table entry's CTAs (up to the capacity, most of them returning at once) would cost more than the chain it
 * serves. Item (r, h, tile) finds the first piece of the r-th split sequence by a
 * scan of the table's split pieces (its first header[2] entries, cp_plan.h; those FIRST), which goes on where the
 * CTA's previous item left it.
 *
 * A step on the tensor cores, ~fp32 (3xTF32: each operand x = hi + lo in tf32 by masks, split_tf32_rz;
 * A B ≈ Ah Bh + (Al Bh + Ah Bl), the three products in accumulators of their own, three chains of KC / 8 mma;
 * the error ~2e-6 relative): KC / 16 warps, warp w the rows d = 16 w .. 16 w + 15 of S_in(j + 1) over all of e, as
 * m16n8k8 products (A = M_j's rows from Mᵀ_j, B = S_in(j)), so no partial sums meet in shared memory. Mᵀ_j's rows
 * stream through a ring of shared-memory stages by bulk copies, 32 rows a block, issued as soon as a step (at K = 256
 * half a step) frees its stages: two steps ahead at K = 128. Mᵀ is stored swizzled (kda_cuda_map_index: its writers
 * are the pre-scans, cp_slot.cuh's store_map), so that the four rows of an A fragment's load fall in different
 * banks. S_in(j) sits in shared memory rows of MERGE_SST floats (conflict-free B fragments), double-buffered: one
 * barrier a step (on CUDA cores, 4 × 4 tiles a thread, a step loads 8 floats from shared memory per 16 FFMA). The
 * backward's chain may take
 * Mᵀ_j from the forward's kept maps instead (kda_cp_params_t.maps, when its plan set header[3]): its chunk map is
 * the forward's transposed, so a piece's Mᵀ is the forward's M (ALGORITHM.md §6), stored in the same layout.
 *
 * Compose (kda_cp_params_t.compose, cross-rank CP's primed summary, xcp.h): the same chain over the K + V columns of
 * the prefix maps, a piece longer, every piece pre-scanned:
 *
 *     X_0 = [M_0 | E_0],     X_j = M_j X_{j−1} + [0 | E_j]      (j = 1 .. np − 1)
 *
 * (M_0 = 0 when the sequence starts on this rank: piece 0 then ran from its initial state), each X_j into the
 * prefix region; X_{np−1} is the summary, and S_in(j + 1) = X_j [S; I] for the state S entering the sequence. A
 * sequence that starts here has M = 0 throughout: only E's columns are chained, and they are S_in(j + 1) itself,
 * stored into the slots as well (the primed forward then runs the pieces at once).
 */
#include "common.cuh"

#define MERGE_COLS 16 /* state columns per CTA */
#define MERGE_EB 32   /* rows of Mᵀ per streamed block */
#define MERGE_SST 24  /* floats per row of S_in in shared memory: B fragments' rows t, t + 1.. in distinct banks */
#define MERGE_NB(KC) ((KC) / MERGE_EB) /* blocks of Mᵀ per step */
/* Ring stages: two steps' blocks (64 KB at K = 128), four steps' at K = 64; half a step at 256 (128 KB of 256) */
#define MERGE_NST(KC) ((KC) <= 128 ? 8 : 4)

/* shared memory: the ring of Mᵀ blocks, S_in(j) twice (KC rows of MERGE_SST), the ring's barriers */
static int merge_smem(int kc) { return MERGE_NST(kc) * MERGE_EB * kc * 4 + 2 * kc * MERGE_SST * 4 + 8 * MERGE_NST(kc); }

/* KC: the K class (a compile-time size: the warps, the ring); COMPOSE: p.compose, fixed per instance so that the
   plain merge carries none of the compose's indexing */
template <int KC, int COMPOSE>
__global__ void __launch_bounds__(2 * KC, 1) kda_cp_merge_kernel(const kda_cp_params_t p) {
    constexpr int NB = MERGE_NB(KC), NST = MERGE_NST(KC), NTH = 2 * KC;
    constexpr int NBR = NB < NST ? NB : NST, ROUNDS = NB / NBR; /* blocks of a round: the ring holds a round */
    constexpr int NF = KC * MERGE_COLS / 4 / NTH;               /* float4s of S_in(1) = E_0 per thread */
    static_assert(NB % NBR == 0 && NST % NBR == 0 && NF >= 1 && KC * MERGE_COLS / 4 == NF * NTH, "merge tiling");
    extern __shared__ __align__(16) float msm[];
    __shared__ int s_count[NTH / 32]; /* the scan's matches per warp */
    __shared__ int64_t s_found;       /* the scan's result: a table index, or −1 */
    pdl_wait();                       /* (launched with pdl: the pre-scan has completed) */
    pdl_trigger();
    if (p.header[1] == 0) return; /* the plan split nothing */
    /* compose: M's columns only where the sequence continues from an earlier rank (first_map); without them the
       prefix's E columns are S_in(j + 1) themselves, also stored into the slots as the plain merge does */
    const int VC = p.pb.vc, nmt = COMPOSE && p.first_map ? KC / MERGE_COLS : 0, nct = nmt + VC / MERGE_COLS;
    const int to_slots = !COMPOSE || !p.first_map;
    const int64_t xw = KC + VC; /* a prefix map's row (compose) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int64_t ne = p.header[2], per_seq = (int64_t)p.pb.hv * nct; /* the split pieces: entries 0 .. slots − 1 */
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
    const int d0 = 16 * warp;                                       /* the warp's rows of S_in(j + 1) */
    const int ca = (d0 + g) ^ (8 * t), cb = (d0 + g + 8) ^ (8 * t); /* their swizzled columns in Mᵀ rows e ≡ t (4) */
    float *ring = msm;                                              /* NST blocks of MERGE_EB × KC */
    float *sS = msm + NST * MERGE_EB * KC; /* 2 × KC rows of MERGE_SST: S_in(j) in buffer j mod 2 */
    const uint32_t bars = smem_u32(sS + 2 * KC * MERGE_SST);
    /* Mᵀ_j: in the slot, or the forward's kept map (the backward's chain, when its plan took the forward's pieces) */
    const float *mts = p.maps && p.header[3] ? p.maps : p.slots;
    const int64_t msz = p.maps && p.header[3] ? (int64_t)KC * KC : sz;
    if (tid == 0) {
        for (int i = 0; i < NST; i++) mbar_init(bars + 8 * i, 1);
        mbar_init_fence();
    }
    __syncthreads();
    int64_t qb = 0;                /* ring blocks of the CTA's earlier items: block q of this item is qb + q */
    int64_t rank = -1, first = -1; /* the split sequence of the last item and its first piece */
    int64_t scanned = 0, seen = 0; /* the scan's next block of entries, and the matches before it */
    for (int64_t item = blockIdx.x;; item += gridDim.x) {
        const int64_t r = item / per_seq;
        const int h = (int)(item / nct % p.pb.hv), tile = (int)(item % nct);
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
        /* the tile's columns: of E (and S_in), or compose's M columns (mcol) */
        const int mcol = tile < nmt, c4 = (mcol ? tile : tile - nmt) * MERGE_COLS, xc = mcol ? c4 : KC + c4;
        const int64_t last = COMPOSE ? np - 1 : np - 2; /* the chain's last step */
#define SLOT(j) (p.slots + ((s0 + (j)) * p.pb.hv + h) * sz)
#define MT(j) (mts + ((s0 + (j)) * p.pb.hv + h) * msz)
#define PREFIX(j) (p.prefix + ((s0 + (j)) * p.pb.hv + h) * (int64_t)KC * xw)
        /* block q of the item's stream: rows b·EB .. of Mᵀ_j, j = 1 + q / NB, b = q % NB; Q blocks in all; in the
           ring at stage (qb + q) mod NST, its use (qb + q) / NST of that stage's barrier */
        const int64_t Q = last > 0 ? last * NB : 0;
#define ISSUE(q)                                                                                                       \
    do {                                                                                                               \
        const int st_ = (int)((qb + (q)) % NST);                                                                       \
        fence_proxy_async();                                                                                           \
        mbar_expect_tx(bars + 8 * st_, MERGE_EB * KC * 4);                                                             \
        bulk_g2s(smem_u32(ring + st_ * MERGE_EB * KC), MT(1 + (q) / NB) + ((q) % NB) * MERGE_EB * KC,                  \
                 MERGE_EB * KC * 4, bars + 8 * st_);                                                                   \
    } while (0)
        /* (every thread has read the stages of the CTA's previous item: its last step's barrier came after) */
        if (tid == 0)
            for (int64_t q = 0; q < NST && q < Q; q++) ISSUE(q);

        if (!COMPOSE) {
#pragma unroll
            for (int u = 0; u < NF; u++) { /* S_in(1) = E_0, into its slot and buffer 1 */
                const int f = tid + NTH * u, row = f >> 2, col = 4 * (f & 3);
                const float4 x = *(const float4 *)(SLOT(0) + KC * KC + (int64_t)row * VC + c4 + col);
                *(float4 *)(SLOT(1) + KC * KC + KC * VC + (int64_t)row * VC + c4 + col) = x;
                *(float4 *)&sS[(KC + row) * MERGE_SST + col] = x;
            }
        } else {
            for (int f = tid; f < KC * MERGE_COLS; f += NTH) { /* X_0: M_0 (from its Mᵀ) or 0, and E_0 */
                const int row = f / MERGE_COLS, col = f % MERGE_COLS;
                const float x = !mcol         ? SLOT(0)[KC * KC + (int64_t)row * VC + c4 + col]
                                : p.first_map ? MT(0)[kda_cuda_map_index(KC, c4 + col, row)]
                                              : 0.0f;
                PREFIX(0)[(int64_t)row * xw + xc + col] = x;
                if (to_slots) SLOT(1)[KC * KC + KC * VC + (int64_t)row * VC + c4 + col] = x;
                sS[(KC + row) * MERGE_SST + col] = x;
            }
        }
        /* the lane's elements of E_j: rows d0 + g, d0 + g + 8, columns 8 nt + 2t, + 1 (the m16n8 C fragment) */
        float2 ej[2][2]; /* (compose's M columns add nothing) */
#define LOAD_E(j)                                                                                                      \
    do {                                                                                                               \
        for (int nt_ = 0; nt_ < 2; nt_++)                                                                              \
            for (int hr_ = 0; hr_ < 2; hr_++)                                                                          \
                ej[nt_][hr_] = mcol ? make_float2(0.0f, 0.0f)                                                          \
                                    : *(const float2 *)(SLOT(j) + KC * KC + (int64_t)(d0 + g + 8 * hr_) * VC + c4 +    \
                                                        8 * nt_ + 2 * t);                                              \
    } while (0)
        if (last > 0) LOAD_E(1);
        __syncthreads(); /* S_in(1) is in buffer 1 */
        for (int64_t j = 1; j <= last; j++) {
            const float *sB = sS + (j & 1) * KC * MERGE_SST; /* S_in(j) */
            float acc[3][2][4]; /* per n8 tile: Ah Bh, Al Bh, Ah Bl, each its own chain of KC / 8 mma */
#pragma unroll
            for (int pt = 0; pt < 3; pt++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++) acc[pt][nt][0] = acc[pt][nt][1] = acc[pt][nt][2] = acc[pt][nt][3] = 0.0f;
#pragma unroll 1
            for (int rd = 0; rd < ROUNDS; rd++) {
#pragma unroll 1
                for (int bb = 0; bb < NBR; bb++) {
                    const int b = rd * NBR + bb;
                    const int64_t q = (j - 1) * NB + b;
                    mbar_wait(bars + 8 * (int)((qb + q) % NST), (uint32_t)(((qb + q) / NST) & 1));
                    const float *blk = ring + ((qb + q) % NST) * MERGE_EB * KC;
#pragma unroll
                    for (int ks = 0; ks < MERGE_EB / 8; ks++) { /* rows e = 32 b + 8 ks + (t, t + 4) */
                        const float *r0 = blk + (8 * ks + t) * KC, *r4 = r0 + 4 * KC;
                        float ah[4], al[4];
                        split_tf32_rz(r0[ca], &ah[0], &al[0]);
                        split_tf32_rz(r0[cb], &ah[1], &al[1]);
                        split_tf32_rz(r4[ca], &ah[2], &al[2]);
                        split_tf32_rz(r4[cb], &ah[3], &al[3]);
                        const float *s0r = sB + (MERGE_EB * b + 8 * ks + t) * MERGE_SST + g;
#pragma unroll
                        for (int nt = 0; nt < 2; nt++)
                            mma_3xtf32(acc[0][nt], acc[1][nt], acc[2][nt], ah, al, s0r[8 * nt],
                                       s0r[4 * MERGE_SST + 8 * nt]);
                    }
                }
                if (rd + 1 < ROUNDS) { /* half a step in the ring (K = 256): refill the round's stages now */
                    __syncthreads();
                    if (tid == 0)
                        for (int bb = 0; bb < NBR; bb++) {
                            const int64_t q2 = (j - 1) * NB + rd * NBR + bb + NST;
                            if (q2 < Q) ISSUE(q2);
                        }
                }
            }
            /* S_in(j + 1) = M_j S_in(j) + E_j (compose: X_j): into its slot (its prefix) and the other buffer */
            float *sN = sS + ((j + 1) & 1) * KC * MERGE_SST;
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int row = d0 + g + 8 * hr, col = 8 * nt + 2 * t;
                    const float x0 = acc[0][nt][2 * hr] + (acc[1][nt][2 * hr] + acc[2][nt][2 * hr]);
                    const float x1 = acc[0][nt][2 * hr + 1] + (acc[1][nt][2 * hr + 1] + acc[2][nt][2 * hr + 1]);
                    const float2 x = make_float2(x0 + ej[nt][hr].x, x1 + ej[nt][hr].y);
                    if (COMPOSE) *(float2 *)(PREFIX(j) + (int64_t)row * xw + xc + col) = x;
                    if (to_slots && j + 1 < np)
                        *(float2 *)(SLOT(j + 1) + KC * KC + KC * VC + (int64_t)row * VC + c4 + col) = x;
                    *(float2 *)&sN[row * MERGE_SST + col] = x;
                }
            if (j + 1 <= last) LOAD_E(j + 1);
            __syncthreads(); /* S_in(j + 1) is in its buffer; the step's (last round's) stages are read */
            if (tid == 0)
                for (int bb = 0; bb < NBR; bb++) {
                    const int64_t q2 = (j - 1) * NB + (ROUNDS - 1) * NBR + bb + NST;
                    if (q2 < Q) ISSUE(q2);
                }
        }
        qb += Q;
#undef LOAD_E
#undef ISSUE
#undef PREFIX
#undef MT
#undef SLOT
    }
}

/* The grid: the work items there can be (the plan's split sequences are at most min(N, slots / 2)), at most as many
   CTAs as are resident at once (by shared memory and threads; 1 per SM at K = 128 and 256, 2 at 64) */
extern "C" int kda_cuda_launch_cp_merge(const kda_cp_params_t *p, int device, void *stream) {
    const int64_t nsplit = p->cap_slots / 2 < p->pb.seqs.num_seqs ? p->cap_slots / 2 : p->pb.seqs.num_seqs;
    const int64_t items = nsplit * p->pb.hv * ((p->pb.vc + (p->compose && p->first_map ? p->pb.kc : 0)) / MERGE_COLS);
    if (items <= 0) return 0;
    const int bytes = merge_smem(p->pb.kc), which = p->pb.kc == 64 ? 0 : p->pb.kc == 128 ? 1 : 2;
    const int threads = 2 * p->pb.kc;
    const int by_smem = (227 * 1024) / (bytes + 1024), by_threads = 2048 / threads;
    const int64_t resident = (int64_t)(p->sm_count > 0 ? p->sm_count : 1) *
                             (by_smem < by_threads ? (by_smem > 0 ? by_smem : 1) : by_threads);
    const int64_t ctas = items < resident ? items : resident;
    const void *kernels[2][3] = {{(const void *)kda_cp_merge_kernel<64, 0>, (const void *)kda_cp_merge_kernel<128, 0>,
                                  (const void *)kda_cp_merge_kernel<256, 0>},
                                 {(const void *)kda_cp_merge_kernel<64, 1>, (const void *)kda_cp_merge_kernel<128, 1>,
                                  (const void *)kda_cp_merge_kernel<256, 1>}};
    static int done[2][3][KDA_MAX_DEVICES];
    const int mode = p->compose ? 1 : 0;
    return kda_launch_ex(kernels[mode][which], ctas, 1, threads, bytes, p, device, done[mode][which], stream, 1);
}
