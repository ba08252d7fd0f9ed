/* Host emulation of src/cuda/xcp/xcp.cu's fold and apply kernels (run.sh) on random sizes: the fold's states against
 * the chain S <- A_j S + C_j done serially in fp64 in the kernel's term order (the same bytes), the apply's incoming
 * states against S_in(j) = A S + C in 3xTF32 (each part's products summed in fp32, e ascending: the same values),
 * and nothing else of the slots written. dev/xcp_emu/run.sh [cases, default every (K, V) of nine sizes]
 * (g++ -x c++; no GPU) */
#include <functional>
#include "xcp.cu" /* with this folder's common.cuh beside it (run.sh) */

__thread emu_dim threadIdx;
emu_dim blockIdx, gridDim, blockDim;
unsigned char emu_smem[EMU_SMEM_BYTES];
pthread_barrier_t emu_block_bar, emu_warp_bar[EMU_MAX_WARPS];
emu_tf32_frag emu_tf32[EMU_MAX_WARPS][32];

struct emu_arg { std::function<void()> *f; unsigned tid; };
static void *emu_thread(void *x) {
    emu_arg *a = (emu_arg *)x;
    threadIdx.x = a->tid, threadIdx.y = threadIdx.z = 0;
    (*a->f)();
    return NULL;
}
static void run_grid(int64_t ctas, int T, std::function<void()> f) {
    pthread_t th[1024];
    emu_arg args[1024];
    gridDim.x = (unsigned)ctas, gridDim.y = gridDim.z = 1;
    blockDim.x = (unsigned)T, blockDim.y = blockDim.z = 1;
    for (int64_t b = 0; b < ctas; b++) {
        blockIdx.x = (unsigned)b, blockIdx.y = blockIdx.z = 0;
        memset(emu_smem, 0x7f, sizeof emu_smem);
        pthread_barrier_init(&emu_block_bar, NULL, T);
        for (int w = 0; w < T / 32; w++) pthread_barrier_init(&emu_warp_bar[w], NULL, 32);
        for (int i = 0; i < T; i++) {
            args[i].f = &f, args[i].tid = (unsigned)i;
            if (pthread_create(&th[i], NULL, emu_thread, &args[i])) { fprintf(stderr, "pthread_create\n"); exit(2); }
        }
        for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
        pthread_barrier_destroy(&emu_block_bar);
        for (int w = 0; w < T / 32; w++) pthread_barrier_destroy(&emu_warp_bar[w]);
    }
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static int64_t rnd(int64_t n) { rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; return (int64_t)(rng % (uint64_t)n); }
static float rndf(void) { return (float)(rnd(2000001) - 1000000) * 1e-6f; }
static int same(float a, float b) { return a == b || (a != a && b != b); }

int main(int argc, char **argv) {
    const int cases = argc > 1 ? atoi(argv[1]) : 12;
    static const int dims[] = {1, 7, 16, 48, 64, 100, 128, 200, 256};
    int bad = 0;
    for (int c = 0; c < cases; c++) {
        const int K = dims[c / 9 % 9], V = dims[c % 9], hv = 1 + (int)rnd(3);
        const int KC = kda_cuda_size_class(K), VC = kda_cuda_size_class(V);
        /* the fold: count maps of R ranks, forward (step 1) or backward (step -1) */
        const int R = 6, count = 1 + (int)rnd(4), step = rnd(2) ? 1 : -1;
        const int64_t first = step > 0 ? rnd(R - count + 1) : count - 1 + rnd(R - count + 1), W = (int64_t)K + V;
        float *sums = (float *)malloc(sizeof(float) * R * hv * K * W);
        for (int64_t i = 0; i < (int64_t)R * hv * K * W; i++) sums[i] = rndf() * (i % W < K ? 2.0f / K : 1.0f);
        float *out = (float *)malloc(sizeof(float) * hv * K * V), *want = (float *)malloc(sizeof(float) * hv * K * V);
        memset(out, 0x7f, sizeof(float) * hv * K * V);
        for (int h = 0; h < hv; h++) {
            double *S = (double *)calloc((size_t)K * V, 8), *N = (double *)calloc((size_t)K * V, 8);
            for (int m = 0; m < count; m++) {
                const float *X = sums + ((first + (int64_t)m * step) * hv + h) * K * W;
                for (int i = 0; i < K; i++)
                    for (int v = 0; v < V; v++) {
                        double acc = X[i * W + K + v];
                        for (int l = 0; m > 0 && l < K; l++) acc += (double)X[i * W + l] * S[(int64_t)l * V + v];
                        N[(int64_t)i * V + v] = acc;
                    }
                memcpy(S, N, sizeof(double) * K * V);
            }
            for (int64_t i = 0; i < (int64_t)K * V; i++) want[h * K * V + i] = (float)S[i];
            free(S), free(N);
        }
        const int tiles = (V + FOLD_COLS - 1) / FOLD_COLS;
        run_grid((int64_t)hv * tiles, FOLD_THREADS, [&] { kda_xcp_fold_kernel(sums, first, count, step, hv, K, V, out); });
        int64_t nd = 0;
        for (int64_t i = 0; i < (int64_t)hv * K * V; i++) nd += !same(out[i], want[i]);
        /* the apply: np pieces' prefix maps (M's padding columns zero, rows past K zero), S = the fold's result */
        const int64_t np = 2 + rnd(3), xw = KC + VC, sz = kda_cuda_cp_slot_floats(KC, VC);
        float *prefix = (float *)calloc((size_t)(np * hv * KC * xw), 4);
        for (int64_t j = 0; j < np; j++)
            for (int h = 0; h < hv; h++)
                for (int d = 0; d < K; d++)
                    for (int64_t x = 0; x < xw; x++)
                        if (x < K || (x >= KC && x - KC < V))
                            prefix[((j * hv + h) * KC + d) * xw + x] = rndf() * (x < K ? 2.0f / K : 1.0f);
        float *slots = (float *)malloc(sizeof(float) * np * hv * sz), *wslots = (float *)malloc(sizeof(float) * np * hv * sz);
        memset(slots, 0x7f, sizeof(float) * np * hv * sz);
        memcpy(wslots, slots, sizeof(float) * np * hv * sz);
        for (int64_t j = 1; j < np; j++)
            for (int h = 0; h < hv; h++)
                for (int d = 0; d < KC; d++)
                    for (int v = 0; v < VC; v++) {
                        const float *X = prefix + (((j - 1) * hv + h) * KC + d) * xw;
                        float acc[3] = {0.0f, 0.0f, 0.0f}; /* Ah Sh, Al Sh, Ah Sl, e ascending */
                        for (int e = 0; e < KC; e++) {
                            float ah, al, sh, sl;
                            split_tf32_rz(X[e], &ah, &al);
                            split_tf32_rz(e < K && v < V ? want[(h * K + e) * V + v] : 0.0f, &sh, &sl);
                            acc[0] += ah * sh, acc[1] += al * sh, acc[2] += ah * sl;
                        }
                        wslots[(j * hv + h) * sz + KC * KC + KC * VC + d * VC + v] =
                            acc[0] + (acc[1] + acc[2]) + X[KC + v];
                    }
        run_grid((np - 1) * hv * (KC / APPLY_T) * (VC / APPLY_T), 256,
                 [&] { kda_xcp_apply_kernel(prefix, want, slots, hv, K, V, KC, VC, sz); });
        int64_t na = 0;
        for (int64_t i = 0; i < np * hv * sz; i++) na += !same(slots[i], wslots[i]);
        printf("case %d: K %d V %d hv %d, fold of %d (step %d): %lld of %lld differ; apply of %lld pieces: %lld differ\n",
               c, K, V, hv, count, step, (long long)nd, (long long)hv * K * V, (long long)np, (long long)na);
        bad += nd > 0 || na > 0;
        free(sums), free(out), free(want), free(prefix), free(slots), free(wslots);
    }
    printf("%d cases: %s\n", cases, bad ? "MISMATCH" : "the same states, nothing else written");
    return bad != 0;
}
