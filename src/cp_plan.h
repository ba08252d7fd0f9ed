/*
 * Intra-card context parallelism (CP): the plan. docs/ALGORITHM.md §4 has the mathematics and the policy.
 *
 * A long sequence is cut into pieces of P whole chunks (C = KDA_CHUNK tokens each; a sequence's last piece may be
 * shorter). Each piece's affine map of the state, S_out = M S_in + S_ext, is computed from a zero state in
 * parallel (pre-scan); a short scan over the pieces of each sequence gives every piece its incoming state
 * (merge); then the pieces' chunk recurrences run in parallel. Chunks are numbered globally, sequence after
 * sequence, as the CUDA forward numbers them (src/cuda/common/seq.cuh): equal rows, chunk0(n) = n ceil(T / C); varlen,
 * chunk0(n) = Σ_{m<n} ceil(len_m / C) (meta.cu's chunk_offsets).
 *
 *   kda_cp_piece_chunks   the decision: P in chunks (0 = no split), from the chunk counts, heads and SMs
 *   kda_cp_capacity       upper bounds of the table's entries and of the pieces that need storage (M, S_ext,
 *                         incoming state), from num_tokens and num_seqs alone when the lengths are on the
 *                         device: workspace sizes and worst-case launch grids
 *   kda_cp_fill_table     the piece table from the sequence bounds; kda_cp_write_seq writes one sequence's
 *                         pieces, for a planning kernel that scans over sequences in parallel. The table holds
 *                         the pieces of split sequences first, entry e being the piece of storage slot e, then
 *                         the whole sequences: so the pre-scan, which has work only in slots, is launched over
 *                         the slots' capacity and finds its entry without a search
 *
 * Header-only and plain C (no allocation, no callbacks, no globals): every function is KDA_HD static inline, so
 * that host code, one CUDA thread or a one-CTA planning kernel run the very same code. Device contents of
 * cu_seqlens cannot be validated without a host sync, so the bounds are clamped as seq.cuh clamps them: a bad
 * offset never gives a piece outside [0, num_tokens) nor more pieces than the capacity.
 */
#ifndef KDA_CP_PLAN_H
#define KDA_CP_PLAN_H

#include <stdint.h>

#include "internal.h" /* KDA_CHUNK */

#ifndef KDA_HD
#ifdef __CUDACC__
#define KDA_HD __host__ __device__
#else
#define KDA_HD
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------------------
 * The policy's constants (each one's reason; docs/ALGORITHM.md §4 gives the cost model behind them)
 * ------------------------------------------------------------------------------------------------------- */

/* CTAs of (piece, value head, V tile) the split aims for per SM. One: pieces twice as long at one CTA per SM beat
 * two CTAs per SM, since every piece adds pre-scan and merge work, and two CTAs on one SM share its bandwidth and
 * issue slots rather than hide each other's chain. */
#define KDA_CP_CTAS_PER_SM 1
/* The shortest piece the library chooses, in chunks. A piece costs its pre-scan (M is K×K: about twice a chunk
 * step's state work) plus one merge step and two extra launches per call; below ~8 chunks that overhead is as
 * large as the chain it removes. (KDA_CP_ON may force pieces down to one chunk, for tests.) */
#define KDA_CP_MIN_PIECE_CHUNKS 8
/* No split unless the longest sequence has at least this many chunks (4096 tokens): a chain of 64 chunk steps
 * split into 8 pieces of 8 saves ~2x on the recurrence, about the cost of the extra launches and the pre-scan;
 * shorter chains save less than that. */
#define KDA_CP_MIN_SEQ_CHUNKS 64
/* No split when, without one, the card already averages sm_count / KDA_CP_FILL_DIV busy 128-column CTAs:
 * eff = (total_chunks / max_chunks) × HV × tiles. With one CTA per SM the longest sequence gets n ≈ sm / eff
 * pieces of P = max / n chunks, and a split's chain costs about three of P (the pre-scan, whose M is K×K, about
 * two; the pieces one), so it pays from n = 4: eff × 4 < sm (n = 2 or 3 pieces cost more than they save). */
#define KDA_CP_FILL_DIV 4
/* A chunk step of the pieces pass against one of the pre-scan, × 10 (rule 3's wave count). The pieces step also
 * makes o (QΓ S, Aqk); the pre-scan's M and E steps run in CTAs of their own. Forced sweeps of five shapes
 * order as the cost model says for any ratio in 0.65–1.9; 1.3 is their middle. */
#define KDA_CP_PIECE_STEP_X10 13
/* Columns of the V tile in which work is counted: the recurrence's widest tile. A narrower tile (the baseline
 * picks 32 columns for few heads) does not shorten a chain, and each tile reloads the chunk's W, QΓ, K̃: the
 * work of a head is ceil(V / 128) tiles whatever tile the recurrence runs. */
#define KDA_CP_TILE_COLS 128
/* The pieces that need storage (those of split sequences) are at most this many times the target piece count
 * (KDA_CP_CTAS_PER_SM × sm_count / (HV × tiles)) in auto mode: the piece length is raised where needed to keep
 * them there, which bounds the workspace by a constant independent of the sequence length. */
#define KDA_CP_SLOTS_PER_TARGET 3

/* Piece flags */
#define KDA_CP_FIRST 1 /* the first piece of its sequence: its incoming state is the sequence's initial state */
#define KDA_CP_LAST 2  /* the last piece of its sequence: its outgoing state is the final state */

/* ---------------------------------------------------------------------------------------------------------
 * The decision
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_cp_problem {
    int64_t num_seqs;      /* N */
    int64_t total_chunks;  /* Σ_n ceil(len_n / C); or its upper bound (kda_cp_chunk_bounds) */
    int64_t max_chunks;    /* max_n ceil(len_n / C); or its upper bound */
    int32_t num_v_heads;   /* HV */
    int32_t v_tiles;       /* V tiles of KDA_CP_TILE_COLS columns per head: kda_cp_v_tiles(V) */
    int32_t sm_count;      /* the device's multiprocessors */
    int32_t mode;          /* kda_cp_mode_t: KDA_CP_AUTO, KDA_CP_OFF or KDA_CP_ON */
    int64_t piece_len;     /* KDA_CP_ON: tokens per piece (validated: a multiple of C in [C, KDA_CP_MAX_PIECE_LEN]) */
    int32_t prescan_pairs; /* the backward's state-gradient chain (v_tiles then counts its two chains per tile): a
                              piece's pre-scan runs two chains (M beside E) but a sequence's last piece one (E) and
                              its first none; rule 3 counts them so (0: the forward) */
} kda_cp_problem_t;

KDA_HD static inline int64_t kda_cp_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
KDA_HD static inline int64_t kda_cp_max64(int64_t a, int64_t b) { return a > b ? a : b; }
KDA_HD static inline int64_t kda_cp_min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* V tiles of KDA_CP_TILE_COLS columns of a head of V columns (at least 1). */
KDA_HD static inline int32_t kda_cp_v_tiles(int32_t head_dim_v) {
    return head_dim_v <= KDA_CP_TILE_COLS ? 1 : (int32_t)kda_cp_ceil_div(head_dim_v, KDA_CP_TILE_COLS);
}

/* Pieces of storage the auto mode allows (KDA_CP_SLOTS_PER_TARGET times the target piece count). */
KDA_HD static inline int64_t kda_cp_auto_slot_limit(const kda_cp_problem_t *p) {
    const int64_t units = kda_cp_max64(1, (int64_t)p->num_v_heads * kda_cp_max64(1, p->v_tiles));
    const int64_t target = (int64_t)KDA_CP_CTAS_PER_SM * kda_cp_max64(1, p->sm_count);
    return KDA_CP_SLOTS_PER_TARGET * kda_cp_ceil_div(target, units);
}

/* The piece length in chunks for this problem, 0 for no split (one serial chain per sequence and head).
 *   KDA_CP_OFF: 0. KDA_CP_ON: piece_len / C, whatever the shape (sequences no longer than it stay whole).
 *   KDA_CP_AUTO, in order:
 *     1. the longest sequence has fewer than KDA_CP_MIN_SEQ_CHUNKS chunks: 0 (too short to pay for a split);
 *     2. the unsplit grid already keeps the card busy, eff × KDA_CP_FILL_DIV >= sm_count: 0;
 *     3. the pieces of the longest sequence: n = floor(max × target / (total_chunks × HV × tiles)), target =
 *        KDA_CP_CTAS_PER_SM × sm_count, the most that keeps the pieces of all sequences within the target (a
 *        piece more would start a second wave of CTAs: 17 pieces of one head on 132 SMs take longer than 16);
 *        n ≤ 1: 0;
 *        the forward then weighs that n against n1, the most pieces whose pre-scan (2n − 3 chains per head and
 *        tile: E of every piece but the last, M of every piece but the first and last) fits one wave: at n its
 *        pre-scan may take two waves of P steps before the pieces' one. kda_cp_fwd_cost counts both, and the
 *        cheaper wins (B1 T32768 H32 on 132 SMs: 4 pieces of 128 chunks cost 2 × 128 + 1.3 × 128, 3 of 171 cost
 *        171 + 1.3 × 171: 3 pieces, 96 pre-scan CTAs instead of 160; T65536 H8 keeps 16 of 64);
 *        with prescan_pairs (the backward's chain: 2n − 3 pre-scan chains for n pieces, as many as one CTA per SM
 *        takes when 2n − 3 <= 2 × that share, v_tiles counting two per tile): n = floor(share + 3/2), and n <= 2
 *        is no split (two pieces: the last piece's pre-scan is as long as the pieces' pass, nothing saved); B1
 *        T32768 H16 on 132 SMs: share 4.125, 5 pieces of 103 chunks, 112 pre-scan and 80 piece CTAs;
 *     4. balanced: P = ceil(max / n), at least KDA_CP_MIN_PIECE_CHUNKS;
 *     5. raised where needed so that the pieces of split sequences stay within kda_cp_auto_slot_limit;
 *     6. P >= max_chunks (nothing would be split): 0.
 * Only sequences longer than P are split; in a mixed batch the short ones stay whole. */
/* Rule 4: n balanced pieces of the longest sequence of max_c chunks, P chunks each (at least the minimum). */
KDA_HD static inline int64_t kda_cp_balanced_len(int64_t max_c, int64_t n) {
    return kda_cp_max64(KDA_CP_MIN_PIECE_CHUNKS, kda_cp_ceil_div(max_c, n));
}

/* Rule 3's cost of the forward's split into n pieces of the longest sequence of max_c chunks, in pre-scan chunk
 * steps × 10: the pre-scan's waves of P steps (its 2k − 3 chains per unit, k pieces of P chunks) and the pieces'
 * one wave (n is at most rule 3's fill count, so the pieces fit the target). */
KDA_HD static inline int64_t kda_cp_fwd_cost(int64_t max_c, int64_t units, int64_t target, int64_t n) {
    const int64_t P = kda_cp_balanced_len(max_c, n);
    const int64_t k = kda_cp_ceil_div(max_c, P);
    const int64_t waves = kda_cp_ceil_div(units * kda_cp_max64(1, 2 * k - 3), target);
    return (10 * waves + KDA_CP_PIECE_STEP_X10) * P;
}

KDA_HD static inline int64_t kda_cp_piece_chunks(const kda_cp_problem_t *p) {
    if (p->mode == KDA_CP_OFF) return 0;
    if (p->mode == KDA_CP_ON) return kda_cp_max64(1, p->piece_len / KDA_CHUNK);
    const int64_t max_c = p->max_chunks, total = kda_cp_max64(p->total_chunks, p->max_chunks);
    if (max_c < KDA_CP_MIN_SEQ_CHUNKS) return 0; /* 1 */
    const int64_t units = kda_cp_max64(1, (int64_t)p->num_v_heads * kda_cp_max64(1, p->v_tiles));
    const int64_t sm = kda_cp_max64(1, p->sm_count);
    if (total * units * KDA_CP_FILL_DIV >= sm * max_c) return 0; /* 2 */
    const int64_t target = (int64_t)KDA_CP_CTAS_PER_SM * sm;
    int64_t n = p->prescan_pairs ? (2 * max_c * target + 3 * total * units) / (2 * total * units)
                                 : max_c * target / (total * units); /* 3 */
    if (n <= (p->prescan_pairs ? 2 : 1)) return 0;
    if (!p->prescan_pairs) {
        const int64_t n1 = (target + 3 * units) / (2 * units); /* units × (2 n1 − 3) <= target */
        if (n1 >= 2 && n1 < n && kda_cp_fwd_cost(max_c, units, target, n1) < kda_cp_fwd_cost(max_c, units, target, n))
            n = n1;
    }
    int64_t P = kda_cp_balanced_len(max_c, n);                                  /* 4 */
    P = kda_cp_max64(P, kda_cp_ceil_div(2 * total, kda_cp_auto_slot_limit(p))); /* 5 */
    return P >= max_c ? 0 : P;                                                  /* 6 */
}

/* ---------------------------------------------------------------------------------------------------------
 * Sequences and chunk counts
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_cp_seqs {
    const void *cu_seqlens; /* [N + 1] offsets (host or device memory, as the caller runs), or NULL: equal rows */
    int cu_seqlens_64;      /* cu_seqlens is int64 (else int32) */
    int64_t num_seqs;       /* N */
    int64_t seq_len;        /* tokens per row, equal rows */
    int64_t num_tokens;     /* rows of the flattened tensors: every bound is clamped into [0, num_tokens] */
} kda_cp_seqs_t;

/* First and last+1 row of sequence n, clamped as src/cuda/common/seq.cuh clamps them. */
KDA_HD static inline void kda_cp_seq_bounds(const kda_cp_seqs_t *s, int64_t n, int64_t *bos, int64_t *eos) {
    if (!s->cu_seqlens) {
        *bos = n * s->seq_len;
        *eos = *bos + s->seq_len;
        return;
    }
    int64_t a, b;
    if (s->cu_seqlens_64) {
        a = ((const int64_t *)s->cu_seqlens)[n];
        b = ((const int64_t *)s->cu_seqlens)[n + 1];
    } else {
        a = ((const int32_t *)s->cu_seqlens)[n];
        b = ((const int32_t *)s->cu_seqlens)[n + 1];
    }
    a = a < 0 ? 0 : (a > s->num_tokens ? s->num_tokens : a);
    b = b < a ? a : (b > s->num_tokens ? s->num_tokens : b);
    *bos = a;
    *eos = b;
}

/* Chunks of sequence n: ceil(len_n / C) of its clamped bounds. */
KDA_HD static inline int64_t kda_cp_seq_chunks(const kda_cp_seqs_t *s, int64_t n) {
    int64_t bos, eos;
    kda_cp_seq_bounds(s, n, &bos, &eos);
    return kda_cp_ceil_div(eos - bos, KDA_CHUNK);
}

/* The exact chunk counts of the sequences (one pass; a host loop or one thread). */
KDA_HD static inline void kda_cp_chunk_counts(const kda_cp_seqs_t *s, int64_t *total, int64_t *max) {
    int64_t t = 0, m = 0;
    for (int64_t n = 0; n < s->num_seqs; n++) {
        const int64_t c = kda_cp_seq_chunks(s, n);
        t += c;
        m = c > m ? c : m;
    }
    *total = t;
    *max = m;
}

/* Upper bounds of the chunk counts from num_tokens and num_seqs alone (varlen with the offsets on the device):
 * Σ ceil(len_n / C) <= (T + (C − 1) N) / C and <= T (a chunk holds a token); max <= ceil(T / C). For equal rows,
 * pass num_tokens = B × T and num_seqs = B: the bounds then hold too (the exact values are B ceil(T / C) and
 * ceil(T / C)). */
KDA_HD static inline void kda_cp_chunk_bounds(int64_t num_tokens, int64_t num_seqs, int64_t *total, int64_t *max) {
    if (num_seqs <= 0 || num_tokens <= 0) {
        *total = *max = 0;
        return;
    }
    *total = kda_cp_min64(num_tokens, (num_tokens + (int64_t)(KDA_CHUNK - 1) * num_seqs) / KDA_CHUNK);
    *max = kda_cp_ceil_div(num_tokens, KDA_CHUNK);
}

/* Pieces of a sequence of `chunks` chunks with pieces of P chunks (P = 0: no split): at least one, so that an
 * empty sequence has a piece that carries its initial state to its final state. */
KDA_HD static inline int64_t kda_cp_seq_pieces(int64_t chunks, int64_t P) {
    return (P <= 0 || chunks <= P) ? 1 : kda_cp_ceil_div(chunks, P);
}

/* Pieces of the sequence that need storage (M, S_ext, incoming state): all of them when it is split, else 0. */
KDA_HD static inline int64_t kda_cp_seq_slots(int64_t chunks, int64_t P) {
    return (P <= 0 || chunks <= P) ? 0 : kda_cp_ceil_div(chunks, P);
}

/* ---------------------------------------------------------------------------------------------------------
 * Capacity and workspace
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_cp_capacity {
    int64_t pieces; /* entries of the piece table: every piece of every sequence */
    int64_t slots;  /* pieces of split sequences, which hold (M, S_ext, incoming state) per value head */
} kda_cp_capacity_t;

/* Upper bounds for `p`. lengths_known: p's chunk counts are the exact ones, so the plan is p's; otherwise they
 * are upper bounds (kda_cp_chunk_bounds) and the answer holds for every set of lengths within them, whatever the
 * decision on the device. With pieces of at least P chunks: table entries <= N + floor(total / P) (a sequence of
 * c chunks has max(1, ceil(c / P)) <= 1 + floor(c / P) pieces), and the pieces of split sequences <= floor(total
 * / P) + floor(total / (P + 1)) (ceil(c / P) <= floor(c / P) + 1, and a split sequence has more than P chunks);
 * in auto mode also <= kda_cp_auto_slot_limit (rule 5), so table entries <= N + that. */
KDA_HD static inline kda_cp_capacity_t kda_cp_capacity(const kda_cp_problem_t *p, int lengths_known) {
    kda_cp_capacity_t c;
    const int64_t N = kda_cp_max64(0, p->num_seqs), total = kda_cp_max64(0, p->total_chunks);
    int64_t P;
    if (p->mode == KDA_CP_OFF) {
        P = 0;
    } else if (p->mode == KDA_CP_ON) {
        P = kda_cp_piece_chunks(p);
    } else if (lengths_known) {
        P = kda_cp_piece_chunks(p);
    } else {
        /* the guards that hold whatever the lengths: eff >= HV × tiles (total >= max), and max <= its bound */
        const int64_t units = (int64_t)p->num_v_heads * kda_cp_max64(1, p->v_tiles);
        const int never =
            p->max_chunks < KDA_CP_MIN_SEQ_CHUNKS || units * KDA_CP_FILL_DIV >= kda_cp_max64(1, p->sm_count);
        P = never ? 0 : KDA_CP_MIN_PIECE_CHUNKS;
    }
    if (P == 0) {
        c.pieces = N;
        c.slots = 0;
        return c;
    }
    c.slots = total / P + total / (P + 1);
    if (p->mode == KDA_CP_AUTO) c.slots = kda_cp_min64(c.slots, kda_cp_auto_slot_limit(p));
    c.pieces = N + kda_cp_min64(total / P, c.slots);
    return c;
}

/* Bytes per piece of storage per value head: M (K×K fp32), S_ext (K×V fp32) and the piece's incoming state (K×V
 * fp32). K = V = 128: 196,608 bytes, 384 bytes per token-head with pieces of KDA_CP_MIN_PIECE_CHUNKS chunks. */
KDA_HD static inline int64_t kda_cp_slot_head_bytes(int32_t K, int32_t V) {
    return (int64_t)4 * ((int64_t)K * K + (int64_t)2 * K * V);
}

/* ---------------------------------------------------------------------------------------------------------
 * Host: from a checked problem
 * ------------------------------------------------------------------------------------------------------- */

/* The planner's problem for a checked kda_problem_t on a device of sm_count SMs. host_cu_seqlens: the offsets
 * where the host can read them (CUDA: a->cu_seqlens_host; the CPU backends: a->cu_seqlens), else NULL. Returns 1
 * when the chunk counts are exact (equal rows, or readable offsets), 0 when they are the bounds from num_tokens
 * and num_seqs (the plan is then made on the device; size with kda_cp_capacity(out, 0)). */
static inline int kda_cp_problem_from(const kda_problem_t *p, int32_t sm_count, const void *host_cu_seqlens,
                                      kda_cp_problem_t *out) {
    const kda_args_t *a = &p->a;
    out->num_seqs = p->num_seqs;
    out->num_v_heads = a->num_v_heads;
    out->v_tiles = kda_cp_v_tiles(a->head_dim_v);
    out->sm_count = sm_count;
    out->mode = (int32_t)a->cp_mode;
    out->piece_len = a->cp_piece_len;
    out->prescan_pairs = 0;
    if (p->varlen && !host_cu_seqlens) {
        kda_cp_chunk_bounds(p->num_tokens, p->num_seqs, &out->total_chunks, &out->max_chunks);
        return 0;
    }
    kda_cp_seqs_t s = {p->varlen ? host_cu_seqlens : NULL, a->cu_seqlens_dtype == KDA_INT64, p->num_seqs, a->seq_len,
                       p->num_tokens};
    if (p->varlen) {
        kda_cp_chunk_counts(&s, &out->total_chunks, &out->max_chunks);
    } else {
        out->max_chunks = kda_cp_ceil_div(a->seq_len, KDA_CHUNK);
        out->total_chunks = p->num_seqs * out->max_chunks;
    }
    return 1;
}

/* Workspace bytes of a plan's capacity: the piece table (rounded up to 256 bytes) and, per stored piece and value
 * head, M, S_ext and the incoming state (kda_cp_slot_head_bytes of the head sizes the kernels store: pass the
 * padded classes if they store padded tiles). */
KDA_HD static inline int64_t kda_cp_workspace_bytes(kda_cp_capacity_t c, int32_t num_v_heads, int32_t K, int32_t V);

/* ---------------------------------------------------------------------------------------------------------
 * The piece table
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_cp_piece {
    int64_t seq;        /* sequence n */
    int64_t chunk0;     /* its first chunk, numbered globally */
    int64_t num_chunks; /* its chunks (0 only for an empty sequence) */
    int64_t bos, eos;   /* its first and last+1 token: absolute rows of the flattened tensors */
    int64_t index;      /* its position within its sequence, 0 .. seq_pieces − 1 */
    int64_t seq_pieces; /* pieces of its sequence */
    int64_t slot;       /* its storage slot (kda_cp_slot_head_bytes per value head), −1 when its sequence is
                           whole; the slots of a split sequence are consecutive, in order, and a split piece's
                           entry is table[slot] */
    int64_t flags;      /* KDA_CP_FIRST | KDA_CP_LAST */
} kda_cp_piece_t;

KDA_HD static inline int64_t kda_cp_workspace_bytes(kda_cp_capacity_t c, int32_t num_v_heads, int32_t K, int32_t V) {
    const int64_t table = (c.pieces * (int64_t)sizeof(kda_cp_piece_t) + 255) / 256 * 256;
    return table + c.slots * num_v_heads * kda_cp_slot_head_bytes(K, V);
}

/* Write the pieces of sequence n, its first chunk being chunk0, and its entries where the table's order puts them:
 * a split sequence's at table[slot0 ..], its slots; a whole sequence's one piece at table[num_slots + whole0], after
 * every split piece. chunk0, slot0 and whole0 are prefix sums over the sequences before it (Σ ceil(c_m / C),
 * Σ kda_cp_seq_slots, and the number of whole sequences: Σ kda_cp_seq_pieces − kda_cp_seq_slots); num_slots is the
 * plan's total of slots. Entries at or past `capacity` are not written. Returns the number of pieces of the
 * sequence. */
KDA_HD static inline int64_t kda_cp_write_seq(const kda_cp_seqs_t *s, int64_t n, int64_t P, int64_t chunk0,
                                              int64_t slot0, int64_t whole0, int64_t num_slots, kda_cp_piece_t *table,
                                              int64_t capacity) {
    int64_t bos, eos;
    kda_cp_seq_bounds(s, n, &bos, &eos);
    const int64_t chunks = kda_cp_ceil_div(eos - bos, KDA_CHUNK);
    const int64_t pieces = kda_cp_seq_pieces(chunks, P), split = kda_cp_seq_slots(chunks, P) > 0;
    const int64_t per = pieces == 1 ? chunks : P;
    const int64_t piece0 = split ? slot0 : num_slots + whole0;
    for (int64_t j = 0; j < pieces && piece0 + j < capacity; j++) {
        kda_cp_piece_t *e = &table[piece0 + j];
        const int64_t c0 = j * per, c1 = kda_cp_min64(chunks, c0 + per);
        e->seq = n;
        e->chunk0 = chunk0 + c0;
        e->num_chunks = c1 - c0;
        e->bos = bos + c0 * KDA_CHUNK;
        e->eos = kda_cp_min64(eos, bos + c1 * KDA_CHUNK);
        e->index = j;
        e->seq_pieces = pieces;
        e->slot = split ? slot0 + j : -1;
        e->flags = (j == 0 ? KDA_CP_FIRST : 0) | (j == pieces - 1 ? KDA_CP_LAST : 0);
    }
    return pieces;
}

/* What kda_cp_fill_table wrote. */
typedef struct kda_cp_plan {
    int64_t num_pieces; /* entries the plan has (those at or past the capacity were not written) */
    int64_t num_slots;  /* storage slots it uses */
    int64_t num_chunks; /* chunks it covers: Σ_n ceil(len_n / C) */
} kda_cp_plan_t;

/* Fill the piece table for pieces of P chunks (0: every sequence whole): the split sequences' pieces in slot order
 * (sequence after sequence, each in chunk order), then the whole sequences in order. A host loop or one CUDA
 * thread (two passes: the slots' total places the whole sequences); a planning kernel may instead scan
 * kda_cp_seq_pieces / kda_cp_seq_slots / chunk counts over the sequences and call kda_cp_write_seq per sequence. */
KDA_HD static inline kda_cp_plan_t kda_cp_fill_table(const kda_cp_seqs_t *s, int64_t P, kda_cp_piece_t *table,
                                                     int64_t capacity) {
    kda_cp_plan_t r = {0, 0, 0};
    int64_t num_slots = 0;
    for (int64_t n = 0; n < s->num_seqs; n++) num_slots += kda_cp_seq_slots(kda_cp_seq_chunks(s, n), P);
    for (int64_t n = 0; n < s->num_seqs; n++) {
        const int64_t chunks = kda_cp_seq_chunks(s, n);
        r.num_pieces += kda_cp_write_seq(s, n, P, r.num_chunks, r.num_slots, r.num_pieces - r.num_slots, num_slots,
                                         table, capacity);
        r.num_slots += kda_cp_seq_slots(chunks, P);
        r.num_chunks += chunks;
    }
    return r;
}

#ifdef __cplusplus
}
#endif

#endif /* KDA_CP_PLAN_H */
