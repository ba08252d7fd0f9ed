/* What dev/xcp_bench's programs share: a CUDA call checked, inputs filled, a launch timed by events */
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <cuda_runtime.h>

#define CK(x)                                                                                                          \
    do {                                                                                                               \
        cudaError_t e_ = (x);                                                                                          \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                                   \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

/* n deterministic values in [−scale, scale] (seed shifts the pattern) into device memory */
static void fill(float *d, int64_t n, float scale, unsigned seed) {
    float *h = (float *)malloc(n * 4);
    for (int64_t i = 0; i < n; i++) h[i] = scale * (float)(((i + seed) * 2654435761u) % 2001 - 1000) / 1000.0f;
    CK(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
    free(h);
}

static int cmpf(const void *a, const void *b) { return *(const float *)a < *(const float *)b ? -1 : 1; }

/* median µs of 50 launches of f (after 5), clearing the L2 before each when flush is given */
static float time_us(void (*f)(void *), void *arg, char *flush, size_t flush_bytes) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float t[50];
    for (int i = -5; i < 50; i++) {
        if (flush) CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, 0));
        CK(cudaEventRecord(e0, 0));
        f(arg);
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        if (i >= 0) CK(cudaEventElapsedTime(&t[i], e0, e1));
    }
    qsort(t, 50, sizeof(float), cmpf);
    return 1000.0f * t[25];
}
