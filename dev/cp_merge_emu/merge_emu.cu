/* Host emulation of the CP merge kernel (src/cuda/cp/cp_merge.cu, its launcher's grid included) on random piece tables
 * (src/cp_plan.h's kda_cp_fill_table, pieces forced): every split sequence's incoming states S_in(1 .. np − 1), per
 * value head and column, against the merge's arithmetic done serially in the kernel's order (the tf32 parts'
 * products summed as the emulated mma.sync sums them, then E_j): the same bytes; nothing else in the slots
 * written. Every other case runs the compose chain instead (its prefix maps, the slots untouched). dev/cp_merge_emu/run.sh [cases] [source]   (g++ -x c++; no GPU) */
#include "cp_merge.cu" /* with this folder's common.cuh beside it (run.sh) */
#include "cp_plan.h"
#include "cp_slot.cuh" /* store_map: the pre-scans' writer of the layout the merge reads */

__thread emu_dim threadIdx;
emu_tf32_frag emu_tf32[EMU_MAX_WARPS][32];
emu_dim blockIdx, gridDim;
unsigned char emu_smem[EMU_SMEM];
pthread_barrier_t emu_block_bar, emu_warp_bar[EMU_MAX_WARPS];
int emu_warp_x[EMU_MAX_WARPS][32];
emu_mbar emu_bars[64];
pthread_mutex_t emu_bar_lock = PTHREAD_MUTEX_INITIALIZER;
const void *emu_kernel;
int64_t emu_ctas;
int emu_threads, emu_bytes;

typedef void (*kernel_t)(const kda_cp_params_t);
typedef struct { const kda_cp_params_t *p; unsigned tid; } emu_arg_t;
static void *emu_thread(void *a) {
    const emu_arg_t *e = (const emu_arg_t *)a;
    threadIdx.x = e->tid, threadIdx.y = threadIdx.z = 0;
    ((kernel_t)emu_kernel)(*e->p);
    return NULL;
}
static void run_grid(const kda_cp_params_t *p) {
    const int T = emu_threads;
    pthread_t *th = (pthread_t *)malloc(sizeof(pthread_t) * T);
    emu_arg_t *args = (emu_arg_t *)malloc(sizeof(emu_arg_t) * T);
    gridDim.x = (unsigned)emu_ctas, gridDim.y = gridDim.z = 1;
    for (int64_t b = 0; b < emu_ctas; b++) {
        blockIdx.x = (unsigned)b, blockIdx.y = blockIdx.z = 0;
        memset(emu_smem, 0x7f, sizeof emu_smem); /* poisoned: NaN-like floats */
        for (int i = 0; i < 64; i++) emu_bars[i].used = 0;
        pthread_barrier_init(&emu_block_bar, NULL, T);
        for (int w = 0; w < T / 32; w++) pthread_barrier_init(&emu_warp_bar[w], NULL, 32);
        for (int i = 0; i < T; i++) {
            args[i].p = p, args[i].tid = (unsigned)i;
            if (pthread_create(&th[i], NULL, emu_thread, &args[i])) { fprintf(stderr, "pthread_create\n"); exit(2); }
        }
        for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
        pthread_barrier_destroy(&emu_block_bar);
        for (int w = 0; w < T / 32; w++) pthread_barrier_destroy(&emu_warp_bar[w]);
    }
    free(th);
    free(args);
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static int64_t rnd(int64_t n) { rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; return (int64_t)(rng % (uint64_t)n); }
static float rndf(void) { return (float)(rnd(2000001) - 1000000) * 1e-6f; }

/* the merge of one (split sequence, value head) in the kernel's order, all VC columns: S_in(j) into `out`. Per
 * step and output (d, v): the m16n8k8 products in e order, 8 rows e at a time, each as three tf32 products (Ah Bh,
 * Al Bh, Ah Bl; the parts by masks) summed k by k into an fp32 accumulator each, as the emulated mma.sync does;
 * then Ah Bh + (Al Bh + Ah Bl) + E_j. Mᵀ_j is read
 * through the swizzle its writers store it with (kda_cuda_map_index). */
/* Element (d, c) of M_j B (B of `w` columns, Mᵀ_j swizzled) as the emulated mma.sync sums it: 8 rows e at a time, the
 * three tf32 products (Ah Bh, Al Bh, Ah Bl; the parts by masks) in accumulators of their own, Ah Bh + (Al Bh + Ah Bl) */
static float step_product(const float *Mt, const float *B, int KC, int64_t w, int d, int64_t c) {
    float acc[3] = {0.f, 0.f, 0.f};
    for (int e0 = 0; e0 < KC; e0 += 8)
        for (int part = 0; part < 3; part++)
            for (int k = 0; k < 8; k++) {
                const float a = Mt[kda_cuda_map_index(KC, e0 + k, d)], b = B[(e0 + k) * w + c];
                const float ah = tf32_rz(a), al = tf32_rz(a - ah), bh = tf32_rz(b), bl = tf32_rz(b - bh);
                acc[part] += part == 0 ? ah * bh : part == 1 ? al * bh : ah * bl;
            }
    return acc[0] + (acc[1] + acc[2]);
}

static void reference(const float *slots, int64_t s0, int64_t np, int h, int hv, int KC, int VC, float *out) {
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
#define RSLOT(j) (slots + ((s0 + (j)) * hv + h) * sz)
#define ROUT(j) (out + ((s0 + (j)) * hv + h) * sz)
    float *S = (float *)malloc(sizeof(float) * KC * VC);
    memcpy(S, RSLOT(0) + KC * KC, sizeof(float) * KC * VC); /* S_in(1) = E_0 */
    memcpy(ROUT(1) + KC * KC + KC * VC, S, sizeof(float) * KC * VC);
    float *next = (float *)malloc(sizeof(float) * KC * VC);
    for (int64_t j = 1; j + 1 < np; j++) {
        const float *Mt = RSLOT(j), *E = RSLOT(j) + KC * KC;
        for (int d = 0; d < KC; d++)
            for (int c = 0; c < VC; c++) {
                next[d * VC + c] = step_product(Mt, S, KC, VC, d, c) + E[d * VC + c];
            }
        memcpy(S, next, sizeof(float) * KC * VC);
        memcpy(ROUT(j + 1) + KC * KC + KC * VC, S, sizeof(float) * KC * VC);
    }
    free(S);
    free(next);
#undef RSLOT
#undef ROUT
}

/* The compose chain of one (split sequence, value head) in the kernel's order (cp_merge.cu, compose): X_0 = [M_0 | E_0]
 * (M_0 from its Mᵀ, or 0 without first_map), X_j = M_j X_{j−1} + [0 | E_j], every X_j into `prefix` */
static void reference_compose(const float *slots, int64_t s0, int64_t np, int h, int hv, int KC, int VC, int first_map,
                              float *prefix, float *wslots) {
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC), W = KC + VC;
#define RSLOT(j) (slots + ((s0 + (j)) * hv + h) * sz)
#define RPRE(j) (prefix + ((s0 + (j)) * hv + h) * KC * W)
    float *X = (float *)malloc(sizeof(float) * KC * W), *next = (float *)malloc(sizeof(float) * KC * W);
    for (int d = 0; d < KC; d++)
        for (int c = 0; c < W; c++)
            X[d * W + c] = c >= KC ? RSLOT(0)[KC * KC + d * VC + c - KC]
                           : first_map ? RSLOT(0)[kda_cuda_map_index(KC, c, d)] : 0.0f;
    /* without first_map the M columns are never written, and E's columns are also the slots' S_in(j + 1) */
#define RSTORE(j)                                                                                                      \
    do {                                                                                                               \
        for (int d = 0; d < KC; d++)                                                                                   \
            for (int c = first_map ? 0 : KC; c < W; c++) RPRE(j)[d * W + c] = X[d * W + c];                            \
        if (!first_map && (j) + 1 < np)                                                                                \
            for (int d = 0; d < KC; d++)                                                                               \
                for (int c = KC; c < W; c++) wslots[((s0 + (j) + 1) * hv + h) * sz + KC * KC + KC * VC + d * VC + c - KC] = X[d * W + c]; \
    } while (0)
    RSTORE(0);
    for (int64_t j = 1; j < np; j++) {
        const float *Mt = RSLOT(j), *E = RSLOT(j) + KC * KC;
        for (int d = 0; d < KC; d++)
            for (int c = 0; c < W; c++) {
                next[d * W + c] = step_product(Mt, X, KC, W, d, c) + (c >= KC ? E[d * VC + c - KC] : 0.0f);
            }
        memcpy(X, next, sizeof(float) * KC * W);
        RSTORE(j);
    }
#undef RSTORE
    free(X);
    free(next);
#undef RSLOT
#undef RPRE
}

/* store_map against kda_cuda_map_index: every lane's accumulators of every 16-column warp tile, stored as Mᵀ
 * (rows v) and as M (rows d), land where the merge reads element (r, c); returns the mismatches */
template <int KD>
static int check_store_map(void) {
    int bad = 0;
    float *dst = (float *)malloc(sizeof(float) * KD * KD);
    for (int rows_v = 0; rows_v < 2; rows_v++) {
        for (int i = 0; i < KD * KD; i++) dst[i] = NAN;
        for (int vw = 0; vw < KD; vw += 16)
            for (int lane = 0; lane < 32; lane++) {
                const int g = lane >> 2, t = lane & 3;
                float s[KD / 8][4];
                for (int nt = 0; nt < KD / 8; nt++)
                    for (int c = 0; c < 4; c++) /* X[d][v] = d * KD + v */
                        s[nt][c] = (float)((8 * nt + 2 * t + (c & 1)) * KD + vw + g + 8 * (c >> 1));
                store_map<KD>(dst, s, rows_v, vw, g, t);
            }
        for (int r = 0; r < KD; r++)
            for (int c = 0; c < KD; c++) {
                const float want = rows_v ? (float)(c * KD + r) : (float)(r * KD + c); /* Mᵀ(r, c) = X[c][r] */
                bad += !(dst[kda_cuda_map_index(KD, r, c)] == want);
            }
    }
    free(dst);
    return bad;
}

int main(int argc, char **argv) {
    const int cases = argc > 1 ? atoi(argv[1]) : 40;
    int bad = 0;
    const int sm = check_store_map<64>() + check_store_map<128>() + check_store_map<256>();
    printf("store_map (K 64, 128, 256; as Mᵀ and as M) against kda_cuda_map_index: %s\n",
           sm ? "MISMATCH" : "every element where the merge reads it");
    bad += sm != 0;
    long items = 0, ctas_total = 0;
    int64_t max_entries = 0;
    for (int c = 0; c < cases; c++) {
        const int KC = c % 5 == 4 ? 256 : (c / 2 % 2 ? 64 : 128), VC = c % 3 == 0 ? 64 : 128; /* compose too at each K */
        const int hv = 1 + (int)rnd(3);
        const int64_t P = 1 + rnd(4); /* chunks per piece */
        /* lengths: a few sequences, some long enough to split into up to ~6 pieces, some empty or short; every
           third case hundreds of them, mostly short (the table then spans several of the scan's blocks) */
        const int many = c % 3 == 2;
        const int64_t N = many ? 200 + rnd(500) : 1 + rnd(6);
        int64_t *cu = (int64_t *)malloc(sizeof(int64_t) * (N + 1));
        cu[0] = 0;
        for (int64_t n = 0; n < N; n++)
            cu[n + 1] = cu[n] + (many ? (rnd(40) == 0 ? rnd(64 * P * 4 + 1) : rnd(64 * P + 1))
                                      : (rnd(4) == 0 ? rnd(3) : rnd(64 * P * 6 + 1)));
        kda_cp_seqs_t s = {cu, 1, N, 0, cu[N]};
        int64_t total = 0, mx = 0;
        for (int64_t n = 0; n < N; n++) { const int64_t k = kda_cp_seq_chunks(&s, n); total += k; mx = k > mx ? k : mx; }
        kda_cp_problem_t cp = {};
        cp.num_seqs = N, cp.total_chunks = total, cp.max_chunks = mx, cp.num_v_heads = hv, cp.v_tiles = 1;
        cp.sm_count = c % 4 == 1 ? 2 : 132, cp.mode = KDA_CP_ON, cp.piece_len = 64 * P;
        const kda_cp_capacity_t cap = kda_cp_capacity(&cp, 1);
        kda_cp_piece_t *tab = (kda_cp_piece_t *)calloc((size_t)(cap.pieces > 0 ? cap.pieces : 1), sizeof *tab);
        const kda_cp_plan_t r = kda_cp_fill_table(&s, P, tab, cap.pieces);
        const int64_t sz = kda_cuda_cp_slot_floats(KC, VC), nfl = (cap.slots > 0 ? cap.slots : 1) * hv * sz;
        float *slots = (float *)malloc(sizeof(float) * nfl), *want = (float *)malloc(sizeof(float) * nfl);
        for (int64_t i = 0; i < nfl; i++) slots[i] = rndf() * (i % sz < KC * KC ? 2.0f / KC : 1.0f);
        for (int64_t sl = 0; sl < (cap.slots > 0 ? cap.slots : 1) * hv; sl++) /* the incoming states: poisoned */
            memset(slots + sl * sz + KC * KC + KC * VC, 0x7f, sizeof(float) * KC * VC);
        memcpy(want, slots, sizeof(float) * nfl);
        /* every other case composes (cross-rank CP's primed summary): the slots stay as they are, the prefix maps
           (poisoned first) are the output */
        const int compose = c % 2 == 1, first_map = c % 4 == 1;
        const int64_t npre = (cap.slots > 0 ? cap.slots : 1) * hv * KC * (KC + VC);
        float *prefix = (float *)malloc(sizeof(float) * npre), *want_pre = (float *)malloc(sizeof(float) * npre);
        memset(prefix, 0x7f, sizeof(float) * npre);
        memcpy(want_pre, prefix, sizeof(float) * npre);
        int64_t nsplit = 0;
        for (int64_t i = 0; i < r.num_pieces; i++)
            if ((tab[i].flags & KDA_CP_FIRST) && tab[i].slot >= 0) {
                nsplit++;
                for (int h = 0; h < hv; h++) {
                    if (compose)
                        reference_compose(slots, tab[i].slot, tab[i].seq_pieces, h, hv, KC, VC, first_map, want_pre, want);
                    else
                        reference(slots, tab[i].slot, tab[i].seq_pieces, h, hv, KC, VC, want);
                }
            }
        int64_t header[4] = {r.num_pieces, r.num_pieces > N || r.num_slots > 0 ? P : P, r.num_slots, 0};
        if (r.num_slots == 0) header[1] = c % 2 ? 0 : P; /* nothing split: P = 0 as the plan's fallback, or P */
        kda_cp_params_t p;
        memset(&p, 0, sizeof p);
        p.pb.seqs.cu_seqlens = cu, p.pb.seqs.cu_seqlens_64 = 1, p.pb.seqs.num_seqs = N, p.pb.seqs.num_tokens = cu[N];
        p.table = tab, p.header = header, p.slots = slots;
        p.compose = compose, p.first_map = first_map, p.prefix = prefix;
        p.cap_pieces = cap.pieces, p.cap_slots = cap.slots;
        p.mode = KDA_CP_ON, p.piece_len = 64 * P, p.pb.hv = hv, p.v_tiles = 1, p.sm_count = cp.sm_count, p.pb.kc = KC, p.pb.vc = VC;
        emu_ctas = 0;
        if (kda_cuda_launch_cp_merge(&p, 0, NULL) != 0) { printf("case %d: launcher failed\n", c); bad++; continue; }
        if (emu_ctas > 0) run_grid(&p);
        ctas_total += emu_ctas;
        if (r.num_pieces > max_entries) max_entries = r.num_pieces;
        items += nsplit * hv * ((VC + (compose && first_map ? KC : 0)) / 16);
        const int ok = !memcmp(slots, want, sizeof(float) * nfl) && !memcmp(prefix, want_pre, sizeof(float) * npre);
        if (!ok) {
            int64_t first = -1, nd = 0;
            for (int64_t i = 0; i < nfl; i++) if (memcmp(&slots[i], &want[i], 4)) { nd++; if (first < 0) first = i; }
            for (int64_t i = 0; i < npre; i++) nd += memcmp(&prefix[i], &want_pre[i], 4) != 0;
            printf("case %d (%s K %d V %d hv %d P %lld N %lld, %lld split, grid %lld): %lld floats differ, first at %lld\n",
                   c, compose ? "compose" : "merge", KC, VC, hv, (long long)P, (long long)N, (long long)nsplit, (long long)emu_ctas, (long long)nd,
                   (long long)first);
            bad++;
        }
        free(slots), free(want), free(tab), free(cu), free(prefix), free(want_pre);
    }
    printf("%d cases (%ld work items, %ld CTAs launched, tables of up to %lld entries): %s\n", cases, items, ctas_total,
           (long long)max_entries,
           bad ? "MISMATCH" : "the same incoming states and prefix maps, nothing else written");
    return bad != 0;
}
