/* The pairs kernel (bwd_pairs.cu, cut before its launcher) under the emulator: a CTA per (chunk, value head,
 * 32-channel tile), after the emulated chunk kernel. */
#include "bwd_pairs.emu.h"

static void pairs_64(const void *p) { kda_bwd_pairs_kernel<64>(*(const kda_bwd_params_t *)p); }
static void pairs_128(const void *p) { kda_bwd_pairs_kernel<128>(*(const kda_bwd_params_t *)p); }

void run_pairs(const kda_bwd_params_t *p) {
    const unsigned blocks = (unsigned)(p->blocks.max_chunks * p->hv * (p->kc / PK_KT));
    emu_launch(blocks, PK_THREADS, p->kc == 64 ? pairs_64 : pairs_128, p);
}
