/* The dS+ kernel (bwd_dstate.cu, cut before its launcher) under the emulator: a CTA per (sequence, value head,
 * BV-column tile). EMU_DS_BV=16 or 32 (default 32): the tile width the launcher picks from the SM count. */
#include "bwd_dstate.emu.h"
#include <stdlib.h>

#define DSTATE_INSTANCE(KC, BV, width) \
    static void dstate_##KC##_##width(const void *p) { kda_bwd_dstate_kernel<KC, BV>(*(const kda_bwd_params_t *)p); }
DSTATE_INSTANCE(64, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(128, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(64, KDA_BWD_BV_WIDE, wide)
DSTATE_INSTANCE(128, KDA_BWD_BV_WIDE, wide)

void run_dstate(const kda_bwd_params_t *p) {
    const int bv = getenv("EMU_DS_BV") ? atoi(getenv("EMU_DS_BV")) : KDA_BWD_BV_WIDE;
    const unsigned blocks = (unsigned)(p->seqs.num_seqs * p->hv * (p->vc / bv));
    emu_kernel_fn kernel;
    if (bv == KDA_BWD_BV) kernel = p->kc == 64 ? dstate_64_narrow : dstate_128_narrow;
    else kernel = p->kc == 64 ? dstate_64_wide : dstate_128_wide;
    emu_launch(blocks, 256, kernel, p);
}
