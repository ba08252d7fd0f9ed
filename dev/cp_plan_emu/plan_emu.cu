/* Host emulation of cp_plan_cta (src/cuda/cp/cp_plan.cuh) at the block sizes it runs with (the planning kernel's 1024
 * threads, the prep kernel's 256 and 512), against the host's plan (src/cp_plan.h: kda_cp_piece_chunks and
 * kda_cp_fill_table) on random problems: the same piece table and header, entry for entry.
 *   dev/cp_plan_emu/run.sh [cases]   (g++ -x c++; no GPU) */
#include <stdio.h>
#include <stdlib.h>
#include "cp_plan.cuh" /* with this folder's common.cuh beside it (run.sh) */

__thread emu_dim threadIdx;
pthread_barrier_t emu_block_bar, emu_warp_bar[EMU_MAX_WARPS];
int64_t emu_warp_x[EMU_MAX_WARPS][32];

typedef struct { const kda_cp_params_t *p; int threads; unsigned tid; } emu_arg_t;
static int64_t g_smem[64]; /* scratch then red_max, NW entries each, as the prep kernel lays them out */

template <int T>
static void *emu_thread(void *a) {
    const emu_arg_t *e = (const emu_arg_t *)a;
    threadIdx.x = e->tid, threadIdx.y = threadIdx.z = 0;
    cp_plan_cta<T>(*e->p, g_smem, g_smem + T / 32);
    return NULL;
}

template <int T>
static void run_cta(const kda_cp_params_t *p) {
    pthread_t th[T];
    emu_arg_t args[T];
    memset(g_smem, 0x5a, sizeof g_smem); /* poisoned, as shared memory is not cleared */
    pthread_barrier_init(&emu_block_bar, NULL, T);
    for (int w = 0; w < T / 32; w++) pthread_barrier_init(&emu_warp_bar[w], NULL, 32);
    for (int i = 0; i < T; i++) {
        args[i].p = p, args[i].threads = T, args[i].tid = (unsigned)i;
        if (pthread_create(&th[i], NULL, emu_thread<T>, &args[i])) { fprintf(stderr, "pthread_create\n"); exit(2); }
    }
    for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&emu_block_bar);
    for (int w = 0; w < T / 32; w++) pthread_barrier_destroy(&emu_warp_bar[w]);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static int64_t rnd(int64_t n) { rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; return (int64_t)(rng % (uint64_t)n); }

int main(int argc, char **argv) {
    const int cases = argc > 1 ? atoi(argv[1]) : 200;
    int bad = 0, split = 0, fallback = 0;
    for (int c = 0; c < cases; c++) {
        /* lengths: one long sequence and short ones, or many mixed, or equal rows (no cu_seqlens) */
        const int kind = c % 3;
        const int64_t N = kind == 0 ? 1 + rnd(12) : kind == 1 ? 1 + rnd(3000) : 1 + rnd(4);
        int64_t *cu = (int64_t *)malloc(sizeof(int64_t) * (N + 1));
        cu[0] = 0;
        const int64_t seq_len = 64 * (1 + rnd(2048)) - rnd(64);
        for (int64_t n = 0; n < N; n++)
            cu[n + 1] = cu[n] + (kind == 0 && n == 0 ? 64 * (256 + rnd(2048)) - rnd(64) : rnd(kind == 1 ? 3000 : 5000));
        const int64_t tokens = kind == 2 ? N * seq_len : cu[N];
        kda_cp_params_t p;
        memset(&p, 0, sizeof p);
        p.seqs.cu_seqlens = kind == 2 ? NULL : cu;
        p.seqs.cu_seqlens_64 = 1;
        p.seqs.num_seqs = N;
        p.seqs.seq_len = kind == 2 ? seq_len : 0;
        p.seqs.num_tokens = tokens;
        p.mode = c % 7 == 3 ? KDA_CP_ON : KDA_CP_AUTO;
        p.piece_len = 64 * (1 + rnd(32));
        p.hv = 1 + (int)rnd(8);
        p.v_tiles = 1 + (int)rnd(2);
        p.sm_count = 132;
        p.prescan_pairs = (int)rnd(2);
        /* the host's plan (the reference), and the capacity from it, sometimes too small (the fallback to P = 0) */
        kda_cp_seqs_t s = {p.seqs.cu_seqlens, 1, N, p.seqs.seq_len, tokens};
        int64_t total = 0, mx = 0;
        for (int64_t n = 0; n < N; n++) { const int64_t k = kda_cp_seq_chunks(&s, n); total += k; mx = k > mx ? k : mx; }
        kda_cp_problem_t cp = {};
        cp.num_seqs = N, cp.total_chunks = total, cp.max_chunks = mx, cp.num_v_heads = p.hv, cp.v_tiles = p.v_tiles;
        cp.sm_count = p.sm_count, cp.mode = p.mode, cp.piece_len = p.piece_len, cp.prescan_pairs = p.prescan_pairs;
        int64_t P = kda_cp_piece_chunks(&cp);
        const kda_cp_capacity_t cap = kda_cp_capacity(&cp, 1);
        p.cap_pieces = cap.pieces, p.cap_slots = cap.slots;
        if (c % 11 == 5 && P > 0) p.cap_slots = cap.slots / 2; /* too small: the plan falls back to P = 0 */
        int64_t pieces = 0, slots = 0;
        for (int64_t n = 0; n < N; n++) { const int64_t k = kda_cp_seq_chunks(&s, n); pieces += kda_cp_seq_pieces(k, P); slots += kda_cp_seq_slots(k, P); }
        if (P > 0 && (pieces > p.cap_pieces || slots > p.cap_slots)) P = 0, fallback++;
        split += P > 0;
        const int64_t cap_entries = p.cap_pieces > N ? p.cap_pieces : N;
        kda_cp_piece_t *ref = (kda_cp_piece_t *)calloc((size_t)cap_entries, sizeof *ref);
        const kda_cp_plan_t r = kda_cp_fill_table(&s, P, ref, p.cap_pieces);
        for (int t = 0; t < 3; t++) {
            kda_cp_piece_t *tab = (kda_cp_piece_t *)malloc((size_t)cap_entries * sizeof *tab);
            memset(tab, 0xab, (size_t)cap_entries * sizeof *tab);
            int64_t header[4] = {-1, -1, -1, -1};
            p.table = tab, p.header = header;
            if (t == 0) run_cta<256>(&p); else if (t == 1) run_cta<512>(&p); else run_cta<1024>(&p);
            const int ok = header[0] == r.num_pieces && header[1] == P && header[2] == r.num_slots && header[3] == 0 &&
                           !memcmp(tab, ref, (size_t)(r.num_pieces < p.cap_pieces ? r.num_pieces : p.cap_pieces) * sizeof *tab);
            if (!ok) {
                bad++;
                printf("case %d (kind %d, N %lld, threads %d): header %lld %lld %lld %lld, host %lld %lld %lld\n", c, kind,
                       (long long)N, 256 << t, (long long)header[0], (long long)header[1], (long long)header[2],
                       (long long)header[3], (long long)r.num_pieces, (long long)P, (long long)r.num_slots);
            }
            free(tab);
        }
        free(ref);
        free(cu);
    }
    printf("%d cases (%d split, %d falling back to P = 0) x 3 block sizes: %s\n", cases, split, fallback,
           bad ? "MISMATCH" : "the same tables and headers");
    return bad != 0;
}
