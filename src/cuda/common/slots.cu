/*
 * State-pool slots named by device-only indices (docs/ALGORITHM.md §4b): which sequence owns each slot.
 *
 * The CUDA kernels cannot check that state_indices names distinct slots (the indices live on the device, and
 * a check would need a host sync). Two sequences naming one slot would race: both write it, and with an
 * in-place pool one may read it after the other wrote it. So that the result is the same on every run, a slot
 * belongs to the LAST sequence that names it, n*(s) = max{n : an entry of row n names s}; every entry of
 * another row that names s is treated as negative (that row starts from zeros and writes nothing there), by
 * seq_slot (seq.cuh) and the decode kernel's slot reads. One CTA, before the kernels that use the pool:
 *
 *   claim[s] ← −1 for every named s;   barrier;   claim[s] ← max(claim[s], n) for every entry (n, ·) naming s
 *
 * Only named slots are touched, so the workspace needs no clearing; the kernels after it read claim[s] == n.
 * Entries outside [0, num_state_slots) or negative are skipped (they already mean "no slot").
 */
#include "common.cuh"

#define CLAIM_THREADS 1024

__global__ void __launch_bounds__(CLAIM_THREADS) kda_claim_kernel(const kda_claim_params_t p) {
    const int64_t entries = p.num_seqs * p.cols;
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t e = threadIdx.x; e < entries; e += CLAIM_THREADS) {
            const int64_t n = e / p.cols, c = e % p.cols;
            const int64_t s = p.state_indices[n * p.stride + c];
            if (s < 0 || s >= p.num_state_slots) continue;
            if (pass == 0) p.claim[s] = -1;
            else atomicMax(&p.claim[s], (int)n);
        }
        __syncthreads(); /* every named slot is −1 before any claim */
    }
}

extern "C" int kda_cuda_launch_claim(const kda_claim_params_t *p, void *stream) {
    if (!p->claim) return 0;
    kda_claim_kernel<<<1, CLAIM_THREADS, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}
