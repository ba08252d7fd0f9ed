/* The emulator's shared state (shim.h, common.cuh) and the launch of a grid: one pthread per CUDA thread, the
 * blocks (or clusters) one after another, each with its shared memory poisoned (0xff) and its barriers new. Linked
 * by the backward's emulator (harness.emu.cu) and by dev/prep_emu. */
#include "common.cuh"
#include <stdio.h>
#include <stdlib.h>

__thread emu_dim threadIdx, blockIdx;
__thread int emu_rank;
emu_dim gridDim = {0, 1, 1};
pthread_barrier_t emu_block_bar[EMU_MAX_CLUSTER], emu_cluster_bar, emu_warp_bar[EMU_WARPS];
float emu_warp_x[EMU_WARPS][32];
emu_mma_frag emu_mma[EMU_WARPS][32];
emu_tf32_frag emu_tf32[EMU_WARPS][32];
uint32_t emu_ldsm_addr[EMU_WARPS][32];
__attribute__((aligned(1024))) unsigned char smem_raw[EMU_SMEM_BYTES * EMU_MAX_CLUSTER];

typedef struct { emu_kernel_fn kernel; const void *arg; unsigned thread, block, rank; } emu_thread_t;

static void *emu_thread_main(void *v) {
    const emu_thread_t *t = (const emu_thread_t *)v;
    threadIdx.x = t->thread, threadIdx.y = 0, threadIdx.z = 0;
    blockIdx.x = t->block, blockIdx.y = 0, blockIdx.z = 0;
    emu_rank = (int)t->rank;
    t->kernel(t->arg);
    return NULL;
}

void emu_launch_cluster(unsigned blocks, unsigned cluster, unsigned threads, emu_kernel_fn kernel, const void *arg) {
    const unsigned n = cluster * threads;
    pthread_t *ids = (pthread_t *)malloc(n * sizeof *ids);
    emu_thread_t *ts = (emu_thread_t *)malloc(n * sizeof *ts);
    if (!ids || !ts || cluster < 1 || cluster > EMU_MAX_CLUSTER || blocks % cluster) {
        fprintf(stderr, "emu_launch: out of memory or a bad cluster (%u of %u blocks)\n", cluster, blocks);
        exit(1);
    }
    for (unsigned b = 0; b < blocks; b += cluster) {
        pthread_barrier_init(&emu_cluster_bar, NULL, n);
        for (unsigned r = 0; r < cluster; r++) pthread_barrier_init(&emu_block_bar[r], NULL, threads);
        for (int w = 0; w < 16 * (int)cluster; w++) pthread_barrier_init(&emu_warp_bar[w], NULL, 32);
        memset(smem_raw, 0xff, (size_t)EMU_SMEM_BYTES * cluster); /* poison shared memory */
        for (unsigned i = 0; i < n; i++) {
            ts[i].kernel = kernel, ts[i].arg = arg, ts[i].thread = i % threads, ts[i].block = b + i / threads;
            ts[i].rank = i / threads;
            if (pthread_create(&ids[i], NULL, emu_thread_main, &ts[i])) {
                fprintf(stderr, "emu_launch: pthread_create failed (thread %u of block %u)\n", i % threads, b + i / threads);
                exit(1);
            }
        }
        for (unsigned i = 0; i < n; i++) pthread_join(ids[i], NULL);
        pthread_barrier_destroy(&emu_cluster_bar);
        for (unsigned r = 0; r < cluster; r++) pthread_barrier_destroy(&emu_block_bar[r]);
        for (int w = 0; w < 16 * (int)cluster; w++) pthread_barrier_destroy(&emu_warp_bar[w]);
    }
    free(ids);
    free(ts);
}

void emu_launch(unsigned blocks, unsigned threads, emu_kernel_fn kernel, const void *arg) {
    emu_launch_cluster(blocks, 1, threads, kernel, arg);
}
