/* The chunk kernel (bwd_chunk.cuh, cut before its launcher) under the emulator: a CTA per (chunk, value head), its
 * fp32-input path (SPLIT = 0: everything recomputed from the inputs, S and dS⁺) or (p->split) the split path after
 * the emulated dstate and inter kernels. */
#define EMU_TU "chunk" /* EMU_TF32_EXACT names stages by it (common.cuh) */
#include "bwd_chunk.emu.h"
#include <stdlib.h>

/* one wrapper per tile instance: emu_launch calls it on every emulated thread with the kernel's parameters */
#define CHUNK_INSTANCE(KC, VC, KSP, NVH)                                                                              \
    static void chunk_##KC##_##VC##_##KSP##_##NVH(const void *p) {                                                    \
        const kda_bwd_params_t *q = (const kda_bwd_params_t *)p;                                                      \
        if (q->split) kda_bwd_chunk_kernel<KC, VC, 1, KSP, NVH>(*q);                                                  \
        else kda_bwd_chunk_kernel<KC, VC, 0, KSP, NVH>(*q);                                                           \
    }
CHUNK_INSTANCE(64, 64, 1, 1)
CHUNK_INSTANCE(64, 128, 1, 1)
CHUNK_INSTANCE(128, 64, 1, 1)
CHUNK_INSTANCE(128, 128, 1, 1)
CHUNK_INSTANCE(64, 128, 1, 2)  /* V class 256: two V halves */
CHUNK_INSTANCE(128, 128, 1, 2)
CHUNK_INSTANCE(128, 64, 2, 1)  /* K class 256: clusters of two CTAs */
CHUNK_INSTANCE(128, 128, 2, 1)
CHUNK_INSTANCE(128, 128, 2, 2)

/* EMU_DO_BF16 (the harness then rounds d_o to bf16 values): the kernel reads a bf16 copy of d_o, as in training
 * (its 16-byte dO loads where V = VC) */
void run_chunk(const kda_bwd_params_t *p) {
    const int ksp = p->pb.kc == 256 ? 2 : 1, nvh = kda_bwd_vhalves(p->pb.vc);
    const unsigned blocks = (unsigned)(p->blocks.max_chunks * p->pb.hv * ksp * nvh);
    emu_kernel_fn kernel;
    if (ksp == 2) kernel = nvh == 2 ? chunk_128_128_2_2 : p->pb.vc == 64 ? chunk_128_64_2_1 : chunk_128_128_2_1;
    else if (nvh == 2) kernel = p->pb.kc == 64 ? chunk_64_128_1_2 : chunk_128_128_1_2;
    else if (p->pb.kc == 64 && p->pb.vc == 64) kernel = chunk_64_64_1_1;
    else if (p->pb.kc == 64) kernel = chunk_64_128_1_1;
    else if (p->pb.vc == 64) kernel = chunk_128_64_1_1;
    else kernel = chunk_128_128_1_1;
    if (getenv("EMU_DO_BF16")) {
        const int64_t n = p->pb.seqs.num_tokens * p->pb.hv * p->pb.V;
        uint16_t *bf = (uint16_t *)aligned_alloc(16, (size_t)((n * 2 + 15) / 16 * 16));
        for (int64_t i = 0; i < n; i++) bf[i] = f32_to_bf16_bits(((const float *)p->d_o)[i]);
        kda_bwd_params_t q = *p;
        q.d_o = bf;
        q.do_dtype = KDA_DT_BF16;
        emu_launch_cluster(blocks, ksp, CK_THREADS, kernel, &q);
        free(bf);
        return;
    }
    emu_launch_cluster(blocks, ksp, CK_THREADS, kernel, p);
}
