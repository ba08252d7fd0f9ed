/*
 * The intra-card context parallelism planner (src/cp_plan.h): the decision's guards on the shapes of issue 9 and
 * of the forward benchmark, the forced modes, the piece table (every chunk once, in order, pieces inside their
 * sequence, short sequences whole), and the capacity bounds against the tables actually built.
 */
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "cp_plan.h"
#include "test_util.h"

#define H100_SMS 132

/* A problem of B equal rows of T tokens, or of the given varlen lengths. */
static kda_cp_problem_t shape(int64_t N, const int64_t *lens, int64_t T, int HV, int V, int sms) {
    kda_cp_problem_t p;
    memset(&p, 0, sizeof p);
    p.num_seqs = N;
    for (int64_t n = 0; n < N; n++) {
        const int64_t c = kda_cp_ceil_div(lens ? lens[n] : T, KDA_CHUNK);
        p.total_chunks += c;
        if (c > p.max_chunks) p.max_chunks = c;
    }
    p.num_v_heads = HV;
    p.v_tiles = kda_cp_v_tiles(V);
    p.sm_count = sms;
    p.mode = KDA_CP_AUTO;
    return p;
}

/* Pieces of the longest sequence, and the CTAs of (piece, head, tile) the plan launches. */
static void plan_stats(const kda_cp_problem_t *p, const int64_t *lens, int64_t T, int64_t P, int64_t *longest,
                       int64_t *ctas) {
    int64_t pieces = 0;
    *longest = 0;
    for (int64_t n = 0; n < p->num_seqs; n++) {
        const int64_t k = kda_cp_seq_pieces(kda_cp_ceil_div(lens ? lens[n] : T, KDA_CHUNK), P);
        pieces += k;
        if (k > *longest) *longest = k;
    }
    *ctas = pieces * p->num_v_heads * p->v_tiles;
}

/* A shape that must split: P at least the minimum piece, the longest sequence in several pieces, and the card
 * given between one and ~3 CTAs per SM (fewer when the pieces are of the minimum length). */
static void expect_split(const char *name, int64_t N, const int64_t *lens, int64_t T, int HV, int V) {
    kda_cp_problem_t p = shape(N, lens, T, HV, V, H100_SMS);
    const int64_t P = kda_cp_piece_chunks(&p);
    CHECK(P >= KDA_CP_MIN_PIECE_CHUNKS, "%s: P = %lld, expected a split", name, (long long)P);
    if (P <= 0) return;
    int64_t longest, ctas;
    plan_stats(&p, lens, T, P, &longest, &ctas);
    CHECK(longest >= 3, "%s: the longest sequence in only %lld pieces (P = %lld)", name, (long long)longest,
          (long long)P);
    /* the card filled to within one more piece of the longest sequence (its HV × tiles CTAs), unless the pieces
       are already as short as allowed, or the most pieces whose pre-scan fits one wave (rule 3's n1: one piece
       more would take it to two); at most ~1.5 waves */
    const int64_t units = (int64_t)HV * p.v_tiles, target = KDA_CP_CTAS_PER_SM * H100_SMS;
    const int one_wave_prescan = units * (2 * longest - 3) <= target && units * (2 * longest - 1) > target;
    CHECK((ctas + units > target || P == KDA_CP_MIN_PIECE_CHUNKS || one_wave_prescan) && ctas <= 3 * target / 2,
          "%s: %lld CTAs for %d SMs (P = %lld)", name, (long long)ctas, H100_SMS, (long long)P);
    /* sequences no longer than P stay whole */
    for (int64_t n = 0; n < N; n++) {
        const int64_t c = kda_cp_ceil_div(lens ? lens[n] : T, KDA_CHUNK);
        if (c <= P) CHECK(kda_cp_seq_pieces(c, P) == 1 && kda_cp_seq_slots(c, P) == 0, "%s: short seq split", name);
    }
}

static void expect_whole(const char *name, int64_t N, const int64_t *lens, int64_t T, int HV, int V) {
    kda_cp_problem_t p = shape(N, lens, T, HV, V, H100_SMS);
    CHECK(kda_cp_piece_chunks(&p) == 0, "%s: split with P = %lld, expected none", name,
          (long long)kda_cp_piece_chunks(&p));
}

/* Issue 9's shapes (K = V = 128). */
TEST(cp_plan_guards_issue_shapes) {
    expect_split("single T65536 H8", 1, NULL, 65536, 8, 128);
    expect_split("single T131072 H4", 1, NULL, 131072, 4, 128);
    expect_split("B1 T32768 H32", 1, NULL, 32768, 32, 128);
    expect_split("GVA single T65536 HV8", 1, NULL, 65536, 8, 128);
    int64_t mix[11] = {131072};
    for (int i = 1; i < 11; i++) mix[i] = 1024;
    expect_split("128K + 10x1K H4", 11, mix, 0, 4, 128);
    kda_cp_problem_t p = shape(11, mix, 0, 4, 128, H100_SMS);
    const int64_t P = kda_cp_piece_chunks(&p);
    CHECK(P > 1024 / KDA_CHUNK, "128K + 10x1K: P = %lld splits the 1K sequences", (long long)P);
    expect_whole("B2 T8192 H64", 2, NULL, 8192, 64, 128);
}

/* The forward benchmark's shapes (bench/bench_fla.py) that must keep today's path, and short sequences. */
TEST(cp_plan_guards_no_split) {
    expect_whole("B1 T8192 H64", 1, NULL, 8192, 64, 128);
    expect_whole("B8 T4096 H32", 8, NULL, 4096, 32, 128);
    expect_whole("B1 T512 H64", 1, NULL, 512, 64, 128);
    static const int64_t v6[] = {1300, 547, 2048, 963, 271, 3063};
    expect_whole("varlen6 H64", 6, v6, 0, 64, 128);
    static const int64_t v8[] = {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024};
    expect_whole("varlen 8x1024 H64", 8, v8, 0, 64, 128);
    expect_whole("GVA B2 T8192 HV64", 2, NULL, 8192, 64, 128);
    expect_whole("K256 B2 T8192 H32", 2, NULL, 8192, 32, 256);
    expect_whole("K64 B4 T4096 H32", 4, NULL, 4096, 32, 64);
    /* the longest sequence below KDA_CP_MIN_SEQ_CHUNKS: no split whatever the heads */
    expect_whole("B1 T4032 H1", 1, NULL, (KDA_CP_MIN_SEQ_CHUNKS - 1) * KDA_CHUNK, 1, 128);
    expect_split("B1 T4096 H1", 1, NULL, KDA_CP_MIN_SEQ_CHUNKS * KDA_CHUNK, 1, 128);
    /* a long sequence drowned in many others: the grid is full */
    int64_t many[200];
    for (int i = 0; i < 200; i++) many[i] = i == 0 ? 65536 : 4096;
    expect_whole("64K + 199x4K H4", 200, many, 0, 4, 128);
    /* the empty problem */
    expect_whole("N0", 0, NULL, 0, 4, 128);
    expect_whole("B3 T0", 3, NULL, 0, 4, 128);
}

/* The guard is on the (sequence, head, tile) grid: as HV grows, the split stops exactly where eff × 3 >= SMs. */
TEST(cp_plan_guard_fill_threshold) {
    for (int HV = 1; HV <= 64; HV++) {
        kda_cp_problem_t p = shape(1, NULL, 65536, HV, 128, H100_SMS);
        const int64_t P = kda_cp_piece_chunks(&p);
        const int full = HV * KDA_CP_FILL_DIV >= H100_SMS;
        CHECK(full ? P == 0 : P >= KDA_CP_MIN_PIECE_CHUNKS, "T65536 HV%d: P = %lld", HV, (long long)P);
    }
    /* V = 256 counts two tiles */
    kda_cp_problem_t p = shape(1, NULL, 65536, 30, 256, H100_SMS);
    CHECK(kda_cp_piece_chunks(&p) == 0, "T65536 HV30 V256: 60 tiles fill the card");
    p = shape(1, NULL, 65536, 30, 128, H100_SMS);
    CHECK(kda_cp_piece_chunks(&p) > 0, "T65536 HV30 V128: 30 tiles do not");
}

/* The backward's state-gradient chain (prescan_pairs, two tiles counted per head): n = floor(share + 3/2) pieces
 * of the longest sequence, whose 2n − 3 pre-scan chains per head fit one CTA per SM; no split at n <= 2. */
TEST(cp_plan_prescan_pairs) {
    struct { int HV; int64_t T; int64_t P; } cases[] = {
        {16, 32768, 103}, /* share 132 / 32 = 4.125: 5 pieces, 16 × 7 = 112 pre-scan CTAs, 80 piece CTAs */
        {8, 65536, 114},  /* share 8.25: 9 pieces, 8 × 15 = 120 pre-scan CTAs */
        {4, 131072, 114}, /* share 16.5: 18 pieces of ceil(2048 / 18) chunks, 4 × 33 = 132 pre-scan CTAs */
        {1, 65536, 16},   /* share 66: 67 pieces, ceil(1024 / 67) = 16 chunks each (>= the slot limit's 11) */
        {32, 32768, 0},   /* the fill guard (64 tiles × KDA_CP_FILL_DIV >= 132) */
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        kda_cp_problem_t p = shape(1, NULL, cases[i].T, cases[i].HV, 128, H100_SMS);
        p.v_tiles *= 2;
        p.prescan_pairs = 1;
        const int64_t P = kda_cp_piece_chunks(&p);
        CHECK(P == cases[i].P, "B1 T%lld H%d: P = %lld, expected %lld", (long long)cases[i].T, cases[i].HV,
              (long long)P, (long long)cases[i].P);
        if (P > 0) {
            const int64_t n = kda_cp_ceil_div(p.max_chunks, P);
            CHECK(cases[i].HV * (2 * n - 3) <= H100_SMS && n >= 3, "B1 T%lld H%d: %lld pieces",
                  (long long)cases[i].T, cases[i].HV, (long long)n);
        }
    }
    /* the forward's rule on the same problem (32 units): 3 pieces of 171 chunks, the pre-scan in one wave */
    kda_cp_problem_t p = shape(1, NULL, 32768, 16, 128, H100_SMS);
    p.v_tiles *= 2;
    CHECK(kda_cp_piece_chunks(&p) == 171, "without prescan_pairs: P = %lld", (long long)kda_cp_piece_chunks(&p));
}

/* The forward's rule 3 on single sequences, 132 SMs: the fill count n, or n1 (the most pieces whose 2n − 3
 * pre-scan chains per head fit one wave) where kda_cp_fwd_cost finds it cheaper; each case's expected choice was
 * measured on an H200 as the best of its forced lengths (bench/cp_sweep.py). */
TEST(cp_plan_prescan_wave) {
    struct { int HV; int64_t T; int64_t P; } cases[] = {
        {32, 32768, 171},  /* n 4 (160 pre-scan CTAs: 2 waves) against n1 3 (96): 3 × 171 */
        {32, 16384, 86},   /* likewise at 256 chunks */
        {24, 16384, 64},   /* n 5 (168 pre-scan CTAs) against n1 4 (120) */
        {16, 32768, 64},   /* n 8 (208: 2 waves) keeps its shorter pieces against n1 5 (103 chunks) */
        {16, 65536, 128},  /* n 8 against n1 5 (205 chunks) */
        {8, 65536, 64},    /* n 16 against n1 9 (114 chunks) */
        {4, 131072, 63},   /* n 33 against n1 18 */
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        kda_cp_problem_t p = shape(1, NULL, cases[i].T, cases[i].HV, 128, H100_SMS);
        const int64_t P = kda_cp_piece_chunks(&p);
        CHECK(P == cases[i].P, "T%lld H%d: P = %lld, expected %lld", (long long)cases[i].T, cases[i].HV,
              (long long)P, (long long)cases[i].P);
    }
    /* the cost: two pre-scan waves of 128 against one of 171, and the pieces' wave of each */
    CHECK(kda_cp_fwd_cost(512, 32, 132, 4) == (20 + KDA_CP_PIECE_STEP_X10) * 128 &&
              kda_cp_fwd_cost(512, 32, 132, 3) == (10 + KDA_CP_PIECE_STEP_X10) * 171,
          "kda_cp_fwd_cost: %lld, %lld", (long long)kda_cp_fwd_cost(512, 32, 132, 4),
          (long long)kda_cp_fwd_cost(512, 32, 132, 3));
}

TEST(cp_plan_forced_modes) {
    kda_cp_problem_t p = shape(1, NULL, 65536, 8, 128, H100_SMS);
    p.mode = KDA_CP_OFF;
    CHECK(kda_cp_piece_chunks(&p) == 0, "off splits");
    p = shape(2, NULL, 8192, 64, 128, H100_SMS); /* auto: no split */
    p.mode = KDA_CP_ON;
    p.piece_len = 64;
    CHECK(kda_cp_piece_chunks(&p) == 1, "on, 64 tokens: %lld", (long long)kda_cp_piece_chunks(&p));
    p.piece_len = 640;
    CHECK(kda_cp_piece_chunks(&p) == 10, "on, 640 tokens");
    p.piece_len = KDA_CP_MAX_PIECE_LEN; /* longer than every sequence: the split path with whole sequences */
    CHECK(kda_cp_piece_chunks(&p) == KDA_CP_MAX_PIECE_LEN / KDA_CHUNK, "on, max");
    p = shape(1, NULL, 100, 1, 128, H100_SMS); /* a short sequence, forced */
    p.mode = KDA_CP_ON;
    p.piece_len = 64;
    CHECK(kda_cp_piece_chunks(&p) == 1, "on, short sequence");
}

/* ---------------------------------------------------------------------------------------------------------
 * The table
 * ------------------------------------------------------------------------------------------------------- */
static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

/* Check a table against the sequences: every chunk once, in order; pieces inside their sequence, of at most P
 * chunks (whole sequences when they are no longer than P), token ranges matching chunk ranges; indices, flags
 * and slots consistent. */
static void check_table(const char *what, const kda_cp_seqs_t *s, int64_t P, const kda_cp_piece_t *t,
                        kda_cp_plan_t r) {
    int64_t chunk = 0, e = 0, slot = 0, whole = 0; /* e: entries seen; the split pieces first, at their slots */
    for (int64_t n = 0; n < s->num_seqs; n++) {
        int64_t bos, eos;
        kda_cp_seq_bounds(s, n, &bos, &eos);
        const int64_t c = kda_cp_ceil_div(eos - bos, KDA_CHUNK);
        const int64_t k = kda_cp_seq_pieces(c, P);
        const int split = P > 0 && c > P;
        CHECK(k >= 1, "%s: seq %lld has no piece", what, (long long)n);
        int64_t tok = bos;
        for (int64_t j = 0; j < k; j++, e++) {
            const int64_t ei = split ? slot : r.num_slots + whole; /* where cp_plan.h's order puts it */
            if (ei >= r.num_pieces) {
                CHECK(0, "%s: table ends inside seq %lld", what, (long long)n);
                return;
            }
            const kda_cp_piece_t *x = &t[ei];
            CHECK(x->seq == n && x->index == j && x->seq_pieces == k, "%s: piece %lld: seq %lld index %lld of %lld, "
                  "expected seq %lld index %lld of %lld", what, (long long)ei, (long long)x->seq, (long long)x->index,
                  (long long)x->seq_pieces, (long long)n, (long long)j, (long long)k);
            CHECK(x->chunk0 == chunk, "%s: piece %lld starts at chunk %lld, expected %lld", what, (long long)ei,
                  (long long)x->chunk0, (long long)chunk);
            CHECK(x->num_chunks >= (c > 0) && (split ? x->num_chunks <= P : x->num_chunks == c),
                  "%s: piece %lld has %lld chunks (P = %lld, sequence %lld chunks)", what, (long long)ei,
                  (long long)x->num_chunks, (long long)P, (long long)c);
            CHECK(x->bos == tok && x->eos > x->bos - (c == 0) && x->eos <= eos, "%s: piece %lld tokens [%lld, %lld), "
                  "expected from %lld within [%lld, %lld)", what, (long long)ei, (long long)x->bos, (long long)x->eos,
                  (long long)tok, (long long)bos, (long long)eos);
            CHECK(kda_cp_ceil_div(x->eos - x->bos, KDA_CHUNK) == x->num_chunks &&
                  (x->eos == eos || x->eos - x->bos == x->num_chunks * KDA_CHUNK),
                  "%s: piece %lld: tokens and chunks disagree", what, (long long)ei);
            const int64_t flags = (j == 0 ? KDA_CP_FIRST : 0) | (j == k - 1 ? KDA_CP_LAST : 0);
            CHECK(x->flags == flags, "%s: piece %lld flags %lld, expected %lld", what, (long long)ei,
                  (long long)x->flags, (long long)flags);
            CHECK(x->slot == (split ? slot : -1), "%s: piece %lld slot %lld, expected %lld", what, (long long)ei,
                  (long long)x->slot, (long long)(split ? slot : -1));
            if (split) slot++;
            else whole++;
            chunk += x->num_chunks;
            tok = x->eos;
        }
        CHECK(tok == eos, "%s: seq %lld covered up to %lld of [%lld, %lld)", what, (long long)n, (long long)tok,
              (long long)bos, (long long)eos);
    }
    CHECK(e == r.num_pieces && slot == r.num_slots && chunk == r.num_chunks,
          "%s: %lld pieces %lld slots %lld chunks, plan says %lld %lld %lld", what, (long long)e, (long long)slot,
          (long long)chunk, (long long)r.num_pieces, (long long)r.num_slots, (long long)r.num_chunks);
}

/* A random varlen problem: lengths drawn around the chunk edges, empty ones, and a few long ones. */
static int64_t random_lens(uint64_t *rng, int64_t *lens, int64_t max_n) {
    const int64_t N = 1 + (int64_t)(rng_next(rng) % (uint64_t)max_n);
    static const int64_t edges[] = {0, 1, 63, 64, 65, 127, 128, 129, 511, 512, 513};
    for (int64_t n = 0; n < N; n++) {
        const uint64_t r = rng_next(rng) % 10;
        lens[n] = r < 5 ? edges[rng_next(rng) % 11] : r < 8 ? (int64_t)(rng_next(rng) % 3000)
                                                           : (int64_t)(rng_next(rng) % 40000);
    }
    return N;
}

/* Every P over random problems: the table is right, and never exceeds either capacity. */
TEST(cp_plan_table_covers_every_chunk) {
    uint64_t rng = 12345;
    int64_t lens[64], cu[65];
    int32_t cu32[65];
    kda_cp_piece_t *t = malloc(sizeof(kda_cp_piece_t) * 20000);
    static const int64_t Ps[] = {0, 1, 2, 3, 8, 33, 1000};
    for (int it = 0; it < 200; it++) {
        const int64_t N = random_lens(&rng, lens, 64);
        cu[0] = 0;
        for (int64_t n = 0; n < N; n++) cu[n + 1] = cu[n] + lens[n];
        for (int64_t n = 0; n <= N; n++) cu32[n] = (int32_t)cu[n];
        kda_cp_seqs_t s = {cu, 1, N, 0, cu[N]};
        kda_cp_seqs_t s32 = {cu32, 0, N, 0, cu[N]};
        for (int pi = 0; pi < 7; pi++) {
            const int64_t P = Ps[pi];
            char what[96];
            snprintf(what, sizeof what, "iteration %d, N %lld, P %lld", it, (long long)N, (long long)P);
            kda_cp_plan_t r = kda_cp_fill_table(&s, P, t, 20000);
            CHECK(r.num_pieces <= 20000, "%s: table too small for the test", what);
            check_table(what, &s, P, t, r);
            /* the int32 offsets give the same table */
            kda_cp_piece_t *t32 = malloc(sizeof(kda_cp_piece_t) * (size_t)r.num_pieces + 1);
            kda_cp_plan_t r32 = kda_cp_fill_table(&s32, P, t32, r.num_pieces);
            CHECK(r32.num_pieces == r.num_pieces && memcmp(t32, t, sizeof(kda_cp_piece_t) * (size_t)r.num_pieces) == 0,
                  "%s: int32 offsets give another table", what);
            free(t32);
            /* capacities: with the exact lengths, and from num_tokens and num_seqs alone (forced P) */
            kda_cp_problem_t p;
            memset(&p, 0, sizeof p);
            p.num_seqs = N;
            kda_cp_chunk_counts(&s, &p.total_chunks, &p.max_chunks);
            p.num_v_heads = 4;
            p.v_tiles = 1;
            p.sm_count = H100_SMS;
            p.mode = P == 0 ? KDA_CP_OFF : KDA_CP_ON;
            p.piece_len = P * KDA_CHUNK;
            kda_cp_capacity_t exact = kda_cp_capacity(&p, 1);
            kda_cp_chunk_bounds(cu[N], N, &p.total_chunks, &p.max_chunks);
            kda_cp_capacity_t bound = kda_cp_capacity(&p, 0);
            CHECK(r.num_pieces <= exact.pieces && r.num_slots <= exact.slots, "%s: %lld pieces %lld slots > exact "
                  "capacity %lld %lld", what, (long long)r.num_pieces, (long long)r.num_slots,
                  (long long)exact.pieces, (long long)exact.slots);
            CHECK(r.num_pieces <= bound.pieces && r.num_slots <= bound.slots, "%s: %lld pieces %lld slots > "
                  "capacity from T and N %lld %lld", what, (long long)r.num_pieces, (long long)r.num_slots,
                  (long long)bound.pieces, (long long)bound.slots);
        }
    }
    free(t);
}

/* Auto mode on random problems, heads and SM counts: the table of the decided P stays within the capacity
 * computed from num_tokens and num_seqs alone (the device-planning case) and within the slot limit. */
TEST(cp_plan_capacity_auto_random) {
    uint64_t rng = 777;
    int64_t lens[64], cu[65];
    kda_cp_piece_t *t = malloc(sizeof(kda_cp_piece_t) * 20000);
    static const int sms[] = {1, 16, 78, 114, 132, 148};
    int splits = 0;
    for (int it = 0; it < 3000; it++) {
        const int64_t N = random_lens(&rng, lens, it % 3 == 0 ? 3 : 64);
        cu[0] = 0;
        for (int64_t n = 0; n < N; n++) cu[n + 1] = cu[n] + lens[n] * (1 + (int64_t)(it % 7 == 0) * 7);
        kda_cp_seqs_t s = {cu, 1, N, 0, cu[N]};
        kda_cp_problem_t p;
        memset(&p, 0, sizeof p);
        p.num_seqs = N;
        kda_cp_chunk_counts(&s, &p.total_chunks, &p.max_chunks);
        p.num_v_heads = 1 + (int32_t)(rng_next(&rng) % 48);
        p.v_tiles = 1 + (int32_t)(rng_next(&rng) % 2);
        p.sm_count = sms[rng_next(&rng) % 6];
        p.mode = KDA_CP_AUTO;
        const int64_t P = kda_cp_piece_chunks(&p);
        CHECK(P == 0 || (P >= KDA_CP_MIN_PIECE_CHUNKS && P < p.max_chunks), "it %d: P = %lld (max %lld)", it,
              (long long)P, (long long)p.max_chunks);
        splits += P > 0;
        kda_cp_plan_t r = kda_cp_fill_table(&s, P, t, 20000);
        kda_cp_capacity_t exact = kda_cp_capacity(&p, 1);
        kda_cp_chunk_bounds(cu[N], N, &p.total_chunks, &p.max_chunks);
        kda_cp_capacity_t bound = kda_cp_capacity(&p, 0);
        CHECK(r.num_pieces <= exact.pieces && r.num_slots <= exact.slots && r.num_pieces <= bound.pieces &&
              r.num_slots <= bound.slots, "it %d (N %lld HV %d tiles %d SMs %d, P %lld): %lld pieces %lld slots; "
              "capacity exact %lld %lld, from T and N %lld %lld", it, (long long)N, p.num_v_heads, p.v_tiles,
              p.sm_count, (long long)P, (long long)r.num_pieces, (long long)r.num_slots, (long long)exact.pieces,
              (long long)exact.slots, (long long)bound.pieces, (long long)bound.slots);
        CHECK(r.num_slots <= kda_cp_auto_slot_limit(&p), "it %d: %lld slots over the auto limit %lld", it,
              (long long)r.num_slots, (long long)kda_cp_auto_slot_limit(&p));
        if (P > 0) check_table("auto", &s, P, t, r);
    }
    CHECK(splits > 100 && splits < 2900, "only %d of 3000 random problems split: the test covers too little", splits);
    free(t);
}

/* Equal rows: chunk0 of row n is n ceil(T / C), every row split alike. */
TEST(cp_plan_equal_rows) {
    kda_cp_seqs_t s = {NULL, 0, 3, 1000, 3000};
    kda_cp_piece_t t[16];
    kda_cp_plan_t r = kda_cp_fill_table(&s, 5, t, 16);
    CHECK(r.num_pieces == 12 && r.num_chunks == 48 && r.num_slots == 12, "%lld pieces %lld chunks %lld slots",
          (long long)r.num_pieces, (long long)r.num_chunks, (long long)r.num_slots);
    check_table("B3 T1000 P5", &s, 5, t, r);
    CHECK(t[4].seq == 1 && t[4].chunk0 == 16 && t[4].bos == 1000 && t[3].num_chunks == 1 && t[3].eos == 1000,
          "row boundaries");
}

/* Short sequences stay whole, with no storage slot; an empty sequence has one empty piece. */
TEST(cp_plan_short_seqs_whole) {
    static const int64_t cu[] = {0, 640, 640, 641, 641 + 64 * 30, 641 + 64 * 30 + 10};
    kda_cp_seqs_t s = {cu, 1, 5, 0, cu[5]};
    kda_cp_piece_t t[16];
    kda_cp_plan_t r = kda_cp_fill_table(&s, 10, t, 16);
    check_table("mixed", &s, 10, t, r);
    CHECK(r.num_pieces == 7 && r.num_slots == 3, "%lld pieces %lld slots", (long long)r.num_pieces,
          (long long)r.num_slots);
    /* the split sequence's pieces first, at their slots; then the whole sequences in order */
    CHECK(t[0].seq == 3 && t[0].slot == 0 && t[1].slot == 1 && t[2].slot == 2 && t[2].flags == KDA_CP_LAST,
          "the split one");
    CHECK(t[3].seq == 0 && t[3].num_chunks == 10 && t[3].slot == -1 && t[3].flags == (KDA_CP_FIRST | KDA_CP_LAST),
          "exactly P: whole");
    CHECK(t[4].num_chunks == 0 && t[4].bos == 640 && t[4].eos == 640 && t[4].slot == -1, "empty sequence");
    CHECK(t[5].seq == 2 && t[6].seq == 4, "the whole sequences in order");
}

/* Device offsets cannot be validated: non-monotone or out-of-range ones are clamped into [0, num_tokens], so
 * every piece stays inside the tokens; overlapping clamped ranges may hold more chunks than num_tokens allows, so
 * the table is never written past its capacity (the plan's count may exceed it: the caller clamps). */
TEST(cp_plan_clamps_bad_offsets) {
    static const int64_t cu[] = {-50, 700, 300, 100000, 900, 1000};
    kda_cp_seqs_t s = {cu, 1, 5, 0, 1000};
    kda_cp_piece_t t[64];
    kda_cp_plan_t r = kda_cp_fill_table(&s, 1, t, 64);
    CHECK(r.num_pieces <= 64, "test table too small");
    check_table("bad offsets", &s, 1, t, r);
    for (int64_t e = 0; e < r.num_pieces; e++)
        CHECK(t[e].bos >= 0 && t[e].eos <= 1000 && t[e].bos <= t[e].eos, "piece %lld outside the tokens",
              (long long)e);
    kda_cp_problem_t p;
    memset(&p, 0, sizeof p);
    p.num_seqs = 5;
    p.num_v_heads = 1;
    p.v_tiles = 1;
    p.sm_count = H100_SMS;
    p.mode = KDA_CP_ON;
    p.piece_len = 64;
    kda_cp_chunk_bounds(1000, 5, &p.total_chunks, &p.max_chunks);
    const int64_t cap = kda_cp_capacity(&p, 0).pieces;
    CHECK(cap < r.num_pieces, "the overlapping offsets should exceed the bound (%lld, %lld)", (long long)cap,
          (long long)r.num_pieces);
    memset(t, 0xab, sizeof t);
    r = kda_cp_fill_table(&s, 1, t, cap);
    const unsigned char *bytes = (const unsigned char *)&t[cap];
    int untouched = 1;
    for (size_t i = 0; i < sizeof(kda_cp_piece_t) * (size_t)(64 - cap); i++) untouched &= bytes[i] == 0xab;
    CHECK(untouched, "entry past the capacity written");
}

/* Workspace growth: M, S_ext and the incoming state in fp32 per piece and value head. */
TEST(cp_plan_slot_bytes) {
    CHECK(kda_cp_slot_head_bytes(128, 128) == 196608, "K = V = 128");
    CHECK(kda_cp_slot_head_bytes(128, 128) / (KDA_CP_MIN_PIECE_CHUNKS * KDA_CHUNK) == 384, "per token-head");
    CHECK(kda_cp_slot_head_bytes(64, 64) == 49152 && kda_cp_slot_head_bytes(256, 256) == 786432, "64, 256");
    /* auto mode: the slots of a call are bounded independently of its length */
    kda_cp_problem_t p = shape(1, NULL, (int64_t)1 << 24, 4, 128, H100_SMS);
    kda_cp_chunk_bounds((int64_t)1 << 24, 1, &p.total_chunks, &p.max_chunks);
    kda_cp_capacity_t c = kda_cp_capacity(&p, 0);
    const int64_t target_pieces = (KDA_CP_CTAS_PER_SM * H100_SMS + 3) / 4; /* ceil(target / 4 heads) */
    CHECK(c.slots == kda_cp_auto_slot_limit(&p) && c.slots == KDA_CP_SLOTS_PER_TARGET * target_pieces,
          "16M tokens H4: %lld slots", (long long)c.slots);
}

/* From a checked problem: exact chunk counts when the host can read the lengths, the bounds otherwise; the
 * caller's mode and piece length carried over; the workspace of the capacity. */
TEST(cp_plan_problem_from_args) {
    static const int64_t lens[] = {5000, 0, 64, 65};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 4;
    c.seqlens = lens;
    c.hv = 3;
    c.k = 64;
    c.v = 200;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    a.cp_mode = KDA_CP_ON;
    a.cp_piece_len = 640;
    kda_problem_t p;
    CHECK(kda_check_args(NULL, &a, "test", 1, &p) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    kda_cp_problem_t cp;
    CHECK(kda_cp_problem_from(&p, 132, a.cu_seqlens, &cp) == 1, "host offsets: exact");
    CHECK(cp.total_chunks == 79 + 0 + 1 + 2 && cp.max_chunks == 79, "exact counts %lld %lld",
          (long long)cp.total_chunks, (long long)cp.max_chunks);
    CHECK(cp.num_seqs == 4 && cp.num_v_heads == 3 && cp.v_tiles == 2 && cp.sm_count == 132, "shape");
    CHECK(cp.mode == KDA_CP_ON && cp.piece_len == 640 && kda_cp_piece_chunks(&cp) == 10, "mode");
    kda_cp_capacity_t cap = kda_cp_capacity(&cp, 1);
    CHECK(cap.pieces == 4 + 8 && cap.slots == 8 + 7, "capacity %lld %lld", (long long)cap.pieces,
          (long long)cap.slots);
    CHECK(kda_cp_workspace_bytes(cap, 3, 64, 200) == 1024 + 15 * 3 * 4 * (64 * 64 + 2 * 64 * 200), "bytes %lld",
          (long long)kda_cp_workspace_bytes(cap, 3, 64, 200));
    CHECK(kda_cp_problem_from(&p, 132, NULL, &cp) == 0, "device offsets: bounds");
    CHECK(cp.total_chunks == (5129 + 63 * 4) / 64 && cp.max_chunks == (5129 + 63) / 64, "bounds %lld %lld",
          (long long)cp.total_chunks, (long long)cp.max_chunks);
    kda_synth_free(&s);

    kda_synth_defaults(&c); /* equal rows: exact without offsets */
    c.batch = 3;
    c.seq_len = 1000;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    CHECK(kda_check_args(NULL, &a, "test", 1, &p) == KDA_STATUS_SUCCESS, "%s", kda_last_error());
    CHECK(kda_cp_problem_from(&p, 132, NULL, &cp) == 1 && cp.total_chunks == 48 && cp.max_chunks == 16 &&
          cp.mode == KDA_CP_AUTO, "equal rows");
    kda_synth_free(&s);
}
