/* The dS+ kernels (bwd_dstate.cu, cut before its launchers) under the emulator: a CTA per (sequence, value head,
 * BV-column tile). The fallback kernel: EMU_DS_BV=16 or 32 (default 32), the tile width the launcher picks from the
 * SM count. EMU_DS_REC=32, 64 or 128: the recurrence kernel's mma.sync path at that tile width instead, from a bf16
 * copy of d_o (the harness rounds d_o to bf16 values then, so that the oracle sees the same dO). */
#include "bwd_dstate.emu.h"
#include <stdlib.h>
#include <stdio.h>

#define DSTATE_INSTANCE(KC, BV, width) \
    static void dstate_##KC##_##width(const void *p) { kda_bwd_dstate_kernel<KC, BV>(*(const kda_bwd_params_t *)p); }
DSTATE_INSTANCE(64, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(128, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(64, KDA_BWD_BV_WIDE, wide)
DSTATE_INSTANCE(128, KDA_BWD_BV_WIDE, wide)

#define DSTATE_REC_INSTANCE(KC, BV) \
    static void dstate_rec_##KC##_##BV(const void *p) { kda_bwd_dstate_rec_kernel<KC, BV, 0, 3>(*(const kda_bwd_params_t *)p); }
DSTATE_REC_INSTANCE(64, 32)
DSTATE_REC_INSTANCE(64, 64)
DSTATE_REC_INSTANCE(64, 128)
DSTATE_REC_INSTANCE(128, 32)
DSTATE_REC_INSTANCE(128, 64)
DSTATE_REC_INSTANCE(128, 128)

void run_dstate(const kda_bwd_params_t *p) {
    if (getenv("EMU_DS_REC")) {
        const int bv = atoi(getenv("EMU_DS_REC"));
        if (bv > p->vc) { fprintf(stderr, "EMU_DS_REC %d above the V class %d\n", bv, p->vc); exit(2); }
        const int64_t n = p->seqs.num_tokens * p->hv * p->V;
        uint16_t *bf = (uint16_t *)malloc((size_t)n * 2);
        for (int64_t i = 0; i < n; i++) bf[i] = f32_to_bf16_bits(((const float *)p->d_o)[i]);
        kda_bwd_params_t q = *p;
        q.d_o = bf;
        q.do_dtype = KDA_DT_BF16;
        emu_kernel_fn kernel = p->kc == 64 ? (bv == 32 ? dstate_rec_64_32 : bv == 64 ? dstate_rec_64_64 : dstate_rec_64_128)
                                           : (bv == 32 ? dstate_rec_128_32 : bv == 64 ? dstate_rec_128_64 : dstate_rec_128_128);
        emu_launch((unsigned)(p->seqs.num_seqs * p->hv * (p->vc / bv)), 2 * bv, kernel, &q);
        free(bf);
        return;
    }
    const int bv = getenv("EMU_DS_BV") ? atoi(getenv("EMU_DS_BV")) : KDA_BWD_BV_WIDE;
    const unsigned blocks = (unsigned)(p->seqs.num_seqs * p->hv * (p->vc / bv));
    emu_kernel_fn kernel;
    if (bv == KDA_BWD_BV) kernel = p->kc == 64 ? dstate_64_narrow : dstate_128_narrow;
    else kernel = p->kc == 64 ? dstate_64_wide : dstate_128_wide;
    emu_launch(blocks, 256, kernel, p);
}
