/* the chunk kernel (bwd_chunk.cu, cut before its launcher) under the emulator */
#include "bwd_chunk.emu.h"
#include <cstdlib>
template <int KC, int VC>
static void launch(const kda_bwd_params_t &p, unsigned blocks) {
    emu_launch(blocks, CK_THREADS, [&]() { kda_bwd_chunk_kernel<KC, VC>(p); });
}
void run_chunk(const kda_bwd_params_t &p) {
    unsigned blocks = (unsigned)(p.blocks.max_chunks * p.hv);
    if (p.kc == 64 && p.vc == 64) launch<64, 64>(p, blocks);
    else if (p.kc == 64) launch<64, 128>(p, blocks);
    else if (p.vc == 64) launch<128, 64>(p, blocks);
    else launch<128, 128>(p, blocks);
}
void run_states(const struct kda_bwd_params &) {}
