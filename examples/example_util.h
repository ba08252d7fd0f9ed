/*
 * example_util.h — what the examples share: CHECK_KDA (a call's status checked, kda_last_error() printed), the
 * memory helpers (buffers where a backend reads them: host memory for the CPU and reference backends, device
 * memory for CUDA when the example is built with KDA_EXAMPLE_CUDA and the CUDA runtime; NULL / nonzero on
 * failure, mem_free takes NULL) and a small generator of synthetic inputs.
 */
#ifndef KDA_EXAMPLE_UTIL_H
#define KDA_EXAMPLE_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kda.h>

#ifdef KDA_EXAMPLE_CUDA
#include <cuda_runtime_api.h>
#endif

/* ---- memory where the backend reads it: host (CPU, reference) or device (CUDA) -------------------------- */
static void *mem_alloc(kda_backend_t backend, size_t bytes) {
#ifdef KDA_EXAMPLE_CUDA
    if (backend == KDA_BACKEND_CUDA) {
        void *p = NULL;
        return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
    }
#endif
    (void)backend;
    return malloc(bytes);
}

static void mem_free(kda_backend_t backend, void *p) {
#ifdef KDA_EXAMPLE_CUDA
    if (backend == KDA_BACKEND_CUDA) {
        cudaFree(p);
        return;
    }
#endif
    (void)backend;
    free(p);
}

/* A copy of host data where the backend reads it. */
static void *mem_upload(kda_backend_t backend, const void *host, size_t bytes) {
    void *p = mem_alloc(backend, bytes);
    if (!p) return NULL;
#ifdef KDA_EXAMPLE_CUDA
    if (backend == KDA_BACKEND_CUDA) {
        if (cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
            cudaFree(p);
            return NULL;
        }
        return p;
    }
#endif
    memcpy(p, host, bytes);
    return p;
}

static int mem_download(kda_backend_t backend, void *host, const void *p, size_t bytes) {
#ifdef KDA_EXAMPLE_CUDA
    if (backend == KDA_BACKEND_CUDA) /* cudaMemcpy waits for the default stream, where kda_forward ran */
        return cudaMemcpy(host, p, bytes, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
#endif
    (void)backend;
    memcpy(host, p, bytes);
    return 0;
}

/* Goes to `done` unless the call succeeds (the caller's label), printing the status and the message */
#define CHECK_KDA(call)                                                                                     \
    do {                                                                                                    \
        kda_status_t st_ = (call);                                                                          \
        if (st_ != KDA_STATUS_SUCCESS) {                                                                    \
            fprintf(stderr, "%s failed: %s: %s\n", #call, kda_status_string(st_), kda_last_error());        \
            goto done;                                                                                      \
        }                                                                                                   \
    } while (0)

/* ---- synthetic inputs ------------------------------------------------------------------------------------- */
static float uniform(unsigned *s) { /* in [-1, 1) */
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 8388608.0f - 1.0f;
}

#endif /* KDA_EXAMPLE_UTIL_H */
