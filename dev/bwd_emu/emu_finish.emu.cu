/* The finish kernels (bwd_finish.cu, cut before its launcher) under the emulator: dq, dk by 8 rows per CTA, then
 * the sums of dA_log and ddt_bias by value head. */
#include "bwd_finish.emu.h"

static void qk_64(const void *p) { kda_bwd_qk_kernel<64>(*(const kda_bwd_params_t *)p); }
static void qk_128(const void *p) { kda_bwd_qk_kernel<128>(*(const kda_bwd_params_t *)p); }
static void gate_params(const void *p) { kda_bwd_gate_params_kernel(*(const kda_bwd_params_t *)p); }

void run_finish(const kda_bwd_params_t *p) {
    const int64_t rows = p->seqs.num_tokens * p->hqk;
    const unsigned blocks = (unsigned)((rows + 7) / 8);
    if (!kda_bwd_pairs_final(p)) emu_launch(blocks, 256, p->kc == 64 ? qk_64 : qk_128, p); /* else the pairs kernel's */
    if (p->dA_log || p->ddt_bias) emu_launch((unsigned)p->hv, 256, gate_params, p);
}
