/* Built when libkda has no CUDA: the CUDA backend answers "not supported on this build". */
#include "internal.h"

/* CMake defines why this build has no CUDA (no GPU visible at configure time, no nvcc, KDA_WITH_CUDA=OFF) */
#ifndef KDA_NO_CUDA_REASON
#define KDA_NO_CUDA_REASON "KDA_WITH_CUDA=OFF"
#endif

kda_status_t kda_cuda_init(kda_context_t *ctx, int device) {
    (void)ctx;
    (void)device;
    return kda_error(KDA_STATUS_NOT_SUPPORTED, "kda_create: this libkda was built without CUDA: " KDA_NO_CUDA_REASON);
}

const kda_backend_ops_t kda_cuda_ops = {.name = "cuda"};
