/*
 * Intra-card context parallelism, step 1 (docs/ALGORITHM.md §4): the piece table, made on the device.
 *
 * From the lengths as the device holds them (cu_seqlens, clamped as seq.cuh clamps them, or equal rows):
 *     c_n = ⌈len_n / C⌉,  total = Σ c_n,  max = max c_n,  P = kda_cp_piece_chunks(total, max, HV, tiles, SMs, mode)
 * then every sequence's pieces of P chunks (src/cp_plan.h's kda_cp_write_seq) at the prefix sums of the pieces,
 * slots and chunks of the sequences before it. The workspace was sized on the host for the worst case
 * (kda_cp_capacity); should the device's lengths need more pieces or slots than that (a graph replayed with
 * lengths the host bound did not foresee), the plan falls back to P = 0: every sequence whole, which is always
 * within the capacity (one entry per sequence) and always exact.
 *
 * Kept piece maps (kda_cp_params_t.maps_mode): the forward's plan records its P where the forward keeps its maps
 * (kda_args_t.saved); the backward's plan takes that P, with the maps (header[3] = 1), when the forward's rule on
 * its own arguments gives the same P, else its own rule (no maps).
 *
 * One CTA of 1024 threads, each owning a contiguous run of sequences (as meta.cu): two block reductions, then
 * block scans of (pieces, slots, chunks). No host involvement, so kda_forward stays graph-capturable.
 */
#include "common.cuh"
#include "seq.cuh"

#define PLAN_THREADS 1024

/* Exclusive scan of x over the block (all threads call it); *total gets the sum. */
DEV int64_t block_exclusive_scan(int64_t x, int64_t *scratch, int64_t *total) {
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
        int64_t w = scratch[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        scratch[lane] = w;
    }
    __syncthreads();
    *total = scratch[PLAN_THREADS / 32 - 1];
    return inc - x + (warp > 0 ? scratch[warp - 1] : 0);
}

__global__ void __launch_bounds__(PLAN_THREADS) kda_cp_plan_kernel(const kda_cp_params_t p) {
    __shared__ int64_t scratch[PLAN_THREADS / 32];
    __shared__ int64_t red_max[PLAN_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t N = p.seqs.num_seqs;
    const int64_t per = (N + PLAN_THREADS - 1) / PLAN_THREADS;
    const int64_t begin = min(N, tid * per), end = min(N, begin + per);
    const kda_cp_seqs_t s = {p.seqs.cu_seqlens, p.seqs.cu_seqlens_64, N, p.seqs.seq_len, p.seqs.num_tokens};

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
    (void)block_exclusive_scan(chunks, scratch, &total); /* its barriers also publish red_max */
    mx = 0;
    for (int w = 0; w < PLAN_THREADS / 32; w++) mx = red_max[w] > mx ? red_max[w] : mx;
    kda_cp_problem_t cp;
    cp.num_seqs = N;
    cp.total_chunks = total;
    cp.max_chunks = mx;
    cp.num_v_heads = p.hv;
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
        piece0 = block_exclusive_scan(pieces, scratch, &pieces_total);
        slot0 = block_exclusive_scan(slots, scratch, &slots_total);
        if (P == 0 || (pieces_total <= p.cap_pieces && slots_total <= p.cap_slots)) break;
        P = 0; /* uniform: every thread saw the same totals */
        maps = 0;
    }
    int64_t unused;
    chunk0 = block_exclusive_scan(chunks, scratch, &unused);
    for (int64_t n = begin; n < end; n++) {
        const int64_t c = kda_cp_seq_chunks(&s, n);
        piece0 += kda_cp_write_seq(&s, n, P, chunk0, piece0, slot0, p.table, p.cap_pieces);
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

extern "C" int kda_cuda_launch_cp_plan(const kda_cp_params_t *p, void *stream) {
    kda_cp_plan_kernel<<<1, PLAN_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}
