/* Variants of the primed forward's apply (src/cuda/xcp/xcp.cu, kda_xcp_apply_kernel) timed beside it on the same
 * buffers (T 4 × 32768 H8's sizes: 15 pieces, 8 heads, K = V = 128), each checked against its output: the apply is
 * bound by its instruction stream at a quarter occupancy (docs/PERF.md, cross-rank CP), and these move the two
 * levers. dev/xcp_bench/run.sh variants on the GPU machine. A variant is the reference's body with
 *   minb      CTAs an SM it is compiled for (__launch_bounds__: 2 = the reference's 114 registers, 3 = at most 85)
 *   cf_early  C's fragments loaded into registers beside the copies (1, the reference) or after the products (0)
 *   nacc      3 accumulators (the reference: Ah Bh, Al Bh, Ah Bl) or 2 (Ah Bh, and Al Bh + Ah Bl in one: not the
 *             reference's bits, compared by relative difference)
 *   presplit  S's tf32 parts made once a CTA into shared memory (hi in place, lo beside it: 36 KB more) instead of by
 *             each of the four warps that read an element
 */
#include <math.h>
#include "xcp.cu"

#include "bench.h"

static int var_smem(int KC, int presplit) { return apply_smem_bytes(KC) + (presplit ? KC * APPLY_LB * 4 : 0); }

DEV void apply_body(const float *prefix, const float *S, float *slots, int hv, int K, int V, int KC, int VC,
                    int64_t slot_floats, const int cf_early, const int nacc, const int presplit) {
    extern __shared__ __align__(16) float var_smem_buf[];
    const int LA = apply_la(KC);
    float *sA = var_smem_buf, *sB = var_smem_buf + APPLY_T * LA, *sBl = sB + KC * APPLY_LB;
    const int dts = KC / APPLY_T, vts = VC / APPLY_T;
    const int64_t b = blockIdx.x;
    const int vt = (int)(b % vts), dt = (int)(b / vts % dts), h = (int)(b / vts / dts % hv);
    const int64_t j = b / vts / dts / hv + 1;
    const int64_t xw = (int64_t)KC + VC;
    const float *X = prefix + ((j - 1) * hv + h) * (int64_t)KC * xw;
    const float *Sh = S + (int64_t)h * K * V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int d0 = dt * APPLY_T, v0 = vt * APPLY_T;
    const int wr = 16 * (warp & 3), wc = 32 * (warp >> 2);
    for (int q = tid; q < APPLY_T * KC / 4; q += 256) {
        const int r = q / (KC / 4), c = 4 * (q % (KC / 4));
        cp_async16_zfill(smem_u32(sA + r * LA + c), X + (int64_t)(d0 + r) * xw + c, 16);
    }
    for (int f = tid; f < KC * APPLY_T; f += 256) {
        const int e = f / APPLY_T, v = v0 + f % APPLY_T, in = e < K && v < V;
        cp_async4_zfill(smem_u32(sB + e * APPLY_LB + f % APPLY_T), in ? Sh + (int64_t)e * V + v : Sh, in ? 4 : 0);
    }
    cp_async_commit();
    float2 cf[4][2];
    if (cf_early)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++)
                cf[nt][hr] =
                    *(const float2 *)(X + (int64_t)(d0 + wr + g + 8 * hr) * xw + KC + v0 + wc + 8 * nt + 2 * t);
    float acc[3][4][4];
#pragma unroll
    for (int pt = 0; pt < 3; pt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) acc[pt][nt][0] = acc[pt][nt][1] = acc[pt][nt][2] = acc[pt][nt][3] = 0.0f;
    cp_async_wait_all();
    if (presplit) { /* the thread's own copies have landed: split them in place */
        for (int f = tid; f < KC * APPLY_T; f += 256) {
            const int o = (f / APPLY_T) * APPLY_LB + f % APPLY_T;
            float hi, lo;
            split_tf32_rz(sB[o], &hi, &lo);
            sB[o] = hi, sBl[o] = lo;
        }
    }
    __syncthreads();
#pragma unroll 4
    for (int ks = 0; ks < KC / 8; ks++) {
        const float *a0 = sA + (wr + g) * LA + 8 * ks + t, *a8 = a0 + 8 * LA;
        float ah[4], al[4];
        split_tf32_rz(a0[0], &ah[0], &al[0]);
        split_tf32_rz(a8[0], &ah[1], &al[1]);
        split_tf32_rz(a0[4], &ah[2], &al[2]);
        split_tf32_rz(a8[4], &ah[3], &al[3]);
        const int ob = (8 * ks + t) * APPLY_LB + wc + g;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            float *c_hl = acc[nacc == 3 ? 2 : 1][nt];
            if (!presplit) {
                mma_3xtf32(acc[0][nt], acc[1][nt], c_hl, ah, al, sB[ob + 8 * nt], sB[ob + 4 * APPLY_LB + 8 * nt]);
                continue;
            }
            const float bh0 = sB[ob + 8 * nt], bh1 = sB[ob + 4 * APPLY_LB + 8 * nt];
            const float bl0 = sBl[ob + 8 * nt], bl1 = sBl[ob + 4 * APPLY_LB + 8 * nt];
            mma_tf32(acc[0][nt], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
            mma_tf32(acc[1][nt], al[0], al[1], al[2], al[3], bh0, bh1);
            mma_tf32(c_hl, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
        }
    }
    float *dst = slots + (j * hv + h) * slot_floats + (int64_t)KC * KC + (int64_t)KC * VC;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = d0 + wr + g + 8 * hr, col = v0 + wc + 8 * nt + 2 * t;
            const float2 c = cf_early ? cf[nt][hr] : *(const float2 *)(X + (int64_t)row * xw + KC + col);
            const float s0 = nacc == 3 ? acc[1][nt][2 * hr] + acc[2][nt][2 * hr] : acc[1][nt][2 * hr];
            const float s1 = nacc == 3 ? acc[1][nt][2 * hr + 1] + acc[2][nt][2 * hr + 1] : acc[1][nt][2 * hr + 1];
            *(float2 *)&dst[(int64_t)row * VC + col] =
                make_float2(acc[0][nt][2 * hr] + s0 + c.x, acc[0][nt][2 * hr + 1] + s1 + c.y);
        }
}

/* name, CTAs an SM, cf_early, nacc, presplit */
#define VARIANT(name, minb, cf, nacc, pre)                                                                             \
    __global__ void __launch_bounds__(256, minb)                                                                       \
        name(const float *prefix, const float *S, float *slots, int hv, int K, int V, int KC, int VC, int64_t sf) {    \
        apply_body(prefix, S, slots, hv, K, V, KC, VC, sf, cf, nacc, pre);                                            \
    }
VARIANT(var_ref_body, 2, 1, 3, 0)
VARIANT(var_minb3_late_c, 3, 0, 3, 0)
VARIANT(var_minb3_late_c_2acc, 3, 0, 2, 0)
VARIANT(var_presplit, 2, 1, 3, 1)
VARIANT(var_presplit_late_c_2acc, 2, 0, 2, 1)

typedef void (*var_fn)(const float *, const float *, float *, int, int, int, int, int, int64_t);
typedef struct {
    const char *name;
    var_fn fn;
    int presplit, exact; /* exact: the reference's bits expected */
} variant_t;
static const variant_t VARS[] = {
    {"the reference's body (minb 2, C early, 3 acc)", var_ref_body, 0, 1},
    {"minb 3, C after the products", var_minb3_late_c, 0, 1},
    {"minb 3, C after, 2 accumulators", var_minb3_late_c_2acc, 0, 0},
    {"S split once in shared memory", var_presplit, 1, 1},
    {"S split once, C after, 2 accumulators", var_presplit_late_c_2acc, 1, 0},
};

typedef struct {
    const float *prefix, *S;
    float *slots;
    int64_t np;
    int hv, K, V;
    const variant_t *v; /* NULL: the library's launcher */
} run_t;

static void launch(const run_t *r) {
    if (!r->v) {
        CK((cudaError_t)kda_xcp_launch_apply(r->prefix, r->S, r->slots, r->np, r->hv, r->K, r->V, r->K, r->V, 0));
        return;
    }
    const int bytes = var_smem(r->K, r->v->presplit);
    CK(cudaFuncSetAttribute((const void *)r->v->fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    const int64_t ctas = (r->np - 1) * r->hv * (r->K / APPLY_T) * (r->V / APPLY_T);
    r->v->fn<<<(unsigned)ctas, 256, bytes>>>(r->prefix, r->S, r->slots, r->hv, r->K, r->V, r->K, r->V,
                                            kda_cuda_cp_slot_floats(r->K, r->V));
    CK(cudaGetLastError());
}

static void launch_any(void *r) { launch((const run_t *)r); }

int main(void) {
    const int hv = 8, K = 128, V = 128;
    const int64_t np = 16, xw = K + V, pre = np * hv * K * xw, sn = (int64_t)hv * K * V;
    const int64_t sf = kda_cuda_cp_slot_floats(K, V), slots = np * hv * sf;
    float *p, *s, *ref, *out;
    CK(cudaMalloc(&p, pre * 4));
    CK(cudaMalloc(&s, sn * 4));
    CK(cudaMalloc(&ref, slots * 4));
    CK(cudaMalloc(&out, slots * 4));
    fill(p, pre, 1.0f / K, 1), fill(s, sn, 1.0f, 7);
    CK(cudaMemset(ref, 0, slots * 4));
    run_t r = {p, s, ref, np, hv, K, V, NULL};
    launch(&r);
    CK(cudaDeviceSynchronize());
    float *hr = (float *)malloc(slots * 4), *ho = (float *)malloc(slots * 4);
    CK(cudaMemcpy(hr, ref, slots * 4, cudaMemcpyDeviceToHost));
    const float t_ref = time_us(launch_any, &r, NULL, 0);
    printf("%-48s %8.2f us\n", "the library's apply", t_ref);
    for (size_t i = 0; i < sizeof VARS / sizeof VARS[0]; i++) {
        run_t q = r;
        q.slots = out, q.v = &VARS[i];
        CK(cudaMemset(out, 0, slots * 4));
        launch(&q);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(ho, out, slots * 4, cudaMemcpyDeviceToHost));
        int64_t nd = 0;
        double num = 0, den = 0;
        for (int64_t e = 0; e < slots; e++) {
            nd += memcmp(&hr[e], &ho[e], 4) != 0;
            num += ((double)hr[e] - ho[e]) * ((double)hr[e] - ho[e]), den += (double)hr[e] * hr[e];
        }
        struct cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, (const void *)VARS[i].fn));
        const float t = time_us(launch_any, &q, NULL, 0);
        printf("%-48s %8.2f us (%.3fx), %d registers; %lld of %lld floats differ, rel %.2e%s\n", VARS[i].name, t,
               t / t_ref, fa.numRegs, (long long)nd, (long long)slots, den > 0 ? sqrt(num / den) : 0.0,
               VARS[i].exact && nd ? "  MISMATCH" : "");
    }
    return 0;
}
