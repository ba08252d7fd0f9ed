/*
 * Context parallelism across ranks on the CUDA backend (docs/ALGORITHM.md §4a, docs/API.md §14): the folds that
 * kda_forward and kda_backward run first, and the summary entry points.
 *   fold       a chain of the gathered summaries into the state entering sequence 0 (forward: ranks r − c .. r − 1)
 *              or the ∂L/∂S leaving sequence N − 1 (backward: ranks r + c' down to r + 1), fp32, in the call's
 *              workspace; the kernels read it in place of h0 (kda_cuda_problem_t.h0_first) or of d_final_state
 *              (kda_bwd_params_t.dht_last)
 *   summary    the forward's [M | E] of the last local sequence, the backward's [Mᵀ | dE] of the first, by the
 *              backend's own forward and backward over that sequence alone: by linearity E (dE) is the state
 *              (state gradient) it leaves with zero coming in, and M the state it leaves from the identity with
 *              v = 0 (K columns); then the parts are placed side by side in the caller's summary
 */
#ifndef KDA_CUDA_XCP_H
#define KDA_CUDA_XCP_H

#include "layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kernels (xcp.cu); a cudaError_t as int */
int kda_xcp_launch_fold(const float *sums, int64_t first, int count, int step, int hv, int K, int V, float *out,
                        void *stream);
int kda_xcp_launch_identity(float *x, int hv, int K, int64_t W, void *stream);
int kda_xcp_launch_gather(void *dst, const void *pool, const int32_t *index, int64_t slots, int64_t elems, int es,
                          void *stream);
int kda_xcp_launch_place(float *dst, int64_t W, int col0, const float *src, int hv, int K, int C, int tr, void *stream);

/* Workspace of the folds a forward (backward: 1) runs, 0 when it runs none */
size_t kda_cuda_xcp_fold_bytes(const kda_problem_t *p, int backward);
/* The forward fold into fwd (the state entering sequence 0) and, for the backward, the backward fold into bwd;
 * either NULL where its chain is empty. On the current device and the caller's stream. */
int kda_cuda_xcp_fold(const kda_problem_t *p, const kda_backward_args_t *b, float *fwd, float *bwd, void *stream);
/* Where the folds lie in a workspace region of kda_cuda_xcp_fold_bytes at mem (bwd NULL: the forward's alone) */
void kda_cuda_xcp_fold_places(const kda_problem_t *p, unsigned char *mem, float **fwd, float **bwd);

int kda_xcp_launch_apply(const float *prefix, const float *S, float *slots, int64_t np, int hv, int K, int V, int KC,
                         int VC, void *stream);
int kda_xcp_launch_place_prefix(float *dst, const float *X, int hv, int K, int V, int KC, int VC, int first_map,
                                void *stream);

/* The primed path (kda_args_t.cp_primed; docs/API.md §14): the summary call runs the forward's launches up to its
 * pieces — prep, the pre-scan of every piece (the first one's M too when the sequence continues from an earlier
 * rank) and the merge composing the prefix maps X_j over K + V columns — and leaves them in the workspace; the
 * forward then folds, applies S_in(j + 1) = X_j [S; I] (one product per piece instead of the merge's chain) and
 * runs the pieces. It applies where the plan splits one sequence, whose lengths the host knows, and nothing else
 * is asked of the forward (no saved blocks, no chunk_states). The pieces of that split (>= 2), or 0: not primed. */
int64_t kda_cuda_xcp_primed_pieces(const cuda_impl_t *impl, const kda_problem_t *p);
/* Workspace of the prefix maps (0 when not primed), after the forward's own regions */
size_t kda_cuda_xcp_prefix_bytes(const cuda_impl_t *impl, const kda_problem_t *p);
/* The key of the arguments and workspace that pair a primed summary with its forward */
uint64_t kda_cuda_xcp_primed_key(const kda_problem_t *p, const void *ws);

/* kda_cuda_ops' summary entries (the arguments checked; bp NULL: the forward's) */
kda_status_t kda_cuda_xcp_summary_workspace(const kda_context_t *ctx, const kda_problem_t *p,
                                            const kda_bwd_problem_t *bp, size_t *bytes);
kda_status_t kda_cuda_xcp_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                  void *summary, void *ws, size_t ws_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_XCP_H */
