/* The inter kernel (bwd_inter.cuh, cut before its launcher) under the emulator: a CTA per (chunk, value head) of the
 * split stage 3 (harness mode use_blocks = 2). */
#define EMU_TU "inter" /* EMU_TF32_EXACT names stages by it (common.cuh) */
#include "bwd_inter.emu.h"

#define INTER_INSTANCE(KC, VC, NVH) \
    static void inter_##KC##_##VC##_##NVH(const void *p) { kda_bwd_inter_kernel<KC, VC, NVH>(*(const kda_bwd_params_t *)p); }
INTER_INSTANCE(64, 64, 1)
INTER_INSTANCE(64, 128, 1)
INTER_INSTANCE(128, 64, 1)
INTER_INSTANCE(128, 128, 1)
INTER_INSTANCE(64, 128, 2) /* V class 256: two halves */
INTER_INSTANCE(128, 128, 2)
INTER_INSTANCE(256, 64, 1)
INTER_INSTANCE(256, 128, 1)
INTER_INSTANCE(256, 128, 2)

void run_inter(const kda_bwd_params_t *p) {
    const int nvh = kda_bwd_vhalves(p->pb.vc);
    const unsigned blocks = (unsigned)(p->blocks.max_chunks * p->pb.hv * nvh);
    emu_kernel_fn kernel;
    if (p->pb.kc == 256) kernel = nvh == 2 ? inter_256_128_2 : p->pb.vc == 64 ? inter_256_64_1 : inter_256_128_1;
    else if (nvh == 2) kernel = p->pb.kc == 64 ? inter_64_128_2 : inter_128_128_2;
    else if (p->pb.kc == 64 && p->pb.vc == 64) kernel = inter_64_64_1;
    else if (p->pb.kc == 64) kernel = inter_64_128_1;
    else if (p->pb.vc == 64) kernel = inter_128_64_1;
    else kernel = inter_128_128_1;
    emu_launch(blocks, BI_THREADS, kernel, p);
}
