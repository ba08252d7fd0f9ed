/* The chunk kernel (bwd_chunk.cu, cut before its launcher) under the emulator: a CTA per (chunk, value head), its
 * fp32-input path (SPLIT = 0: everything recomputed from the inputs, S and dS⁺) or (p->split) the split path after
 * the emulated dstate and inter kernels. */
#include "bwd_chunk.emu.h"
#include <stdlib.h>

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

/* EMU_DO_BF16 (the harness then rounds d_o to bf16 values): the kernel reads a bf16 copy of d_o, as in training
 * (its 16-byte dO loads where V = VC) */
void run_chunk(const kda_bwd_params_t *p) {
    const unsigned blocks = (unsigned)(p->blocks.max_chunks * p->hv);
    emu_kernel_fn kernel;
    if (p->kc == 64 && p->vc == 64) kernel = chunk_64_64;
    else if (p->kc == 64) kernel = chunk_64_128;
    else if (p->vc == 64) kernel = chunk_128_64;
    else kernel = chunk_128_128;
    if (getenv("EMU_DO_BF16")) {
        const int64_t n = p->seqs.num_tokens * p->hv * p->V;
        uint16_t *bf = (uint16_t *)aligned_alloc(16, (size_t)((n * 2 + 15) / 16 * 16));
        for (int64_t i = 0; i < n; i++) bf[i] = f32_to_bf16_bits(((const float *)p->d_o)[i]);
        kda_bwd_params_t q = *p;
        q.d_o = bf;
        q.do_dtype = KDA_DT_BF16;
        emu_launch(blocks, CK_THREADS, kernel, &q);
        free(bf);
        return;
    }
    emu_launch(blocks, CK_THREADS, kernel, p);
}
