/*
 * Helpers shared by the GPU test programs: a CUDA call that must succeed, and a host buffer copied to the device.
 */
#ifndef KDA_TEST_GPU_UTIL_H
#define KDA_TEST_GPU_UTIL_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#define CUDA_OK(x)                                                                                          \
    do {                                                                                                    \
        cudaError_t e_ = (x);                                                                               \
        if (e_ != cudaSuccess) {                                                                            \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));             \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

/* A device copy of `bytes` bytes of host memory (NULL for NULL; at least 16 bytes allocated). */
static inline void *to_dev(const void *h, size_t bytes) {
    if (!h) return NULL;
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, bytes ? bytes : 16));
    CUDA_OK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

#endif /* KDA_TEST_GPU_UTIL_H */
