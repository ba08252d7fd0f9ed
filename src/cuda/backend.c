/*
 * The CUDA backend, host side (C): device checks, workspace layout, the choice of the recurrence tiling, and
 * the launches of the stages (kda_cuda.h) on the caller's stream. Nothing here synchronises with the device
 * or allocates: varlen scheduling is computed on the device (meta.cu), so kda_forward can be captured in a
 * CUDA graph.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "kda_cuda.h"

typedef struct {
    int sm_count;
    int major, minor;
    char name[128];
} cuda_impl_t;

static void cuda_destroy(kda_context_t *ctx) {
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
    ctx->impl = impl;
    ctx->num_threads = 0;
    return KDA_STATUS_SUCCESS;
}

static kda_status_t cuda_supports(const kda_context_t *ctx, const kda_problem_t *p, const char *fn) {
    (void)ctx;
    const kda_args_t *a = &p->a;
    if (a->head_dim_k != a->head_dim_v || (a->head_dim_k != 64 && a->head_dim_k != 128))
        return kda_error(KDA_STATUS_NOT_SUPPORTED,
                         "%s: argument 'head_dim_k': the CUDA backend supports K = V = 64 or 128 (got K = %d, "
                         "V = %d); use the CPU backend for other sizes",
                         fn, a->head_dim_k, a->head_dim_v);
    const void *ptrs[5] = {a->q, a->k, a->v, a->g, a->o};
    const char *names[5] = {"q", "k", "v", "g", "o"};
    for (int i = 0; i < 5; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0)
            return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument '%s': the CUDA backend needs 16-byte aligned "
                             "tensors", fn, names[i]);
    return KDA_STATUS_SUCCESS;
}

/* Upper bound of the number of chunks: Σ ceil(len/64) ≤ (T + 63 N) / 64 for varlen. */
static int64_t max_chunks(const kda_problem_t *p) {
    if (p->varlen) return (p->a.seq_len + 63 * p->num_seqs) / 64;
    return p->a.batch * ((p->a.seq_len + 63) / 64);
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

static size_t meta_bytes(const kda_problem_t *p) {
    return p->varlen ? align256((size_t)(p->num_seqs + 1) * sizeof(int32_t)) : 0;
}

static kda_status_t cuda_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    (void)ctx;
    *bytes = 256 + meta_bytes(p) + (size_t)max_chunks(p) * (size_t)p->a.num_v_heads *
                                       (size_t)kda_cuda_block_bytes(p->a.head_dim_k);
    return KDA_STATUS_SUCCESS;
}

/* Columns of the state per recurrence CTA: the widest tile that still gives ~80% of the SMs a CTA. */
static int choose_bv(const cuda_impl_t *impl, const kda_problem_t *p) {
    const int kd = p->a.head_dim_k;
    const int64_t heads = p->num_seqs * p->a.num_v_heads;
    for (int bv = kd; bv >= 32; bv /= 2)
        if (heads * (kd / bv) * 5 >= (int64_t)impl->sm_count * 4) return bv;
    return 32;
}

static kda_status_t cuda_run(kda_context_t *ctx, const kda_problem_t *p, void *ws, void *stream, const char *fn) {
    const cuda_impl_t *impl = (const cuda_impl_t *)ctx->impl;
    const kda_args_t *a = &p->a;
    kda_cuda_params_t c;
    memset(&c, 0, sizeof c);
    c.q = a->q;
    c.k = a->k;
    c.v = a->v;
    c.g = a->g;
    c.beta = a->beta;
    c.o = a->o;
    c.h0 = a->initial_state;
    c.ht = a->final_state;
    c.A_log = a->use_gate_in_kernel ? a->A_log : NULL;
    c.dt_bias = a->use_gate_in_kernel ? a->dt_bias : NULL;
    c.cu_seqlens = a->cu_seqlens;
    c.cu_seqlens_64 = a->cu_seqlens_dtype == KDA_INT64;
    c.state_indices = a->state_indices;
    c.num_state_slots = a->num_state_slots;
    c.dtype = (int)a->dtype;
    c.g_dtype = (int)a->g_dtype;
    c.beta_dtype = (int)a->beta_dtype;
    c.o_dtype = (int)a->o_dtype;
    c.h0_dtype = (int)a->initial_state_dtype;
    c.ht_dtype = (int)a->final_state_dtype;
    c.num_tokens = p->num_tokens;
    c.seq_len = a->seq_len;
    c.num_seqs = p->num_seqs;
    c.hqk = a->num_qk_heads;
    c.hv = a->num_v_heads;
    c.group = p->group;
    c.kd = a->head_dim_k;
    c.scale = p->scale;
    c.lower_bound = p->has_lower_bound ? a->lower_bound : 0.0f;
    c.l2norm = a->use_qk_l2norm != 0;
    c.gate_in_kernel = a->use_gate_in_kernel != 0;
    c.beta_sigmoid = a->use_beta_sigmoid != 0;
    c.neg_eigval = a->allow_neg_eigval != 0;
    c.v_first = a->state_v_first != 0;
    c.max_chunks = max_chunks(p);
    c.block_bytes = kda_cuda_block_bytes(c.kd);
    c.chunks_per_row = (a->seq_len + 63) / 64;
    c.device = ctx->device;
    c.bv = choose_bv(impl, p);
    const char *skip = getenv("KDA_DEV_SKIP");
    c.dev_skip = skip ? atoi(skip) : 0;
    const char *bv = getenv("KDA_DEV_BV");
    if (bv && (atoi(bv) == 32 || atoi(bv) == 64 || atoi(bv) == 128) && atoi(bv) <= c.kd) c.bv = atoi(bv);
    kda_cuda_recurrence_smem(&c);
    c.rec_wgmma = impl->major == 9 && c.bv >= 64 && !getenv("KDA_DEV_REC_MMA"); /* development: A/B the two */
    const char *nst = getenv("KDA_DEV_STAGES");
    if (nst && atoi(nst) == 2) c.rec_stages = 2;
    if (c.max_chunks * c.hv >= ((int64_t)1 << 31) || p->num_seqs * c.hv * (c.kd / 32) >= ((int64_t)1 << 31))
        return kda_error(KDA_STATUS_NOT_SUPPORTED, "%s: argument 'seq_len': %lld tokens of %d heads exceed one launch",
                         fn, (long long)p->num_tokens, c.hv);

    unsigned char *base = (unsigned char *)(((uintptr_t)ws + 255) & ~(uintptr_t)255);
    c.chunk_offsets = p->varlen ? (int32_t *)base : NULL;
    c.blocks = base + meta_bytes(p);

    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != ctx->device) e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess) return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    int err = 0;
    const char *stage = "";
    if (p->varlen && (err = kda_cuda_launch_meta(&c, stream)) != 0) stage = "meta";
    else if (!(c.dev_skip & 8) && (err = kda_cuda_launch_prep(&c, stream)) != 0) stage = "prep";
    else if (!(c.dev_skip & 16) && (err = kda_cuda_launch_recurrence(&c, stream)) != 0) stage = "recurrence";
    if (prev >= 0 && prev != ctx->device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the %s kernel: %s", fn, stage,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}

static kda_status_t cuda_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    return cuda_run(ctx, p, ws, stream, "kda_forward");
}

/* Decode runs the chunked kernels too (a chunk may hold one token): same results, same state pools. */
static kda_status_t cuda_decode(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes, void *stream) {
    (void)ws_bytes;
    return cuda_run(ctx, p, ws, stream, "kda_decode");
}

const kda_backend_ops_t kda_cuda_ops = {
    .name = "cuda",
    .forward_workspace = cuda_workspace,
    .forward = cuda_forward,
    .decode_workspace = cuda_workspace,
    .decode = cuda_decode,
    .supports = cuda_supports,
    .destroy = cuda_destroy,
};
