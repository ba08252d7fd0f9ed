/*
 * The CUDA forward, host side (fwd/launch.c; docs/ALGORITHM.md §3): the prep and recurrence params from the
 * call's problem and the workspace regions backend.c lays out, the recurrence's tiling, and the launches:
 *   meta        varlen only: chunk_offsets[n] = Σ_{m<n} ⌈len_m / C⌉ (meta.cu)
 *   claim       state_indices: slot ownership, claim[s] = the last sequence naming slot s (slots.cu)
 *   prep        per (chunk, value head): A, Aqk, T = (I + A)⁻¹, W, U, QΓ, K̃, γ into the blocks (prep.cuh;
 *               CTA 0 makes the CP plan where a split is possible)
 *   states      chunk_states only: S at every chunk start (the recurrence in KDA_REC_STATES mode)
 *   recurrence  per (sequence, value head, V tile): Δ = U − W S, O = QΓ S + Aqk Δ, S ← Diag(γ) S + K̃ᵀ Δ
 *               (recurrence.cuh); where a split is possible, CP's pre-scan, merge and pieces instead (cp.h)
 */
#ifndef KDA_CUDA_FWD_H
#define KDA_CUDA_FWD_H

#include <string.h>

#include "kda_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One forward call's launches: the problem, and where backend.c's workspace layout put each region */
typedef struct kda_fwd_launch {
    const kda_problem_t *p;       /* the checked problem: o, chunk_states, the CP controls */
    const kda_cuda_config_t *cfg; /* the configuration row of (pb.kc, pb.vc) */
    kda_cuda_problem_t pb;        /* filled once for the call (kda_cuda_problem_fill) */
    kda_cuda_blocks_t blocks;     /* the chunk blocks: in the workspace, or in the caller's saved memory */
    int32_t *claim;               /* slot ownership (kda_cuda_claim_bytes), or NULL */
    unsigned char *cp_base;       /* the CP region, of capacity cap; cap.slots == 0: no sequence can split */
    kda_cp_capacity_t cap;
    uint16_t *states_bf16; /* S at every chunk start kept for the backward (saved), or NULL */
    int64_t *maps;         /* CP's piece maps kept for the backward (saved), or NULL */
    float *fold;           /* cross-rank CP: the state entering sequence 0, folded first (xcp.h), or NULL */
    int primed;            /* cross-rank CP's primed path (xcp.h): 0 none; 1 the summary's launches; 2 the forward's */
    int64_t primed_np;     /* its pieces */
    float *prefix;         /* its prefix maps, in the workspace */
    float *summary;        /* primed 1: the caller's summary */
    int sm_count, major;   /* the device's SMs and compute capability major */
    kda_tuning_t tune;     /* the context's tuning (tests); dev_skip 0 outside development builds */
} kda_fwd_launch_t;

/* The chunk preparation's params over the blocks (the backward's first stage takes them too; inline, so that
 * dev/prep_emu fills them by this code without the CUDA runtime) */
static inline void kda_fwd_prep_params(const kda_cuda_problem_t *pb, kda_cuda_blocks_t blocks, int dev_skip,
                                       kda_prep_params_t *pp) {
    const int K = pb->K, V = pb->V;
    memset(pp, 0, sizeof *pp);
    pp->pb = *pb;
    pp->blocks = blocks;
    pp->piece_qk = K % 8 == 0 ? 16 : K % 4 == 0 ? 8 : K % 2 == 0 ? 4 : 2;
    pp->piece_v = V % 8 == 0 ? 16 : V % 4 == 0 ? 8 : V % 2 == 0 ? 4 : 2;
    pp->dev_skip = dev_skip;
    pp->div_hv = kda_fastdiv_make(pb->hv);
    pp->div_group = kda_fastdiv_make(pb->group);
    pp->div_cpr = kda_fastdiv_make(pb->seqs.chunks_per_row);
}

/* Columns of the state per recurrence CTA over `heads` (sequence, value head) pairs: the widest tile (up to 128,
 * within the V class vc) that still gives ~80% of the SMs a CTA */
int kda_fwd_choose_bv(int64_t heads, int vc, int sm_count);

/* The recurrence in KDA_REC_STATES mode over whole sequences, BV columns a CTA (narrowed until two ring stages
 * fit), the stages and the MMA kind chosen here: chunk_states and the backward's stage 1 (rp: the problem, the
 * blocks and where the states go); a cudaError_t as int */
int kda_fwd_launch_states(const kda_cuda_config_t *cfg, kda_rec_params_t *rp, int bv, int major, int device,
                          void *stream);

/* The forward's launches on the caller's stream, on `device` (the current device restored after) */
kda_status_t kda_fwd_run(const kda_fwd_launch_t *l, int device, void *stream, const char *fn);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_FWD_H */
