/* The pairs kernel (bwd_pairs.cu, cut before its launcher) under the emulator: a CTA per (chunk, query/key head,
 * 32-channel tile), its value heads in turn, after the emulated chunk kernel; it writes dq and dk (with l2norm the
 * step's sums exchanged within a cluster of a row's channel tiles), as the launcher does. */
#include "bwd_pairs.emu.h"

static void pairs_64(const void *p) { kda_bwd_pairs_kernel<64>(*(const kda_bwd_params_t *)p); }
static void pairs_128(const void *p) { kda_bwd_pairs_kernel<128>(*(const kda_bwd_params_t *)p); }

void run_pairs(const kda_bwd_params_t *p) {
    const unsigned tiles = (unsigned)(p->kc / PK_KT), blocks = (unsigned)(p->blocks.max_chunks * p->hqk) * tiles;
    emu_launch_cluster(blocks, p->l2norm ? tiles : 1, PK_THREADS, p->kc == 64 ? pairs_64 : pairs_128, p);
}
