/*
 * Intra-card context parallelism, step 1: the piece table, made by one CTA on the device (cp_plan.cu says what and
 * why). Here as a device function of the block size, for the two places it runs: cp_plan.cu's kernel of 1024
 * threads, and CTA 0 of the prep kernel (prep.cuh, kda_prep_params_t.plan), of 256 or 512 threads.
 */
#ifndef KDA_CUDA_CP_PLAN_CUH
#define KDA_CUDA_CP_PLAN_CUH

#include "common.cuh"
#include "seq.cuh"

/* Exclusive scan of x over the block of THREADS threads (all call it; scratch: THREADS / 32 entries); *total gets
 * the sum. */
template <int THREADS>
DEV int64_t plan_exclusive_scan(int64_t x, int64_t *scratch, int64_t *total) {
    constexpr int NW = THREADS / 32;
    static_assert(THREADS % 32 == 0 && NW <= 32, "plan: a warp's lanes cover the warps");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int64_t inc = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int64_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads(); /* scratch free from any earlier use */
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int64_t w = lane < NW ? scratch[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < NW) scratch[lane] = w;
    }
    __syncthreads();
    *total = scratch[NW - 1];
    return inc - x + (warp > 0 ? scratch[warp - 1] : 0);
}

/* The plan by one CTA of THREADS threads (blockDim.x == THREADS); scratch and red_max: THREADS / 32 entries of
 * shared memory each */
template <int THREADS>
DEV void cp_plan_cta(const kda_cp_params_t &p, int64_t *scratch, int64_t *red_max) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t N = p.pb.seqs.num_seqs;
    const int64_t per = (N + THREADS - 1) / THREADS;
    const int64_t begin = min(N, tid * per), end = min(N, begin + per);
    const kda_cp_seqs_t s = {p.pb.seqs.cu_seqlens, p.pb.seqs.cu_seqlens_64, N, p.pb.seqs.seq_len, p.pb.seqs.num_tokens};

    /* the decision's counts */
    int64_t chunks = 0, mx = 0;
    for (int64_t n = begin; n < end; n++) {
        const int64_t c = kda_cp_seq_chunks(&s, n);
        chunks += c;
        mx = c > mx ? c : mx;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const int64_t y = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = y > mx ? y : mx;
    }
    if (lane == 0) red_max[warp] = mx;
    int64_t total;
    (void)plan_exclusive_scan<THREADS>(chunks, scratch, &total); /* its barriers also publish red_max */
    mx = 0;
    for (int w = 0; w < THREADS / 32; w++) mx = red_max[w] > mx ? red_max[w] : mx;
    kda_cp_problem_t cp;
    cp.num_seqs = N;
    cp.total_chunks = total;
    cp.max_chunks = mx;
    cp.num_v_heads = p.pb.hv;
    cp.v_tiles = p.v_tiles;
    cp.sm_count = p.sm_count;
    cp.mode = p.mode;
    cp.piece_len = p.piece_len;
    cp.prescan_pairs = p.prescan_pairs;
    int64_t P = kda_cp_piece_chunks(&cp);
    int maps = 0; /* the backward takes the forward's pieces and maps */
    if (p.maps_mode == 2) {
        kda_cp_problem_t f = cp; /* the forward's rule on these arguments */
        f.prescan_pairs = 0;
        f.v_tiles = p.v_tiles / 2;
        const int64_t Pf = kda_cp_piece_chunks(&f);
        if (Pf > 0 && p.maps_header[0] == Pf) {
            P = Pf;
            maps = 1;
        }
    }

    /* offsets of each thread's run; P = 0 if the plan does not fit the workspace */
    int64_t pieces_total, slots_total, piece0, slot0, chunk0;
    for (;;) {
        int64_t pieces = 0, slots = 0;
        for (int64_t n = begin; n < end; n++) {
            const int64_t c = kda_cp_seq_chunks(&s, n);
            pieces += kda_cp_seq_pieces(c, P);
            slots += kda_cp_seq_slots(c, P);
        }
        piece0 = plan_exclusive_scan<THREADS>(pieces, scratch, &pieces_total);
        slot0 = plan_exclusive_scan<THREADS>(slots, scratch, &slots_total);
        if (P == 0 || (pieces_total <= p.cap_pieces && slots_total <= p.cap_slots)) break;
        P = 0; /* uniform: every thread saw the same totals */
        maps = 0;
    }
    int64_t unused;
    chunk0 = plan_exclusive_scan<THREADS>(chunks, scratch, &unused);
    for (int64_t n = begin; n < end; n++) { /* split pieces at their slots, whole sequences after all of them */
        const int64_t c = kda_cp_seq_chunks(&s, n);
        piece0 += kda_cp_write_seq(&s, n, P, chunk0, slot0, piece0 - slot0, slots_total, p.table, p.cap_pieces);
        slot0 += kda_cp_seq_slots(c, P);
        chunk0 += c;
    }
    if (tid == 0) {
        p.header[0] = pieces_total;
        p.header[1] = P;
        p.header[2] = slots_total;
        p.header[3] = maps;
        if (p.maps_mode == 1) p.maps_header[0] = P;
    }
}

#endif /* KDA_CUDA_CP_PLAN_CUH */
