/*
 * The CUDA backend's host state and the workspace layout its ops share (C): the context's device facts, the sizes
 * and places of the chunk blocks, of what the forward keeps for the backward (kda_args_t.saved) and of the CP
 * region, the chunk preparation's params, the recurrence's tiling and its states mode. backend.c (context,
 * workspace, dispatch) and each op's launch file (bwd/launch.c, ...) include it; layout.c defines it.
 */
#ifndef KDA_CUDA_LAYOUT_H
#define KDA_CUDA_LAYOUT_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include <pthread.h>

#include "internal.h"
#include "kda_cuda.h"

#define KDA_CUDA_PRIMED_KEYS 64

typedef struct {
    int sm_count;
    int major, minor;
    char name[128];
    /* The backward's second stream: its states stage runs there beside the state-gradient stage when the two
       grids fit the card together (bwd_overlap), forked from and joined to the caller's stream by the two events;
       the lock keeps each call's record-wait pairs together when threads share the context. Created with the
       context (no call allocates). */
    cudaStream_t side;
    cudaEvent_t fork, join;
    pthread_mutex_t lock;
    /* Cross-rank CP: the keys of the arguments and workspaces primed kda_cp_forward_summary calls left their work
       in, for the kda_forward that follows each (xcp.h), under the lock; 0: free. The newest
       KDA_CUDA_PRIMED_KEYS are kept, so that one context can serve several ranks' pairs (a one-process
       simulation of the split) */
    uint64_t primed_keys[KDA_CUDA_PRIMED_KEYS];
    const void *primed_ws[KDA_CUDA_PRIMED_KEYS];
    int primed_next;
    int primed_held; /* keys held (written under the lock, read atomically): forget skips the lock at 0 */
} cuda_impl_t;

/* Cross-rank CP's primed pairs (backend.c): every call given a workspace forgets the pair left in it, except the
 * primed summary, which then remembers its own, and the primed forward, which takes it (1: it was there) */
void kda_cuda_primed_forget(cuda_impl_t *impl, const void *ws);
void kda_cuda_primed_remember(cuda_impl_t *impl, const void *ws, uint64_t key);
int kda_cuda_primed_take(cuda_impl_t *impl, const void *ws, uint64_t key);

/* The backward's state-gradient chain takes the same plan (bwd_dstate.cuh's CP modes, run last piece first) with
 * twice the tiles: its pre-scan runs each piece's M columns beside its E columns, each as long a chain as the
 * piece, and the split aims at one pre-scan CTA per SM, counting a sequence's 2n − 3 pre-scan chains of n pieces
 * (kda_cp_problem_t.prescan_pairs; B1 T32768 H16 on 132 SMs: 5 pieces of 103 chunks, 112 pre-scan CTAs and 80
 * piece CTAs of 103 steps against 32 CTAs of 512) */
#define KDA_BWD_CP_TILES 2

int64_t max_chunks(const kda_problem_t *p);
size_t align256(size_t x);
size_t meta_bytes(const kda_problem_t *p);
kda_cp_capacity_t cp_capacity_tiles(const cuda_impl_t *impl, const kda_problem_t *p, int tiles_factor);
kda_cp_capacity_t cp_capacity(const kda_context_t *ctx, const kda_problem_t *p);
kda_cp_capacity_t bwd_own_capacity(const cuda_impl_t *impl, const kda_problem_t *p);
size_t cp_bytes(const kda_problem_t *p, kda_cp_capacity_t cap);
int bwd_split(const kda_problem_t *p);
size_t states_bf16_bytes(const kda_problem_t *p);
int keeps_blocks(const kda_problem_t *p);
int keeps_states(const cuda_impl_t *impl, const kda_problem_t *p);
int keeps_maps(const cuda_impl_t *impl, const kda_problem_t *p);
int fine_for(const cuda_impl_t *impl, const kda_problem_t *p, int kept);
size_t blocks_bytes_fine(const kda_problem_t *p, int fine);
size_t saved_blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p);
size_t saved_maps_bytes(const cuda_impl_t *impl, const kda_problem_t *p);
size_t saved_bytes(const cuda_impl_t *impl, const kda_problem_t *p);
int uses_saved(const kda_problem_t *p);
int fine_blocks(const cuda_impl_t *impl, const kda_problem_t *p);
size_t blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p);
unsigned char *saved_base(const kda_problem_t *p);
uint16_t *saved_states(const cuda_impl_t *impl, const kda_problem_t *p);
int64_t *saved_maps(const cuda_impl_t *impl, const kda_problem_t *p);
size_t ws_blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p);
kda_cuda_blocks_t call_blocks(const cuda_impl_t *impl, const kda_problem_t *p, unsigned char *base);
void fill_prep_params(const cuda_impl_t *impl, const kda_problem_t *p, unsigned char *base, int dev_skip,
                      kda_prep_params_t *out);
int states_bv(const cuda_impl_t *impl, const kda_problem_t *p);
int64_t states_ctas(const cuda_impl_t *impl, const kda_problem_t *p);
int launch_rec_states(const cuda_impl_t *impl, const kda_problem_t *p, const kda_cuda_config_t *cfg,
                      kda_rec_params_t *rp, int device, void *stream);
void fill_cp_params(const cuda_impl_t *impl, const kda_problem_t *p, kda_cp_capacity_t cap, int tiles_factor,
                    unsigned char *cpbase, const kda_cuda_problem_t *pb, kda_cp_params_t *cpp);

#ifdef KDA_DEV_BUILD
/* Development builds only: the process-wide tuning kda_dev_set_tuning sets (a context's own takes precedence) */
extern kda_tuning_t dev_tuning;
#endif

/* The training backward's entries of kda_cuda_ops (bwd/launch.c) */
kda_status_t cuda_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes);
kda_status_t cuda_backward(kda_context_t *ctx, const kda_bwd_problem_t *bp, void *ws, size_t ws_bytes, void *stream);

#endif /* KDA_CUDA_LAYOUT_H */
