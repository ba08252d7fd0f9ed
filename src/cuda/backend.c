/*
 * The CUDA backend, host side (C): device checks, the configuration table (configs.def), workspace layout, the
 * choice of the recurrence tiling, and the launches of the stages (kda_cuda.h) on the caller's stream. Nothing
 * here synchronises with the device or allocates: varlen scheduling is computed on the device (meta.cu), so
 * kda_forward can be captured in a CUDA graph.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bwd.h"
#include "decode.h"
#include "layout.h"


static void cuda_destroy(kda_context_t *ctx) {
    cuda_impl_t *impl = (cuda_impl_t *)ctx->impl;
    if (impl) {
        if (impl->side) (void)cudaStreamDestroy(impl->side);
        if (impl->fork) (void)cudaEventDestroy(impl->fork);
        if (impl->join) (void)cudaEventDestroy(impl->join);
        pthread_mutex_destroy(&impl->lock);
    }
    free(ctx->impl);
    ctx->impl = NULL;
}

kda_status_t kda_cuda_init(kda_context_t *ctx, int device) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "kda_create: no CUDA device (%s)",
                         e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    }
    if (device >= count)
        return kda_error(KDA_STATUS_INVALID_VALUE, "kda_create: argument 'device': %d, but there are %d CUDA devices",
                         device, count);
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "kda_create: cudaGetDeviceProperties: %s", cudaGetErrorString(e));
    if (!((prop.major == 9 && prop.minor == 0) || (prop.major == 10 && prop.minor == 0)))
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "kda_create: CUDA device %d (%s) has compute capability %d.%d; libkda's kernels are built "
                         "for sm_90a (Hopper) and sm_100a",
                         device, prop.name, prop.major, prop.minor);
    cuda_impl_t *impl = (cuda_impl_t *)calloc(1, sizeof *impl);
    if (!impl) return kda_error(KDA_STATUS_ALLOC_FAILED, "kda_create: out of host memory");
    impl->sm_count = prop.multiProcessorCount;
    impl->major = prop.major;
    impl->minor = prop.minor;
    memcpy(impl->name, prop.name, sizeof impl->name - 1);
    pthread_mutex_init(&impl->lock, NULL);
    int prev = -1;
    (void)cudaGetDevice(&prev);
    if ((e = cudaSetDevice(device)) == cudaSuccess &&
        (e = cudaStreamCreateWithFlags(&impl->side, cudaStreamNonBlocking)) == cudaSuccess &&
        (e = cudaEventCreateWithFlags(&impl->fork, cudaEventDisableTiming)) == cudaSuccess)
        e = cudaEventCreateWithFlags(&impl->join, cudaEventDisableTiming);
    if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
    ctx->impl = impl;
    if (e != cudaSuccess) {
        cuda_destroy(ctx);
        return kda_error(KDA_STATUS_BACKEND_ERROR, "kda_create: the backward's stream and events: %s",
                         cudaGetErrorString(e));
    }
    ctx->num_threads = 0;
    return KDA_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * The configuration table: its rows come from configs.def; the launchers are defined by the instance files
 * CMake generates from the same rows.
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_REC_CONFIG(K, WG)                                                                                  \
    int kda_rec_launch_k##K(const kda_rec_params_t *p, int device, void *stream);                              \
    int kda_rec_smem_k##K(const kda_rec_params_t *p, int stages);                                              \
    enum { kda_rec_wgmma_k##K = WG };
#define KDA_CONFIG(K, V) int kda_prep_launch_k##K##_v##V(const kda_prep_params_t *p, int device, void *stream);
#include "configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG

static const kda_cuda_config_t configs[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V) {K, V, kda_rec_wgmma_k##K, kda_prep_launch_k##K##_v##V, kda_rec_launch_k##K, kda_rec_smem_k##K},
#include "configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG
};

const kda_cuda_config_t *kda_cuda_find_config(int kc, int vc) {
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        if (configs[i].kc == kc && configs[i].vc == vc) return &configs[i];
    return NULL;
}

static kda_status_t cuda_supports(const kda_context_t *ctx, const kda_problem_t *p, const char *fn) {
    (void)ctx;
    const kda_args_t *a = &p->a;
    /* the recurrent kernel (decode.cu) takes any K, V in [1, 256] and any alignment */
    if (kda_cuda_decode_fits(p, strncmp(fn, "kda_decode", 10) == 0)) return KDA_STATUS_SUCCESS;
    const int kc = kda_cuda_size_class(a->head_dim_k), vc = kda_cuda_size_class(a->head_dim_v);
    if (strncmp(fn, "kda_backward", 12) == 0 && (a->head_dim_k > KDA_BWD_MAX_HEAD_DIM || a->head_dim_v > KDA_BWD_MAX_HEAD_DIM))
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument '%s': the CUDA backward takes K, V <= %d (K = %d, V = %d); "
                         "use the cpu backend for larger heads", fn, a->head_dim_k > KDA_BWD_MAX_HEAD_DIM ? "head_dim_k" : "head_dim_v",
                         KDA_BWD_MAX_HEAD_DIM, a->head_dim_k, a->head_dim_v);
    if (strncmp(fn, "kda_backward", 12) == 0 && !kda_bwd_supports(kc, vc))
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'head_dim_k': no CUDA backward configuration for K = %d, "
                         "V = %d (classes %d, %d)", fn, a->head_dim_k, a->head_dim_v, kc, vc);
    if (a->chunk_states && a->head_dim_k > KDA_BWD_TILE)
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'chunk_states': the CUDA backend writes it for K <= %d "
                         "(K = %d); use the cpu backend for larger heads", fn, KDA_BWD_TILE, a->head_dim_k);
    if (!kda_cuda_find_config(kc, vc))
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'head_dim_k': no CUDA kernel configuration for K = %d, "
                         "V = %d (classes %d, %d)", fn, a->head_dim_k, a->head_dim_v, kc, vc);
    const void *ptrs[5] = {a->q, a->k, a->v, a->g, a->o};
    const char *names[5] = {"q", "k", "v", "g", "o"};
    for (int i = 0; i < 5; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0)
            return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument '%s': the CUDA backend needs 16-byte aligned "
                             "tensors", fn, names[i]);
    return KDA_STATUS_SUCCESS;
}

static kda_status_t cuda_saved_size(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = saved_bytes((const cuda_impl_t *)ctx->impl, p);
    return KDA_STATUS_SUCCESS;
}


static kda_status_t cuda_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    const cuda_impl_t *impl = (const cuda_impl_t *)ctx->impl;
    *bytes = 256 + meta_bytes(p) + ws_blocks_bytes(impl, p) + cp_bytes(p, cp_capacity(ctx, p)) +
             kda_cuda_claim_bytes(p);
    return KDA_STATUS_SUCCESS;
}


/* chunk_states: S before every chunk, by the recurrence kernel in KDA_REC_STATES mode over the prep's blocks (no O
 * products), into the caller's tensor. It runs before the forward's own recurrence, which may overwrite an
 * in-place initial state; whole sequences, whatever the CP split of the forward. */
static int chunk_states_pass(const cuda_impl_t *impl, const kda_problem_t *p, const kda_cuda_config_t *cfg,
                             const kda_rec_params_t *fwd, int device, void *stream) {
    kda_rec_params_t rp = *fwd;
    rp.chunk_states = NULL;
    rp.states_bf16 = NULL;
    rp.states_out = p->a.chunk_states;
    rp.states_out_dtype = (int)p->a.chunk_states_dtype;
    return launch_rec_states(impl, p, cfg, &rp, device, stream);
}


static kda_status_t cuda_run(kda_context_t *ctx, const kda_problem_t *p, void *ws, void *stream, const char *fn) {
    const cuda_impl_t *impl = (const cuda_impl_t *)ctx->impl;
    const kda_args_t *a = &p->a;
    const int K = a->head_dim_k, V = a->head_dim_v;
    const int kc = kda_cuda_size_class(K), vc = kda_cuda_size_class(V);
    const kda_cuda_config_t *cfg = kda_cuda_find_config(kc, vc); /* non-NULL: cuda_supports checked it */
    kda_tuning_t tune = ctx->tuning;
#ifdef KDA_DEV_BUILD
    if (!tune.bv) tune.bv = dev_tuning.bv;
    if (!tune.rec_mma) tune.rec_mma = dev_tuning.rec_mma;
    if (!tune.stages) tune.stages = dev_tuning.stages;
    if (!tune.dev_skip) tune.dev_skip = dev_tuning.dev_skip;
#else
    tune.dev_skip = 0;
#endif

    unsigned char *base = (unsigned char *)(((uintptr_t)ws + 255) & ~(uintptr_t)255);
    kda_prep_params_t pp;
    fill_prep_params(impl, p, base, tune.dev_skip, &pp);
    const kda_cuda_seqs_t seqs = pp.seqs;
    const kda_cuda_blocks_t blocks = pp.blocks;

    kda_rec_params_t rp;
    memset(&rp, 0, sizeof rp);
    rp.seqs = seqs;
    rp.blocks = blocks;
    rp.o = a->o;
    rp.h0 = a->initial_state;
    rp.ht = a->final_state;
    rp.state_indices = a->state_indices;
    rp.num_state_slots = a->num_state_slots;
    /* slot ownership (slots.cu) at the workspace's end */
    const kda_cp_capacity_t cap = cp_capacity(ctx, p);
    kda_claim_params_t cl = {a->state_indices, p->num_seqs, 1, 1, a->num_state_slots, NULL};
    if (kda_cuda_claim_bytes(p) > 0)
        cl.claim = (int32_t *)(base + meta_bytes(p) + ws_blocks_bytes(impl, p) + cp_bytes(p, cap));
    rp.claim = cl.claim;
    rp.o_dtype = (int)a->o_dtype;
    rp.h0_dtype = (int)a->initial_state_dtype;
    rp.ht_dtype = (int)a->final_state_dtype;
    rp.hv = a->num_v_heads;
    rp.K = K;
    rp.V = V;
    rp.v_first = a->state_v_first != 0;
    rp.states_bf16 = saved_states(impl, p); /* S for the backward, written as the recurrence (or CP's pieces) passes */
    /* intra-card CP: when a split is possible, the pieces' launches replace the recurrence's */
    if (cap.slots > 0) { /* the pieces' recurrence: the widest tiles (the split made the CTAs); M's columns come in
                            tiles of the same width, so no wider than the K class */
        rp.bv = vc < 128 ? vc : 128;
        if (kc < rp.bv) rp.bv = kc;
    } else {
        rp.bv = choose_bv(impl, p, vc);
        if ((tune.bv == 32 || tune.bv == 64 || tune.bv == 128) && tune.bv <= vc) rp.bv = tune.bv;
    }
    rp.stages = cfg->rec_smem(&rp, 3) <= KDA_REC_SMEM_MAX ? 3 : 2;
    if (tune.stages == 2) rp.stages = 2;
    rp.wgmma = impl->major == 9 && rp.bv >= 64 && cfg->rec_wgmma && !tune.rec_mma;
    rp.dev_skip = tune.dev_skip;

    kda_cp_params_t cpp;
    memset(&cpp, 0, sizeof cpp);
    if (cap.slots > 0) {
        fill_cp_params(impl, p, cap, 1, base + meta_bytes(p) + ws_blocks_bytes(impl, p), &seqs, &cpp);
        int64_t *maps = saved_maps(impl, p);
        if (maps) { /* the plan records its piece length, the pre-scan writes M for the backward */
            cpp.maps_mode = 1;
            cpp.maps_header = maps;
            rp.cp_maps = (float *)(maps + 32);
        }
        rp.cp_table = cpp.table;
        rp.cp_header = cpp.header;
        rp.cp_slots = cpp.slots;
        rp.cp_capacity = cap.pieces;
        rp.cp_capacity_slots = cap.slots;
    }
    pp.plan = cap.slots > 0;
    pp.cp = cpp;

    if (blocks.max_chunks * a->num_v_heads >= ((int64_t)1 << 31) ||
        p->num_seqs * a->num_v_heads * (vc / 32) >= ((int64_t)1 << 31) ||
        cap.pieces * a->num_v_heads * (kc / 64 + vc / 32) >= ((int64_t)1 << 31) ||
        cap.slots * a->num_v_heads * (kc / 32 + vc / 32) >= ((int64_t)1 << 31)) /* the pre-scan's grid, by slots */
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'seq_len': %lld tokens of %d heads exceed one launch",
                         fn, (long long)p->num_tokens, a->num_v_heads);

    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != ctx->device) e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess) return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    int err = 0;
    const char *stage = "";
    if (p->varlen && (err = kda_cuda_launch_meta(&seqs, stream)) != 0) stage = "meta";
    else if ((err = kda_cuda_launch_claim(&cl, stream)) != 0) stage = "slot ownership";
    /* the CP plan reads only the lengths: CTA 0 of the prep kernel makes it beside the chunks (its own kernel
       before prep sat on the chain before the pre-scan, ~8 µs on the H200; after prep, ~9 µs); a kernel of its own
       only when prep does not run */
    else if (cap.slots != 0 && (tune.dev_skip & 8) && (err = kda_cuda_launch_cp_plan(&cpp, stream)) != 0)
        stage = "CP plan";
    else if (!(tune.dev_skip & 8) && (err = cfg->prep(&pp, ctx->device, stream)) != 0) stage = "prep";
    else if (a->chunk_states && (err = chunk_states_pass(impl, p, cfg, &rp, ctx->device, stream)) != 0)
        stage = "chunk states";
    else if (cap.slots == 0) {
        if (!(tune.dev_skip & 16) && (err = cfg->rec(&rp, ctx->device, stream)) != 0) stage = "recurrence";
    } else if ((rp.mode = KDA_REC_PRESCAN, err = cfg->rec(&rp, ctx->device, stream)) != 0) {
        stage = "CP pre-scan";
    } else if ((err = kda_cuda_launch_cp_merge(&cpp, ctx->device, stream)) != 0) {
        stage = "CP merge";
    } else if ((rp.mode = KDA_REC_PIECES, err = cfg->rec(&rp, ctx->device, stream)) != 0) {
        stage = "CP pieces";
    }
    if (prev >= 0 && prev != ctx->device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the %s kernel: %s", fn, stage,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}

/* The decode kernel's workspace is the slot-ownership array alone (256-aligned within it), or nothing */
static size_t decode_ws_bytes(const kda_problem_t *p) {
    const size_t b = kda_cuda_claim_bytes(p);
    return b ? b + 256 : 0;
}
static int32_t *decode_claim(const kda_problem_t *p, void *ws) {
    return kda_cuda_claim_bytes(p) ? (int32_t *)(((uintptr_t)ws + 255) & ~(uintptr_t)255) : NULL;
}

static kda_status_t cuda_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    if (kda_cuda_decode_fits(p, 0)) /* headwise β, 2-D state_indices: only the recurrent kernel has them */
        return kda_cuda_decode_run(p, ctx->device, ((const cuda_impl_t *)ctx->impl)->sm_count, &ctx->tuning,
                                   decode_claim(p, ws), stream, "kda_forward");
    return cuda_run(ctx, p, ws, stream, "kda_forward");
}

/* Decode: the recurrent kernel (decode.cu) for short sequences, the chunked kernels for long ones. */
static kda_status_t cuda_decode(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    if (kda_cuda_decode_fits(p, 1))
        return kda_cuda_decode_run(p, ctx->device, ((const cuda_impl_t *)ctx->impl)->sm_count, &ctx->tuning,
                                   decode_claim(p, ws), stream, "kda_decode");
    return cuda_run(ctx, p, ws, stream, "kda_decode");
}

static kda_status_t cuda_forward_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    if (kda_cuda_decode_fits(p, 0)) return *bytes = decode_ws_bytes(p), KDA_STATUS_SUCCESS;
    return cuda_workspace(ctx, p, bytes);
}

static kda_status_t cuda_decode_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    if (kda_cuda_decode_fits(p, 1)) return *bytes = decode_ws_bytes(p), KDA_STATUS_SUCCESS;
    return cuda_workspace(ctx, p, bytes);
}

const kda_backend_ops_t kda_cuda_ops = {
    .name = "cuda",
    .forward_workspace = cuda_forward_workspace,
    .forward = cuda_forward,
    .decode_workspace = cuda_decode_workspace,
    .decode = cuda_decode,
    .supports = cuda_supports,
    .destroy = cuda_destroy,
    .saved_size = cuda_saved_size,
    .backward_workspace = cuda_backward_workspace,
    .backward = cuda_backward,
};
