/*
 * The CUDA decode kernels' host/device contract: their launch parameters, filled and planned by launch.c from a
 * checked kda_problem_t, the tile geometry both sides read, the instance launchers (one per row of configs.def),
 * and the entry points backend.c calls. Independent of the chunked kernels' params.
 */
#ifndef KDA_CUDA_DECODE_H
#define KDA_CUDA_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include "kda_cuda.h" /* kda_cuda_problem_t */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kda_decode_params {
    kda_cuda_problem_t pb; /* the call's problem (kda_cuda_problem_fill); pb.num_state_slots: the pool's
                                        slots with state_indices, else one per sequence */
    void *o;
    const int32_t *num_accepted; /* 2-D indices only; NULL: column 0 */
    const int32_t *claim;        /* slots.cu: an entry's slot counts for row n only if claim[slot] == n;
                                        NULL: all */
    int64_t idx_cols;            /* 0: 1-D state_indices; else T_max of the 2-D [N, T_max] */
    int64_t idx_stride;          /* elements between rows of the 2-D indices */
    int o_dtype;                 /* kda_dtype_t code */
    int beta_headwise;           /* β per value channel (a V-vector per token and head) */

    /* launch shape (decode_plan) */
    int vec;                               /* state rows and bases allow 16-byte (fp32) / 8-byte (bf16) accesses */
    int bulk;                              /* state tiles by bulk copy (16-byte rows, aligned pool) */
    int vec_in;                            /* K, V even and input bases 8-byte aligned: element pairs by cp.async */
    int ts;                                /* tokens of an item whose rows travel in its stage (1..DEC_TS) */
    int raw_rows, raw_tok, raw_bias;       /* stage bytes: first token block, one token block, dt_bias */
    int raw_q, raw_k, raw_g, raw_v, raw_b; /* byte offsets of the rows within a token block */
    int stage_bytes;                       /* one stage: state tile + input rows (16-byte multiple) */
    int smem_bytes;                        /* the kernel's dynamic shared memory */
    int sm_count;
    int forced_ctas;   /* kda_tuning_t.decode_ctas (tests): at most this many CTAs; 0: as fit */
    int forced_kernel; /* kda_tuning_t.decode_kernel: 1 staged, 2 tile, 3/4 tile with 8/16 chunks
                                        per thread */
    int claim_scan;    /* 1-D state_indices, no claim array: each CTA of the tile kernel finds whether a
                                        later row names its slot (N ≤ KDA_DEC_SCAN_MAX; saves the claim launch) */
} kda_decode_params_t;

/* ---------------------------------------------------------------------------------------------------------
 * Tile geometry, read by the kernels and by the host's plan
 * ------------------------------------------------------------------------------------------------------- */
/* The staged kernel (decode_staged.cuh): tiles of KDA_DEC_TILE state elements, BV = KDA_DEC_TILE / KC columns of
 * the K class KC; a stage row holds KC elements (V-first) or BV padded by a quarter (K-first, no bank conflicts). */
#define KDA_DEC_THREADS 128
#define KDA_DEC_TILE 4096
#define KDA_DEC_NA 8 /* four-element chunks of a tile per thread: KDA_DEC_TILE / 4 / KDA_DEC_THREADS */
#define KDA_DEC_TS 4 /* at most this many tokens of an item travel in its stage (p.ts); later ones one ahead */
#define KDA_DEC_BV(KC) (KDA_DEC_TILE / (KC))
#define KDA_DEC_ROW(VF, KC) ((VF) ? (KC) : KDA_DEC_BV(KC) + KDA_DEC_BV(KC) / 4)
#define KDA_DEC_ELEMS(VF, KC) ((VF) ? KDA_DEC_TILE : KDA_DEC_ROW(VF, KC) * (KC))
/* Stages of the ring: 3 (fp32) or 4 (bf16) tiles, so that three CTAs of 128 threads share an SM */
#define KDA_DEC_STAGES(SF32) ((SF32) ? 3 : 4)

/* The tile kernel (decode_tile.cuh): NA four-element chunks of state per thread, BV = 512·NA / K columns. */
#define KDA_DT_THREADS 128
#define KDA_DT_BV(K, NA) (KDA_DT_THREADS * 4 * (NA) / (K))
/* Rows whose slot ownership the tile kernel settles itself (1-D indices): each of its threads compares
 * KDA_DT_SCAN later rows' indices with the CTA's slot. */
#define KDA_DT_SCAN 2
#define KDA_DEC_SCAN_MAX (1 + KDA_DT_SCAN * KDA_DT_THREADS)

/* ---------------------------------------------------------------------------------------------------------
 * Instances: the kernel column of configs.def's KDA_DECODE_CONFIG rows (the values of kda_tuning_t.decode_kernel)
 * and the launcher each row defines (generated from the row by CMake)
 * ------------------------------------------------------------------------------------------------------- */
enum { KDA_DEC_KERNEL_staged = 1, KDA_DEC_KERNEL_tile = 2 };
typedef int (*kda_decode_launch_fn)(const kda_decode_params_t *p, int device, void *stream);

/* The staged kernel's CTAs for launch p (stage layout done) when a thread holds `regs` registers and a CTA
 * p->smem_bytes of shared memory: as many as fit on the card at once, at most the items (0: nothing to do). */
int64_t kda_decode_staged_ctas(const kda_decode_params_t *p, int regs);

/* ---------------------------------------------------------------------------------------------------------
 * The entry points of backend.c
 * ------------------------------------------------------------------------------------------------------- */
/* Whether the recurrent kernel runs problem p: always for what only it supports (headwise β, 2-D
 * state_indices); for kda_decode (is_decode) also for fp32 / fp16 inputs at any length (fp32 arithmetic, as
 * FLA's fused_recurrent_kda) and for bf16 inputs up to KDA_DECODE_MAX_TOKENS_PER_SEQ tokens per sequence on
 * average. Such a call needs only the slot-ownership workspace (kda_cuda_claim_bytes). */
int kda_cuda_decode_fits(const kda_problem_t *p, int is_decode);

/* Bytes of the slot-ownership array (slots.cu) a call with state_indices needs, 256-aligned: one int32 per pool
 * slot when two or more rows could name one slot, else 0. */
size_t kda_cuda_claim_bytes(const kda_problem_t *p);

/* Run p through a recurrent kernel on `stream` on CUDA device `device` (sm_count: its SMs; tuning: the
 * context's, decode_ctas and decode_kernel; claim: kda_cuda_claim_bytes of workspace, or NULL when that is 0).
 * No allocation, no host sync. */
kda_status_t kda_cuda_decode_run(const kda_problem_t *p, int device, int sm_count, const kda_tuning_t *tuning,
                                 int32_t *claim, void *stream, const char *fn);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_DECODE_H */
