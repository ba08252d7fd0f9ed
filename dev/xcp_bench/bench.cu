/* The cross-rank fold and the primed apply (src/cuda/xcp/xcp.cu) timed alone, on buffers of their own, to tell their
 * arithmetic from what they wait on in the forward: the apply at T 4 × 32768 H8's sizes (15 pieces, 8 heads,
 * K = V = 128) on fresh cudaMalloc buffers, then with its regions at the far end of a large allocation (as in the
 * forward's workspace), then with the L2 cleared before each launch; the fold of two maps from device and from
 * managed summaries (touched by the host first, as tests/gpu/test_xcp_cuda.c's are). CUDA events, medians of 50.
 * dev/xcp_bench/run.sh on the GPU machine. */
#include <stdio.h>
#include <stdlib.h>
#include "xcp.cu"

#include "bench.h"

typedef struct {
    const float *prefix, *S, *sums;
    float *slots, *out;
    int64_t np;
    int hv, K, V, count;
} run_t;

static void apply(void *x) {
    run_t *r = (run_t *)x;
    CK((cudaError_t)kda_xcp_launch_apply(r->prefix, r->S, r->slots, r->np, r->hv, r->K, r->V, r->K, r->V, 0));
}
static void fold(void *x) {
    run_t *r = (run_t *)x;
    CK((cudaError_t)kda_xcp_launch_fold(r->sums, 0, r->count, 1, r->hv, r->K, r->V, r->out, 0));
}

int main(void) {
    const int hv = 8, K = 128, V = 128;
    const int64_t np = 16, xw = K + V, pre = np * hv * K * xw, sn = hv * K * V;
    const int64_t slots = np * hv * kda_cuda_cp_slot_floats(K, V);
    run_t r = {0};
    r.np = np, r.hv = hv, r.K = K, r.V = V;
    float *p, *s, *sl;
    CK(cudaMalloc(&p, pre * 4));
    CK(cudaMalloc(&s, sn * 4));
    CK(cudaMalloc(&sl, slots * 4));
    fill(p, pre, 1.0f / K, 0), fill(s, sn, 1.0f, 0);
    r.prefix = p, r.S = s, r.slots = sl;
    char *flush;
    const size_t fb = (size_t)256 << 20;
    CK(cudaMalloc(&flush, fb));
    printf("apply, fresh buffers:               %8.2f us\n", time_us(apply, &r, NULL, 0));
    printf("apply, fresh buffers, L2 cleared:   %8.2f us\n", time_us(apply, &r, flush, fb));
    /* the same regions at the end of a 2 GiB allocation */
    const size_t big = (size_t)2 << 30;
    char *w;
    CK(cudaMalloc(&w, big));
    char *end = w + big - (size_t)(pre + sn + slots) * 4 - 4096;
    end = (char *)(((uintptr_t)end) & ~(uintptr_t)255);
    run_t q = r;
    q.slots = (float *)end, q.prefix = (float *)(end + slots * 4), q.S = (float *)(end + (slots + pre) * 4);
    CK(cudaMemcpy((void *)q.prefix, p, pre * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy((void *)q.S, s, sn * 4, cudaMemcpyDeviceToDevice));
    printf("apply, regions at a 2 GiB end:      %8.2f us\n", time_us(apply, &q, NULL, 0));
    /* the fold of two maps (one product), from device and from managed summaries */
    const int64_t sz = (int64_t)2 * hv * K * xw;
    float *sd, *sm, *out;
    CK(cudaMalloc(&sd, sz * 4));
    CK(cudaMallocManaged(&sm, sz * 4, cudaMemAttachGlobal));
    CK(cudaMalloc(&out, sn * 4));
    fill(sd, sz, 1.0f / K, 0);
    CK(cudaMemcpy(sm, sd, sz * 4, cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
    volatile float acc = 0;
    for (int64_t i = 0; i < sz; i += 1024) acc += sm[i]; /* the host touches them, as the tests do */
    r.out = out, r.count = 1, r.sums = sd;
    printf("fold, one map (a copy), device:     %8.2f us\n", time_us(fold, &r, NULL, 0));
    r.count = 2;
    printf("fold, two maps, device summaries:   %8.2f us\n", time_us(fold, &r, NULL, 0));
    r.sums = sm;
    printf("fold, two maps, managed summaries:  %8.2f us\n", time_us(fold, &r, NULL, 0));
    return 0;
}
