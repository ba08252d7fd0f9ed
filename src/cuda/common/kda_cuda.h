/*
 * The CUDA backend's host/device contract: the size classes and the table of kernel configurations, the problem
 * every kernel reads (kda_cuda_problem_t: filled once per call by problem.c from the checked kda_problem_t and
 * embedded as `pb` in each kernel's params, passed by value), one params struct per kernel adding its workspace
 * regions and tiling (filled by the op's launch file: fwd/launch.c, cp/launch.c), the workspace block layout, and
 * the launchers of each stage.
 *
 * Stages of kda_forward (docs/ALGORITHM.md §3), per chunk of C tokens:
 *   meta.cu        varlen only: chunk_offsets[n] = Σ_{m<n} ⌈len_m / C⌉, on the device (no host sync)
 *   prep.cuh       one CTA per (chunk, value head): the per-token inputs, A, Aqk, T = (I + A)⁻¹,
 *                  W = T Diag(β) KΓ, U = T Diag(β) V, QΓ, K̃, γ into a workspace block per (chunk, head); one
 *                  instance per (K class, V class)
 *   recurrence.cuh one CTA per (sequence, value head, V tile), chunk after chunk: Δ = U − W S,
 *                  O = QΓ S + Aqk Δ, S ← Diag(γ) S + K̃ᵀ Δ; one instance per K class (and MMA kind)
 * and, when a long sequence is split into pieces (intra-card context parallelism, docs/ALGORITHM.md §4), between
 * prep and a recurrence over the pieces:
 *   cp_plan.cu     one CTA (or the prep kernel's CTA 0): the piece table (src/cp_plan.h's decision and layout,
 *                  from the device's lengths)
 *   recurrence.cuh pre-scan: per (split piece j, value head, tile) its affine map S_out = M_j S_in + E_j
 *   cp_merge.cu    per (split sequence, value head, 16 columns): S_in(j + 1) = M_j S_in(j) + E_j, in order, fp32
 *   recurrence.cuh pieces: per (piece, value head, V tile) the chunk recurrence from S_in, writing O
 * The recurrence's states pass (S at every chunk start, no O) serves chunk_states and the backward's stage 1.
 *
 * Head sizes: any K and V in [1, KDA_MAX_HEAD_DIM], independently. Each is padded to its size class (64, 128 or
 * 256): loads zero-fill the padding and stores are masked, so a problem runs the kernels of its class. The
 * classes and what runs for them are the rows of configs.def, read both by the backend's supports check and by
 * the launchers.
 */
#ifndef KDA_CUDA_H
#define KDA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h" /* KDA_CHUNK, KDA_SUB, KDA_DIAG_RANGE, KDA_GATE_MIN, KDA_MAX_HEAD_DIM */
#include "cp_plan.h"  /* kda_cp_piece_t: the piece table of intra-card context parallelism */

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

/* ---------------------------------------------------------------------------------------------------------
 * Size classes
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_PANEL_COLS 64 /* columns of one 128-byte-swizzled panel of a bf16 tile (common.cuh pan_off) */
#define KDA_PANEL_BYTES (KDA_CHUNK * 128)

/* The class a head size is padded to: 64, 128 or 256 (0 outside [1, KDA_MAX_HEAD_DIM]). */
KDA_HD static inline int kda_cuda_size_class(int n) {
    return n < 1 ? 0 : n <= 64 ? 64 : n <= 128 ? 128 : n <= KDA_MAX_HEAD_DIM ? 256 : 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * Development switches: compiled in only with -DKDA_DEV=ON (KDA_DEV_BUILD), set through kda_dev_set_tuning
 * by a development harness (bench/stages.py); the shipped library has none, so nothing a user's environment
 * holds can change a result.
 *   bit 0 prep A/Aqk, bit 1 prep T_II, bit 2 prep W/U solve, bit 3 prep kernel, bit 4 recurrence kernel,
 *   bit 5 gate sums, bit 6 normalisation, bit 7 QΓ/K̃/γ, bit 8 W/U copy-out, bit 9 input copies;
 *   recurrence: bit 10 copies after the first stages, bit 11 the math; bit 12 prep at one CTA an SM (its shared
 *   memory padded; results right: half the warps an SM, a fused CTA's producer budget)
 * ------------------------------------------------------------------------------------------------------- */
#ifdef KDA_DEV_BUILD
#define KDA_SKIP(p, bit) ((p).dev_skip & (bit))
#else
#define KDA_SKIP(p, bit) 0
#endif

/* ---------------------------------------------------------------------------------------------------------
 * Params: what every kernel needs to find its sequences and chunks, then one struct per kernel
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_cuda_seqs {
    const void *cu_seqlens; /* NULL: equal-length rows */
    int cu_seqlens_64;      /* cu_seqlens is int64 */
    int64_t num_tokens;     /* rows of q, k, v, g, beta, o */
    int64_t seq_len;        /* T of a row (equal-length rows) */
    int64_t num_seqs;       /* N */
    int64_t chunks_per_row; /* equal-length rows: ceil(T / C) */
    int32_t *chunk_offsets; /* [N + 1], varlen only (workspace, written by meta.cu) */
} kda_cuda_seqs_t;

/* The problem every kernel of a call reads, filled once per call from the checked kda_problem_t
 * (kda_cuda_problem_fill, problem.c) and embedded as `pb` in each kernel's parameters: the sequences, the inputs
 * and states with their dtypes, the heads and head sizes with their size classes, and the options. */
typedef struct kda_cuda_problem {
    kda_cuda_seqs_t seqs;
    const void *q, *k, *v, *g, *beta;
    const float *A_log, *dt_bias; /* NULL unless gate_in_kernel (A_log may be NULL with a lower bound) */
    const void *h0;               /* initial state or pool; NULL: zeros */
    const float *h0_first;        /* cross-rank CP: the fold of the earlier ranks' maps, the state entering
                                     sequence 0, [hv][K][V] fp32, in place of its initial state; NULL: h0 */
    void *ht;                     /* final state or pool; NULL: not written */
    const int32_t *state_indices; /* NULL: sequence n is state n */
    int64_t num_state_slots;
    int dtype, g_dtype, beta_dtype, h0_dtype, ht_dtype; /* kda_dtype_t codes */
    int hqk, hv, group;                                 /* heads of q/k, of v; group = hv / hqk */
    int K, V, kc, vc;                                   /* head sizes and their size classes (kda_cuda_size_class) */
    int v_first;                                        /* states stored V-first, [V][K] per head */
    float scale, lower_bound;                           /* scale resolved; lower_bound != 0: the sigmoid gate */
    int l2norm, gate_in_kernel, beta_sigmoid, neg_eigval;
} kda_cuda_problem_t;

/* Fill pb from the checked problem p (chunk_offsets: the varlen chunk offsets in the workspace, or NULL). */
void kda_cuda_problem_fill(kda_cuda_problem_t *pb, const kda_problem_t *p, int32_t *chunk_offsets);

/* The workspace blocks: [max_chunks][hv] blocks of block_bytes (layout below) */
typedef struct kda_cuda_blocks {
    void *base;
    int64_t block_bytes;
    int64_t max_chunks;
    int fine; /* the low parts the blocks end with: KDA_FINE_QG | KDA_FINE_KT (kda_cuda_block_bytes_fine) */
} kda_cuda_blocks_t;

/* Intra-card context parallelism's plan and merge (cp_plan.cu, cp_plan.cuh, cp_merge.cu): the lengths, the piece
 * table and its storage in the workspace, the decision's inputs */
typedef struct kda_cp_params {
    kda_cuda_problem_t pb; /* the call's problem (its sequences, value heads and size classes) */
    kda_cp_piece_t *table;
    int64_t *header; /* [0] pieces, [1] P (chunks per piece, 0: no split), [2] slots used */
    float *slots;
    int64_t cap_pieces, cap_slots; /* the workspace's capacity (kda_cp_capacity) */
    int mode;                      /* kda_cp_mode_t */
    int64_t piece_len;             /* tokens, KDA_CP_ON */
    int v_tiles, sm_count;         /* the decision's inputs (kda_cp_problem_t), with pb.hv */
    int prescan_pairs;             /* kda_cp_problem_t.prescan_pairs: the backward's state-gradient chain */
    /* The forward's piece maps kept for the backward's chain (kda_args_t.saved): maps_header[0] is the piece length
       the forward's plan chose (0: none split, nothing kept), written by the forward's plan (maps_mode 1) and read
       by the backward's (maps_mode 2), which takes that length, and the maps (header[3] = 1), when its own
       arguments give the same under the forward's rule; else its own rule (prescan_pairs) and header[3] = 0. The
       backward's merge reads Mᵀ from `maps` when header[3] is set. */
    int maps_mode; /* 0: no kept maps; 1: the forward (writes maps_header); 2: the backward */
    int64_t *maps_header;
    const float *maps; /* [slot][hv] × KC·KC: the backward's Mᵀ (maps_mode 2) */
    /* Cross-rank CP's primed summary (xcp.h): compose = 1 makes the merge the chain of the prefix maps over K + V
       columns, X_0 = [M_0 | E_0] (M_0 = 0 unless first_map), X_j = M_j X_{j−1} + [0 | E_j] for every piece j of
       each split sequence, into `prefix` ([slot][hv] × KC·(KC + VC), [d][column], M's columns first) */
    int compose, first_map;
    float *prefix;
} kda_cp_params_t;

/* Division of n < 2^31 by a launch constant d ≥ 1 as a multiply and a shift, q = (n · m) >> s: Granlund and
 * Montgomery's round-up method, m = ⌈2^(31+l) / d⌉ with l = ⌈log2 d⌉ (exact for every such n; m < 2^32). A d
 * outside [1, 2^31) gives m = 0, whose quotients are all 0: only for a divisor no launch uses (0 chunks a row). */
typedef struct {
    uint32_t m, s;
} kda_fastdiv_t;
KDA_HD static inline kda_fastdiv_t kda_fastdiv_make(int64_t d) {
    kda_fastdiv_t f = {0, 0};
    if (d <= 0 || d >= ((int64_t)1 << 31)) return f;
    uint32_t l = 0;
    while (((int64_t)1 << l) < d) l++;
    f.m = (uint32_t)((((uint64_t)1 << (31 + l)) + (uint64_t)d - 1) / (uint64_t)d);
    f.s = 31 + l;
    return f;
}
/* n / d for n < 2^31, f = kda_fastdiv_make(d) */
KDA_HD static inline uint32_t kda_fastdiv(uint32_t n, kda_fastdiv_t f) {
    return (uint32_t)(((uint64_t)n * f.m) >> f.s);
}

typedef struct kda_prep_params {
    kda_cuda_problem_t pb; /* the call's problem: K, V the true head sizes (the template holds the classes) */
    kda_cuda_blocks_t blocks;
    int piece_qk, piece_v; /* bytes in which 16-bit K (V) rows are copied: 16, 8, 4 or 2 (K % 8 == 0: 16) */
    int dev_skip;          /* KDA_SKIP */
    kda_fastdiv_t div_hv, div_group, div_cpr; /* by hv, group and seqs.chunks_per_row: the CTA → chunk step */
    /* plan = 1: the prep kernel's CTA 0 makes the CP piece table from cp (cp_plan.cuh) beside the chunks' CTAs,
       instead of a planning kernel of its own on the chain before prep (the pre-scan, after prep, reads it) */
    int plan;
    kda_cp_params_t cp;
} kda_prep_params_t;

/* What the recurrence kernel walks (kda_rec_params_t.mode) */
#define KDA_REC_SEQ 0 /* whole sequences: one CTA per (sequence, value head, V tile) */
#define KDA_REC_PRESCAN                                                                                                \
    1                    /* pieces of split sequences: M (identity in, U = 0) and E (zero in; the first piece:
                             the initial state) per (piece, value head, tile), no O */
#define KDA_REC_PIECES 2 /* every piece of the table, from its incoming state (merged, or the initial state) */
#define KDA_REC_STATES                                                                                                 \
    3 /* whole sequences as KDA_REC_SEQ, no O and no final state; S at every chunk start into
                             chunk_states (the backward's stage 1: fp32 [KC][VC]; states_bf16 on its split path) or,
                             when set, into states_out (the caller's kda_args_t.chunk_states: its dtype and layout,
                             masked to K × V) */

/* The CP storage of one (slot, value head), fp32, classes KC, VC: Mᵀ (KC×KC, [e][d], swizzled:
 * kda_cuda_map_index), E (KC×VC, [d][v]), S_in (KC×VC, [d][v]); kda_cp_slot_head_bytes(KC, VC) bytes. */
KDA_HD static inline int64_t kda_cuda_cp_slot_floats(int kc, int vc) { return (int64_t)kc * kc + (int64_t)2 * kc * vc; }

/* Where element (r, c) of a KC × KC map the merge streams by rows r (Mᵀ in a slot; the forward's M kept for the
 * backward, kda_rec_params_t.cp_maps) is stored: row r, column c ⊕ 8 (r mod 4). The merge's tf32 fragments
 * (cp_merge.cu) read column c of rows r .. r + 3 in one instruction; unswizzled, those four rows lie in one bank. */
KDA_HD static inline int64_t kda_cuda_map_index(int kc, int r, int c) { return (int64_t)r * kc + (c ^ ((r & 3) << 3)); }

/* The order of the bf16 states (kda_rec_params_t.states_bf16, the backward's S; also of its fp16 dS⁺, bwd.h
 * dstates_f16: states16.cuh writes and reads both): the recurrence's warps write S as their mma accumulators hold
 * it, each lane 16-byte pieces, so that a warp's store is whole 512-byte lines (the row-major [KC][VC] order takes
 * 64 two-byte stores per thread and chunk, each warp store four half sectors). Per (chunk, head), KC · VC elements
 * as [VC / 16][KC / 16][32 lanes][8]: element j of
 * lane l of piece (vb, np), flat index e = ((vb · KC/16 + np) · 32 + l) · 8 + j, is S[d][v] with
 * nt = 2 np + j / 4, c = j mod 4, d = 8 nt + 2 (l mod 4) + c mod 2, v = 16 vb + l / 4 + 8 (c / 2). */
KDA_HD static inline void kda_cuda_states_dv(int e, int kc, int *d, int *v) {
    const int j = e & 7, l = (e >> 3) & 31, np = (e >> 8) % (kc / 16), vb = (e >> 8) / (kc / 16);
    const int nt = 2 * np + (j >> 2), c = j & 3;
    *d = 8 * nt + 2 * (l & 3) + (c & 1);
    *v = 16 * vb + (l >> 2) + 8 * (c >> 1);
}

typedef struct kda_rec_params {
    kda_cuda_problem_t pb; /* the call's problem: sequences, states, heads, head sizes */
    kda_cuda_blocks_t blocks;
    void *o;
    int o_dtype;                    /* also sizes the O staging rows of the modes that write no O */
    const int32_t *claim;           /* slots.cu: a slot counts for sequence n only if claim[slot] == n; NULL: all */
    int bv;                         /* V columns per CTA: 32, 64 or 128 (<= the V class) */
    int stages;                     /* chunks buffered in shared memory (ring mode): 2 or 3 */
    int wgmma;                      /* 1: warpgroup MMA (sm_90a, bv >= 64); 0: mma.sync */
    int dev_skip;                   /* KDA_SKIP */
    int mode;                       /* KDA_REC_SEQ, KDA_REC_PRESCAN or KDA_REC_PIECES */
    const kda_cp_piece_t *cp_table; /* the piece table (modes PRESCAN, PIECES) */
    const int64_t *cp_header;       /* [0] pieces in the table, [1] piece length in chunks (0: nothing split),
                                        [2] slots used (the split pieces: table entries 0 .. [2] − 1) */
    float *cp_slots;                /* per (slot, value head): kda_cuda_cp_slot_floats */
    int64_t cp_capacity;            /* table entries the pieces' grid covers */
    int64_t cp_capacity_slots;      /* slots the pre-scan's grid covers */
    float *cp_maps;                 /* KDA_REC_PRESCAN, the forward keeping its piece maps for the backward
                                        (kda_args_t.saved; ALGORITHM.md §6): M of every middle piece, [d][e] (the
                                        backward's Mᵀ), at the backward's mirrored slot; NULL: not kept */
    float *chunk_states;            /* KDA_REC_STATES: [max_chunks][hv][KC][VC], S at each chunk start */
    uint16_t *states_bf16;          /* KDA_REC_STATES instead of chunk_states, and KDA_REC_SEQ / KDA_REC_PIECES when
                                        set (the forward keeping S for the backward, kda_args_t.saved): S at each
                                        chunk start in bf16, [max_chunks][hv] × KC·VC in kda_cuda_states_dv's
                                        order (the backward's split path) */
    int cp_summary;                 /* KDA_REC_PRESCAN for cross-rank CP's primed summary (xcp.h): 0 the forward's
                                        pre-scan; 1 also every sequence's last piece; 2 also that, and first pieces
                                        from zero with M (the sequence continues from an earlier rank) */
    void *states_out;               /* KDA_REC_STATES: instead, the caller's chunk_states ([rows][hv][K][V], V-first
                                        [rows][hv][V][K]) in states_out_dtype */
    int states_out_dtype;
} kda_rec_params_t;

/* The planning and merging kernels of intra-card context parallelism (cp_plan.cu, cp_merge.cu) */

int kda_cuda_launch_cp_plan(const kda_cp_params_t *p, void *stream);
int kda_cuda_launch_cp_merge(const kda_cp_params_t *p, int device, void *stream);

/* ---------------------------------------------------------------------------------------------------------
 * One (chunk, head) block of the workspace for K class KC and V class VC, in this order (byte offsets below):
 *   W, QΓ, K̃   C×KC bf16 each, panel layout (common.cuh)     — copied to shared memory byte for byte
 *   Aqk        C×C bf16, panel layout
 *   γ          KC fp32
 *   U          C×VC bf16, panel layout                       — each V tile copies the panels it needs
 *   QΓ_lo      C×KC bf16, panel layout, fine blocks only      — the state-gradient chain's (fp16, fp32 inputs)
 *   K̃_lo       C×KC bf16, panel layout, fine blocks only      — the recurrence's (K class ≤ 128)
 * Rows past the end of a short chunk and padded columns are zero, so the recurrence needs no masks there.
 * ------------------------------------------------------------------------------------------------------- */
KDA_HD static inline int64_t kda_cuda_off_qg(int kc) { return (int64_t)KDA_CHUNK * kc * 2; }
KDA_HD static inline int64_t kda_cuda_off_kt(int kc) { return (int64_t)2 * KDA_CHUNK * kc * 2; }
KDA_HD static inline int64_t kda_cuda_off_aqk(int kc) { return (int64_t)3 * KDA_CHUNK * kc * 2; }
KDA_HD static inline int64_t kda_cuda_off_gamma(int kc) { return kda_cuda_off_aqk(kc) + KDA_CHUNK * KDA_CHUNK * 2; }
KDA_HD static inline int64_t kda_cuda_off_u(int kc) { return kda_cuda_off_gamma(kc) + (int64_t)kc * 4; }
KDA_HD static inline int64_t kda_cuda_block_bytes(int kc, int vc) {
    return kda_cuda_off_u(kc) + (int64_t)KDA_CHUNK * vc * 2;
}
/* Fine blocks (kda_cuda_blocks_t.fine): low parts after U, each C×KC bf16 in the panel layout, x = hi + lo to ~16
 * bits:
 *   KDA_FINE_QG  QΓ_lo, fp16 and fp32 inputs (prep.cuh gated_qk, from the unrounded s q̂ e^G), for the state-gradient
 *                chain's QΓᵀ dO (bwd_dstate.cuh): with QΓ in bf16 alone, d_initial_state of fp32 inputs is ~3x FLA's
 *   KDA_FINE_KT  K̃_lo, K class ≤ 128 (prep.cuh decay_factors, from k̂'s bf16 times the decay factor), for the
 *                states pass's Sᵀ += Δᵀ K̃ (recurrence.cuh, KDA_REC_STATES; the backward's S, chunk_states):
 *                S's rounding from a bf16 K̃ reached dA_log through dγ = rowsum(S ⊙ dS⁺). The forward's
 *                recurrences do not read it (backend.c fine_for says which blocks carry it) */
#define KDA_FINE_QG 1
#define KDA_FINE_KT 2
KDA_HD static inline int64_t kda_cuda_off_qglo(int kc, int vc) { return kda_cuda_block_bytes(kc, vc); }
KDA_HD static inline int64_t kda_cuda_off_ktlo(int kc, int vc, int fine) {
    return kda_cuda_block_bytes(kc, vc) + ((fine & KDA_FINE_QG) ? (int64_t)KDA_CHUNK * kc * 2 : 0);
}
KDA_HD static inline int64_t kda_cuda_block_bytes_fine(int kc, int vc, int fine) {
    return kda_cuda_off_ktlo(kc, vc, fine) + ((fine & KDA_FINE_KT) ? (int64_t)KDA_CHUNK * kc * 2 : 0);
}

/* ---------------------------------------------------------------------------------------------------------
 * The configuration table (configs.def): one row per (K class, V class). The launchers return a cudaError_t
 * as int (0 = success); they raise a kernel's shared-memory limit once per device (devices numbered below
 * KDA_MAX_DEVICES; others every call; common.cuh kda_smem_limit).
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_MAX_DEVICES 64

typedef int (*kda_prep_launch_fn)(const kda_prep_params_t *p, int device, void *stream);
typedef int (*kda_rec_launch_fn)(const kda_rec_params_t *p, int device, void *stream);
typedef int (*kda_rec_smem_fn)(const kda_rec_params_t *p, int stages);

typedef struct kda_cuda_config {
    int kc, vc;    /* the size classes of K and V */
    int rec_wgmma; /* the recurrence has a warpgroup-MMA version for this K class (sm_90a) */
    kda_prep_launch_fn prep;
    kda_rec_launch_fn rec;
    kda_rec_smem_fn rec_smem; /* shared memory of a recurrence CTA with `stages` stages (0: as chosen) */
} kda_cuda_config_t;

/* The row for (kc, vc), or NULL: the supports check and the launchers both come here. */
const kda_cuda_config_t *kda_cuda_find_config(int kc, int vc);

#define KDA_REC_SMEM_MAX 232448 /* bytes of shared memory a CTA may use on sm_90 and sm_100 */

int kda_cuda_launch_meta(const kda_cuda_seqs_t *s, void *stream);

/* Slot ownership with device-only state_indices (slots.cu): claim[s] = the last row naming slot s */
typedef struct {
    const int32_t *state_indices; /* [num_seqs][cols] with row stride `stride` (1-D: cols = stride = 1) */
    int64_t num_seqs, cols, stride, num_state_slots;
    int32_t *claim; /* [num_state_slots] in the workspace; NULL: nothing to do */
} kda_claim_params_t;
int kda_cuda_launch_claim(const kda_claim_params_t *p, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_H */
