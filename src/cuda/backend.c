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
#include "cp.h"
#include "decode.h"
#include "fwd.h"
#include "layout.h"
#include "xcp.h"

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
#define KDA_REC_CONFIG(K, WG)                                                                                          \
    int kda_rec_launch_k##K(const kda_rec_params_t *p, int device, void *stream);                                      \
    int kda_rec_smem_k##K(const kda_rec_params_t *p, int stages);                                                      \
    enum { kda_rec_wgmma_k##K = WG };
#define KDA_CONFIG(K, V) int kda_prep_launch_k##K##_v##V(const kda_prep_params_t *p, int device, void *stream);
#include "configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG

static const kda_cuda_config_t configs[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)                                                                                               \
    {K, V, kda_rec_wgmma_k##K, kda_prep_launch_k##K##_v##V, kda_rec_launch_k##K, kda_rec_smem_k##K},
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
    /* the recurrent kernel (decode/) takes any K, V in [1, 256] and any alignment */
    if (kda_cuda_decode_fits(p, strncmp(fn, "kda_decode", 10) == 0)) return KDA_STATUS_SUCCESS;
    const int kc = kda_cuda_size_class(a->head_dim_k), vc = kda_cuda_size_class(a->head_dim_v);
    if (strncmp(fn, "kda_backward", 12) == 0 &&
        (a->head_dim_k > KDA_BWD_MAX_HEAD_DIM || a->head_dim_v > KDA_BWD_MAX_HEAD_DIM))
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument '%s': the CUDA backward takes K, V <= %d (K = %d, V = %d); "
                         "use the cpu backend for larger heads",
                         fn, a->head_dim_k > KDA_BWD_MAX_HEAD_DIM ? "head_dim_k" : "head_dim_v", KDA_BWD_MAX_HEAD_DIM,
                         a->head_dim_k, a->head_dim_v);
    if (strncmp(fn, "kda_backward", 12) == 0 && !kda_bwd_supports(kc, vc))
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'head_dim_k': no CUDA backward configuration for K = %d, "
                         "V = %d (classes %d, %d)",
                         fn, a->head_dim_k, a->head_dim_v, kc, vc);
    if (a->chunk_states && a->head_dim_k > KDA_BWD_TILE)
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'chunk_states': the CUDA backend writes it for K <= %d "
                         "(K = %d); use the cpu backend for larger heads",
                         fn, KDA_BWD_TILE, a->head_dim_k);
    if (!kda_cuda_find_config(kc, vc))
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'head_dim_k': no CUDA kernel configuration for K = %d, "
                         "V = %d (classes %d, %d)",
                         fn, a->head_dim_k, a->head_dim_v, kc, vc);
    if (a->cp_num_ranks > 0 && a->cp_summary_dtype != KDA_FLOAT32)
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'cp_summary_dtype': the CUDA backend's cross-rank CP summaries are float32", fn);
    const void *ptrs[5] = {a->q, a->k, a->v, a->g, a->o};
    const char *names[5] = {"q", "k", "v", "g", "o"};
    for (int i = 0; i < 5; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0)
            return kda_error(KDA_STATUS_NOT_SUPPORTED,
                             "%s: argument '%s': the CUDA backend needs 16-byte aligned "
                             "tensors",
                             fn, names[i]);
    return KDA_STATUS_SUCCESS;
}

static kda_status_t cuda_saved_size(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = saved_bytes((const cuda_impl_t *)ctx->impl, p);
    return KDA_STATUS_SUCCESS;
}

static kda_status_t cuda_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    const cuda_impl_t *impl = (const cuda_impl_t *)ctx->impl;
    *bytes = 256 + meta_bytes(p) + ws_blocks_bytes(impl, p) + cp_bytes(p, cp_capacity(ctx, p)) +
             kda_cuda_claim_bytes(p) + kda_cuda_xcp_fold_bytes(p, 0) + kda_cuda_xcp_prefix_bytes(impl, p);
    return KDA_STATUS_SUCCESS;
}
/* The forward's chunked path: the workspace regions of this call, then its launches (fwd/launch.c); primed: cross-rank
 * CP's primed path (xcp.h), 1 the summary's part into `summary`, 2 the forward's, over np pieces
 * (kda_cuda_xcp_primed_pieces) */
static kda_status_t cuda_run(kda_context_t *ctx, const kda_problem_t *p, void *ws, void *stream, const char *fn,
                             int primed, int64_t np, void *summary) {
    const cuda_impl_t *impl = (const cuda_impl_t *)ctx->impl;
    kda_fwd_launch_t l;
    memset(&l, 0, sizeof l);
    l.p = p;
    l.tune = ctx->tuning;
#ifdef KDA_DEV_BUILD
    if (!l.tune.bv) l.tune.bv = dev_tuning.bv;
    if (!l.tune.rec_mma) l.tune.rec_mma = dev_tuning.rec_mma;
    if (!l.tune.stages) l.tune.stages = dev_tuning.stages;
    if (!l.tune.dev_skip) l.tune.dev_skip = dev_tuning.dev_skip;
#else
    l.tune.dev_skip = 0;
#endif
    unsigned char *base = (unsigned char *)(((uintptr_t)ws + 255) & ~(uintptr_t)255);
    kda_cuda_problem_fill(&l.pb, p, (int32_t *)base);
    l.cfg = kda_cuda_find_config(l.pb.kc, l.pb.vc); /* non-NULL: cuda_supports checked it */
    l.blocks = call_blocks(impl, p, base);
    /* after the blocks: the CP region, slot ownership (slots.cu), the cross-rank fold, the primed prefix maps
       (cuda_workspace's order) */
    l.cap = cp_capacity(ctx, p);
    l.cp_base = base + meta_bytes(p) + ws_blocks_bytes(impl, p);
    unsigned char *claim = l.cp_base + cp_bytes(p, l.cap), *fold = claim + kda_cuda_claim_bytes(p);
    l.claim = fold > claim ? (int32_t *)claim : NULL;
    kda_cuda_xcp_fold_places(p, fold, &l.fold, NULL);
    l.pb.h0_first = l.fold;
    if (primed) {
        unsigned char *pre = fold + kda_cuda_xcp_fold_bytes(p, 0);
        l.prefix = (float *)(((uintptr_t)pre + 255) & ~(uintptr_t)255);
        l.primed = primed;
        l.primed_np = np;
        l.summary = (float *)summary;
    }
    l.states_bf16 = saved_states(impl, p);
    l.maps = saved_maps(impl, p);
    l.sm_count = impl->sm_count;
    l.major = impl->major;
    return kda_fwd_run(&l, ctx->device, stream, fn);
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
    cuda_impl_t *impl = (cuda_impl_t *)ctx->impl;
    if (kda_cuda_decode_fits(p, 0)) { /* headwise β, 2-D state_indices: only the recurrent kernel has them */
        kda_cuda_primed_forget(impl, ws);
        return kda_cuda_decode_run(p, ctx->device, impl->sm_count, &ctx->tuning, decode_claim(p, ws), stream,
                                   "kda_forward");
    }
    const int64_t np = kda_cuda_xcp_primed_pieces(impl, p);
    if (np) { /* the summary's work must be in this workspace, for these arguments */
        if (!kda_cuda_primed_take(impl, ws, kda_cuda_xcp_primed_key(p, ws)))
            return kda_error(KDA_STATUS_INVALID_VALUE,
                             "kda_forward: argument 'cp_primed': 1, but no kda_cp_forward_summary with cp_primed on "
                             "these arguments and this workspace came before it on this context");
        return cuda_run(ctx, p, ws, stream, "kda_forward", 2, np, NULL);
    }
    kda_cuda_primed_forget(impl, ws);
    return cuda_run(ctx, p, ws, stream, "kda_forward", 0, 0, NULL);
}

/* (under the lock) the key in place i freed */
static void primed_free(cuda_impl_t *impl, int i) {
    impl->primed_keys[i] = 0, impl->primed_ws[i] = NULL;
    __atomic_store_n(&impl->primed_held, impl->primed_held - 1, __ATOMIC_RELEASE);
}

void kda_cuda_primed_forget(cuda_impl_t *impl, const void *ws) {
    if (!ws || __atomic_load_n(&impl->primed_held, __ATOMIC_ACQUIRE) == 0) return; /* no pair anywhere */
    pthread_mutex_lock(&impl->lock);
    for (int i = 0; i < KDA_CUDA_PRIMED_KEYS; i++)
        if (impl->primed_ws[i] == ws) primed_free(impl, i);
    pthread_mutex_unlock(&impl->lock);
}

void kda_cuda_primed_remember(cuda_impl_t *impl, const void *ws, uint64_t key) {
    kda_cuda_primed_forget(impl, ws);
    pthread_mutex_lock(&impl->lock);
    if (impl->primed_ws[impl->primed_next]) primed_free(impl, impl->primed_next); /* the oldest place */
    impl->primed_keys[impl->primed_next] = key;
    impl->primed_ws[impl->primed_next] = ws;
    __atomic_store_n(&impl->primed_held, impl->primed_held + 1, __ATOMIC_RELEASE);
    impl->primed_next = (impl->primed_next + 1) % KDA_CUDA_PRIMED_KEYS;
    pthread_mutex_unlock(&impl->lock);
}

int kda_cuda_primed_take(cuda_impl_t *impl, const void *ws, uint64_t key) {
    int match = 0;
    pthread_mutex_lock(&impl->lock);
    for (int i = 0; i < KDA_CUDA_PRIMED_KEYS && !match; i++)
        if (impl->primed_ws[i] == ws && impl->primed_keys[i] == key) {
            primed_free(impl, i); /* one summary primes one forward */
            match = 1;
        }
    pthread_mutex_unlock(&impl->lock);
    return match;
}

/* Cross-rank CP's summaries: the forward's primed one where it applies (xcp.h), else the passes of xcp/launch.c */
static kda_status_t cuda_summary_workspace(const kda_context_t *ctx, const kda_problem_t *p,
                                           const kda_bwd_problem_t *bp, size_t *bytes) {
    if (!bp && kda_cuda_xcp_primed_pieces((const cuda_impl_t *)ctx->impl, p)) return cuda_workspace(ctx, p, bytes);
    return kda_cuda_xcp_summary_workspace(ctx, p, bp, bytes);
}

static kda_status_t cuda_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, void *summary,
                                 void *ws, size_t ws_bytes, void *stream) {
    cuda_impl_t *impl = (cuda_impl_t *)ctx->impl;
    kda_cuda_primed_forget(impl, ws);
    const int64_t np = bp ? 0 : kda_cuda_xcp_primed_pieces(impl, p);
    if (!np) return kda_cuda_xcp_summary(ctx, p, bp, summary, ws, ws_bytes, stream);
    const kda_status_t st = cuda_run(ctx, p, ws, stream, "kda_cp_forward_summary", 1, np, summary);
    if (st == KDA_STATUS_SUCCESS) kda_cuda_primed_remember(impl, ws, kda_cuda_xcp_primed_key(p, ws));
    return st;
}

/* Decode: the recurrent kernel (decode/) for short sequences, the chunked kernels for long ones. */
static kda_status_t cuda_decode(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    kda_cuda_primed_forget((cuda_impl_t *)ctx->impl, ws);
    if (kda_cuda_decode_fits(p, 1))
        return kda_cuda_decode_run(p, ctx->device, ((const cuda_impl_t *)ctx->impl)->sm_count, &ctx->tuning,
                                   decode_claim(p, ws), stream, "kda_decode");
    return cuda_run(ctx, p, ws, stream, "kda_decode", 0, 0, NULL);
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
    .cp_device_summary_workspace = cuda_summary_workspace,
    .cp_device_summary = cuda_summary,
};
