/* The finish kernel (bwd_finish.cu, cut before its launcher) under the emulator: the sums of dA_log and ddt_bias by
 * value head. */
#include "bwd_finish.emu.h"

static void gate_params(const void *p) { kda_bwd_gate_params_kernel(*(const kda_bwd_params_t *)p); }
static void dbeta(const void *p) { kda_bwd_dbeta_kernel(*(const kda_bwd_params_t *)p); }

void run_finish(const kda_bwd_params_t *p) {
    const int64_t rows = p->pb.seqs.num_tokens * p->pb.hv;
    if (kda_bwd_vhalves(p->pb.vc) == 2 && rows > 0) emu_launch((unsigned)((rows + 255) / 256), 256, dbeta, p);
    if (p->dA_log || p->ddt_bias) emu_launch((unsigned)p->pb.hv, 256, gate_params, p);
}
