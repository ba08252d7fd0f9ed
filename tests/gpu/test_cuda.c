/*
 * CUDA backend tests: skipped (exit 77) where the build or the machine has no CUDA device.
 */
#include "compare.h"
#include "test_util.h"

TEST(gpu_available) {
    kda_context_t *ctx = NULL;
    if (kda_create(&ctx, KDA_BACKEND_CUDA, 0) != KDA_STATUS_SUCCESS) SKIP("no CUDA device: %s", kda_last_error());
    kda_destroy(ctx);
}
