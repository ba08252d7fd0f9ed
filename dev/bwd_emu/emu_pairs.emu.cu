/* The pairs kernel (bwd_pairs.cu, cut before its launcher) under the emulator: a CTA per (chunk, value head,
 * 32-channel tile), after the emulated chunk kernel; with one value head per query/key head it writes dq and dk
 * (the l2norm step's sums exchanged within a cluster of a row's channel tiles), as the launcher does. */
#include "bwd_pairs.emu.h"

static void pairs_64(const void *p) { kda_bwd_pairs_kernel<64, 0>(*(const kda_bwd_params_t *)p); }
static void pairs_128(const void *p) { kda_bwd_pairs_kernel<128, 0>(*(const kda_bwd_params_t *)p); }
static void pairs_64_final(const void *p) { kda_bwd_pairs_kernel<64, 1>(*(const kda_bwd_params_t *)p); }
static void pairs_128_final(const void *p) { kda_bwd_pairs_kernel<128, 1>(*(const kda_bwd_params_t *)p); }

void run_pairs(const kda_bwd_params_t *p) {
    const unsigned tiles = (unsigned)(p->kc / PK_KT), blocks = (unsigned)(p->blocks.max_chunks * p->hv) * tiles;
    if (!kda_bwd_pairs_final(p)) emu_launch(blocks, PK_THREADS, p->kc == 64 ? pairs_64 : pairs_128, p);
    else emu_launch_cluster(blocks, p->l2norm ? tiles : 1, PK_THREADS, p->kc == 64 ? pairs_64_final : pairs_128_final, p);
}
