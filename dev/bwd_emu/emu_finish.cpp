#include "bwd_finish.emu.h"
void run_finish(const kda_bwd_params_t &p) {
    const int64_t rows = p.seqs.num_tokens * p.hqk;
    unsigned blocks = (unsigned)((rows + 7) / 8);
    if (p.kc == 64) emu_launch(blocks, 256, [&]() { kda_bwd_qk_kernel<64>(p); });
    else emu_launch(blocks, 256, [&]() { kda_bwd_qk_kernel<128>(p); });
    if (p.dA_log || p.ddt_bias) emu_launch((unsigned)p.hv, 256, [&]() { kda_bwd_gate_params_kernel(p); });
}
