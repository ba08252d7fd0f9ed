/* The inter kernel (bwd_inter.cu, cut before its launcher) under the emulator: a CTA per (chunk, value head) of the
 * split stage 3 (harness mode use_blocks = 2). */
#include "bwd_inter.emu.h"

#define INTER_INSTANCE(KC, VC) \
    static void inter_##KC##_##VC(const void *p) { kda_bwd_inter_kernel<KC, VC>(*(const kda_bwd_params_t *)p); }
INTER_INSTANCE(64, 64)
INTER_INSTANCE(64, 128)
INTER_INSTANCE(128, 64)
INTER_INSTANCE(128, 128)

void run_inter(const kda_bwd_params_t *p) {
    const unsigned blocks = (unsigned)(p->blocks.max_chunks * p->hv);
    emu_kernel_fn kernel;
    if (p->kc == 64 && p->vc == 64) kernel = inter_64_64;
    else if (p->kc == 64) kernel = inter_64_128;
    else if (p->vc == 64) kernel = inter_128_64;
    else kernel = inter_128_128;
    emu_launch(blocks, BI_THREADS, kernel, p);
}
