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
 * One CTA, each thread owning a contiguous run of sequences (as meta.cu): two block reductions, then block scans of
 * (pieces, slots, chunks): cp_plan.cuh's cp_plan_cta. No host involvement, so kda_forward stays graph-capturable.
 * The forward runs it as CTA 0 of its prep kernel (kda_prep_params_t.plan: beside the chunks, off the chain of
 * launches before the pre-scan); this kernel of 1024 threads is the backward's plan, and the forward's when prep
 * does not run.
 */

#include "cp_plan.cuh"

#define PLAN_THREADS 1024

__global__ void __launch_bounds__(PLAN_THREADS) kda_cp_plan_kernel(const kda_cp_params_t p) {
    __shared__ int64_t scratch[PLAN_THREADS / 32];
    __shared__ int64_t red_max[PLAN_THREADS / 32];
    cp_plan_cta<PLAN_THREADS>(p, scratch, red_max);
}

extern "C" int kda_cuda_launch_cp_plan(const kda_cp_params_t *p, void *stream) {
    kda_cp_plan_kernel<<<1, PLAN_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}
