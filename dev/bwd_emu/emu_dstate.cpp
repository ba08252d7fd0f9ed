#include "bwd_dstate.emu.h"
void run_dstate(const kda_bwd_params_t &p) {
    unsigned blocks = (unsigned)(p.seqs.num_seqs * p.hv * (p.vc / KDA_BWD_BV));
    if (p.kc == 64) emu_launch(blocks, 256, [&]() { kda_bwd_dstate_kernel<64>(p); });
    else emu_launch(blocks, 256, [&]() { kda_bwd_dstate_kernel<128>(p); });
}
