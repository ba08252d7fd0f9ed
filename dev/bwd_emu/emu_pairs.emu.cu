/* The pairs kernel (bwd_pairs.cuh, cut before its launcher) under the emulator: a CTA per (chunk, query/key head,
 * 32-channel tile), its value heads in turn, after the emulated chunk kernel; it writes dq and dk (with l2norm the
 * step's sums exchanged within a cluster of a row's channel tiles), as the launcher does. */
#define EMU_TU "pairs" /* EMU_TF32_EXACT names stages by it (common.cuh) */
#include "bwd_pairs.emu.h"

#define PAIRS_INSTANCE(KC, NVH) \
    static void pairs_##KC##_##NVH(const void *p) { kda_bwd_pairs_kernel<KC, NVH>(*(const kda_bwd_params_t *)p); }
PAIRS_INSTANCE(64, 1)
PAIRS_INSTANCE(128, 1)
PAIRS_INSTANCE(256, 1)
PAIRS_INSTANCE(64, 2)
PAIRS_INSTANCE(128, 2)
PAIRS_INSTANCE(256, 2)

void run_pairs(const kda_bwd_params_t *p) {
    const unsigned tiles = (unsigned)(p->pb.kc / PK_KT), blocks = (unsigned)(p->blocks.max_chunks * p->pb.hqk) * tiles;
    const int nvh = kda_bwd_vhalves(p->pb.vc);
    emu_kernel_fn k = p->pb.kc == 64 ? (nvh == 2 ? pairs_64_2 : pairs_64_1)
                      : p->pb.kc == 128 ? (nvh == 2 ? pairs_128_2 : pairs_128_1) : (nvh == 2 ? pairs_256_2 : pairs_256_1);
    emu_launch_cluster(blocks, p->pb.l2norm ? tiles : 1, PK_THREADS, k, p);
}
