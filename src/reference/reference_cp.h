/*
 * The fp64 oracle's internal entry points beyond kda_forward: the per-token inputs and the state at any token
 * (reference.c), and the oracle of intra-card context parallelism, the pre-scan and the merge (reference_cp.c,
 * docs/ALGORITHM.md §4). Not part of the public API: tests link them from the static library, so that the CUDA
 * pre-scan and merge (and, later, the multi-GPU exchange of the same maps) have their own oracle.
 *
 * Matrices are dense row-major fp64: M is K×K, E (S_ext) and states are K×V (K-major, whatever state_v_first).
 */
#ifndef KDA_CPU_REFERENCE_CP_H
#define KDA_CPU_REFERENCE_CP_H

#include "../cp_plan.h"
#include "../internal.h"

/* ---- reference.c ------------------------------------------------------------------------------------------ */

/* The initial state of value head h of sequence n (its slot's, zeros without one) into S, each column (value
 * channel) that holds a non-finite value set to NaN whole (kda_reference_poison_columns: the non-finite contract,
 * docs/ALGORITHM.md §7; the maps of reference_cp.c keep it in its column). */
void kda_ref_initial_state(const kda_problem_t *p, int64_t n, int h, double *S);

/* Token t's inputs for value head h exactly as the oracle uses them (l2norm, in-kernel gate and clamp, β
 * sigmoid): q, k, gate K each, v V, beta 1 (V with beta_headwise). Returns 1 when the token poisons. */
int kda_ref_token(const kda_problem_t *p, int64_t t, int h, double *q, double *k, double *v, double *gate,
                  double *beta);

/* The oracle's state of (sequence n, value head h) after tokens [bos_n, t_end) from its initial state, by the
 * very loop kda_forward runs on the reference backend (NaN when poisoned). t_end = bos_n: the initial state. */
void kda_ref_state_at(const kda_problem_t *p, int64_t n, int h, int64_t t_end, double *S);

/* ---- reference_cp.c --------------------------------------------------------------------------------------- */

/* The affine map of tokens [t0, t1) (absolute rows inside sequence n) of value head h: the state after token
 * t1 − 1 is M S + E for the state S before token t0. Returns 0; 1 when a token of the range poisons the head (M
 * and E are then NaN, as the oracle's state would be); −1 for a headwise β (no K×K map: each value column has its
 * own), M and E untouched. t0 == t1: the identity, M = I, E = 0. */
int kda_ref_cp_map(const kda_problem_t *p, int64_t n, int h, int64_t t0, int64_t t1, double *M, double *E);

/* (M, E) = (Mb, Eb) ∘ (Ma, Ea) = (Mb Ma, Mb Ea + Eb): first a, then b. M and E must not alias the inputs. */
void kda_ref_cp_compose(int K, int V, const double *Ma, const double *Ea, const double *Mb, const double *Eb, double *M,
                        double *E);

/* S_out = M S_in + E (S_out must not alias S_in). */
void kda_ref_cp_apply(int K, int V, const double *M, const double *E, const double *S_in, double *S_out);

/* The pre-scan over a piece table (cp_plan.h): for every piece with a storage slot (slot >= 0) and every value
 * head h, its map into M[(slot HV + h) K K ...] and E[(slot HV + h) K V ...]. Pieces of whole sequences are
 * skipped. NOT_SUPPORTED for a headwise β. */
kda_status_t kda_ref_cp_prescan(const kda_problem_t *p, const kda_cp_piece_t *table, int64_t num_pieces, double *M,
                                double *E);

/* The merge over a piece table: S_in[(slot HV + h) K V ...] the incoming state of every piece with a slot: its
 * sequence's initial state for its first piece, M S_in + E of the piece before it for the others (pieces of a
 * sequence are consecutive in the table). The final state of a split sequence is M S_in + E of its last piece. */
kda_status_t kda_ref_cp_merge(const kda_problem_t *p, const kda_cp_piece_t *table, int64_t num_pieces, const double *M,
                              const double *E, double *S_in);

/* ---- Context parallelism across ranks (docs/ALGORITHM.md §4a): the backend's cp_summary ops ---------------- */

/* Workspace of kda_ref_xcp_summary. */
kda_status_t kda_ref_xcp_summary_workspace(const kda_context_t *ctx, const kda_problem_t *p,
                                           const kda_bwd_problem_t *bp, size_t *bytes);
/* This rank's summary into out ([HV, K, K + V], rows [A | C]): bp NULL, the forward's [M | E] of the last local
 * sequence part (M = 0 and E its state at the slice's end when it starts here); else the backward's [Mᵀ | dE] of
 * the first (M = 0 and dE from its d_final_state when it ends here; else dE from d_o alone). */
kda_status_t kda_ref_xcp_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out,
                                 void *ws, size_t ws_bytes);

#endif /* KDA_CPU_REFERENCE_CP_H */
