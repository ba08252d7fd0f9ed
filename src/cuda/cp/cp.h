/*
 * Intra-card context parallelism, host side (cp/launch.c; docs/ALGORITHM.md §4): the CP params over the
 * workspace's CP region, and the forward's launches over the pieces of split sequences:
 *   plan      cp_plan.cu, or CTA 0 of the prep kernel: the piece table from the lengths the device holds
 *   pre-scan  the recurrence in KDA_REC_PRESCAN mode: per split piece j, S_out = M_j S_in + E_j
 *   merge     cp_merge.cu: S_in of every piece, in order, S_in(j + 1) = M_j S_in(j) + E_j
 *   pieces    the recurrence in KDA_REC_PIECES mode: every piece's O from its S_in, the final state from a
 *             sequence's last piece
 */
#ifndef KDA_CUDA_CP_H
#define KDA_CUDA_CP_H

#include "kda_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CP params over the region at cpbase (a 256-byte header, the piece table, the slots; cap: its capacity) and
 * the plan's inputs. tiles_factor 1: the forward's plan; 2: the backward's state-gradient chain, whose pre-scan
 * runs M's columns beside E's (kda_cp_problem_t.prescan_pairs) */
void kda_cp_fill_params(const kda_cuda_problem_t *pb, const kda_args_t *a, kda_cp_capacity_t cap, int tiles_factor,
                        int sm_count, unsigned char *cpbase, kda_cp_params_t *cpp);

/* The forward recurrence's CP fields from cpp; maps non-NULL: the forward keeps its piece maps for the backward
 * (kda_args_t.saved: a 256-byte header, then the maps), so its plan records its piece length there and its
 * pre-scan writes M */
void kda_cp_fwd_params(kda_cp_params_t *cpp, int64_t *maps, kda_rec_params_t *rp);

/* The pieces' recurrence tile: the widest (the split made the CTAs), no wider than the K class, since M's columns
 * come in tiles of the same width */
int kda_cp_rec_bv(int kc, int vc);

/* The pre-scan, the merge and the pieces (rp: the forward's recurrence params with kda_cp_fwd_params's fields);
 * a cudaError_t as int, *stage naming the launch that failed */
int kda_cp_launch_fwd(const kda_cuda_config_t *cfg, kda_rec_params_t *rp, const kda_cp_params_t *cpp, int device,
                      void *stream, const char **stage);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_CP_H */
