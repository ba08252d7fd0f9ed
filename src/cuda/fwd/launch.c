/*
 * The CUDA forward, host side (fwd.h; docs/ALGORITHM.md §3): from the call's problem and the workspace regions
 * backend.c laid out, the prep and recurrence params, the recurrence's tiling, and the launches on the caller's
 * stream: meta (varlen), slot ownership, prep (with the CP plan in its CTA 0), the chunk_states pass, then the
 * recurrence, or CP's pre-scan, merge and pieces (cp/launch.c). Nothing here synchronises with the device or
 * allocates, so kda_forward can be captured in a CUDA graph.
 */
#include <cuda_runtime_api.h>
#include <string.h>

#include "cp.h"
#include "fwd.h"
#include "xcp.h"

int kda_fwd_choose_bv(int64_t heads, int vc, int sm_count) {
    for (int bv = vc < 128 ? vc : 128; bv >= 32; bv /= 2)
        if (heads * (vc / bv) * 5 >= (int64_t)sm_count * 4) return bv;
    return 32;
}

/* The recurrence's tile narrowed until two ring stages fit (rp->blocks and o_dtype set): with fine blocks' K̃_lo a
 * stage at K = 128, BV = 128 is 89 KB, and with fp32 O staging two of them no longer fit at BV 128 */
static void rec_fit_bv(const kda_cuda_config_t *cfg, kda_rec_params_t *rp) {
    while (rp->bv > 32 && cfg->rec_smem(rp, 2) > KDA_REC_SMEM_MAX) rp->bv /= 2;
}

int kda_fwd_launch_states(const kda_cuda_config_t *cfg, kda_rec_params_t *rp, int bv, int major, int device,
                          void *stream) {
    rp->mode = KDA_REC_STATES;
    rp->bv = bv;
    rec_fit_bv(cfg, rp);
    rp->stages = cfg->rec_smem(rp, 3) <= KDA_REC_SMEM_MAX ? 3 : 2;
    rp->wgmma = major == 9 && rp->bv >= 64 && cfg->rec_wgmma;
    return cfg->rec(rp, device, stream);
}

/* chunk_states: S before every chunk, by the recurrence in KDA_REC_STATES mode over the prep's blocks (no O
 * products), into the caller's tensor. It runs before the forward's own recurrence, which may overwrite an
 * in-place initial state; whole sequences, whatever the CP split of the forward. */
static int chunk_states_pass(const kda_fwd_launch_t *l, const kda_rec_params_t *fwd, int device, void *stream) {
    kda_rec_params_t rp = *fwd;
    rp.chunk_states = NULL;
    rp.states_bf16 = NULL;
    rp.states_out = l->p->a.chunk_states;
    rp.states_out_dtype = (int)l->p->a.chunk_states_dtype;
    const int bv = kda_fwd_choose_bv(l->pb.seqs.num_seqs * l->pb.hv, l->pb.vc, l->sm_count);
    return kda_fwd_launch_states(l->cfg, &rp, bv, l->major, device, stream);
}

/* The recurrence's params: the problem, the blocks, O, and its tiling (the tests' tuning where it asks) */
static void fill_rec_params(const kda_fwd_launch_t *l, kda_rec_params_t *rp) {
    const kda_args_t *a = &l->p->a;
    const int kc = l->pb.kc, vc = l->pb.vc;
    memset(rp, 0, sizeof *rp);
    rp->pb = l->pb;
    rp->blocks = l->blocks;
    rp->o = a->o;
    rp->claim = l->claim;
    rp->o_dtype = (int)a->o_dtype;
    rp->states_bf16 = l->states_bf16; /* S for the backward, written as the recurrence (or CP's pieces) passes */
    if (l->cap.slots > 0) {
        rp->bv = kda_cp_rec_bv(kc, vc);
    } else {
        rp->bv = kda_fwd_choose_bv(l->pb.seqs.num_seqs * l->pb.hv, vc, l->sm_count);
        if ((l->tune.bv == 32 || l->tune.bv == 64 || l->tune.bv == 128) && l->tune.bv <= vc) rp->bv = l->tune.bv;
    }
    rp->stages = l->cfg->rec_smem(rp, 3) <= KDA_REC_SMEM_MAX ? 3 : 2;
    if (l->tune.stages == 2) rp->stages = 2;
    rp->wgmma = l->major == 9 && rp->bv >= 64 && l->cfg->rec_wgmma && !l->tune.rec_mma;
    rp->dev_skip = l->tune.dev_skip;
}

/* The primed summary's last launches (xcp.h): after the pre-scan of every piece, the merge composing the prefix maps,
 * then the last one placed into the caller's summary */
static int summary_launches(const kda_fwd_launch_t *l, kda_rec_params_t *rp, const kda_cp_params_t *cpp, int device,
                            void *stream, const char **stage) {
    const kda_cuda_problem_t *pb = &l->pb;
    int err;
    rp->mode = KDA_REC_PRESCAN;
    if ((err = l->cfg->rec(rp, device, stream)) != 0) {
        *stage = "CP pre-scan";
    } else if ((err = kda_cuda_launch_cp_merge(cpp, device, stream)) != 0) {
        *stage = "CP merge";
    } else {
        const float *last = l->prefix + (l->primed_np - 1) * pb->hv * (int64_t)pb->kc * (pb->kc + pb->vc);
        err =
            kda_xcp_launch_place_prefix(l->summary, last, pb->hv, pb->K, pb->V, pb->kc, pb->vc, cpp->first_map, stream);
        if (err) *stage = "cross-rank CP summary";
    }
    return err;
}

/* The primed forward's launches (xcp.h): the fold, S_in of every later piece from it and the prefix maps (where
 * the sequence continues from an earlier rank; else the merge stored them), the pieces */
static int primed_launches(const kda_fwd_launch_t *l, kda_rec_params_t *rp, int device, void *stream,
                           const char **stage) {
    const kda_cuda_problem_t *pb = &l->pb;
    int err = 0;
    if (l->fold && (err = kda_cuda_xcp_fold(l->p, NULL, l->fold, NULL, stream)) != 0) {
        *stage = "cross-rank CP fold";
    } else if (l->fold && (err = kda_xcp_launch_apply(l->prefix, l->fold, rp->cp_slots, l->primed_np, pb->hv, pb->K,
                                                      pb->V, pb->kc, pb->vc, stream)) != 0) {
        *stage = "cross-rank CP apply";
    } else {
        rp->mode = KDA_REC_PIECES;
        if ((err = l->cfg->rec(rp, device, stream)) != 0) *stage = "CP pieces";
    }
    return err;
}

/* The launches in order; a cudaError_t as int, *stage naming the one that failed */
static int fwd_launches(const kda_fwd_launch_t *l, kda_prep_params_t *pp, kda_rec_params_t *rp,
                        const kda_cp_params_t *cpp, int device, void *stream, const char **stage) {
    const kda_cuda_config_t *cfg = l->cfg;
    const int skip = l->tune.dev_skip, split = l->cap.slots > 0;
    const kda_claim_params_t cl = {l->pb.state_indices, l->pb.seqs.num_seqs, 1, 1, l->pb.num_state_slots, l->claim};
    int err = 0;
    if (l->primed == 2) return primed_launches(l, rp, device, stream, stage);
    if (l->fold && !l->primed && (err = kda_cuda_xcp_fold(l->p, NULL, l->fold, NULL, stream)) != 0)
        *stage = "cross-rank CP fold";
    else if (l->p->varlen && (err = kda_cuda_launch_meta(&l->pb.seqs, stream)) != 0) *stage = "meta";
    else if ((err = kda_cuda_launch_claim(&cl, stream)) != 0) *stage = "slot ownership";
    /* the CP plan reads only the lengths: CTA 0 of the prep kernel makes it beside the chunks, off the chain of
       launches before the pre-scan; a kernel of its own only when prep does not run */
    else if (split && (skip & 8) && (err = kda_cuda_launch_cp_plan(cpp, stream)) != 0) *stage = "CP plan";
    else if (!(skip & 8) && (err = cfg->prep(pp, device, stream)) != 0) *stage = "prep";
    else if (l->p->a.chunk_states && (err = chunk_states_pass(l, rp, device, stream)) != 0) *stage = "chunk states";
    else if (!split) {
        if (!(skip & 16) && (err = cfg->rec(rp, device, stream)) != 0) *stage = "recurrence";
    } else if (l->primed == 1) {
        err = summary_launches(l, rp, cpp, device, stream, stage);
    } else {
        err = kda_cp_launch_fwd(cfg, rp, cpp, device, stream, stage);
    }
    return err;
}

kda_status_t kda_fwd_run(const kda_fwd_launch_t *l, int device, void *stream, const char *fn) {
    const kda_problem_t *p = l->p;
    const int kc = l->pb.kc, vc = l->pb.vc, hv = l->pb.hv;
    kda_prep_params_t pp;
    kda_fwd_prep_params(&l->pb, l->blocks, l->tune.dev_skip, &pp);
    kda_rec_params_t rp;
    fill_rec_params(l, &rp);
    kda_cp_params_t cpp;
    memset(&cpp, 0, sizeof cpp);
    if (l->cap.slots > 0) { /* intra-card CP: when a split is possible, the pieces' launches replace the recurrence */
        kda_cp_fill_params(&l->pb, &p->a, l->cap, 1, l->sm_count, l->cp_base, &cpp);
        kda_cp_fwd_params(&cpp, l->maps, &rp);
    }
    if (l->primed) { /* every piece pre-scanned, the first one's M too where the sequence continues (xcp.h) */
        cpp.compose = 1;
        cpp.first_map = kda_xcp_folds_forward(p);
        cpp.prefix = l->prefix;
        rp.cp_summary = cpp.first_map ? 2 : 1;
        if (l->primed == 1) rp.pb.h0_first = pp.pb.h0_first = NULL; /* the fold comes after the gather */
    }
    pp.plan = l->cap.slots > 0;
    pp.cp = cpp;

    if (l->blocks.max_chunks * hv >= ((int64_t)1 << 31) || p->num_seqs * hv * (vc / 32) >= ((int64_t)1 << 31) ||
        l->cap.pieces * hv * (kc / 64 + vc / 32) >= ((int64_t)1 << 31) ||
        l->cap.slots * hv * (kc / 32 + vc / 32) >= ((int64_t)1 << 31)) /* the pre-scan's grid, by slots */
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'seq_len': %lld tokens of %d heads exceed one launch",
                         fn, (long long)p->num_tokens, hv);

    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    const char *stage = "";
    const int err = fwd_launches(l, &pp, &rp, &cpp, device, stream, &stage);
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the %s kernel: %s", fn, stage,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}
