/*
 * The CUDA backward's host side (C): its workspace layout, the params of its stages (bwd.h) and their launches on
 * the caller's stream, with the states stage on the context's second stream where the two grids fit the card.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <string.h>

#include <pthread.h>

#include "bwd.h"
#include "layout.h"
#include "xcp.h"

/* ---------------------------------------------------------------------------------------------------------
 * The training backward (bwd.h): the forward's meta and prep kernels write the chunk blocks (the prep not when
 * the forward kept them: kda_args_t.saved), then the six backward stages. Workspace, each region 256-byte aligned:
 *   varlen offsets | chunk blocks (bf16, as the forward's; none when the forward kept them in kda_args_t.saved)
 *   | S per chunk (fp32 [KC][VC] per chunk and head; bf16 on the split path, kda_cuda_states_dv's order; none when
 *   the forward kept it) | dS⁺ per chunk (fp32 [KC][VC]; on the split path fp16 in that order, then the exponents
 *   of its factors, a byte per 16 columns and lane: states16.cuh) | Δ per chunk (fp16 [C][VC] and a byte per row:
 *   KDA_BWD_DELTA_BYTES; bf16 inputs only: the split stage 3, bwd.h) | dγ per chunk (fp32 [KC]) | dQΓ, dK̃ per
 *   token and value head (fp32 2 × KC) | the coefficient gradients P, B per chunk (fp32 2 × [C][C + 4]: rows padded as the pairs
 *   kernel's shared tiles, one contiguous region there) |
 *   β ⊙ dX per token and value head (fp32 KC) | l2norm factors (fp32 2 per token and value head) | dA_log/ddt_bias
 *   partials per chunk, head and channel (fp32 2 × KC) | V class 256: dβ before its sigmoid per token, head and V
 *   half (fp32 2); with V class 256 the regions dγ, dQΓ and dK̃, P and B, β ⊙ dX hold a copy per V half
 *   (kda_bwd_vhalves, bwd.h) | the state-gradient chain's CP region (cp_bytes: the plan's
 *   header and table, per stored piece and head Mᵀ, E and the incoming dS; none where it never splits)
 * ------------------------------------------------------------------------------------------------------- */
/* The backward chain's capacity: where the forward kept its piece maps, the plan may take the forward's pieces or
 * its own (cp_plan.cu), so room for either */
static kda_cp_capacity_t bwd_cp_capacity(const cuda_impl_t *impl, const kda_problem_t *p) {
    kda_cp_capacity_t c = bwd_own_capacity(impl, p);
    if (uses_saved(p) && keeps_maps(impl, p)) {
        const kda_cp_capacity_t f = cp_capacity_tiles(impl, p, 1);
        if (f.pieces > c.pieces) c.pieces = f.pieces;
        if (f.slots > c.slots) c.slots = f.slots;
    }
    return c;
}

typedef struct {
    size_t blocks, states, dstates, dsexp, delta, dgam, dqk, dcoef, dx, rnorm, part, dbeta, cp, fold, total;
    kda_cp_capacity_t cap; /* the state-gradient chain's CP capacity (bwd_cp_capacity; slots 0: never split) */
} bwd_layout_t;

static bwd_layout_t bwd_layout(const cuda_impl_t *impl, const kda_problem_t *p) {
    const size_t kc = (size_t)kda_cuda_size_class(p->a.head_dim_k), vc = (size_t)kda_cuda_size_class(p->a.head_dim_v);
    const size_t heads = (size_t)max_chunks(p) * (size_t)p->a.num_v_heads;
    const size_t rows = (size_t)p->num_tokens * (size_t)p->a.num_v_heads; /* (token, value head) */
    const size_t nvh = (size_t)kda_bwd_vhalves((int)vc); /* the copies of the regions that sum over V */
    bwd_layout_t l;
    l.blocks = meta_bytes(p);
    l.states = l.blocks + ws_blocks_bytes(impl, p);
    /* S: fp32, or bf16 on the split path, none when the forward kept it */
    l.dstates = l.states + (!bwd_split(p)           ? align256(heads * kc * vc * 4)
                            : saved_states(impl, p) ? 0
                                                    : states_bf16_bytes(p));
    /* dS⁺: fp32, or fp16 and a byte per (lane, 16 columns) on the split path */
    l.dsexp = l.dstates + align256(heads * kc * vc * (bwd_split(p) ? 2 : 4));
    l.delta = l.dsexp + (size_t)bwd_split(p) * align256(heads * vc * 2);
    l.dgam = l.delta + (size_t)bwd_split(p) * align256(heads * nvh * (size_t)KDA_BWD_DELTA_BYTES(vc / nvh));
    l.dqk = l.dgam + align256(heads * nvh * kc * 4);
    l.dcoef = l.dqk + align256(rows * nvh * 2 * kc * 4);
    l.dx = l.dcoef + align256(heads * nvh * 2 * KDA_CHUNK * (KDA_CHUNK + 4) * 4);
    l.rnorm = l.dx + align256(rows * nvh * kc * 4);
    l.part = l.rnorm + align256(rows * 2 * 4);
    l.dbeta = l.part + align256(heads * 2 * kc * 4);
    l.cp = l.dbeta + (nvh == 2 ? align256(rows * 2 * 4) : 0);
    l.cap = bwd_cp_capacity(impl, p);
    l.fold = l.cp + align256(cp_bytes(p, l.cap));
    l.total = l.fold + kda_cuda_xcp_fold_bytes(p, 1);
    return l;
}

kda_status_t cuda_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes) {
    *bytes = 256 + bwd_layout((const cuda_impl_t *)ctx->impl, &p->f).total;
    return KDA_STATUS_SUCCESS;
}

#ifdef KDA_DEV_BUILD
/* Development builds only: per-stage GPU times of the backward (bench/bwd_stages.py). kda_dev_bwd_timing(1)
 * makes each following kda_backward record a CUDA event before each stage (meta, prep, dh0 memset, states,
 * dstate, inter, chunk, pairs, finish) and after the last, on its stream (the events of the device current at the
 * first call); kda_dev_bwd_stage_ms waits for the last call's events and writes the 9 stage times in ms. The shipped
 * library has neither. */
#define BWD_EVENTS 10
static cudaEvent_t bwd_ev[BWD_EVENTS];
static int bwd_timing;
KDA_API int kda_dev_bwd_timing(int enable) {
    if (enable && !bwd_ev[0])
        for (int i = 0; i < BWD_EVENTS; i++) {
            const cudaError_t e = cudaEventCreate(&bwd_ev[i]);
            if (e != cudaSuccess) return (int)e;
        }
    bwd_timing = enable;
    return 0;
}
KDA_API int kda_dev_bwd_stage_ms(float *ms, int n) {
    if (!bwd_ev[0]) return -1;
    cudaError_t e = cudaEventSynchronize(bwd_ev[BWD_EVENTS - 1]);
    for (int i = 0; i < n && i < BWD_EVENTS - 1 && e == cudaSuccess; i++)
        e = cudaEventElapsedTime(&ms[i], bwd_ev[i], bwd_ev[i + 1]);
    return (int)e;
}
/* records event i on the stream (timing on); always 0, so that it can stand in a condition */
static int bwd_mark(int i, void *stream) {
    if (bwd_timing) (void)cudaEventRecord(bwd_ev[i], (cudaStream_t)stream);
    return 0;
}
#define BWD_MARK(i) bwd_mark((i), stream)

#else
#define BWD_MARK(i) 0
#endif

/* The backward's stage 1: S at every chunk start, by the forward's recurrence kernel in KDA_REC_STATES mode
 * (wgmma / mma.sync, the same products as the forward's, S stored from its fp32 accumulators; a non-finite
 * initial-state element poisons its value column as in the forward, ALGORITHM.md §7). */
static int bwd_states(const cuda_impl_t *impl, const kda_problem_t *p, const kda_bwd_params_t *bw,
                      const kda_cuda_config_t *cfg, int device, void *stream) {
    kda_rec_params_t rp;
    memset(&rp, 0, sizeof rp);
    rp.pb = bw->pb; /* (the mode writes no final state: pb.ht unused) */
    rp.blocks = bw->blocks;
    rp.o_dtype = (int)KDA_DT_BF16; /* no O is written; sizes the (unused) staging rows */
    rp.chunk_states = bw->states;
    rp.states_bf16 = bw->states_bf16;
    return launch_rec_states(impl, p, cfg, &rp, device, stream);
}

/* Whether the states stage runs on the second stream beside the state-gradient stage: both are chains of chunk
 * steps, one CTA per SM, on as many CTAs as their (sequence, head, tile)s; when the two grids fit the SMs
 * together (B1 T32768 H16: 64 + 32 CTAs) the second one's time is saved, else (B2 T8192 H32: 128 + 128) they
 * would only queue behind each other. Not under the development build's stage timing (its events are on the
 * caller's stream). */
static int bwd_overlap(const cuda_impl_t *impl, const kda_problem_t *p, const kda_bwd_params_t *bw) {
#ifdef KDA_DEV_BUILD
    if (bwd_timing) return 0;
#endif
    if (saved_states(impl, p)) return 0;     /* no states stage */
    if (bw->ds_mode != KDA_DS_SEQ) return 0; /* the split chain's pieces take the card */
    return states_ctas(impl, p) + kda_bwd_dstate_ctas(bw) <= impl->sm_count;
}

/* The states stage on the second stream, after everything the caller's stream holds so far (the chunk blocks);
 * the join event recorded after it (the caller's stream waits for it before the inter kernel) */
static int bwd_fork_states(const cuda_impl_t *impl, const kda_problem_t *p, const kda_bwd_params_t *bw,
                           const kda_cuda_config_t *cfg, int device, void *stream) {
    cudaError_t e = cudaEventRecord(impl->fork, (cudaStream_t)stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(impl->side, impl->fork, 0);
    if (e != cudaSuccess) return (int)e;
    const int err = bwd_states(impl, p, bw, cfg, device, (void *)impl->side);
    return err != 0 ? err : (int)cudaEventRecord(impl->join, impl->side);
}

/* The state-gradient stage: one chain per (sequence, head, tile), or, split (cpp non-NULL: its plan made by
 * the plan kernel, launched first in the call), the pieces' maps dS_out = M dS_in + E, the merge over each split
 * sequence's pieces (mirrored slots: the last piece first) and the pieces from their incoming dS */
static int bwd_dstate_stage(kda_bwd_params_t *bw, const kda_cp_params_t *cpp, int device, void *stream) {
    if (!cpp) return kda_bwd_launch_dstate(bw, device, stream);
    bw->ds_mode = KDA_DS_PRESCAN;
    int err = kda_bwd_launch_dstate(bw, device, stream);
    if (!err) err = kda_cuda_launch_cp_merge(cpp, device, stream);
    bw->ds_mode = KDA_DS_PIECES;
    if (!err) err = kda_bwd_launch_dstate(bw, device, stream);
    return err;
}

kda_status_t cuda_backward(kda_context_t *ctx, const kda_bwd_problem_t *bp, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    const char *fn = "kda_backward";
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    cuda_impl_t *impl = (cuda_impl_t *)ctx->impl;
    kda_cuda_primed_forget(impl, ws);
    uint16_t *kept_states = saved_states(impl, p);
    unsigned char *base = (unsigned char *)(((uintptr_t)ws + 255) & ~(uintptr_t)255);
    const bwd_layout_t l = bwd_layout(impl, p);
    kda_prep_params_t pp;
    fill_prep_params(impl, p, base, 0, &pp);

    kda_bwd_params_t bw;
    memset(&bw, 0, sizeof bw);
    bw.pb = pp.pb;
    bw.blocks = pp.blocks;
    bw.states = bwd_split(p) ? NULL : (float *)(base + l.states);
    bw.states_bf16 = !bwd_split(p) ? NULL : kept_states ? kept_states : (uint16_t *)(base + l.states);
    bw.dstates = bwd_split(p) ? NULL : (float *)(base + l.dstates);
    bw.dstates_f16 = bwd_split(p) ? (uint16_t *)(base + l.dstates) : NULL;
    bw.dstates_exp = bwd_split(p) ? (uint8_t *)(base + l.dsexp) : NULL;
    bw.delta = (unsigned char *)(base + l.delta);
    bw.dgam = (float *)(base + l.dgam);
    bw.dqk = (float *)(base + l.dqk);
    bw.dcoef = (float *)(base + l.dcoef);
    bw.dx = (float *)(base + l.dx);
    bw.rnorm = (float *)(base + l.rnorm);
    bw.part = (float *)(base + l.part);
    bw.dbeta_part = kda_bwd_vhalves(bw.pb.vc) == 2 ? (float *)(base + l.dbeta) : NULL;
    kda_cuda_xcp_fold_places(p, base + l.fold, (float **)&bw.pb.h0_first, (float **)&bw.dht_last);
    bw.dh0_zero_first = kda_xcp_folds_forward(p);
    bw.dht = b->d_final_state;
    bw.d_o = b->d_o;
    bw.dht_dtype = (int)b->d_final_state_dtype;
    bw.do_dtype = (int)b->d_o_dtype;
    bw.dq = b->dq;
    bw.dk = b->dk;
    bw.dv = b->dv;
    bw.dg = b->dg;
    bw.dbeta = b->dbeta;
    bw.dh0 = b->d_initial_state;
    bw.dA_log = b->dA_log;
    bw.ddt_bias = b->ddt_bias;
    bw.dq_dtype = (int)b->dq_dtype;
    bw.dk_dtype = (int)b->dk_dtype;
    bw.dv_dtype = (int)b->dv_dtype;
    bw.dg_dtype = (int)b->dg_dtype;
    bw.dbeta_dtype = (int)b->dbeta_dtype;
    bw.dh0_dtype = (int)b->d_initial_state_dtype;
    bw.split = bwd_split(p);
    bw.sm_count = impl->sm_count;
#ifdef KDA_DEV_BUILD
    bw.dev_skip = dev_tuning.dev_skip;
#endif

    const kda_cuda_config_t *cfg = kda_cuda_find_config(bw.pb.kc, bw.pb.vc); /* non-NULL: cuda_supports checked it */
    bw.wgmma = ((const cuda_impl_t *)ctx->impl)->major == 9 && cfg->rec_wgmma;
    if (pp.blocks.max_chunks * a->num_v_heads * (bw.pb.kc / 32) >=
            ((int64_t)1 << 31) || /* ≥ the chunk and pairs grids */
        p->num_seqs * a->num_v_heads * (bw.pb.vc / KDA_BWD_BV) >= ((int64_t)1 << 31) ||
        l.cap.slots * a->num_v_heads * (bw.pb.kc / 32 + bw.pb.vc / 32) >=
            ((int64_t)1 << 31)) /* the CP pre-scan's grid */
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'seq_len': %lld tokens of %d heads exceed one launch",
                         fn, (long long)p->num_tokens, a->num_v_heads);

    /* the state-gradient chain split (intra-card CP) where the workspace holds a plan and its kernel applies; the
       plan itself is made on the device (it may still decide on no split: then every piece is a whole sequence) */
    kda_cp_params_t cpp;
    const int ds_cp = l.cap.slots > 0 && kda_bwd_dstate_cp_applies(&bw);
    if (ds_cp) {
        fill_cp_params(impl, p, l.cap, KDA_BWD_CP_TILES, base + l.cp, &bw.pb, &cpp);
        int64_t *maps = saved_maps(impl, p);
        if (maps) { /* the forward's pieces and maps where its plan's length is this call's (cp_plan.cu) */
            cpp.maps_mode = 2;
            cpp.maps_header = maps;
            cpp.maps = (const float *)(maps + 32);
        }
        bw.ds_mode = KDA_DS_PIECES; /* (bwd_overlap: not KDA_DS_SEQ) */
        bw.cp_table = cpp.table;
        bw.cp_header = cpp.header;
        bw.cp_slots = cpp.slots;
        bw.cp_capacity = l.cap.pieces;
        bw.cp_capacity_slots = l.cap.slots;
    }
    const int overlap = bwd_overlap(impl, p, &bw);
    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != ctx->device) e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    int err = 0;
    const char *stage = "";
    if (overlap) pthread_mutex_lock(&impl->lock);
    (void)BWD_MARK(0);
    if ((bw.pb.h0_first || bw.dht_last) &&
        (err = kda_cuda_xcp_fold(p, b, (float *)bw.pb.h0_first, (float *)bw.dht_last, stream)) != 0)
        stage = "cross-rank CP fold";
    else if (p->varlen && (err = kda_cuda_launch_meta(&bw.pb.seqs, stream)) != 0) stage = "meta";
    else if (ds_cp && (err = kda_cuda_launch_cp_plan(&cpp, stream)) != 0) stage = "CP plan";
    else if (BWD_MARK(1) || (!uses_saved(p) && (err = cfg->prep(&pp, ctx->device, stream)) != 0)) stage = "prep";
    else if (BWD_MARK(2) || (bw.dh0 && a->state_indices &&
                             (err = (int)cudaMemsetAsync(bw.dh0, 0,
                                                         (size_t)a->num_state_slots * (size_t)a->num_v_heads *
                                                             (size_t)kda_state_head_elems(p) *
                                                             kda_dtype_size(b->d_initial_state_dtype),
                                                         (cudaStream_t)stream)) != 0))
        stage = "d_initial_state memset";
    else if (overlap && (err = bwd_fork_states(impl, p, &bw, cfg, ctx->device, stream)) != 0)
        stage = "backward states (second stream)";
    else if (BWD_MARK(3) ||
             (!overlap && !kept_states && (err = bwd_states(impl, p, &bw, cfg, ctx->device, stream)) != 0))
        stage = "backward states";
    else if (BWD_MARK(4) || (err = bwd_dstate_stage(&bw, ds_cp ? &cpp : NULL, ctx->device, stream)) != 0)
        stage = "backward state-gradient";
    else if (overlap && (err = (int)cudaStreamWaitEvent((cudaStream_t)stream, impl->join, 0)) != 0)
        stage = "backward states (join)";
    else if (BWD_MARK(5) || (bw.split && (err = kda_bwd_launch_inter(&bw, ctx->device, stream)) != 0))
        stage = "backward inter";
    else if (BWD_MARK(6) || (err = kda_bwd_launch_chunk(&bw, ctx->device, stream)) != 0) stage = "backward chunk";
    else if (BWD_MARK(7) || (err = kda_bwd_launch_pairs(&bw, ctx->device, stream)) != 0) stage = "backward pairs";
    else if (BWD_MARK(8) || (err = kda_bwd_launch_finish(&bw, ctx->device, stream)) != 0) stage = "backward finish";
    (void)BWD_MARK(9);
    if (overlap) pthread_mutex_unlock(&impl->lock);
    if (prev >= 0 && prev != ctx->device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the %s kernel: %s", fn, stage,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}
