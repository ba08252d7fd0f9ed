/* Built when libkda has no CUDA: the CUDA backend answers "not supported on this build". */
#include "internal.h"

kda_status_t kda_cuda_init(kda_context_t *ctx, int device) {
    (void)ctx;
    (void)device;
    return kda_error(KDA_STATUS_NOT_SUPPORTED, "kda_create: this libkda was built without CUDA");
}

const kda_backend_ops_t kda_cuda_ops = {.name = "cuda"};
