/*
 * The CUDA backward's instance tables (C): one entry per KDA_BWD_*_CONFIG row of configs.def, whose instance files
 * CMake generates from the same rows (build/cuda_instances/bwd_*.cu, each expanding the instance macro of its
 * kernel's header: bwd_chunk.cuh, bwd_inter.cuh, bwd_pairs.cuh, bwd_dstate.cuh). The launchers of bwd.h choose an
 * instance by looking its parameters up here, and the supports check (kda_bwd_supports) reads the same tables, so a
 * class that has no row is refused before any launch.
 */
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "bwd.h"

typedef int (*bwd_launch_fn)(const kda_bwd_params_t *p, int device, void *stream);

/* ---------------------------------------------------------------------------------------------------------
 * The tables: the instance launchers declared, then one entry per row
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)
#define KDA_BWD_CHUNK_CONFIG(KC, VC, SPLIT, KSP, NVH)                                                                  \
    int kda_bwd_chunk_k##KC##_v##VC##_s##SPLIT##_c##KSP##_h##NVH(const kda_bwd_params_t *p, int device, void *stream);
#define KDA_BWD_INTER_CONFIG(KC, VC, NVH)                                                                              \
    int kda_bwd_inter_k##KC##_v##VC##_h##NVH(const kda_bwd_params_t *p, int device, void *stream);
#define KDA_BWD_PAIRS_CONFIG(KC, NVH)                                                                                  \
    int kda_bwd_pairs_k##KC##_h##NVH(const kda_bwd_params_t *p, int device, void *stream);
#define KDA_BWD_DSTATE_CONFIG(KC, BV)                                                                                  \
    int kda_bwd_dstate_k##KC##_b##BV(const kda_bwd_params_t *p, int device, void *stream);
#define KDA_BWD_DSTATE_REC_CONFIG(KC, BV, WG, CP)                                                                      \
    int kda_bwd_dstate_rec_k##KC##_b##BV##_w##WG(const kda_bwd_params_t *p, int device, void *stream);
#include "../configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG

/* the chunk kernel's rows by class (kc, vc) = (KC · KSP, VC · NVH) and path */
static const struct {
    int kc, vc, split;
    bwd_launch_fn fn;
} chunk_rows[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)
#define KDA_BWD_CHUNK_CONFIG(KC, VC, SPLIT, KSP, NVH)                                                                  \
    {KC * KSP, VC * NVH, SPLIT, kda_bwd_chunk_k##KC##_v##VC##_s##SPLIT##_c##KSP##_h##NVH},
#include "../configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG
};
/* the inter kernel's by class (KC, VC · NVH) */
static const struct {
    int kc, vc;
    bwd_launch_fn fn;
} inter_rows[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)
#define KDA_BWD_INTER_CONFIG(KC, VC, NVH) {KC, VC * NVH, kda_bwd_inter_k##KC##_v##VC##_h##NVH},
#include "../configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG
};
/* the pairs kernel's by K class and V halves */
static const struct {
    int kc, nvh;
    bwd_launch_fn fn;
} pairs_rows[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)
#define KDA_BWD_PAIRS_CONFIG(KC, NVH) {KC, NVH, kda_bwd_pairs_k##KC##_h##NVH},
#include "../configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG
};
/* the dstate kernels' by K class and tile width: the fallback, the recurrence kernel (wg: by wgmma; cp: with the
   CP modes) */
static const struct {
    int kc, bv;
    bwd_launch_fn fn;
} dstate_rows[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)
#define KDA_BWD_DSTATE_CONFIG(KC, BV) {KC, BV, kda_bwd_dstate_k##KC##_b##BV},
#include "../configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG
};
static const struct {
    int kc, bv, wg, cp;
    bwd_launch_fn fn;
} dstate_rec_rows[] = {
#define KDA_REC_CONFIG(K, WG)
#define KDA_CONFIG(K, V)
#define KDA_BWD_DSTATE_REC_CONFIG(KC, BV, WG, CP) {KC, BV, WG, CP, kda_bwd_dstate_rec_k##KC##_b##BV##_w##WG},
#include "../configs.def"
#undef KDA_REC_CONFIG
#undef KDA_CONFIG
};
#define ROWS(t) (sizeof(t) / sizeof((t)[0]))

static bwd_launch_fn find_chunk(int kc, int vc, int split) {
    for (size_t i = 0; i < ROWS(chunk_rows); i++)
        if (chunk_rows[i].kc == kc && chunk_rows[i].vc == vc && chunk_rows[i].split == split) return chunk_rows[i].fn;
    return NULL;
}
static bwd_launch_fn find_inter(int kc, int vc) {
    for (size_t i = 0; i < ROWS(inter_rows); i++)
        if (inter_rows[i].kc == kc && inter_rows[i].vc == vc) return inter_rows[i].fn;
    return NULL;
}
static bwd_launch_fn find_pairs(int kc, int nvh) {
    for (size_t i = 0; i < ROWS(pairs_rows); i++)
        if (pairs_rows[i].kc == kc && pairs_rows[i].nvh == nvh) return pairs_rows[i].fn;
    return NULL;
}
static bwd_launch_fn find_dstate(int kc, int bv) {
    for (size_t i = 0; i < ROWS(dstate_rows); i++)
        if (dstate_rows[i].kc == kc && dstate_rows[i].bv == bv) return dstate_rows[i].fn;
    return NULL;
}
/* cp: a row with the CP modes is needed */
static bwd_launch_fn find_dstate_rec(int kc, int bv, int wg, int cp) {
    for (size_t i = 0; i < ROWS(dstate_rec_rows); i++)
        if (dstate_rec_rows[i].kc == kc && dstate_rec_rows[i].bv == bv && dstate_rec_rows[i].wg == wg &&
            (!cp || dstate_rec_rows[i].cp))
            return dstate_rec_rows[i].fn;
    return NULL;
}

/* f's launch, or cudaErrorInvalidValue where the table has no row (kda_bwd_supports refused the class before) */
static int launch(bwd_launch_fn f, const kda_bwd_params_t *p, int device, void *stream) {
    return f ? f(p, device, stream) : (int)cudaErrorInvalidValue;
}

/* ---------------------------------------------------------------------------------------------------------
 * The dstate stage's choice of kernel and tile
 * ------------------------------------------------------------------------------------------------------- */
/* The wide tile when the (sequence, head) pairs at that width give at least a CTA per SM (the chains are no longer
 * than with narrow tiles, and each chunk's panels are copied half as often); else the narrow one. */
static int dstate_wide(const kda_bwd_params_t *p) {
    return p->pb.vc >= KDA_BWD_BV_WIDE && p->pb.seqs.num_seqs * p->pb.hv * (p->pb.vc / KDA_BWD_BV_WIDE) >= p->sm_count;
}

/* The CP modes' tile: the widest, one CTA per piece and head where the classes allow (the pieces fill the card;
 * each tile reloads the chunk's panels), and M's columns in tiles of the same width: min(VC, KC, 128) */
static int dstate_cp_bv(const kda_bwd_params_t *p) {
    const int bv = p->pb.vc < 128 ? p->pb.vc : 128;
    return p->pb.kc < bv ? p->pb.kc : bv;
}

/* The recurrence kernel's tile: the widest whose CTAs fill the card (the forward recurrence's rule, layout.c
 * choose_bv), but on sm_90a never below 64, wgmma's width (fewer (sequence, head) pairs than SMs leave SMs idle
 * either way: the chain is as long at 32 columns as at 64, and a wgmma step is shorter than two warps' mma.sync
 * step; development builds: dev_skip 16384 gives the narrow tile back, to time it) */
static int dstate_rec_bv(const kda_bwd_params_t *p) {
    if (p->pb.kc > 128) return 32;
    const int64_t heads = p->pb.seqs.num_seqs * p->pb.hv;
    int bv = p->pb.vc > 128 ? 128 : p->pb.vc; /* (V class 256: at most 128, the kernel's widest tile) */
    while (bv > 32 && heads * (p->pb.vc / bv) * 5 < (int64_t)p->sm_count * 4) bv /= 2;
    if (p->wgmma && bv < 64 && p->pb.vc >= 64 && !KDA_SKIP(*p, 16384)) bv = 64;
    return bv;
}

/* The recurrence kernel where its bulk copies of dO rows apply (bf16, 16-byte rows and start), else the fallback.
 * K class 256: mma.sync at BV 32 with a 2-stage ring (226,320 bytes; three stages would need 338,968, above the
 * SM's shared memory), no CP split (its tiles would be 128 columns wide) */
static int dstate_rec_applies(const kda_bwd_params_t *p) {
    return p->do_dtype == KDA_DT_BF16 && p->pb.V % 8 == 0 && ((uintptr_t)p->d_o & 15) == 0;
}

/* The state columns per CTA of the kernel that applies (one decision for the launch and for its CTA count) */
static int dstate_bv(const kda_bwd_params_t *p) {
    return dstate_rec_applies(p) ? dstate_rec_bv(p) : dstate_wide(p) ? KDA_BWD_BV_WIDE : KDA_BWD_BV;
}

int64_t kda_bwd_dstate_ctas(const kda_bwd_params_t *p) {
    return p->pb.seqs.num_seqs * p->pb.hv * (p->pb.vc / dstate_bv(p));
}

int kda_bwd_dstate_cp_applies(const kda_bwd_params_t *p) { return p->pb.kc <= 128 && dstate_rec_applies(p); }

/* ---------------------------------------------------------------------------------------------------------
 * The launchers (bwd.h) and the supports check
 * ------------------------------------------------------------------------------------------------------- */
int kda_bwd_launch_dstate(const kda_bwd_params_t *p, int device, void *stream) {
    if (p->ds_mode != KDA_DS_SEQ) { /* the host takes the CP modes only where the recurrence kernel applies */
        const int bv = dstate_cp_bv(p);
        return launch(find_dstate_rec(p->pb.kc, bv, p->wgmma ? 1 : 0, 1), p, device, stream);
    }
    const int bv = dstate_bv(p);
    if (dstate_rec_applies(p))
        return launch(find_dstate_rec(p->pb.kc, bv, bv == 32 || !p->wgmma ? 0 : 1, 0), p, device, stream);
    return launch(find_dstate(p->pb.kc, bv), p, device, stream);
}

int kda_bwd_launch_inter(const kda_bwd_params_t *p, int device, void *stream) {
    return launch(find_inter(p->pb.kc, p->pb.vc), p, device, stream);
}

int kda_bwd_launch_chunk(const kda_bwd_params_t *p, int device, void *stream) {
    return launch(find_chunk(p->pb.kc, p->pb.vc, p->split ? 1 : 0), p, device, stream);
}

int kda_bwd_launch_pairs(const kda_bwd_params_t *p, int device, void *stream) {
    return launch(find_pairs(p->pb.kc, kda_bwd_vhalves(p->pb.vc)), p, device, stream);
}

int kda_bwd_supports(int kc, int vc) {
    return find_chunk(kc, vc, 0) && find_chunk(kc, vc, 1) && find_inter(kc, vc) &&
           find_pairs(kc, kda_bwd_vhalves(vc)) && find_dstate(kc, KDA_BWD_BV) &&
           (vc < KDA_BWD_BV_WIDE || find_dstate(kc, KDA_BWD_BV_WIDE)) && find_dstate_rec(kc, 32, 0, 0);
}
