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

#include <pthread.h>

#include "internal.h"
#include "bwd.h"
#include "cp.h"
#include "decode.h"
#include "fwd.h"
#include "kda_cuda.h"

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
} cuda_impl_t;

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

/* Upper bound of the number of chunks: Σ ceil(len/C) ≤ (T + (C−1) N) / C for varlen. */
static int64_t max_chunks(const kda_problem_t *p) {
    if (p->varlen) return (p->a.seq_len + (KDA_CHUNK - 1) * p->num_seqs) / KDA_CHUNK;
    return p->a.batch * ((p->a.seq_len + KDA_CHUNK - 1) / KDA_CHUNK);
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

static size_t meta_bytes(const kda_problem_t *p) {
    return p->varlen ? align256((size_t)(p->num_seqs + 1) * sizeof(int32_t)) : 0;
}

/* The backward's state-gradient chain takes the same plan (bwd_dstate.cu's CP modes, run last piece first) with
 * twice the tiles: its pre-scan runs each piece's M columns beside its E columns, each as long a chain as the
 * piece, and the split aims at one pre-scan CTA per SM, counting a sequence's 2n − 3 pre-scan chains of n pieces
 * (kda_cp_problem_t.prescan_pairs; B1 T32768 H16 on 132 SMs: 5 pieces of 103 chunks, 112 pre-scan CTAs and 80
 * piece CTAs of 103 steps against 32 CTAs of 512) */
#define KDA_BWD_CP_TILES 2

/* Intra-card context parallelism (docs/ALGORITHM.md §4, src/cp_plan.h): the capacity the workspace holds for
 * this problem. Zero slots: no sequence can be split, and kda_forward launches exactly what it did before CP
 * existed. The lengths are exact with equal rows or cu_seqlens_host, else bounded from num_tokens; the plan itself
 * is made on the device (cp_plan.cu) from the lengths it holds, within this capacity. */
static kda_cp_capacity_t cp_capacity_tiles(const cuda_impl_t *impl, const kda_problem_t *p, int tiles_factor) {
    kda_cp_problem_t cp;
    const int known = kda_cp_problem_from(p, impl->sm_count, p->a.cu_seqlens_host, &cp);
    cp.v_tiles *= tiles_factor;
    cp.prescan_pairs = tiles_factor == KDA_BWD_CP_TILES;
    return kda_cp_capacity(&cp, known);
}
static kda_cp_capacity_t cp_capacity(const kda_context_t *ctx, const kda_problem_t *p) {
    return cp_capacity_tiles((const cuda_impl_t *)ctx->impl, p, 1);
}
/* The backward chain's own capacity: slots > 0 where its chain may split (then the forward keeps S, and its maps) */
static kda_cp_capacity_t bwd_own_capacity(const cuda_impl_t *impl, const kda_problem_t *p) {
    return cp_capacity_tiles(impl, p, KDA_BWD_CP_TILES);
}
static int keeps_maps(const cuda_impl_t *impl, const kda_problem_t *p);
static int uses_saved(const kda_problem_t *p);
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

/* The CP region after the blocks: a 256-byte header ([0] pieces, [1] P, [2] slots), the piece table, the slots. */
static size_t cp_bytes(const kda_problem_t *p, kda_cp_capacity_t cap) {
    if (cap.slots == 0) return 0;
    const int kc = kda_cuda_size_class(p->a.head_dim_k), vc = kda_cuda_size_class(p->a.head_dim_v);
    return 256 + (size_t)kda_cp_workspace_bytes(cap, p->a.num_v_heads, kc, vc);
}

/* bwd.h kda_bwd_params_t.split: bf16 inputs take the split stage 3 (and its Δ region). fp16 inputs take the fp32
 * recomputation as fp32 ones do: the split's bf16 tiles round fp16's 10-bit dO and S to 7 bits, and on FLA's
 * test_chunk_varlen fp16 case that puts dq, dk, dh0 at 4-6x FLA's errors and ddt_bias above its bar */
static int bwd_split(const kda_problem_t *p) { return p->a.dtype == KDA_BFLOAT16; }

/* S at every chunk start in bf16 ([max_chunks][hv][KC][VC]): the split path's states (its products take S in
 * bf16, as the forward's do) */
static size_t states_bf16_bytes(const kda_problem_t *p) {
    const size_t kc = (size_t)kda_cuda_size_class(p->a.head_dim_k), vc = (size_t)kda_cuda_size_class(p->a.head_dim_v);
    return align256((size_t)max_chunks(p) * (size_t)p->a.num_v_heads * kc * vc * 2);
}

/* What kda_forward keeps for the backward (kda_args_t.saved): the chunk blocks, where the forward's prep writes
 * them and the backward's stages read them instead of rerunning the prep; kept for the chunked path with K, V <=
 * KDA_BWD_TILE (class 256: nothing kept yet, the backward reruns the prep). */
static int keeps_blocks(const kda_problem_t *p) {
    return !kda_cuda_decode_fits(p, 0) && p->a.head_dim_k <= KDA_BWD_TILE && p->a.head_dim_v <= KDA_BWD_TILE;
}
static int64_t states_ctas(const cuda_impl_t *impl, const kda_problem_t *p);
/* With bf16 inputs the forward also keeps S at every chunk start in bf16, which its recurrence writes as it
 * passes (+128 bytes per token-head at K = V = 64, +512 at 128), so that the backward runs no states stage —
 * where that stage would take the card: its CTAs fill more than half of the SMs, or the state-gradient chain is
 * split (its pieces then take the card). Otherwise it runs beside the state-gradient stage on the second stream
 * and costs the step nothing, while the forward's writes would cost the forward their bytes. The problem alone
 * decides, so the forward and the backward agree. */
static int keeps_states(const cuda_impl_t *impl, const kda_problem_t *p) {
    return bwd_split(p) && keeps_blocks(p) &&
           (2 * states_ctas(impl, p) > impl->sm_count || bwd_own_capacity(impl, p).slots > 0);
}
/* Where the backward's chain may split (bf16 inputs), the forward also keeps its pre-scan's piece maps: a middle
 * piece's M, which is the chain's Mᵀ (ALGORITHM.md §6), so that the chain, walking the forward's pieces, runs no
 * M of its own (B1 T32768 H16: 112 pre-scan CTAs of E alone over 8 pieces of 64 chunks, against 5 pieces of 103
 * chunks with M beside E). A 256-byte header (the forward's piece length, cp_plan.cu), then KC × KC fp32 per
 * forward slot and value head: +64 KB per piece-head at K = 128, 4 MB per 64 piece-heads. */
static int keeps_maps(const cuda_impl_t *impl, const kda_problem_t *p) {
    return bwd_split(p) && keeps_blocks(p) && bwd_own_capacity(impl, p).slots > 0;
}
/* Fine blocks (kda_cuda.h): QΓ's low part for fp16 and fp32 inputs, whose backward takes the fp32 path (its
 * state-gradient chain reads QΓ as hi + lo); K̃'s low part for K class ≤ 128 wherever a states pass reads the
 * blocks (the recurrence's KDA_REC_STATES mode adds Δᵀ K̃_lo to S; no forward recurrence reads it, so o is the
 * same with and without `saved`, and an inference forward writes none): the backward's own blocks, a chunk_states
 * forward's, and the blocks a forward keeps in saved unless it keeps S as well (keeps_states: the backward then
 * reads the forward's S, made without K̃_lo, and runs no states pass). `kept`: the blocks are (or would be) those
 * kept in saved */
static int fine_for(const cuda_impl_t *impl, const kda_problem_t *p, int kept) {
    const int kt = kda_cuda_size_class(p->a.head_dim_k) <= 128 &&
                   (kept ? !keeps_states(impl, p) : p->bwd || p->a.chunk_states != NULL);
    return (p->a.dtype != KDA_BFLOAT16 ? KDA_FINE_QG : 0) | (kt ? KDA_FINE_KT : 0);
}
static size_t blocks_bytes_fine(const kda_problem_t *p, int fine) {
    const int64_t b = kda_cuda_block_bytes_fine(kda_cuda_size_class(p->a.head_dim_k),
                                                kda_cuda_size_class(p->a.head_dim_v), fine);
    return align256((size_t)max_chunks(p) * (size_t)p->a.num_v_heads * (size_t)b);
}
/* The blocks kept in saved, 256 bytes more for the alignment; 0 where none are kept */
static size_t saved_blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    return keeps_blocks(p) ? 256 + blocks_bytes_fine(p, fine_for(impl, p, 1)) : 0;
}
static size_t saved_maps_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    if (!keeps_maps(impl, p)) return 0;
    const size_t kc = (size_t)kda_cuda_size_class(p->a.head_dim_k);
    return align256(256 + (size_t)cp_capacity_tiles(impl, p, 1).slots * (size_t)p->a.num_v_heads * kc * kc * 4);
}
static size_t saved_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    const size_t b = saved_blocks_bytes(impl, p);
    return b == 0 ? 0 : b + (keeps_states(impl, p) ? states_bf16_bytes(p) : 0) + saved_maps_bytes(impl, p);
}
static kda_status_t cuda_saved_size(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    *bytes = saved_bytes((const cuda_impl_t *)ctx->impl, p);
    return KDA_STATUS_SUCCESS;
}
/* The caller's saved memory holds the blocks (the API checked that saved_bytes is large enough) */
static int uses_saved(const kda_problem_t *p) { return p->a.saved && keeps_blocks(p); }
/* This call's blocks: their fine parts and their bytes (in saved or in the workspace) */
static int fine_blocks(const cuda_impl_t *impl, const kda_problem_t *p) { return fine_for(impl, p, uses_saved(p)); }
static size_t blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    return blocks_bytes_fine(p, fine_blocks(impl, p));
}
static unsigned char *saved_base(const kda_problem_t *p) {
    return (unsigned char *)(((uintptr_t)p->a.saved + 255) & ~(uintptr_t)255);
}
/* The kept bf16 states (after the blocks in saved), or NULL */
static uint16_t *saved_states(const cuda_impl_t *impl, const kda_problem_t *p) {
    return uses_saved(p) && keeps_states(impl, p) ? (uint16_t *)(saved_base(p) + blocks_bytes(impl, p)) : NULL;
}
/* The kept piece maps' header (after the blocks and the states in saved), or NULL; the maps follow it */
static int64_t *saved_maps(const cuda_impl_t *impl, const kda_problem_t *p) {
    if (!uses_saved(p) || !keeps_maps(impl, p)) return NULL;
    return (int64_t *)(saved_base(p) + blocks_bytes(impl, p) + (keeps_states(impl, p) ? states_bf16_bytes(p) : 0));
}
/* The blocks' bytes in the workspace: none when they go to saved */
static size_t ws_blocks_bytes(const cuda_impl_t *impl, const kda_problem_t *p) {
    return uses_saved(p) ? 0 : blocks_bytes(impl, p);
}

static kda_status_t cuda_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes) {
    const cuda_impl_t *impl = (const cuda_impl_t *)ctx->impl;
    *bytes = 256 + meta_bytes(p) + ws_blocks_bytes(impl, p) + cp_bytes(p, cp_capacity(ctx, p)) +
             kda_cuda_claim_bytes(p);
    return KDA_STATUS_SUCCESS;
}

/* The chunk blocks: at `base` after the varlen offsets, or in the caller's saved memory */
static kda_cuda_blocks_t call_blocks(const cuda_impl_t *impl, const kda_problem_t *p, unsigned char *base) {
    const int fine = fine_blocks(impl, p);
    const kda_cuda_blocks_t blocks = {uses_saved(p) ? saved_base(p) : base + meta_bytes(p),
                                      kda_cuda_block_bytes_fine(kda_cuda_size_class(p->a.head_dim_k),
                                                                kda_cuda_size_class(p->a.head_dim_v), fine),
                                      max_chunks(p), fine};
    return blocks;
}

/* The call's problem (its varlen offsets at `base`) and the chunk preparation's params over its blocks: the
 * forward's first stages, which the backward runs too (unless saved) */
static void fill_prep_params(const cuda_impl_t *impl, const kda_problem_t *p, unsigned char *base, int dev_skip,
                             kda_prep_params_t *out) {
    kda_cuda_problem_t pb;
    kda_cuda_problem_fill(&pb, p, (int32_t *)base);
    kda_fwd_prep_params(&pb, call_blocks(impl, p, base), dev_skip, out);
}

#ifdef KDA_DEV_BUILD
/* Development builds only: a process-wide tuning a harness (bench/stages.py) sets through ctypes; a context's
 * own tuning (tests) takes precedence field by field. */
static kda_tuning_t dev_tuning;
KDA_API void kda_dev_set_tuning(int dev_skip, int bv, int rec_mma, int stages) {
    dev_tuning.dev_skip = dev_skip;
    dev_tuning.bv = bv;
    dev_tuning.rec_mma = rec_mma;
    dev_tuning.stages = stages;
}
#endif

/* The state columns per CTA of the recurrence kernel in KDA_REC_STATES mode (its launch and states_ctas) */
static int states_bv(const cuda_impl_t *impl, const kda_problem_t *p) {
    return kda_fwd_choose_bv(p->num_seqs * p->a.num_v_heads, kda_cuda_size_class(p->a.head_dim_v), impl->sm_count);
}
/* The CTAs of the backward's states stage (keeps_states, bwd_overlap) */
static int64_t states_ctas(const cuda_impl_t *impl, const kda_problem_t *p) {
    return p->num_seqs * p->a.num_v_heads * (kda_cuda_size_class(p->a.head_dim_v) / states_bv(impl, p));
}

/* The recurrence kernel in KDA_REC_STATES mode over whole sequences (the backward's stage 1; fwd/launch.c) */
static int launch_rec_states(const cuda_impl_t *impl, const kda_problem_t *p, const kda_cuda_config_t *cfg,
                             kda_rec_params_t *rp, int device, void *stream) {
    return kda_fwd_launch_states(cfg, rp, states_bv(impl, p), impl->major, device, stream);
}

/* The CP region at cpbase (cp_bytes(p, cap) bytes) and the plan's inputs; tiles_factor 1 for the forward,
 * KDA_BWD_CP_TILES for the backward's state-gradient chain (cp/launch.c) */
static void fill_cp_params(const cuda_impl_t *impl, const kda_problem_t *p, kda_cp_capacity_t cap, int tiles_factor,
                           unsigned char *cpbase, const kda_cuda_problem_t *pb, kda_cp_params_t *cpp) {
    kda_cp_fill_params(pb, &p->a, cap, tiles_factor, impl->sm_count, cpbase, cpp);
}

/* The forward's chunked path: the workspace regions of this call, then its launches (fwd/launch.c) */
static kda_status_t cuda_run(kda_context_t *ctx, const kda_problem_t *p, void *ws, void *stream, const char *fn) {
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
    /* the CP region after the blocks, slot ownership (slots.cu) at the workspace's end */
    l.cap = cp_capacity(ctx, p);
    l.cp_base = base + meta_bytes(p) + ws_blocks_bytes(impl, p);
    l.claim = kda_cuda_claim_bytes(p) > 0 ? (int32_t *)(l.cp_base + cp_bytes(p, l.cap)) : NULL;
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
typedef struct {
    size_t blocks, states, dstates, dsexp, delta, dgam, dqk, dcoef, dx, rnorm, part, dbeta, cp, total;
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
    l.dstates = l.states + (!bwd_split(p)            ? align256(heads * kc * vc * 4)
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
    l.total = l.cp + align256(cp_bytes(p, l.cap));
    return l;
}

static kda_status_t cuda_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes) {
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
 * initial-state element poisons its value column as in the forward, ALGORITHM.md §7). Measured on an H100 (dev
 * build, B2 T8192 H32): 0.36 ms against 2.45 for the CUDA-core kernel it replaced (bwd_states.cu, removed),
 * gradients within 2e-5 of it; B1 T32768 H16: 0.84 against 4.14 ms. */
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
    if (saved_states(impl, p)) return 0; /* no states stage */
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

static kda_status_t cuda_backward(kda_context_t *ctx, const kda_bwd_problem_t *bp, void *ws, size_t ws_bytes,
                                  void *stream) {
    (void)ws_bytes;
    const char *fn = "kda_backward";
    const kda_problem_t *p = &bp->f;
    const kda_args_t *a = &p->a;
    const kda_backward_args_t *b = &bp->b;
    cuda_impl_t *impl = (cuda_impl_t *)ctx->impl;
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
    if (pp.blocks.max_chunks * a->num_v_heads * (bw.pb.kc / 32) >= ((int64_t)1 << 31) || /* ≥ the chunk and pairs grids */
        p->num_seqs * a->num_v_heads * (bw.pb.vc / KDA_BWD_BV) >= ((int64_t)1 << 31) ||
        l.cap.slots * a->num_v_heads * (bw.pb.kc / 32 + bw.pb.vc / 32) >= ((int64_t)1 << 31)) /* the CP pre-scan's grid */
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
    if (e != cudaSuccess) return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    int err = 0;
    const char *stage = "";
    if (overlap) pthread_mutex_lock(&impl->lock);
    (void)BWD_MARK(0);
    if (p->varlen && (err = kda_cuda_launch_meta(&bw.pb.seqs, stream)) != 0) stage = "meta";
    else if (ds_cp && (err = kda_cuda_launch_cp_plan(&cpp, stream)) != 0) stage = "CP plan";
    else if (BWD_MARK(1) || (!uses_saved(p) && (err = cfg->prep(&pp, ctx->device, stream)) != 0)) stage = "prep";
    else if (BWD_MARK(2) || (bw.dh0 && a->state_indices &&
             (err = (int)cudaMemsetAsync(bw.dh0, 0, (size_t)a->num_state_slots * (size_t)a->num_v_heads *
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
