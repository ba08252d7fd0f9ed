/*
 * The CUDA backward's host/device contract: one params struct shared by its five stages (filled by backend.c
 * from a checked kda_bwd_problem_t, passed by value), the workspace regions, and the launchers.
 *
 * Stages of kda_backward (docs/ALGORITHM.md §6), after the forward's meta (varlen) and prep kernels have written
 * the chunk blocks (W, QΓ, K̃, Aqk, γ, U in bf16, kda_cuda.h) into the workspace, or with the blocks the forward
 * kept in the caller's kda_args_t.saved (then no prep runs):
 *   states         the forward's recurrence kernel in KDA_REC_STATES mode (backend.c bwd_states): S at every
 *                  chunk start, fp32 (bf16 on the split path); on the context's second stream beside bwd_dstate.cuh
 *                  when the two grids fit the SMs together (backend.c bwd_overlap: dS never reads S). Not run
 *                  when the forward kept S (bf16 inputs with kda_args_t.saved: its recurrence wrote it)
 *   bwd_dstate.cuh one CTA per (sequence, value head, V tile), last chunk to first: dS⁺ = ∂L/∂S at every chunk
 *                  end, fp32 (on the split path fp16 in S's order, scaled per lane and 16 columns), and
 *                  d_initial_state (from the fp32 sums; bf16 d_o: the forward's recurrence transposed, dSᵀ in
 *                  registers); long sequences with few heads split by intra-card CP (the plan, the pieces' maps,
 *                  the merge, the pieces: ds_mode below)
 *   bwd_inter.cuh  one CTA per (chunk, value head): the products with the states on bf16 tiles — Δ = U − W S,
 *                  dQΓ = dO Sᵀ and dK̃ = Δ dS⁺ᵀ (raw, into the dq̂, dk̂ scratch), dγ = rowsum(S ⊙ dS⁺)
 *                  (bf16 inputs only)
 *   bwd_chunk.cuh  one CTA per (chunk, value head): the chunk's pair products and inverse from the inputs, then
 *                  the products with its C × C coefficients (bf16 inputs: with Δ from bwd_inter.cuh): dv, dβ
 *                  written; the coefficient gradients s·dAqk and Diag(β) dA, β ⊙ dX and the l2norm factors into
 *                  the workspace (fp32 inputs: also dQΓ, dK̃, dγ); tensor cores (tf32, fp32 sums)
 *   bwd_pairs.cuh  one CTA per (chunk, query/key head, 32-channel tile), its G value heads in turn: the pair
 *                  products' backward and the factor rules per channel, the gate's backward: dg written, dA_log/
 *                  ddt_bias partial sums per (chunk, value head, channel); dq̂, dk̂ summed over the G value heads in
 *                  order, then the l2norm step and dq, dk written (the KC/32 tiles of a row in a cluster)
 *   bwd_finish.cu  ddt_bias summed over the chunks, dA_log over the chunks and then the channels, in order
 * No float atomics anywhere: two identical calls give identical bytes.
 *
 * Head sizes: K and V each padded to a class KC, VC ∈ {64, 128, 256} (KDA_BWD_MAX_HEAD_DIM). The chunk kernel keeps
 * its fp32 tiles in shared memory, which bounds its tile to 128 (KDA_BWD_TILE): class 256 runs as 128-wide parts —
 * V by two halves of the inter and chunk grids whose sums over V go into a copy of their regions per half (added
 * by the pairs and finish kernels), K by a cluster of two chunk-kernel CTAs exchanging partial sums (bwd_chunk.cuh);
 * the dstate stage's recurrence kernel takes K ≤ 128 (CP split too), and K 256 with one 2-stage ring of 32 columns
 * (bwd_dstate.cuh).
 */
#ifndef KDA_CUDA_BWD_H
#define KDA_CUDA_BWD_H

#include "kda_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KDA_BWD_MAX_HEAD_DIM 256 /* largest K and V of the CUDA backward */
#define KDA_BWD_TILE                                                                                                   \
    128 /* the inter and chunk kernels' widest K and V tile: class 256 runs as two (V: two
                                    launched halves whose sums over V add up; K: a cluster of two CTAs, bwd_chunk.cuh) */
/* The V halves of class vc (1 or 2): the per-(chunk, head) and per-(token, head) regions that sum over V (dγ, dQΓ
 * and dK̃, β ⊙ dX, P and B, dβ) hold one copy per half, added by their readers */
KDA_HD static inline int kda_bwd_vhalves(int vc) { return vc > KDA_BWD_TILE ? 2 : 1; }
#define KDA_BWD_BV                                                                                                     \
    16 /* V columns per CTA of the dstate fallback kernel (bwd_dstate.cuh): narrow, so that a long sequence with few
                                    heads still gives the card ~V/16 CTAs per head for its sequential chain; 32
                                    (KDA_BWD_BV_WIDE) when the (sequence, head) pairs fill the card anyway */
#define KDA_BWD_BV_WIDE 32

/* The state-gradient stage's modes (bwd_dstate.cuh's recurrence kernel) */
#define KDA_DS_SEQ 0 /* one chain per (sequence, value head, tile), last chunk first */
/* The bytes of one (chunk, value head, V part)'s Δ between the inter and chunk kernels: fp16 [C][VCP], C exponents */
#define KDA_BWD_DELTA_BYTES(VCP) ((int64_t)KDA_CHUNK * 2 * (VCP) + KDA_CHUNK)
#define KDA_DS_PRESCAN                                                                                                 \
    1 /* per (piece, value head, tile) of split sequences: the piece's map dS_out = M dS_in + E
                            (M's columns from the identity without dO; E's from zero, or from d_final_state for a
                            sequence's last piece, whose M is not needed) into its slot */
#define KDA_DS_PIECES                                                                                                  \
    2 /* every piece of the table from its incoming dS (merged, or d_final_state): dS⁺ of its
                            chunks, d_initial_state from a sequence's first piece */

typedef struct kda_bwd_params {
    kda_cuda_problem_t pb;    /* the forward's problem (kda_cuda_problem_fill; pb.ht unused) */
    kda_cuda_blocks_t blocks; /* the forward's chunk blocks (prep.cuh), bf16 */
    /* workspace regions, fp32 */
    float *states;         /* [max_chunks][hv][KC][VC]: S at each chunk start (padding zero); fp32 and fp16
                                     inputs (NULL on the split path) */
    uint16_t *states_bf16; /* the split path's: the same in bf16 (from the states stage, or kept by the
                                     forward in kda_args_t.saved: then no states stage runs) */
    float *dstates;        /* [max_chunks][hv][KC][VC]: dS⁺ = ∂L/∂S at each chunk end; fp32 and fp16 inputs
                                     (NULL on the split path) */
    uint16_t *dstates_f16; /* the split path's: the same in fp16, in kda_cuda_states_dv's order (as S: the dstate
                                     recurrence kernel holds dSᵀ as the forward's holds Sᵀ), each lane's values of a
                                     16-column block times 2^−e (states16.cuh) */
    uint8_t *dstates_exp;  /* [max_chunks][hv][VC / 16][32]: the biased exponent of each 2^e (split path) */
    unsigned char *delta;  /* [max_chunks][hv][NVH] pieces of KDA_BWD_DELTA_BYTES(VC / NVH): Δ = U − W S of
                                     each chunk (inter kernel; split only) as fp16 [C][VC / NVH] times each row's
                                     2^(e − 127), then the C bytes e; V class 256: by V half */
    float *dgam;           /* [max_chunks][hv][NVH][KC]: dγ = rowsum(S ⊙ dS⁺) of each chunk (inter kernel, or the
                                     chunk kernel with fp32 inputs); NVH = kda_bwd_vhalves(VC) copies, one per V half,
                                     as in the next four regions */
    float *dqk;            /* [num_tokens][hv][NVH][2][KC]: the raw dQΓ, dK̃ (inter kernel, or the chunk kernel
                                     with fp32 inputs), read by the pairs kernel */
    float *dcoef;          /* [max_chunks][hv][NVH][2][C][C + 4]: P = s·dAqk (lower), B = Diag(β) dA (strictly
                                     lower) of each chunk, rows padded with zeros (chunk kernel) */
    float *dx;             /* [num_tokens][hv][NVH][KC]: β ⊙ dX, dX = −dR Sᵀ (chunk kernel) */
    float *rnorm;          /* [num_tokens][hv][2]: the l2norm factors 1/‖q‖, 1/‖k‖ (chunk kernel; l2norm) */
    float *part;           /* [max_chunks][hv][2][KC]: per chunk and channel Σ ∂L/∂A_log, Σ ∂L/∂dt_bias[d] */
    float *dbeta_part;     /* V class 256 only: [num_tokens][hv][2] ∂L/∂β before β's sigmoid, per V half (chunk
                                     kernel), summed by bwd_finish.cu */
    /* the backward's own inputs (the forward's are pb's) */
    const void *dht, *d_o; /* d_final_state (NULL: zeros), d_o */
    int dht_dtype, do_dtype;
    const float *dht_last; /* cross-rank CP: the fold of the later ranks' maps, ∂L/∂S at the end of sequence N − 1,
                              [hv][K][V] fp32, in place of its d_final_state; NULL: d_final_state */
    int dh0_zero_first;    /* cross-rank CP: sequence 0 continues from an earlier rank, its d_initial_state is 0 */
    /* outputs */
    void *dq, *dk, *dv, *dg, *dbeta, *dh0;
    float *dA_log, *ddt_bias;
    int dq_dtype, dk_dtype, dv_dtype, dg_dtype, dbeta_dtype, dh0_dtype;
    int split;    /* bf16 q, k, v: the products with the states by bwd_inter.cuh (Δ, dγ, dQΓ, dK̃:
                                     products of the bf16 chunk blocks and bf16-rounded states), then bwd_chunk.cuh;
                                     fp32 and fp16 inputs: bwd_chunk.cuh alone, from fp32 recomputations (tf32
                                     products; backend.c bwd_split says why fp16 too) */
    int sm_count; /* the device's SMs (the dstate kernel's tile width) */
    /* intra-card CP of the state-gradient chain (bwd_dstate.cuh; docs/ALGORITHM.md §4 and §6): the piece table of
       the forward's plan (cp_plan.cu, made in the backward's workspace), walked last piece first; ds_mode
       KDA_DS_SEQ (whole sequences), KDA_DS_PRESCAN or KDA_DS_PIECES */
    int ds_mode;
    const kda_cp_piece_t *cp_table;
    const int64_t *cp_header;  /* [0] pieces in the table, [3] 1: the plan took the forward's pieces and maps
                                     (the pre-scan runs no M, the merge reads the maps: cp_plan.cu) */
    float *cp_slots;           /* per (slot, value head): kda_cuda_cp_slot_floats (Mᵀ, E, incoming dS) */
    int64_t cp_capacity;       /* table entries the pieces' grid covers */
    int64_t cp_capacity_slots; /* slots the pre-scan's grid covers (entry = slot: cp_plan.h) */
    int wgmma;                 /* sm_90a: the dstate recurrence kernel's products by wgmma */
    int dev_skip;              /* development builds (0 in the shipped library) */
} kda_bwd_params_t;

/* The launchers (bwd/configs.c): a cudaError_t as int (0 = success); each looks its instance up by p->pb.kc, p->pb.vc
 * (and the path, the tile) in the tables of configs.def's KDA_BWD_* rows. */
int kda_bwd_launch_dstate(const kda_bwd_params_t *p, int device, void *stream);
int64_t kda_bwd_dstate_ctas(const kda_bwd_params_t *p); /* the CTAs kda_bwd_launch_dstate launches (KDA_DS_SEQ) */
/* Whether the state-gradient chain can take the CP modes (its recurrence kernel applies: bf16 d_o, 16-byte rows) */
int kda_bwd_dstate_cp_applies(const kda_bwd_params_t *p);
int kda_bwd_launch_inter(const kda_bwd_params_t *p, int device, void *stream);
int kda_bwd_launch_chunk(const kda_bwd_params_t *p, int device, void *stream);
int kda_bwd_launch_pairs(const kda_bwd_params_t *p, int device, void *stream);
int kda_bwd_launch_finish(const kda_bwd_params_t *p, int device, void *stream);
/* Whether configs.def has the backward's instances for K class kc and V class vc (the supports check) */
int kda_bwd_supports(int kc, int vc);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_BWD_H */
