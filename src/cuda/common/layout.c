/*
 * The CUDA backend's workspace layout and the launch helpers its ops share (layout.h).
 */
#include <string.h>

#include "bwd.h"
#include "decode.h"
#include "cp.h"
#include "fwd.h"
#include "layout.h"

/* Upper bound of the number of chunks: Σ ceil(len/C) ≤ (T + (C−1) N) / C for varlen. */
int64_t max_chunks(const kda_problem_t *p) {
    if (p->varlen) return (p->a.seq_len + (KDA_CHUNK - 1) * p->num_seqs) / KDA_CHUNK;
    return p->a.batch * ((p->a.seq_len + KDA_CHUNK - 1) / KDA_CHUNK);
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

size_t meta_bytes(const kda_problem_t *p) {
    return p->varlen ? align256((size_t)(p->num_seqs + 1) * sizeof(int32_t)) : 0;
}

/* Intra-card context parallelism (docs/ALGORITHM.md §4, src/cp_plan.h): the capacity the workspace holds for
 * this problem. Zero slots: no sequence can be split, and kda_forward launches exactly what it did before CP
 * existed. The lengths are exact with equal rows or cu_seqlens_host, else bounded from num_tokens; the plan itself
 * is made on the device (cp_plan.cu) from the lengths it holds, within this capacity. */
kda_cp_capacity_t cp_capacity_tiles(const cuda_impl_t *impl, const kda_problem_t *p, int tiles_factor) {
    kda_cp_problem_t cp;
    const int known = kda_cp_problem_from(p, impl->sm_count, p->a.cu_seqlens_host, &cp);
    cp.v_tiles *= tiles_factor;
    cp.prescan_pairs = tiles_factor == KDA_BWD_CP_TILES;
    return kda_cp_capacity(&cp, known);
}
kda_cp_capacity_t cp_capacity(const kda_context_t *ctx, const kda_problem_t *p) {
    return cp_capacity_tiles((const cuda_impl_t *)ctx->impl, p, 1);
}
/* The backward chain's own capacity: slots > 0 where its chain may split (then the forward keeps S, and its maps) */
kda_cp_capacity_t bwd_own_capacity(const cuda_impl_t *impl, const kda_problem_t *p) {
    return cp_capacity_tiles(impl, p, KDA_BWD_CP_TILES);
}

/* The CP region after the blocks: a 256-byte header ([0] pieces, [1] P, [2] slots), the piece table, the slots. */
size_t cp_bytes(const kda_problem_t *p, kda_cp_capacity_t cap) {
    if (cap.slots == 0) return 0;
    const int kc = kda_cuda_size_class(p->a.head_dim_k), vc = kda_cuda_size_class(p->a.head_dim_v);
    return 256 + (size_t)kda_cp_workspace_bytes(cap, p->a.num_v_heads, kc, vc);
}

/* bwd.h kda_bwd_params_t.split: bf16 inputs take the split stage 3 (and its Δ region). fp16 inputs take the fp32
 * recomputation as fp32 ones do: the split's bf16 tiles round fp16's 10-bit dO and S to 7 bits, and on FLA's
 * test_chunk_varlen fp16 case that puts dq, dk, dh0 at 4-6x FLA's errors and ddt_bias above its bar */
int bwd_split(const kda_problem_t *p) { return p->a.dtype == KDA_BFLOAT16; }

/* S at every chunk start in bf16 ([max_chunks][hv][KC][VC]): the split path's states (its products take S in
 * bf16, as the forward's do) */
size_t states_bf16_bytes(const kda_problem_t *p) {
    const size_t kc = (size_t)kda_cuda_size_class(p->a.head_dim_k), vc = (size_t)kda_cuda_size_class(p->a.head_dim_v);
    return align256((size_t)max_chunks(p) * (size_t)p->a.num_v_heads * kc * vc * 2);
}

/* What kda_forward keeps for the backward (kda_args_t.saved): the chunk blocks, where the forward's prep writes
 * them and the backward's stages read them instead of rerunning the prep; kept for the chunked path with K, V <=
 * KDA_BWD_TILE (class 256: nothing kept yet, the backward reruns the prep). */
int keeps_blocks(const kda_problem_t *p) {
    return !kda_cuda_decode_fits(p, 0) && p->a.head_dim_k <= KDA_BWD_TILE && p->a.head_dim_v <= KDA_BWD_TILE;
}
/* With bf16 inputs the forward also keeps S at every chunk start in bf16, which its recurrence writes as it
 * passes (+128 bytes per token-head at K = V = 64, +512 at 128), so that the backward runs no states stage —
 * where that stage would take the card: its CTAs fill more than half of the SMs, or the state-gradient chain is
 * split (its pieces then take the card). Otherwise it runs beside the state-gradient stage on the second stream
 * and costs the step nothing, while the forward's writes would cost the forward their bytes. The problem alone
 * decides, so the forward and the backward agree. */
int keeps_states(const cuda_impl_t *impl, const kda_problem_t *p) {
    return bwd_split(p) && keeps_blocks(p) &&
           (2 * states_ctas(impl, p) > impl->sm_count || bwd_own_capacity(impl, p).slots > 0);
}
/* Where the backward's chain may split (bf16 inputs), the forward also keeps its pre-scan's piece maps: a middle
 * piece's M, which is the chain's Mᵀ (ALGORITHM.md §6), so that the chain, walking the forward's pieces, runs no
 * M of its own (B1 T32768 H16: 112 pre-scan CTAs of E alone over 8 pieces of 64 chunks, against 5 pieces of 103
 * chunks with M beside E). A 256-byte header (the forward's piece length, cp_plan.cu), then KC × KC fp32 per
 * forward slot and value head: +64 KB per piece-head at K = 128, 4 MB per 64 piece-heads. */
int keeps_maps(const cuda_impl_t *impl, const kda_problem_t *p) {
    return bwd_split(p) && keeps_blocks(p) && bwd_own_capacity(impl, p).slots > 0;
}
/* Fine blocks (kda_cuda.h): QΓ's low part for fp16 and fp32 inputs, whose backward takes the fp32 path (its
 * state-gradient chain reads QΓ as hi + lo); K̃'s low part for K class ≤ 128 wherever a states pass reads the
 * blocks (the recurrence's KDA_REC_STATES mode adds Δᵀ K̃_lo to S; no forward recurrence reads it, so o is the
 * same with and without `saved`, and an inference forward writes none): the backward's own blocks, a chunk_states
 * forward's, and the blocks a forward keeps in saved unless it keeps S as well (keeps_states: the backward then
 * reads the forward's S, made without K̃_lo, and runs no states pass). `kept`: the blocks are (or would be) those
 * kept in saved */
int fine_for(const cuda_impl_t *impl, const kda_problem_t *p, int kept) {
    const int kt = kda_cuda_size_class(p->a.head_dim_k) <= 128 &&
                   (kept ? !keeps_states(impl, p) : p->bwd || p->a.chunk_states != NULL);
    return (p->a.dtype != KDA_BFLOAT16 ? KDA_FINE_QG : 0) | (kt ? KDA_FINE_KT : 0);
}
size_t blocks_bytes_fine(const kda_problem_t *p, int fine) {
    const int64_t b =
        kda_cuda_block_bytes_fine(kda_cuda_size_class(p->a.head_dim_k), kda_cuda_size_class(p->a.head_dim_v), fine);
    return align256((size_t)max_chunks(p) * (size_t)p->a.num_v_heads * (size_t)b);
}
/* The blocks kept in saved, 256 bytes more for the alignment; 0 where none are kept */
size_t saved_blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    return keeps_blocks(p) ? 256 + blocks_bytes_fine(p, fine_for(impl, p, 1)) : 0;
}
size_t saved_maps_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    if (!keeps_maps(impl, p)) return 0;
    const size_t kc = (size_t)kda_cuda_size_class(p->a.head_dim_k);
    return align256(256 + (size_t)cp_capacity_tiles(impl, p, 1).slots * (size_t)p->a.num_v_heads * kc * kc * 4);
}
size_t saved_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    const size_t b = saved_blocks_bytes(impl, p);
    return b == 0 ? 0 : b + (keeps_states(impl, p) ? states_bf16_bytes(p) : 0) + saved_maps_bytes(impl, p);
}
/* The caller's saved memory holds the blocks (the API checked that saved_bytes is large enough) */
int uses_saved(const kda_problem_t *p) { return p->a.saved && keeps_blocks(p); }
/* This call's blocks: their fine parts and their bytes (in saved or in the workspace) */
int fine_blocks(const cuda_impl_t *impl, const kda_problem_t *p) { return fine_for(impl, p, uses_saved(p)); }
size_t blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    return blocks_bytes_fine(p, fine_blocks(impl, p));
}
unsigned char *saved_base(const kda_problem_t *p) {
    return (unsigned char *)(((uintptr_t)p->a.saved + 255) & ~(uintptr_t)255);
}
/* The kept bf16 states (after the blocks in saved), or NULL */
uint16_t *saved_states(const cuda_impl_t *impl, const kda_problem_t *p) {
    return uses_saved(p) && keeps_states(impl, p) ? (uint16_t *)(saved_base(p) + blocks_bytes(impl, p)) : NULL;
}
/* The kept piece maps' header (after the blocks and the states in saved), or NULL; the maps follow it */
int64_t *saved_maps(const cuda_impl_t *impl, const kda_problem_t *p) {
    if (!uses_saved(p) || !keeps_maps(impl, p)) return NULL;
    return (int64_t *)(saved_base(p) + blocks_bytes(impl, p) + (keeps_states(impl, p) ? states_bf16_bytes(p) : 0));
}
/* The blocks' bytes in the workspace: none when they go to saved */
size_t ws_blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    return uses_saved(p) ? 0 : blocks_bytes(impl, p);
}

/* The chunk blocks: at `base` after the varlen offsets, or in the caller's saved memory */
kda_cuda_blocks_t call_blocks(const cuda_impl_t *impl, const kda_problem_t *p, unsigned char *base) {
    const int fine = fine_blocks(impl, p);
    const kda_cuda_blocks_t blocks = {
        uses_saved(p) ? saved_base(p) : base + meta_bytes(p),
        kda_cuda_block_bytes_fine(kda_cuda_size_class(p->a.head_dim_k), kda_cuda_size_class(p->a.head_dim_v), fine),
        max_chunks(p), fine};
    return blocks;
}

/* The call's problem (its varlen offsets at `base`) and the chunk preparation's params over its blocks: the
 * forward's first stages, which the backward runs too (unless saved) */
void fill_prep_params(const cuda_impl_t *impl, const kda_problem_t *p, unsigned char *base, int dev_skip,
                      kda_prep_params_t *out) {
    kda_cuda_problem_t pb;
    kda_cuda_problem_fill(&pb, p, (int32_t *)base);
    kda_fwd_prep_params(&pb, call_blocks(impl, p, base), dev_skip, out);
}

#ifdef KDA_DEV_BUILD
/* Development builds only: a process-wide tuning a harness (bench/stages.py) sets through ctypes; a context's
 * own tuning (tests) takes precedence field by field. */
kda_tuning_t dev_tuning;
KDA_API void kda_dev_set_tuning(int dev_skip, int bv, int rec_mma, int stages) {
    dev_tuning.dev_skip = dev_skip;
    dev_tuning.bv = bv;
    dev_tuning.rec_mma = rec_mma;
    dev_tuning.stages = stages;
}
#endif

/* The state columns per CTA of the recurrence kernel in KDA_REC_STATES mode (its launch and states_ctas) */
int states_bv(const cuda_impl_t *impl, const kda_problem_t *p) {
    return kda_fwd_choose_bv(p->num_seqs * p->a.num_v_heads, kda_cuda_size_class(p->a.head_dim_v), impl->sm_count);
}
/* The CTAs of the backward's states stage (keeps_states, bwd_overlap) */
int64_t states_ctas(const cuda_impl_t *impl, const kda_problem_t *p) {
    return p->num_seqs * p->a.num_v_heads * (kda_cuda_size_class(p->a.head_dim_v) / states_bv(impl, p));
}

/* The recurrence kernel in KDA_REC_STATES mode over whole sequences (the backward's stage 1; fwd/launch.c) */
int launch_rec_states(const cuda_impl_t *impl, const kda_problem_t *p, const kda_cuda_config_t *cfg,
                      kda_rec_params_t *rp, int device, void *stream) {
    return kda_fwd_launch_states(cfg, rp, states_bv(impl, p), impl->major, device, stream);
}

/* The CP region at cpbase (cp_bytes(p, cap) bytes) and the plan's inputs; tiles_factor 1 for the forward,
 * KDA_BWD_CP_TILES for the backward's state-gradient chain (cp/launch.c) */
void fill_cp_params(const cuda_impl_t *impl, const kda_problem_t *p, kda_cp_capacity_t cap, int tiles_factor,
                    unsigned char *cpbase, const kda_cuda_problem_t *pb, kda_cp_params_t *cpp) {
    kda_cp_fill_params(pb, &p->a, cap, tiles_factor, impl->sm_count, cpbase, cpp);
}
