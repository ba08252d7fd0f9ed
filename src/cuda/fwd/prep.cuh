/*
 * Chunk preparation: everything of a chunk that does not depend on the state (docs/ALGORITHM.md §3).
 *
 * One CTA of 8 or 16 warps (PREP_NT) per (chunk of C = 64 tokens, value head); chunks of all sequences run in
 * parallel. With intra-card CP possible (kda_prep_params_t.plan), CTA 0 makes the piece table instead
 * (cp_plan.cuh) and the chunks' CTAs follow it. In the notation of ALGORITHM.md, with G the chunk's cumulative
 * log decay (kept in log2 units, so every exp is one ex2), it writes the chunk's workspace block (kda_cuda.h).
 * KD and VD are the size classes of K and V (64, 128 or 256): columns past K (V) are zero in every tile, and the
 * gate is 0 there, so they contribute nothing.
 * The steps, each a device function below, in the order the kernel body calls them:
 *
 *   load_inputs        q, k, v (16-bit: into their tiles), the raw 16-bit gate tile, β (sigmoid in kernel)
 *   gate_cumsum        the gate (in-kernel gate, clamped to [KDA_GATE_MIN, 0]) summed down each channel: G
 *   normalize_qkv      q ← s·q/‖q‖, k ← k/‖k‖ (l2norm), v: all as bf16 tiles; a bf16 q stays raw in its tile
 *                      and its row factor f_q = s/‖q‖ goes to fq, applied in fp32 by its readers (Aqk's rows,
 *                      QΓ), so that s q̂ e^G is rounded once rather than twice
 *   neutral_rows       [rare] the non-finite contract (ALGORITHM.md §7): the chunk's first poisoning row t*
 *                      (NaN gate; q, k, v, β non-finite or |x| ≥ 2^56, found beside the three steps above);
 *                      rows from t* on become neutral (q = k = v = β = 0), so no row before t* reads them
 *   intra_chunk_A      A = β_i k_i·k_j e^{G_i−G_j} (j < i) and Aqk = q_i·k_j e^{G_i−G_j} (j ≤ i) by 16×16
 *                      blocks on the tensor cores, the factor split around a reference R (ALGORITHM.md §3)
 *                      [the A warps]; Aqk → workspace. With 16 warps two warps share each run of blocks, one
 *                      channel half each, and intra_chunk_store adds the halves after a barrier
 *   decay_factors      γ = e^{G_last} → workspace, Aqk's upper blocks zeroed [the decay warps, beside intra_chunk_A,
 *                      whose exponentials then have the SM's MUFU pipe to themselves]
 *   gated_qk           QΓ = f_q q e^{G} and K̃ = k e^{G_last−G} → workspace, KΓ = k e^{G} → shared, from one load
 *                      of G and k; fine blocks (fp16, fp32 inputs): QΓ = hi + lo from the input row (KDA_FINE_QG),
 *                      K̃_lo too (KDA_FINE_KT)
 *   invert_diag_blocks the diagonal 16×16 blocks T_II of T = (I + A)⁻¹ by fp32 forward substitution, as T_II − I
 *   aqk_diagonal       Aqk's diagonal q_i·k_i from normalize_qkv (unrounded rows) → workspace [warps 4-5, beside it]
 *   solve_w_u          [W | U] = T Diag(β) [KΓ | V] by block forward substitution on the tensor cores
 *   store_w_u          W, U → workspace
 *   poison_block       [rare] QΓ rows from t* on and γ set to NaN: the recurrence, unchanged, then writes NaN
 *                      in o from t* on and carries a NaN state to every later token and the final state
 * Rows past the end of a short chunk are zeros (k = q = v = β = 0, G = G_last), so every output row there is
 * zero and the recurrence needs no masks.
 *
 * Shared memory (strides KD + 8, VD + 8 elements so that fragment reads are conflict-free), regions reused:
 *   R_G  fp32 [C][KD+8]   the raw gate tile, then G; later the W and U tiles being built (bf16, panels)
 *   R_K  bf16 [C][KD+8]   k; later each warp's Y scratch
 *   R_Q  bf16 [C][KD+8]   q; later KΓ
 *   R_V  bf16 [C][VD+8]   v
 *   R_A  fp32 [C][72]     A's diagonal blocks (later T_II − I), for invert_diag_blocks
 *   β    fp32 [C], and 2·NT floats for the partial sums of the gate, and t* (an int), and Aqk's diagonal fp32 [C],
 *   and q's row factors fq and fqn fp32 [C] each
 *   with 16 warps: the second channel half's A/Aqk accumulators, fp32 [6 roles][8][32 lanes][4]
 *   R_AB bf16 A fragments [10 blocks][32 lanes][8]: A_IM (M < I, from intra_chunk_A) and L_II (from
 *        invert_diag_blocks), each written once as solve_w_u's warps read it (before, each of the 8 or 16 warps
 *        read A in fp32 and rounded the same fragments itself)
 */
#include "common.cuh"
#include "cp_plan.cuh"
#include "seq.cuh"

/* Threads of a CTA: 8 warps, or 16 for K = V class 256, whose shared memory holds one CTA per SM: 8 warps alone
 * left an SM's issue slots idle through every latency-bound step. With 16 warps each step's per-thread work is
 * that of the 8-warp kernel of a class half as wide (the same registers). The code takes 16 warps for any pair of
 * classes ≥ 128 (the classes (128, 256) and (256, 128) compile to 120 and 128 registers, no spill); the mixed
 * pairs keep 8 warps. */
#define PREP_NT(KD, VD) ((KD) == 256 && (VD) == 256 ? 512 : 256)
#define PREP_A_WARPS                                                                                                   \
    6 /* A/Aqk roles: warps 0-5, and with 16 warps 6-11 the same roles over the second half of
                               the channels; the other warps ("decay warps") compute the decay factors beside them */
#define PREP_KSPLIT(NT) ((NT) / 256)    /* channel halves of intra_chunk_A */
#define PREP_LOG2(n) ((n) == 8 ? 3 : 2) /* of the threads per row in normalize_qkv (4 or 8) */
#define SA                                                                                                             \
    72 /* fp32 stride of A and T: rows 8 banks apart, so the float2 fragment reads of
                               solve_w_u (a half-warp spans 4 rows) and the float2 stores of A are conflict-free */

typedef __nv_bfloat16 bf16;

/* Shared memory layout (bytes) for classes KD, VD */
#define PREP_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PREP_S(D) ((D) + 8)
#define PREP_YS(KD, VD)                                                                                                \
    (PREP_MAX(KD, VD) / (PREP_NT(KD, VD) / 64) + 8) /* stride of a warp's Y scratch [16][slab]
                                                                          in solve_w_u */
#define PREP_BYTES_G(KD, VD) PREP_MAX(KDA_CHUNK *PREP_S(KD) * 4, KDA_CHUNK * ((KD) + (VD)) * 2)
#define PREP_BYTES_K(KD, VD) PREP_MAX(KDA_CHUNK *PREP_S(KD) * 2, (PREP_NT(KD, VD) / 32) * 16 * PREP_YS(KD, VD) * 2)
#define PREP_OFF_K(KD, VD) PREP_BYTES_G(KD, VD)
#define PREP_OFF_Q(KD, VD) (PREP_OFF_K(KD, VD) + PREP_BYTES_K(KD, VD))
#define PREP_OFF_V(KD, VD) (PREP_OFF_Q(KD, VD) + KDA_CHUNK * PREP_S(KD) * 2)
#define PREP_OFF_A(KD, VD) (PREP_OFF_V(KD, VD) + KDA_CHUNK * PREP_S(VD) * 2)
#define PREP_OFF_BETA(KD, VD) (PREP_OFF_A(KD, VD) + KDA_CHUNK * SA * 4)
#define PREP_OFF_TOT(KD, VD) (PREP_OFF_BETA(KD, VD) + KDA_CHUNK * 4)
#define PREP_OFF_TSTAR(KD, VD) (PREP_OFF_TOT(KD, VD) + 2 * PREP_NT(KD, VD) * 4)
#define PREP_OFF_DIAG(KD, VD) (PREP_OFF_TSTAR(KD, VD) + 16)
#define PREP_OFF_FQ(KD, VD) (PREP_OFF_DIAG(KD, VD) + KDA_CHUNK * 4)
#define PREP_OFF_FQN(KD, VD) (PREP_OFF_FQ(KD, VD) + KDA_CHUNK * 4)
#define PREP_OFF_RED(KD, VD) (PREP_OFF_FQN(KD, VD) + KDA_CHUNK * 4)
#define PREP_BYTES_RED(KD, VD) ((PREP_KSPLIT(PREP_NT(KD, VD)) - 1) * PREP_A_WARPS * 32 * 32 * 4)
#define PREP_OFF_AB(KD, VD) (PREP_OFF_RED(KD, VD) + PREP_BYTES_RED(KD, VD))
#define PREP_BYTES_AB (10 * 32 * 16) /* A's ten lower blocks as bf16 fragments: [block][lane] 16 bytes */
#define PREP_BYTES(KD, VD) (PREP_OFF_AB(KD, VD) + PREP_BYTES_AB)
/* A's block (I, M), M ≤ I, in the fragment region */
#define PREP_AB_BLOCK(I, M) ((I) * ((I) + 1) / 2 + (M))

/* The contract's bound for q, k, v, β (ALGORITHM.md §7, 4): a row holding an element with |x| ≥ 2^56 (after the
 * l2norm and the scale, β after its sigmoid), ±∞ or NaN poisons its token. Below it no product of the chunk
 * overflows (k·k over 256 channels times β ≤ 2 stays under 2^121), so no 0·∞ reaches an earlier row. */
#define PREP_HUGE 0x1p56f

/* The shared-memory tiles and the chunk a CTA prepares */
typedef struct {
    float *G; /* R_G */
    bf16 *K, *Q, *V;
    float *A, *beta, *tot;
    int *tstar;  /* the chunk's first poisoning row, KDA_CHUNK if none */
    float *diag; /* Aqk's diagonal from normalize_qkv */
    float *fq;   /* q's row factor still to apply: s/‖q‖ where the tile kept the raw bf16 q, else 1 */
    float *fqn;  /* q's whole row factor s/‖q‖ (fine blocks: gated_qk's QΓ_lo from the input row) */
    float *red;  /* with 16 warps: intra_chunk_A's second-half accumulators */
    uint4 *ab;   /* A's blocks (I, M < I) and L_II as solve_w_u's bf16 A fragments, [PREP_AB_BLOCK][lane] */
} prep_smem_t;

typedef struct {
    int K, V; /* head sizes: the classes themselves in an EXACT instance (constants after inlining) */
    int piece_qk, piece_v;
    int64_t t0;         /* first token (row of the [B*T] tensors) */
    int clen;           /* tokens in the chunk (1..C) */
    int h, hq;          /* value head, its query/key head */
    unsigned char *blk; /* the workspace block */
} prep_chunk_t;

/* ---------------------------------------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------------------------------------- */
/* N 16-bit values of a shared row (16-byte aligned, N % 8 == 0) → fp32 (F16: fp16, else bf16) */
template <int F16, int N>
DEV void row16_to_f32(const bf16 *row, float *x) {
#pragma unroll
    for (int c = 0; c < N; c += 8) {
        const uint4 w8 = *(const uint4 *)(row + c);
        const uint32_t *w = (const uint32_t *)&w8;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float2 f = unpack_16x2<F16>(w[u]);
            x[c + 2 * u] = f.x;
            x[c + 2 * u + 1] = f.y;
        }
    }
}

/* A channel pair of the raw 16-bit gate tile ([C][KD], pairs as 32-bit words) over ROWS rows from `pair` → fp32 */
template <int F16, int KD, int ROWS>
DEV void gate_pairs_to_f32(const uint32_t *pair, float *gx, float *gy) {
#pragma unroll
    for (int u = 0; u < ROWS; u++) {
        const float2 f = unpack_16x2<F16>(pair[u * (KD / 2)]);
        gx[u] = f.x;
        gy[u] = f.y;
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * load_inputs: the 16-bit q, k, v tiles and the raw gate tile. Rows go by cp.async with zero-fill in the widest
 * pieces their length allows: 16 bytes when it is a multiple of 8 elements, else 8, 4 or (odd lengths) element
 * by element; rows past the chunk's end and pieces past K or V read 0 bytes. β by the first C threads.
 * ------------------------------------------------------------------------------------------------------- */
/* One 16-bit [C][W] tile of `n` valid columns from rows `row0 + r·heads` of a [tokens][heads][n] tensor into
 * shared memory at `dst` (element stride `stride`), zero-filled, in pieces of `piece` bytes. */
template <int W, int NT>
DEV void load_tile16(const uint16_t *base, int64_t row0, int64_t heads, int n, int clen, int piece, bf16 *dst,
                     int stride, int tid) {
    if (piece == 16) {
        constexpr int row_chunks = W / 8;      /* 16-byte pieces per row */
        constexpr int RSTEP = NT / row_chunks; /* rows between a thread's copies */
        const int c = tid % row_chunks, r0 = tid / row_chunks;
        const uint16_t *src = base + ((row0 + r0) * heads) * n + c * 8;
        const int64_t step = RSTEP * heads * n;
        const uint32_t d0 = smem_u32(dst + r0 * stride + c * 8), dstep = stride * RSTEP * 2;
        if (clen == KDA_CHUNK && n == W) { /* a whole chunk of whole rows (the common case): no masks, no selects */
#pragma unroll
            for (int j = 0; j < KDA_CHUNK / RSTEP; j++) cp_async16_zfill(d0 + j * dstep, src + j * step, 16);
        } else {
            const int col_ok = c * 8 < n;
#pragma unroll
            for (int j = 0; j < KDA_CHUNK / RSTEP; j++) {
                const int ok = col_ok && r0 + j * RSTEP < clen;
                cp_async16_zfill(d0 + j * dstep, ok ? (const void *)(src + j * step) : (const void *)base, ok ? 16 : 0);
            }
        }
    } else if (piece >= 4) {                     /* 8 or 4 bytes */
        const int per = piece / 2, np = W / per; /* elements per piece, pieces per row */
        for (int e = tid; e < KDA_CHUNK * np; e += NT) {
            const int r = e / np, c = (e % np) * per;
            const int ok = r < clen && c < n;
            const void *src = ok ? (const void *)(base + (row0 + r) * heads * n + c) : (const void *)base;
            const uint32_t d = smem_u32(dst + r * stride + c);
            if (piece == 8) cp_async8_zfill(d, src, ok ? 8 : 0);
            else cp_async4_zfill(d, src, ok ? 4 : 0);
        }
    } else {
#pragma unroll 4
        for (int e = tid; e < KDA_CHUNK * W; e += NT) {
            const int r = e / W, c = e % W;
            uint16_t x = 0;
            if (r < clen && c < n) x = base[(row0 + r) * heads * n + c];
            ((uint16_t *)dst)[r * stride + c] = x;
        }
    }
}

template <int KD, int VD>
DEV void load_inputs(const kda_prep_params_t &p, const prep_smem_t &sm, const prep_chunk_t &ck, int tid, int &bad) {
    constexpr int NT = PREP_NT(KD, VD);
    if (tid == 0) *sm.tstar = KDA_CHUNK; /* lowered only after gate_cumsum's barrier */
    if (!KDA_SKIP(p, 512)) {
        if (p.pb.dtype != KDA_DT_F32) {
            const uint16_t *q = (const uint16_t *)p.pb.q + ck.hq * (int64_t)ck.K,
                           *k = (const uint16_t *)p.pb.k + ck.hq * (int64_t)ck.K;
            const uint16_t *v = (const uint16_t *)p.pb.v + ck.h * (int64_t)ck.V;
            load_tile16<KD, NT>(q, ck.t0, p.pb.hqk, ck.K, ck.clen, ck.piece_qk, sm.Q, PREP_S(KD), tid);
            load_tile16<KD, NT>(k, ck.t0, p.pb.hqk, ck.K, ck.clen, ck.piece_qk, sm.K, PREP_S(KD), tid);
            load_tile16<VD, NT>(v, ck.t0, p.pb.hv, ck.V, ck.clen, ck.piece_v, sm.V, PREP_S(VD), tid);
        }
        if (p.pb.g_dtype != KDA_DT_F32) /* raw, [C][KD], into R_G (G is written there only after a barrier) */
            load_tile16<KD, NT>((const uint16_t *)p.pb.g + ck.h * (int64_t)ck.K, ck.t0, p.pb.hv, ck.K, ck.clen,
                                ck.piece_qk, (bf16 *)sm.G, KD, tid);
    }
    if (tid < KDA_CHUNK) {
        float b = 0.0f;
        if (tid < ck.clen) {
            b = load_elem(p.pb.beta, p.pb.beta_dtype, (ck.t0 + tid) * p.pb.hv + ck.h);
            if (p.pb.beta_sigmoid) b = beta_sigmoid(b, p.pb.neg_eigval);
            if (!(fabsf(b) < PREP_HUGE)) bad = tid;
        }
        sm.beta[tid] = b;
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * gate_cumsum, first half: the gate values of a channel pair over GROWS rows, in log2 units, summed down the
 * rows (all loads and gate values of a thread independent, the running sum a chain of adds); the part's total
 * to shared memory. After the next barrier gate_cumsum_finish adds the totals of the parts above it.
 * Branch-free within each gate mode: a branch per element would serialise independent latency chains.
 * ------------------------------------------------------------------------------------------------------- */
#define GATE_PAIRS(KD) ((KD) / 2)                          /* a thread's channel pair */
#define GATE_PARTS(KD, NT) ((NT) / GATE_PAIRS(KD))         /* row parts: 8 warps 2 (KD 256), 4 (KD 128) or 8 (KD 64) */
#define GATE_ROWS(KD, NT) (KDA_CHUNK / GATE_PARTS(KD, NT)) /* rows of a part */

/* The gate values of a part's rows summed down them (the loops of gate_cumsum). FULL: every row of the part is inside
 * the chunk and both channels are real (nvalid ≥ GROWS), so no row's value is masked to 0; else rows u ≥ nvalid add
 * 0. The same sums either way: FULL only drops the selects. */
template <int GROWS, int FULL>
DEV void gate_rows_lb(float (&gx)[GROWS], float (&gy)[GROWS], float za, float lb2, float2 bias, int nvalid,
                      int nvalid_y, int gr0, float &run0, float &run1, int &bad) {
#pragma unroll
    for (int u = 0; u < GROWS; u++) {
        const float vx = lb2 * rcp_approx(1.0f + ex2(za * (gx[u] + bias.x)));
        const float vy = lb2 * rcp_approx(1.0f + ex2(za * (gy[u] + bias.y)));
        if (vx != vx || vy != vy)
            bad = min(bad, gr0 + u); /* a NaN gate poisons (rows past the end and padded
                                                               channels hold finite zeros) */
        run0 += FULL || u < nvalid ? fmaxf(vx, lb2) : 0.0f;
        run1 += FULL || u < nvalid_y ? fmaxf(vy, lb2) : 0.0f;
        gx[u] = run0;
        gy[u] = run1;
    }
}
template <int GROWS, int FULL>
DEV void gate_rows_clamp(float (&gx)[GROWS], float (&gy)[GROWS], int nvalid, int nvalid_y, int gr0, float &run0,
                         float &run1, int &bad) {
#pragma unroll
    for (int u = 0; u < GROWS; u++) {
        if (gx[u] != gx[u] || gy[u] != gy[u]) bad = min(bad, gr0 + u); /* NaN poisons */
        /* clamp into [KDA_GATE_MIN, 0]: −inf becomes the minimum (NaN too: its rows are neutral) */
        run0 += FULL || u < nvalid ? fminf(fmaxf(gx[u], KDA_GATE_MIN), 0.0f) * LOG2E : 0.0f;
        run1 += FULL || u < nvalid_y ? fminf(fmaxf(gy[u], KDA_GATE_MIN), 0.0f) * LOG2E : 0.0f;
        gx[u] = run0;
        gy[u] = run1;
    }
}

template <int KD, int NT, int EXACT>
DEV void gate_cumsum(const kda_prep_params_t &p, const prep_smem_t &sm, const prep_chunk_t &ck, int tid,
                     float (&gx)[GATE_ROWS(KD, NT)], float (&gy)[GATE_ROWS(KD, NT)], int &bad) {
    constexpr int PAIRS = GATE_PAIRS(KD), GROWS = GATE_ROWS(KD, NT);
    const int gd = 2 * (tid % PAIRS), gr0 = (tid / PAIRS) * GROWS;
    const int okx = EXACT || gd < ck.K, oky = EXACT || gd + 1 < ck.K; /* padded channels: gate 0 */
    const float A = p.pb.A_log ? __expf(p.pb.A_log[ck.h]) : 1.0f;
    float2 bias = make_float2(0.0f, 0.0f);
    if (p.pb.gate_in_kernel && p.pb.dt_bias) {
        const float *db = p.pb.dt_bias + ck.h * (int64_t)ck.K + gd;
        if ((ck.K & 1) == 0 && okx) bias = *(const float2 *)db;
        else bias = make_float2(okx ? db[0] : 0.0f, oky ? db[1] : 0.0f);
    }
    if (p.pb.g_dtype == KDA_DT_F32) {
        const float *gp = (const float *)p.pb.g + (ck.t0 * p.pb.hv + ck.h) * (int64_t)ck.K + gd;
        const int64_t rs = (int64_t)p.pb.hv * ck.K;
        if ((ck.K & 1) == 0) {
#pragma unroll
            for (int u = 0; u < GROWS; u++) {
                const float2 v =
                    gr0 + u < ck.clen && okx ? *(const float2 *)&gp[(gr0 + u) * rs] : make_float2(0.f, 0.f);
                gx[u] = v.x;
                gy[u] = v.y;
            }
        } else {
#pragma unroll
            for (int u = 0; u < GROWS; u++) {
                gx[u] = gr0 + u < ck.clen && okx ? gp[(gr0 + u) * rs] : 0.0f;
                gy[u] = gr0 + u < ck.clen && oky ? gp[(gr0 + u) * rs + 1] : 0.0f;
            }
        }
    }
    cp_async_wait_all();
    __syncthreads(); /* the tiles were copied by all threads */
    const uint32_t *graw = (const uint32_t *)sm.G + gd / 2;
    if (p.pb.g_dtype == KDA_DT_F16) /* dtype branches outside the loops, as in normalize_qkv */
        gate_pairs_to_f32<1, KD, GROWS>(graw + gr0 * (KD / 2), gx, gy);
    else if (p.pb.g_dtype == KDA_DT_BF16) gate_pairs_to_f32<0, KD, GROWS>(graw + gr0 * (KD / 2), gx, gy);
    /* rows past the chunk's end and padded channels add 0 */
    const int nvalid = okx ? ck.clen - gr0 : 0, nvalid_y = oky ? ck.clen - gr0 : 0;
    float run0 = 0.0f, run1 = 0.0f;
    if (p.pb.gate_in_kernel && p.pb.lower_bound != 0.0f) {
        /* lower_bound · sigmoid(A (g + bias)), straight in log2 units: it lies in [lower_bound, 0] (the
           validated lower_bound ≥ −5 is inside the clamp), so one fmaxf is the whole clamp (NaN → min) */
        const float za = -A * LOG2E, lb2 = p.pb.lower_bound * LOG2E;
        if (!KDA_SKIP(p, 32)) {
            if (nvalid >= GROWS && nvalid_y >= GROWS) /* every row of the part inside the chunk: no masks */
                gate_rows_lb<GROWS, 1>(gx, gy, za, lb2, bias, nvalid, nvalid_y, gr0, run0, run1, bad);
            else gate_rows_lb<GROWS, 0>(gx, gy, za, lb2, bias, nvalid, nvalid_y, gr0, run0, run1, bad);
        }
    } else {
        if (p.pb.gate_in_kernel) { /* −A softplus(g + bias) */
#pragma unroll
            for (int u = 0; u < GROWS; u++) {
                gx[u] = -A * softplusf_(gx[u] + bias.x);
                gy[u] = -A * softplusf_(gy[u] + bias.y);
            }
        }
        if (!KDA_SKIP(p, 32)) {
            if (nvalid >= GROWS && nvalid_y >= GROWS)
                gate_rows_clamp<GROWS, 1>(gx, gy, nvalid, nvalid_y, gr0, run0, run1, bad);
            else gate_rows_clamp<GROWS, 0>(gx, gy, nvalid, nvalid_y, gr0, run0, run1, bad);
        }
    }
    *(float2 *)&sm.tot[(gr0 / GROWS) * KD + gd] = make_float2(run0, run1);
}

/* gate_cumsum, second half (after a barrier): G = the running sums plus the totals of the parts above */
template <int KD, int NT>
DEV void gate_cumsum_finish(const prep_smem_t &sm, int tid, const float (&gx)[GATE_ROWS(KD, NT)],
                            const float (&gy)[GATE_ROWS(KD, NT)]) {
    constexpr int PAIRS = GATE_PAIRS(KD), GROWS = GATE_ROWS(KD, NT), S = PREP_S(KD);
    const int gd = 2 * (tid % PAIRS), gr0 = (tid / PAIRS) * GROWS;
    float pre0 = 0.0f, pre1 = 0.0f;
    for (int q = 0; q < gr0 / GROWS; q++) {
        const float2 t = *(const float2 *)&sm.tot[q * KD + gd];
        pre0 += t.x;
        pre1 += t.y;
    }
#pragma unroll
    for (int u = 0; u < GROWS; u++) *(float2 *)&sm.G[(gr0 + u) * S + gd] = make_float2(gx[u] + pre0, gy[u] + pre1);
}

/* ---------------------------------------------------------------------------------------------------------
 * normalize_qkv: TPR = NT/64 threads per row (4 or 8), W/TPR columns each: q (l2norm, × scale), k (l2norm), v →
 * bf16 tiles in place
 * (16-bit inputs were copied there; fp32 inputs are read from global memory here); and Aqk's diagonal
 * q_i·k_i (its decays cancel: e^{G_i − G_i} = 1) from the fp32 rows before their bf16 rounding, into sm.diag
 * ------------------------------------------------------------------------------------------------------- */
/* A thread's W/TPR columns of its row as fp32 */
template <int W, int TPR, int EXACT>
DEV void load_row(const kda_prep_params_t &p, const void *src_base, int64_t row, int n, int vec, int clen,
                  const bf16 *tile, int tid, float (&x)[W / TPR]) {
    constexpr int CW = W / TPR, S = PREP_S(W);
    const int r = tid >> PREP_LOG2(TPR), c0 = (tid & (TPR - 1)) * CW;
    if (p.pb.dtype == KDA_DT_F32) {
        const float *src = (const float *)src_base + row * n + c0;
        if (vec) {
#pragma unroll
            for (int c = 0; c < CW; c += 4) {
                const float4 f =
                    r < clen && (EXACT || c0 + c < n) ? *(const float4 *)(src + c) : make_float4(0.f, 0.f, 0.f, 0.f);
                x[c] = f.x;
                x[c + 1] = f.y;
                x[c + 2] = f.z;
                x[c + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int c = 0; c < CW; c++) x[c] = r < clen && c0 + c < n ? src[c] : 0.0f;
        }
    } else if (p.pb.dtype == KDA_DT_F16) { /* the dtype branch outside the loops: inside, the compiler computed both
                                             conversions and selected */
        row16_to_f32<1, CW>(tile + r * S + c0, x);
    } else {
        row16_to_f32<0, CW>(tile + r * S + c0, x);
    }
}

/* The row's factor f (1/‖x‖ with the l2norm, from the row's Σx² ss_row, times the scale), the contract's bound,
 * x f → the bf16 tile; f. With keep_raw (the tile holds the 16-bit input exactly, as bf16) and f within 2^±40
 * the tile keeps x and *kept is set: its readers apply f themselves, so that q's products with the decay factors
 * are rounded once; the bound keeps x e^{G−R} and its sums as far from
 * overflow and underflow as x f e^{G−R} would be, give or take 2^40. */
template <int W, int TPR>
DEV float scale_row(const float (&x)[W / TPR], float ss_row, bf16 *tile, int norm, float scale, int tid, int &bad,
                    int keep_raw, int *kept) {
    constexpr int CW = W / TPR, S = PREP_S(W);
    const int r = tid >> PREP_LOG2(TPR), c0 = (tid & (TPR - 1)) * CW;
    const float f = (norm ? rsqrtf(ss_row + 1e-6f) : 1.0f) * scale;
    /* with the l2norm a finite Σx² bounds every |x f| by the scale, so only a non-finite Σx² needs the elements
       (then ±∞ gives NaN, a huge finite element 0); without it every element is tested */
    if (!norm || !(ss_row < INFINITY)) {
        bool huge = false;
#pragma unroll
        for (int c = 0; c < CW; c++) huge |= !(fabsf(x[c] * f) < PREP_HUGE);
        if (huge) bad = min(bad, r);
    }
    if (keep_raw && f >= 0x1p-40f && f <= 0x1p40f) {
        *kept = 1;
        return f;
    }
#pragma unroll
    for (int c = 0; c < CW; c += 8)
        *(uint4 *)(tile + r * S + c0 + c) =
            make_uint4(pack_bf16(x[c] * f, x[c + 1] * f), pack_bf16(x[c + 2] * f, x[c + 3] * f),
                       pack_bf16(x[c + 4] * f, x[c + 5] * f), pack_bf16(x[c + 6] * f, x[c + 7] * f));
    return f;
}

/* bf16 v stays as copied: its bound by the exponent bits, 8 elements a 16-byte load (a half is at or above
 * 2^56, ±∞ or NaN iff its exponent field is ≥ 183: adding 0x2480 to the field carries into the half's top bit) */
template <int W, int TPR>
DEV void huge_bf16_rows(const bf16 *tile, int tid, int &bad) {
    constexpr int CW = W / TPR, S = PREP_S(W);
    const int r = tid >> PREP_LOG2(TPR), c0 = (tid & (TPR - 1)) * CW;
    uint32_t acc = 0;
#pragma unroll
    for (int c = 0; c < CW; c += 8) {
        const uint4 w = *(const uint4 *)(tile + r * S + c0 + c);
        acc |= ((w.x & 0x7f807f80u) + 0x24802480u) | ((w.y & 0x7f807f80u) + 0x24802480u) |
               ((w.z & 0x7f807f80u) + 0x24802480u) | ((w.w & 0x7f807f80u) + 0x24802480u);
    }
    if (acc & 0x80008000u) bad = min(bad, r);
}

/* Aqk's diagonal, Aqk_ii = q_i·k_i: with the factors of intra_chunk_A it carried the bf16 rounding of q, of k,
 * of both exponentials and of both factors, and o_i ≈ Aqk_ii Δ_i where the decay is strong: here it is s q·k /
 * (‖q‖ ‖k‖) in fp32 from the unrounded rows, substituted after intra_chunk_A
 * (aqk_diagonal). With the l2norm |q·k| ≤ √(Σq² Σk²), so a row whose sums are finite cannot overflow; one whose
 * sum is not (its normalized row is 0, or NaN and poisoned) gets 0, as does, without the l2norm, a row whose raw
 * q·k overflows (only with a scale below ~2^-8 and elements near the contract's bound: that token's own o_i,
 * clause 3). Rows from t* on get 0 in neutral_rows. */
template <int KD, int VD, int EXACT>
DEV void normalize_qkv(const kda_prep_params_t &p, const prep_smem_t &sm, const prep_chunk_t &ck, int tid, int &bad) {
    constexpr int TPR = PREP_NT(KD, VD) / KDA_CHUNK, CW = KD / TPR;
    static_assert((TPR == 4 || TPR == 8) && CW % 8 == 0 && (VD / TPR) % 8 == 0,
                  "normalize_qkv: 4 or 8 threads a row (PREP_LOG2), whole 16-byte pieces each");
    if (KDA_SKIP(p, 64)) {
        if ((tid & (TPR - 1)) == 0)
            sm.diag[tid >> PREP_LOG2(TPR)] = 0.0f, sm.fq[tid >> PREP_LOG2(TPR)] = sm.fqn[tid >> PREP_LOG2(TPR)] = 1.0f;
        return;
    }
    const int row = tid >> PREP_LOG2(TPR);
    const int64_t row_qk = (ck.t0 + row) * p.pb.hqk + ck.hq, row_v = (ck.t0 + row) * p.pb.hv + ck.h;
    const int vec4_qk = EXACT || (ck.K & 3) == 0, vec4_v = EXACT || (ck.V & 3) == 0; /* fp32 rows by float4 */
    float xq[CW], xk[CW];
    load_row<KD, TPR, EXACT>(p, p.pb.q, row_qk, ck.K, vec4_qk, ck.clen, sm.Q, tid, xq);
    load_row<KD, TPR, EXACT>(p, p.pb.k, row_qk, ck.K, vec4_qk, ck.clen, sm.K, tid, xk);
    /* q·k, Σq², Σk² over the row's TPR threads, the three reductions side by side */
    float dot = 0.0f, ssq = 0.0f, ssk = 0.0f;
#pragma unroll
    for (int c = 0; c < CW; c++) {
        dot += xq[c] * xk[c];
        ssq += xq[c] * xq[c];
        ssk += xk[c] * xk[c];
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, o);
        ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
        ssk += __shfl_xor_sync(0xffffffffu, ssk, o);
    }
    int q_kept = 0; /* bf16 q: the tile keeps it raw and fq waits in sm.fq (the same f in all TPR threads) */
    const float fq =
        scale_row<KD, TPR>(xq, ssq, sm.Q, p.pb.l2norm, p.pb.scale, tid, bad, p.pb.dtype == KDA_DT_BF16, &q_kept);
    const float fk = scale_row<KD, TPR>(xk, ssk, sm.K, p.pb.l2norm, 1.0f, tid, bad, 0, NULL);
    if ((tid & (TPR - 1)) == 0) {
        const float d = dot * fq * fk;
        sm.diag[row] = fabsf(d) < INFINITY ? d : 0.0f;
        sm.fq[row] = q_kept ? fq : 1.0f;
        sm.fqn[row] = fq;
    }
    if (p.pb.dtype != KDA_DT_BF16) {
        float xv[VD / TPR];
        load_row<VD, TPR, EXACT>(p, p.pb.v, row_v, ck.V, vec4_v, ck.clen, sm.V, tid, xv);
        scale_row<VD, TPR>(xv, 0.0f, sm.V, 0, 1.0f, tid, bad, 0, NULL);
    } else {
        huge_bf16_rows<VD, TPR>(sm.V, tid, bad);
    }
}

/* neutral_rows [rare]: rows t* .. C − 1 of q, k, v and β zeroed, so that they add nothing to any product (the
 * tensor-core products also run over the structural zeros of the triangles: a non-finite row would make 0·∞
 * in the rows before it). Their gate stays (finite after the clamp). */
template <int KD, int VD>
DEV void neutral_rows(const prep_smem_t &sm, int tstar, int tid) {
    constexpr int SK = PREP_S(KD), SV = PREP_S(VD), NT = PREP_NT(KD, VD);
    for (int e = tid; e < (KDA_CHUNK - tstar) * (KD / 8); e += NT) {
        const int r = tstar + e / (KD / 8), c = (e % (KD / 8)) * 8;
        *(uint4 *)(sm.Q + r * SK + c) = make_uint4(0, 0, 0, 0);
        *(uint4 *)(sm.K + r * SK + c) = make_uint4(0, 0, 0, 0);
    }
    for (int e = tid; e < (KDA_CHUNK - tstar) * (VD / 8); e += NT) {
        const int r = tstar + e / (VD / 8), c = (e % (VD / 8)) * 8;
        *(uint4 *)(sm.V + r * SV + c) = make_uint4(0, 0, 0, 0);
    }
    if (tid >= tstar && tid < KDA_CHUNK) sm.beta[tid] = sm.diag[tid] = 0.0f;
}

/* ---------------------------------------------------------------------------------------------------------
 * intra_chunk_A: A and Aqk by 16×16 blocks with the split factors of ALGORITHM.md §3
 * ------------------------------------------------------------------------------------------------------- */
/* Row factors of a 16-row block for one k-tile: A fragments of k_i e^{G_i − R} and q_i e^{G_i − R}. */
template <int KD>
DEV void row_factors(const float *sG, const bf16 *sK, const bf16 *sQ, const float *R, int row0, int kt, int lane,
                     uint32_t fk[4], uint32_t fq[4]) {
    constexpr int S = PREP_S(KD);
    const int g = lane >> 2, t = lane & 3;
    /* k's and q's fragments by ldmatrix: matrix m of the four is rows row0 + 8 (m & 1).., columns kt·16 + 8 (m >> 1)..
       (lanes 8m..8m+7 give its row addresses), so register r holds the pair (g + 8 (r & 1), 2t + 8 (r >> 1)) */
    const int lrow = row0 + (lane & 7) + 8 * ((lane >> 3) & 1), lcol = kt * 16 + 8 * (lane >> 4);
    uint32_t kf[4], qf[4];
    ldsm_x4(kf, smem_u32(sK + lrow * S + lcol));
    ldsm_x4(qf, smem_u32(sQ + lrow * S + lcol));
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = row0 + g + 8 * (r & 1), col = kt * 16 + 2 * t + 8 * (r >> 1);
        const float2 G = *(const float2 *)&sG[row * S + col];
        const float2 Rr = *(const float2 *)&R[col];
        const uint32_t e = pack_bf16(ex2(G.x - Rr.x), ex2(G.y - Rr.y));
        fk[r] = mul_bf16x2(kf[r], e);
        fq[r] = mul_bf16x2(qf[r], e);
    }
}

/* Column factors for one k-tile: the B fragments (b[2 nt], b[2 nt + 1]) of k_j e^{R − G_j} for the 16 tokens
 * row0..row0+15, n-tile nt the tokens row0 + 8 nt... k's pairs by ldmatrix: matrix m is rows row0 + 8 (m >> 1)..,
 * columns kt·16 + 8 (m & 1).., so register m holds the pair (token row0 + 8 (m >> 1) + g, channels 2t + 8 (m & 1)). */
template <int KD>
DEV void col_factors(const float *sG, const bf16 *sK, const float *R, int row0, int kt, int lane, uint32_t b[4]) {
    constexpr int S = PREP_S(KD);
    const int g = lane >> 2, t = lane & 3;
    uint32_t kf[4];
    ldsm_x4(kf, smem_u32(sK + (row0 + (lane & 7) + 8 * (lane >> 4)) * S + kt * 16 + 8 * ((lane >> 3) & 1)));
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const int row = row0 + 8 * (m >> 1) + g, col = kt * 16 + 2 * t + 8 * (m & 1);
        const float2 G = *(const float2 *)&sG[row * S + col];
        const float2 Rr = *(const float2 *)&R[col];
        b[m] = mul_bf16x2(kf[m], pack_bf16(ex2(Rr.x - G.x), ex2(Rr.y - G.y)));
    }
}

/* A and Aqk of the NB 16×16 blocks (rows row0.., columns col0 + 16 b..) by the split factors around reference
 * R: Σ_kt (row factors of the rows, computed once per k-tile for all NB blocks) · (column factors of the
 * columns) on the tensor cores, into accA[b] / accQ[b]; the NKT k-tiles from kt0. */
template <int KD, int NB, int NKT>
DEV void blocks_by_factors(const float *sG, const bf16 *sK, const bf16 *sQ, const float *R, int row0, int col0, int kt0,
                           int lane, float (*accA)[2][4], float (*accQ)[2][4]) {
#pragma unroll
    for (int kt = kt0; kt < kt0 + NKT; kt++) {
        uint32_t fk[4], fq[4];
        row_factors<KD>(sG, sK, sQ, R, row0, kt, lane, fk, fq);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            uint32_t bf[4];
            col_factors<KD>(sG, sK, R, col0 + 16 * b, kt, lane, bf);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                mma_bf16(accA[b][nt], fk, bf[2 * nt], bf[2 * nt + 1]);
                mma_bf16(accQ[b][nt], fq, bf[2 * nt], bf[2 * nt + 1]);
            }
        }
    }
}

/* A and Aqk of the diagonal block D when its decays are too strong to split: one exponential per (i, j, d),
 * fp32, over the channels d0 .. d1 − 1 */
template <int KD>
DEV void diag_block_exact(const float *sG, const bf16 *sK, const bf16 *sQ, int D, int d0, int d1, int lane,
                          float accA[2][4], float accQ[2][4]) {
    constexpr int S = PREP_S(KD);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int i = 16 * D + g + 8 * (c >> 1), j = 16 * D + 8 * nt + 2 * t + (c & 1);
            float sa = 0.0f, sq = 0.0f;
            for (int d = d0; d < d1 && j <= i; d++) {
                const float e = __bfloat162float(sK[j * S + d]) * ex2(sG[i * S + d] - sG[j * S + d]);
                sa += __bfloat162float(sK[i * S + d]) * e;
                sq += __bfloat162float(sQ[i * S + d]) * e;
            }
            accA[nt][c] = sa;
            accQ[nt][c] = sq;
        }
}

/* Store a 16×16 block of A (β-scaled, strictly lower) and of Aqk (lower with diagonal, into the workspace) from
 * the accumulators of its two 8-column halves. A's diagonal blocks go to R_A in fp32 for invert_diag_blocks, its
 * off-diagonal blocks to R_AB as solve_w_u's bf16 A fragments (the lane holds its own fragment already). */
DEV void store_block(float *sA, uint4 *ab, unsigned char *blk_aqk, const float *sBeta, const float *sFq, int I, int J,
                     int lane, const float accA[2][4], const float accQ[2][4], int diagonal) {
    const int g = lane >> 2, t = lane & 3;
    uint32_t frag[4]; /* an off-diagonal block's A fragment of this lane for solve_w_u: register hr + 2 nt */
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int i = 16 * I + g + 8 * hr, j = 16 * J + 8 * nt + 2 * t;
            float a0 = accA[nt][2 * hr] * sBeta[i], a1 = accA[nt][2 * hr + 1] * sBeta[i];
            float q0 = accQ[nt][2 * hr] * sFq[i], q1 = accQ[nt][2 * hr + 1] * sFq[i]; /* q's row factor, if kept */
            if (diagonal) {
                if (j >= i) a0 = 0.0f;
                if (j + 1 >= i) a1 = 0.0f;
                if (j > i) q0 = 0.0f;
                if (j + 1 > i) q1 = 0.0f;
            }
            if (diagonal) *(float2 *)&sA[i * SA + j] = make_float2(a0, a1); /* for invert_diag_blocks */
            frag[hr + 2 * nt] = pack_bf16(a0, a1);
            *(uint32_t *)(blk_aqk + pan_off_r8(16 * I + 8 * hr, g, j)) = pack_bf16(q0, q1); /* (row i) */
        }
    }
    if (!diagonal) ab[PREP_AB_BLOCK(I, J) * 32 + lane] = make_uint4(frag[0], frag[1], frag[2], frag[3]);
}

/* A role's blocks from its accumulators → A (shared memory: R_A, R_AB) and Aqk (workspace) */
DEV void store_role_blocks(const prep_smem_t &sm, unsigned char *blk_aqk, int I, int J0, int nb, int lane,
                           const float (&accA)[2][2][4], const float (&accQ)[2][2][4]) {
#pragma unroll
    for (int b = 0; b < 2; b++)
        if (b < nb) store_block(sm.A, sm.ab, blk_aqk, sm.beta, sm.fq, I, J0 + b, lane, accA[b], accQ[b], J0 + b == I);
}

/* The A warps' six roles, each a run of blocks of one row block I that share their row factors:
 *   (0,0) | (1,0) (1,1) | (2,0) (2,1) | (2,2) | (3,0) (3,1) | (3,2) (3,3).
 * role_blocks gives a role's row block I, first column block J0 and block count nb. */
DEV void role_blocks(int role, int &I, int &J0, int &nb) {
    I = role < 2 ? role : (role + 2) >> 1;
    J0 = (role >= 2 && (role & 1)) ? 2 : 0;
    nb = (role == 0 || role == 3) ? 1 : 2;
}

/* The 4 accumulators of a role's sums as 8 quads: q = 0..3 of A, 4..7 of Aqk (block q/2 & 1, half q & 1) */
DEV float *acc_quad(float (&accA)[2][2][4], float (&accQ)[2][2][4], int q) {
    return q < 4 ? accA[q >> 1][q & 1] : accQ[(q - 4) >> 1][q & 1];
}

/* intra_chunk_A: a role's blocks. The reference R is G at the middle row of block I when the warp has the
 * diagonal block and the block's exponents stay within ±KDA_DIAG_RANGE (the off-diagonal column factors
 * e^{R − G_j} are then ≤ 1, the row factors ≤ e^{KDA_DIAG_RANGE}); otherwise G at block I's first row (every
 * factor ≤ 1) and the diagonal block by one exponential per (i, j, d).
 * With KSPLIT = 1 the role's sums, then its blocks stored. With KSPLIT = 2 (16 warps) warps w and w + 6 share a
 * role, each over half of the channels: the sums of the warp's half are left in keepA/keepQ (the second half's
 * also in sm.red), and after the kernel's next barrier intra_chunk_store adds them and stores the blocks. */
template <int KD, int KSPLIT>
DEV void intra_chunk_A(const prep_smem_t &sm, unsigned char *blk_aqk, int warp, int lane, float (&keepA)[2][2][4],
                       float (&keepQ)[2][2][4]) {
    constexpr int S = PREP_S(KD), NKT = KD / 16 / KSPLIT;
    const int role = KSPLIT > 1 ? warp % PREP_A_WARPS : warp, kh = KSPLIT > 1 ? warp / PREP_A_WARPS : 0; /* half */
    int I, J0, nb;
    role_blocks(role, I, J0, nb);
    const int has_diag = J0 + nb - 1 == I;
    int split = 0;
    if (has_diag) {
        const float *Gfirst = sm.G + (16 * I) * S, *Gmid = sm.G + (16 * I + 7) * S, *Glast = sm.G + (16 * I + 15) * S;
        float range = 0.0f;
        for (int d = lane; d < KD; d += 32) range = fmaxf(range, fmaxf(Gfirst[d] - Gmid[d], Gmid[d] - Glast[d]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) range = fmaxf(range, __shfl_xor_sync(0xffffffffu, range, o));
        split = range <= KDA_DIAG_RANGE * LOG2E;
    }
    const float *R = sm.G + (16 * I + (split ? 7 : 0)) * S;
    const int nf = nb - (has_diag && !split); /* blocks by factors */
    float accA[2][2][4] = {{{0.f}}}, accQ[2][2][4] = {{{0.f}}};
    if (nf == 2) blocks_by_factors<KD, 2, NKT>(sm.G, sm.K, sm.Q, R, 16 * I, 16 * J0, kh * NKT, lane, accA, accQ);
    else if (nf == 1) blocks_by_factors<KD, 1, NKT>(sm.G, sm.K, sm.Q, R, 16 * I, 16 * J0, kh * NKT, lane, accA, accQ);
    if (nf < nb) {
        const int d0 = kh * (KD / KSPLIT), d1 = d0 + KD / KSPLIT;
        if (nb == 2) diag_block_exact<KD>(sm.G, sm.K, sm.Q, I, d0, d1, lane, accA[1], accQ[1]);
        else diag_block_exact<KD>(sm.G, sm.K, sm.Q, I, d0, d1, lane, accA[0], accQ[0]);
    }
    if (KSPLIT == 1) {
        store_role_blocks(sm, blk_aqk, I, J0, nb, lane, accA, accQ);
        return;
    }
    float4 *red = (float4 *)sm.red + role * 8 * 32 + lane; /* float4 q of a lane at [role][q][lane] */
#pragma unroll
    for (int q = 0; q < 8; q++) {
        const float *x = acc_quad(accA, accQ, q);
        float *y = acc_quad(keepA, keepQ, q);
        if (kh == 1) red[q * 32] = make_float4(x[0], x[1], x[2], x[3]);
        y[0] = x[0];
        y[1] = x[1];
        y[2] = x[2];
        y[3] = x[3];
    }
}

/* With KSPLIT = 2, after the barrier: the first channel half's warps (0-5) add the second's sums and store */
DEV void intra_chunk_store(const prep_smem_t &sm, unsigned char *blk_aqk, int warp, int lane, float (&accA)[2][2][4],
                           float (&accQ)[2][2][4]) {
    int I, J0, nb;
    role_blocks(warp, I, J0, nb);
    const float4 *red = (const float4 *)sm.red + warp * 8 * 32 + lane;
#pragma unroll
    for (int q = 0; q < 8; q++) {
        float *x = acc_quad(accA, accQ, q);
        const float4 h = red[q * 32];
        x[0] += h.x;
        x[1] += h.y;
        x[2] += h.z;
        x[3] += h.w;
    }
    store_role_blocks(sm, blk_aqk, I, J0, nb, lane, accA, accQ);
}

/* ---------------------------------------------------------------------------------------------------------
 * decay_factors (the decay warps, ND = 64 or 128 threads, beside intra_chunk_A): γ = e^{G_last} → workspace,
 * and Aqk's zero blocks above the diagonal. K̃ is made in gated_qk: here it put 8 K of a chunk's exponentials on
 * the MUFU pipe while the A warps' 33 K bunched there.
 * ------------------------------------------------------------------------------------------------------- */
template <int KD, int VD, int ND>
DEV void decay_factors(const kda_prep_params_t &p, const prep_smem_t &sm, const prep_chunk_t &ck, int tid2) {
    constexpr int S = PREP_S(KD);
    const float *GL = sm.G + (ck.clen - 1) * S;
    if (!KDA_SKIP(p, 128)) { /* (K̃ itself: gated_qk, beside QΓ and KΓ, from the same loads of G and k) */
        float *gamma = (float *)(ck.blk + kda_cuda_off_gamma(KD));
        for (int d = tid2; d < KD; d += ND) gamma[d] = ex2(GL[d]);
    }
    if (!KDA_SKIP(p, 1)) {
        unsigned char *blk_aqk = ck.blk + kda_cuda_off_aqk(KD);
        for (int e = tid2; e < KDA_CHUNK * 8; e += ND) {
            const int r = e >> 3, c = e & 7;
            if (c >= 2 * ((r >> 4) + 1)) *(uint4 *)(blk_aqk + pan_off(r, 8 * c)) = make_uint4(0, 0, 0, 0);
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * gated_qk: QΓ = f_q q e^{G} and K̃ = k e^{G_last − G} → workspace, KΓ = k e^{G} → shared (over q), sharing e^G and
 * the loads of G and k
 * ------------------------------------------------------------------------------------------------------- */
template <int KD, int VD, int NT>
DEV void gated_qk(const kda_prep_params_t &p, const prep_smem_t &sm, const prep_chunk_t &ck, int tid) {
    constexpr int S = PREP_S(KD), row_chunks = KD / 8;
    if (KDA_SKIP(p, 128)) return;
    unsigned char *blk_qg = ck.blk + kda_cuda_off_qg(KD), *blk_kt = ck.blk + kda_cuda_off_kt(KD);
    /* a thread's 8 columns c·8.. are the same in every row it takes (NT is a multiple of row_chunks): G_last's
       values once */
    static_assert(NT % row_chunks == 0, "gated_qk: a thread keeps its columns");
    const float *GL = sm.G + (ck.clen - 1) * S + (tid % row_chunks) * 8;
    const float4 la = *(const float4 *)GL, lb = *(const float4 *)(GL + 4);
    const float lv[8] = {la.x, la.y, la.z, la.w, lb.x, lb.y, lb.z, lb.w};
    const int fine_kt = p.blocks.fine & KDA_FINE_KT;
    for (int e = tid; e < KDA_CHUNK * row_chunks; e += NT) {
        const int r = e / row_chunks, c = e % row_chunks;
        const float *G = sm.G + r * S + c * 8;
        const uint4 q8 = *(const uint4 *)(sm.Q + r * S + c * 8), k8 = *(const uint4 *)(sm.K + r * S + c * 8);
        const uint32_t *qw = (const uint32_t *)&q8, *kw = (const uint32_t *)&k8;
        const float4 ga = *(const float4 *)G, gb = *(const float4 *)(G + 4);
        const float gv[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
        float eg[8];
#pragma unroll
        for (int u = 0; u < 8; u++) eg[u] = ex2(gv[u]);
        uint32_t qg[4], kg[4], kt[4];
        float xt[8];
#pragma unroll
        for (int u = 0; u < 4; u++) { /* the products in fp32, rounded once: raw bf16 k · e^G (and q · s/‖q‖ · e^G);
                                         K̃ = k e^{G_last − G} (as FLA's kg) */
            const float2 kf = unpack_bf16(kw[u]);
            kg[u] = pack_bf16(kf.x * eg[2 * u], kf.y * eg[2 * u + 1]);
            xt[2 * u] = kf.x * ex2(lv[2 * u] - gv[2 * u]);
            xt[2 * u + 1] = kf.y * ex2(lv[2 * u + 1] - gv[2 * u + 1]);
            kt[u] = pack_bf16(xt[2 * u], xt[2 * u + 1]);
        }
        *(uint4 *)(blk_kt + pan_off(r, c * 8)) = make_uint4(kt[0], kt[1], kt[2], kt[3]);
        if (fine_kt) { /* its low part too, K̃ = hi + lo */
            uint32_t lo[4];
#pragma unroll
            for (int u = 0; u < 4; u++) lo[u] = pack_bf16_lo(xt[2 * u], xt[2 * u + 1], kt[u]);
            *(uint4 *)(ck.blk + kda_cuda_off_ktlo(KD, VD, p.blocks.fine) + pan_off(r, c * 8)) =
                make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
        if (p.blocks.fine & KDA_FINE_QG) { /* fp16 and fp32 inputs: QΓ = hi + lo from the input row, unrounded (the tile
                                holds bf16(q̂)): lo goes to QΓ_lo. Rows from t* on (neutral) and past the chunk's end are
                                zero, as in the tile */
            const int ok = r < ck.clen && r < *sm.tstar;
            const int64_t row = (ck.t0 + r) * p.pb.hqk + ck.hq;
            float x[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int col = c * 8 + u;
                float qv = 0.0f;
                if (ok && col < ck.K)
                    qv = p.pb.dtype == KDA_DT_F32 ? ((const float *)p.pb.q)[row * ck.K + col]
                                                  : __half2float(((const __half *)p.pb.q)[row * ck.K + col]);
                x[u] = qv * sm.fqn[r] * eg[u];
            }
            uint32_t lo[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                qg[u] = pack_bf16(x[2 * u], x[2 * u + 1]);
                lo[u] = pack_bf16_lo(x[2 * u], x[2 * u + 1], qg[u]);
            }
            *(uint4 *)(ck.blk + kda_cuda_off_qglo(KD, VD) + pan_off(r, c * 8)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        } else {
            const float fq = sm.fq[r];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const float2 qf = unpack_bf16(qw[u]);
                qg[u] = pack_bf16(qf.x * fq * eg[2 * u], qf.y * fq * eg[2 * u + 1]);
            }
        }
        *(uint4 *)(blk_qg + pan_off(r, c * 8)) = make_uint4(qg[0], qg[1], qg[2], qg[3]);
        *(uint4 *)(sm.Q + r * S + c * 8) = make_uint4(kg[0], kg[1], kg[2], kg[3]); /* same thread read it */
    }
}

/* aqk_diagonal (warps 4-5, while warps 0-3 invert): Aqk's diagonal from normalize_qkv over the one intra_chunk_A
 * wrote (a 16-bit store into its word, ordered after it by the barrier between them) */
DEV void aqk_diagonal(const prep_smem_t &sm, unsigned char *blk_aqk, int i) {
    *(bf16 *)(blk_aqk + pan_off(i, i)) = __float2bfloat16_rn(sm.diag[i]);
}

/* ---------------------------------------------------------------------------------------------------------
 * invert_diag_blocks: the diagonal blocks of T = (I + A)⁻¹ in fp32 by forward substitution (warps 0-3, one
 * block each, a column per lane), written over A's diagonal blocks less their unit diagonal, as L_II = T_II − I,
 * then as the bf16 fragments solve_w_u reads (R_AB; A_IM, M < I, are there from store_block)
 * ------------------------------------------------------------------------------------------------------- */
DEV void invert_diag_blocks(float *sA, uint4 *ab, int warp, int lane) {
    const int j = lane & 15, b = 16 * warp;
    float tcol[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        float s = 0.0f;
#pragma unroll
        for (int m = 0; m < i; m++) s += sA[(b + i) * SA + b + m] * tcol[m];
        tcol[i] = i == j ? 1.0f : (i > j ? -s : 0.0f);
    }
    __syncwarp();
    if (lane < 16)
#pragma unroll
        for (int i = 0; i < 16; i++) sA[(b + i) * SA + b + j] = i == j ? 0.0f : tcol[i];
    __syncwarp();
    /* L_II as solve_w_u's bf16 A fragment (lane (g, t): rows g, g + 8, columns 2t.., 2t + 8..) */
    const int g = lane >> 2, t = lane & 3;
    uint32_t frag[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const float2 v = *(const float2 *)&sA[(b + g + 8 * (r & 1)) * SA + b + 2 * t + 8 * (r >> 1)];
        frag[r] = pack_bf16(v.x, v.y);
    }
    ab[PREP_AB_BLOCK(warp, warp) * 32 + lane] = make_uint4(frag[0], frag[1], frag[2], frag[3]);
}

/* ---------------------------------------------------------------------------------------------------------
 * solve_w_u: [W | U] = T Diag(β) [KΓ | V] by block forward substitution: for row blocks I = 0..3,
 *   Y_I = β_I ⊙ [KΓ | V]_I − Σ_{M<I} A_IM X_M,   X_I = T_II Y_I = Y_I + L_II Y_I.
 * Y_I stays in fp32 in the accumulators that L_II Y_I (Y_I rounded to bf16) is added to: with T_II's unit
 * diagonal on the tensor cores, Y's bf16 rounding would go straight into X.
 * A warp owns a slab of SLAB columns of W (the first half of the warps, SLAB = KD/4 with 8 warps, KD/8 with 16)
 * or of U (the second half, VD/4 or VD/8), so it needs no other warp. X goes to `stage` (panel layout), Y
 * through the warp's scratch rows (stride YS).
 * ------------------------------------------------------------------------------------------------------- */
template <int SLAB, int SRC_S>
DEV void solve_slab(const kda_prep_params_t &p, int ab_from_beta, const float *sBeta, const bf16 *src, int col0,
                    unsigned char *stage, bf16 *Y, int YS, int lane) {
    constexpr int NTW = SLAB / 8; /* n-tiles of a warp's slab */
    const int g = lane >> 2, t = lane & 3;
    /* the fragment region's address from β's (a constant distance): a pointer of its own, live from the kernel's
       start, cost spills at 128 registers */
    const uint32_t ab = smem_u32(sBeta) + ab_from_beta + lane * 16;
    for (int I = 0; I < 4 && !KDA_SKIP(p, 4); I++) {
        float acc[NTW][4];
#pragma unroll
        for (int nt = 0; nt < NTW; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        for (int M = 0; M < I; M++) {
            uint32_t a[4];
            lds_u4(a, ab + PREP_AB_BLOCK(I, M) * 512);
#pragma unroll
            for (int pp = 0; pp < NTW / 2; pp++) {
                const int col = col0 + pp * 16 + (lane >> 4) * 8; /* row 16 M + 8 ((lane >> 3) & 1) + (lane & 7) */
                uint32_t b[4];
                ldsm_x4_t(b, smem_u32(stage + pan_off_r8(16 * M + ((lane >> 3) & 1) * 8, lane & 7, col)));
                mma_bf16(acc[2 * pp], a, b[0], b[1]);
                mma_bf16(acc[2 * pp + 1], a, b[2], b[3]);
            }
        }
        /* Y = β ⊙ B − acc: fp32 in acc (X's accumulators from here), bf16 rows of the warp's scratch. B's pairs
         * and β are all loaded before the first Y store: the compiler cannot move a shared load above a shared
         * store it cannot tell apart, and loaded one by one each waited for the last (ncu: 6 % of the kernel) */
        uint32_t bsrc[NTW][2];
        const float be[2] = {sBeta[16 * I + g], sBeta[16 * I + g + 8]};
#pragma unroll
        for (int nt = 0; nt < NTW; nt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++)
                bsrc[nt][hr] = *(const uint32_t *)&src[(16 * I + g + 8 * hr) * SRC_S + col0 + nt * 8 + 2 * t];
#pragma unroll
        for (int nt = 0; nt < NTW; nt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const float2 bb = unpack_bf16(bsrc[nt][hr]);
                acc[nt][2 * hr] = be[hr] * bb.x - acc[nt][2 * hr];
                acc[nt][2 * hr + 1] = be[hr] * bb.y - acc[nt][2 * hr + 1];
                *(uint32_t *)&Y[(g + 8 * hr) * YS + nt * 8 + 2 * t] = pack_bf16(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
            }
        __syncwarp();
        uint32_t a[4]; /* L_II */
        lds_u4(a, ab + PREP_AB_BLOCK(I, I) * 512);
#pragma unroll
        for (int pp = 0; pp < NTW / 2; pp++) {
            const int row = (lane & 7) + ((lane >> 3) & 1) * 8, col = pp * 16 + (lane >> 4) * 8;
            uint32_t b[4];
            ldsm_x4_t(b, smem_u32(Y + row * YS + col));
            mma_bf16(acc[2 * pp], a, b[0], b[1]);
            mma_bf16(acc[2 * pp + 1], a, b[2], b[3]);
        }
        /* X_I → the staging tile */
#pragma unroll
        for (int nt = 0; nt < NTW; nt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int c = col0 + nt * 8 + 2 * t; /* row 16 I + 8 hr + g */
                *(uint32_t *)(stage + pan_off_r8(16 * I + 8 * hr, g, c)) =
                    pack_bf16(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
            }
        __syncwarp();
    }
}

template <int KD, int VD>
DEV void solve_w_u(const kda_prep_params_t &p, const prep_smem_t &sm, int warp, int lane) {
    constexpr int NH = PREP_NT(KD, VD) / 64; /* warps per side: W by warps 0..NH − 1, U by NH..2NH − 1 */
    const int is_u = warp >= NH;
    unsigned char *stage = (unsigned char *)sm.G + is_u * (KDA_CHUNK * KD * 2); /* X tiles: W, then U */
    if (KD == VD) {                                                             /* one code path for both warp kinds */
        constexpr int YS = KD / NH + 8;
        solve_slab<KD / NH, PREP_S(KD)>(p, PREP_OFF_AB(KD, VD) - PREP_OFF_BETA(KD, VD), sm.beta, is_u ? sm.V : sm.Q,
                                        (warp & (NH - 1)) * (KD / NH), stage, sm.K + warp * 16 * YS, YS, lane);
    } else if (is_u) {
        constexpr int YS = PREP_YS(KD, VD);
        solve_slab<VD / NH, PREP_S(VD)>(p, PREP_OFF_AB(KD, VD) - PREP_OFF_BETA(KD, VD), sm.beta, sm.V,
                                        (warp & (NH - 1)) * (VD / NH), stage, sm.K + warp * 16 * YS, YS, lane);
    } else {
        constexpr int YS = PREP_YS(KD, VD);
        solve_slab<KD / NH, PREP_S(KD)>(p, PREP_OFF_AB(KD, VD) - PREP_OFF_BETA(KD, VD), sm.beta, sm.Q,
                                        (warp & (NH - 1)) * (KD / NH), stage, sm.K + warp * 16 * YS, YS, lane);
    }
}

/* store_w_u: W and U (both in the panel layout already) → workspace */
template <int KD, int VD>
DEV void store_w_u(const kda_prep_params_t &p, const prep_smem_t &sm, const prep_chunk_t &ck, int tid) {
    constexpr int NT = PREP_NT(KD, VD);
    if (KDA_SKIP(p, 256)) return;
    constexpr int W16 = KDA_CHUNK * KD * 2 / 16, U16 = KDA_CHUNK * VD * 2 / 16;
    uint4 *w_out = (uint4 *)ck.blk, *u_out = (uint4 *)(ck.blk + kda_cuda_off_u(KD));
    const uint4 *w_in = (const uint4 *)sm.G, *u_in = w_in + W16;
    if (KD == VD) {
        for (int e = tid; e < W16; e += NT) {
            w_out[e] = w_in[e];
            u_out[e] = u_in[e];
        }
    } else {
        for (int e = tid; e < W16; e += NT) w_out[e] = w_in[e];
        for (int e = tid; e < U16; e += NT) u_out[e] = u_in[e];
    }
}

/* poison_block [rare]: QΓ rows t* .. C − 1 and γ → NaN in the workspace block (after every thread's own stores
 * of them, which earlier barriers ordered). The recurrence needs no test of its own: o of those rows reads their
 * QΓ row, and γ S makes the state NaN, hence every later output of the sequence (later CP pieces through the
 * pre-scan's maps and the merge) and its final state. */
template <int KD, int NT>
DEV void poison_block(const prep_chunk_t &ck, int tstar, int tid) {
    constexpr int row_chunks = KD / 8;
    unsigned char *blk_qg = ck.blk + kda_cuda_off_qg(KD);
    const uint32_t nan2 = 0x7fc07fc0u; /* two bf16 NaNs */
    for (int e = tid; e < (KDA_CHUNK - tstar) * row_chunks; e += NT) {
        const int r = tstar + e / row_chunks, c = e % row_chunks;
        *(uint4 *)(blk_qg + pan_off(r, c * 8)) = make_uint4(nan2, nan2, nan2, nan2);
    }
    float *gamma = (float *)(ck.blk + kda_cuda_off_gamma(KD));
    for (int d = tid; d < KD; d += NT) gamma[d] = __int_as_float(0x7fffffff);
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernel
 * ------------------------------------------------------------------------------------------------------- */
/* two CTAs per SM (128 registers a thread) where their shared memory fits, i.e. for classes up to 128 */
#define PREP_MIN_CTAS(KD, VD) ((KD) <= 128 && (VD) <= 128 ? 2 : 1)

/* EXACT: K and V are the classes themselves (K = KD, V = VD): the masks and the narrow load paths compile away.
 * Without it the kernel carries them, and its larger code would slow the common sizes (instruction fetch). */
template <int KD, int VD, int EXACT>
__global__ void __launch_bounds__(PREP_NT(KD, VD), PREP_MIN_CTAS(KD, VD)) kda_prep_kernel(const kda_prep_params_t p) {
    constexpr int NT = PREP_NT(KD, VD), KSPLIT = PREP_KSPLIT(NT), NA = PREP_A_WARPS * KSPLIT; /* NA: A warps */
    extern __shared__ __align__(16) unsigned char smem[];
    const prep_smem_t sm = {(float *)smem,
                            (bf16 *)(smem + PREP_OFF_K(KD, VD)),
                            (bf16 *)(smem + PREP_OFF_Q(KD, VD)),
                            (bf16 *)(smem + PREP_OFF_V(KD, VD)),
                            (float *)(smem + PREP_OFF_A(KD, VD)),
                            (float *)(smem + PREP_OFF_BETA(KD, VD)),
                            (float *)(smem + PREP_OFF_TOT(KD, VD)),
                            (int *)(smem + PREP_OFF_TSTAR(KD, VD)),
                            (float *)(smem + PREP_OFF_DIAG(KD, VD)),
                            (float *)(smem + PREP_OFF_FQ(KD, VD)),
                            (float *)(smem + PREP_OFF_FQN(KD, VD)),
                            (float *)(smem + PREP_OFF_RED(KD, VD)),
                            (uint4 *)(smem + PREP_OFF_AB(KD, VD))};
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    pdl_wait(); /* (launched with pdl: the kernels before, meta's chunk offsets among them, have completed) */
    pdl_trigger();
    if (p.plan && blockIdx.x == 0) { /* the CP piece table, beside the chunks (read by the pre-scan, after prep) */
        cp_plan_cta<NT>(p.cp, (int64_t *)smem, (int64_t *)smem + NT / 32);
        return;
    }

    /* this CTA's chunk */
    prep_chunk_t ck;
    ck.K = EXACT ? KD : p.pb.K;
    ck.V = EXACT ? VD : p.pb.V;
    ck.piece_qk = EXACT ? 16 : p.piece_qk;
    ck.piece_v = EXACT ? 16 : p.piece_v;
    /* (chunk, value head) of this CTA, after the planning CTA when there is one; the divisions by multiplies (fewer
       than 2^31 CTAs and chunks, so every dividend is below 2^31: kda_fastdiv_t) */
    const uint32_t b = blockIdx.x - (uint32_t)p.plan;
    const uint32_t cid = kda_fastdiv(b, p.div_hv);
    ck.h = (int)(b - cid * (uint32_t)p.pb.hv);
    int64_t n;
    if (!p.pb.seqs.cu_seqlens) {
        n = kda_fastdiv(cid, p.div_cpr);
        if (n >= p.pb.seqs.num_seqs) return;
    } else {
        n = chunk_seq(p.pb.seqs, cid);
        if (n < 0) return;
    }
    int64_t bos, eos;
    seq_bounds(p.pb.seqs, n, &bos, &eos);
    ck.t0 = bos + (cid - seq_chunk0(p.pb.seqs, n)) * KDA_CHUNK;
    ck.clen = (int)min((int64_t)KDA_CHUNK, eos - ck.t0);
    if (ck.clen <= 0) return;
    ck.hq = (int)kda_fastdiv((uint32_t)ck.h, p.div_group);
    ck.blk = (unsigned char *)p.blocks.base + (int64_t)b * p.blocks.block_bytes;

    int bad = KDA_CHUNK; /* the first poisoning row this thread saw */
    load_inputs<KD, VD>(p, sm, ck, tid, bad);
    float gx[GATE_ROWS(KD, NT)], gy[GATE_ROWS(KD, NT)];
    gate_cumsum<KD, NT, EXACT>(p, sm, ck, tid, gx, gy, bad); /* waits for the copies */
    normalize_qkv<KD, VD, EXACT>(p, sm, ck, tid, bad);
    if (bad < ck.clen) atomicMin(sm.tstar, bad);
    __syncthreads(); /* the parts' totals, the raw gate tile's last reads, q, k, v and t* are done */
    const int tstar = *sm.tstar;
    if (tstar < ck.clen) neutral_rows<KD, VD>(sm, tstar, tid);
    gate_cumsum_finish<KD, NT>(sm, tid, gx, gy);
    __syncthreads();

    float accA[2][2][4], accQ[2][2][4]; /* with 16 warps: a role's sums from intra_chunk_A to intra_chunk_store */
    if (warp < NA) {
        if (!KDA_SKIP(p, 1)) intra_chunk_A<KD, KSPLIT>(sm, ck.blk + kda_cuda_off_aqk(KD), warp, lane, accA, accQ);
    } else {
        decay_factors<KD, VD, NT - NA * 32>(p, sm, ck, tid - NA * 32);
    }
    if (KSPLIT > 1) {
        __syncthreads(); /* the second channel half's sums are in sm.red */
        if (warp < PREP_A_WARPS && !KDA_SKIP(p, 1))
            intra_chunk_store(sm, ck.blk + kda_cuda_off_aqk(KD), warp, lane, accA, accQ);
    }
    __syncthreads(); /* gated_qk overwrites q with KΓ */
    gated_qk<KD, VD, NT>(p, sm, ck, tid);
    if (warp < 4 && !KDA_SKIP(p, 2)) invert_diag_blocks(sm.A, sm.ab, warp, lane);
    if (warp >= 4 && warp < 6 && !KDA_SKIP(p, 1)) aqk_diagonal(sm, ck.blk + kda_cuda_off_aqk(KD), tid - 128);
    __syncthreads();
    solve_w_u<KD, VD>(p, sm, warp, lane);
    __syncthreads();
    store_w_u<KD, VD>(p, sm, ck, tid);
    if (tstar < ck.clen) poison_block<KD, NT>(ck, tstar, tid);
}

/* The launcher of one configuration: one CTA per (chunk, value head), and the planning CTA first when p->plan */
template <int KD, int VD>
static int kda_prep_launch(const kda_prep_params_t *p, int device, void *stream) {
    const int64_t ctas = p->blocks.max_chunks * p->pb.hv + (p->plan ? 1 : 0);
    if (ctas == 0) return 0;
    if (ctas >= ((int64_t)1 << 31)) return (int)cudaErrorInvalidValue; /* (the kernel's 32-bit CTA → chunk step) */
    const int solo = 116 * 1024; /* KDA_SKIP bit 12: more than half an SM's shared memory, one CTA an SM */
    const int bytes = KDA_SKIP(*p, 4096) && PREP_BYTES(KD, VD) < solo ? solo : PREP_BYTES(KD, VD);
    const int exact = p->pb.K == KD && p->pb.V == VD;
    static int done[2][KDA_MAX_DEVICES];
    const void *kernel = exact ? (const void *)kda_prep_kernel<KD, VD, 1> : (const void *)kda_prep_kernel<KD, VD, 0>;
    return kda_launch_ex(kernel, ctas, 1, PREP_NT(KD, VD), bytes, p, device, done[exact], stream, 1);
}
