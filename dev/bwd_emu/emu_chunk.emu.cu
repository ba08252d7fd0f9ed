/* The chunk kernel (bwd_chunk.cu, cut before its launcher) under the emulator: a CTA per (chunk, value head), its
 * fp32-input path (SPLIT = 0: everything recomputed from the inputs, S and dS⁺) or (p->split) the split path after
 * the emulated dstate and inter kernels. */
#include "bwd_chunk.emu.h"

/* one wrapper per tile instance: emu_launch calls it on every emulated thread with the kernel's parameters */
#define CHUNK_INSTANCE(KC, VC)                                                                                        \
    static void chunk_##KC##_##VC(const void *p) {                                                                    \
        const kda_bwd_params_t *q = (const kda_bwd_params_t *)p;                                                      \
        if (q->split) kda_bwd_chunk_kernel<KC, VC, 1>(*q);                                                            \
        else kda_bwd_chunk_kernel<KC, VC, 0>(*q);                                                                     \
    }
CHUNK_INSTANCE(64, 64)
CHUNK_INSTANCE(64, 128)
CHUNK_INSTANCE(128, 64)
CHUNK_INSTANCE(128, 128)

void run_chunk(const kda_bwd_params_t *p) {
    const unsigned blocks = (unsigned)(p->blocks.max_chunks * p->hv);
    emu_kernel_fn kernel;
    if (p->kc == 64 && p->vc == 64) kernel = chunk_64_64;
    else if (p->kc == 64) kernel = chunk_64_128;
    else if (p->vc == 64) kernel = chunk_128_64;
    else kernel = chunk_128_128;
    emu_launch(blocks, CK_THREADS, kernel, p);
}
