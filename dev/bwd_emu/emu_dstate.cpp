#include "bwd_dstate.emu.h"
#include <cstdlib>
/* EMU_DS_BV=16 or 32 (default 32): the tile width the launcher picks from the SM count */
void run_dstate(const kda_bwd_params_t &p) {
    const int bv = getenv("EMU_DS_BV") ? atoi(getenv("EMU_DS_BV")) : KDA_BWD_BV_WIDE;
    unsigned blocks = (unsigned)(p.seqs.num_seqs * p.hv * (p.vc / bv));
    if (bv == KDA_BWD_BV) {
        if (p.kc == 64) emu_launch(blocks, 256, [&]() { kda_bwd_dstate_kernel<64, KDA_BWD_BV>(p); });
        else emu_launch(blocks, 256, [&]() { kda_bwd_dstate_kernel<128, KDA_BWD_BV>(p); });
    } else {
        if (p.kc == 64) emu_launch(blocks, 256, [&]() { kda_bwd_dstate_kernel<64, KDA_BWD_BV_WIDE>(p); });
        else emu_launch(blocks, 256, [&]() { kda_bwd_dstate_kernel<128, KDA_BWD_BV_WIDE>(p); });
    }
}
