/*
 * The CUDA backend's host/device contract: one plain struct of launch parameters (filled by backend.c from
 * a checked kda_problem_t, passed by value to every kernel) and the launchers of each stage (.cu files).
 *
 * Stages of kda_forward (docs/ALGORITHM.md §3):
 *   meta.cu        varlen only: chunk_offsets[n] = Σ_{m<n} ceil(len_m / 64), on the device (no host sync)
 *   prep.cu        one CTA per (chunk, value head): per-token inputs, A, Aqk, T = (I + A)⁻¹, W, U, QΓ, K̃, γ
 *                  into a workspace block per (chunk, head)
 *   recurrence.cu  one CTA per (sequence, value head, V tile): the chunk recurrence over the blocks
 */
#ifndef KDA_CUDA_H
#define KDA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "../internal.h" /* KDA_CHUNK, KDA_SUB, KDA_DIAG_RANGE, KDA_GATE_MIN: the blocking both backends share */

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes, equal to kda_dtype_t's */
#define KDA_DT_F32 0
#define KDA_DT_F16 1
#define KDA_DT_BF16 2

#ifdef __CUDACC__
#define KDA_HD __host__ __device__
#else
#define KDA_HD
#endif

typedef struct kda_cuda_params {
    /* tensors (device pointers) */
    const void *q, *k, *v, *g, *beta;
    void *o;
    const void *h0;
    void *ht;
    const float *A_log, *dt_bias;
    const void *cu_seqlens;      /* NULL: equal-length rows */
    const int32_t *state_indices;
    int64_t num_state_slots;
    int dtype, g_dtype, beta_dtype, o_dtype, h0_dtype, ht_dtype;
    int cu_seqlens_64;           /* cu_seqlens is int64 */

    /* sizes */
    int64_t num_tokens;          /* rows of q, k, v, g, beta, o */
    int64_t seq_len;             /* T of a row (equal-length rows) */
    int64_t num_seqs;            /* N */
    int hqk, hv, group, kd;      /* kd = K = V */

    /* options */
    float scale, lower_bound;    /* lower_bound != 0: sigmoid gate */
    int l2norm, gate_in_kernel, beta_sigmoid, neg_eigval, v_first;

    int device;                  /* the context's CUDA device (current during the launches) */

    /* workspace */
    int32_t *chunk_offsets;      /* [N + 1], varlen only */
    void *blocks;                /* [max_chunks][hv] blocks of block_bytes */
    int64_t max_chunks;          /* grid of the preparation kernel */
    int64_t block_bytes;
    int64_t chunks_per_row;      /* equal-length rows: ceil(T / 64) */

    /* recurrence tiling */
    int bv;                      /* V columns per CTA: 32, 64 or 128 */
    int rec_stages;              /* chunks buffered in shared memory: 2 or 3 (kda_cuda_recurrence_smem) */
    int rec_wgmma;               /* 1: warpgroup MMA (sm_90a, bv >= 64); 0: mma.sync (bv = 32, sm_100a) */

    /* development only (KDA_DEV_SKIP, for timing stages; results are wrong when set):
       bit 0 prep step 2, bit 1 prep step 4, bit 2 prep step 5, bit 3 prep kernel, bit 4 recurrence kernel;
       prep: bit 5 gate sums, bit 6 normalisation, bit 7 step 3, bit 8 W/U copy-out, bit 9 input copies;
       recurrence: bit 10 copies after the first stages, bit 11 the math */
    int dev_skip;
} kda_cuda_params_t;

/* One (chunk, head) block of the workspace, in this order (byte offsets below):
 *   W, QΓ, K̃   64×kd bf16 each, panel layout (common.cuh)     — copied to shared memory byte for byte
 *   Aqk        64×64 bf16, panel layout
 *   γ          kd fp32
 *   U          64×kd bf16, panel layout                       — each V tile copies the 64-column panels it needs
 * Rows past the end of a short chunk are zero, so the recurrence needs no masks. */
KDA_HD static inline int64_t kda_cuda_off_qg(int kd) { return (int64_t)64 * kd * 2; }
KDA_HD static inline int64_t kda_cuda_off_kt(int kd) { return (int64_t)2 * 64 * kd * 2; }
KDA_HD static inline int64_t kda_cuda_off_aqk(int kd) { return (int64_t)3 * 64 * kd * 2; }
KDA_HD static inline int64_t kda_cuda_off_gamma(int kd) { return kda_cuda_off_aqk(kd) + 64 * 64 * 2; }
KDA_HD static inline int64_t kda_cuda_off_u(int kd) { return kda_cuda_off_gamma(kd) + (int64_t)kd * 4; }
KDA_HD static inline int64_t kda_cuda_block_bytes(int kd) { return kda_cuda_off_u(kd) + (int64_t)64 * kd * 2; }

/* The launchers return a cudaError_t as int (0 = success). They raise a kernel's shared-memory limit once per
 * device (devices numbered below KDA_MAX_DEVICES; others every call; common.cuh kda_smem_limit). */
#define KDA_MAX_DEVICES 64
int kda_cuda_launch_meta(const kda_cuda_params_t *p, void *stream);
int kda_cuda_launch_prep(const kda_cuda_params_t *p, void *stream);
int kda_cuda_launch_recurrence(const kda_cuda_params_t *p, void *stream);
int kda_cuda_recurrence_smem(kda_cuda_params_t *p);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_H */
