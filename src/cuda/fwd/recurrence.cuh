/*
 * The chunk recurrence (docs/ALGORITHM.md §3): per sequence, chunk after chunk,
 *
 *     Δ = U − W S,     O = QΓ S + Aqk Δ,     S ← Diag(γ) S + K̃ᵀ Δ
 *
 * from the workspace blocks of prep.cuh. One CTA per (sequence, value head, tile of BV state columns): the
 * recurrence is independent across the V columns of S, so a head's state splits over CTAs without any
 * exchange (BV = 128, 64 or 32 chosen by the host to fill the GPU). Each warp owns 16 columns: it holds Sᵀ
 * (16 × KD, fp32) in accumulators for the whole sequence. With Sᵀ as the left operand every product has its
 * left operand in registers:
 *
 *     Δᵀ = Uᵀ − Sᵀ Wᵀ          (Sᵀ packed to bf16 A fragments; Uᵀ read in accumulator layout by ldmatrix.trans)
 *     Oᵀ = Sᵀ QΓᵀ + Δᵀ Aqkᵀ    (Δᵀ accumulators reused as A fragments)
 *     Sᵀ ← Sᵀ Diag(γ) + Δᵀ K̃   (the states pass over fine blocks, K class ≤ 128: Δᵀ K̃_hi + Δᵀ K̃_lo, K̃ to ~16 bits)
 *
 * state_products computes the first two products, state_update the rest. Two ways to do them:
 *   - wgmma (sm_90a, BV ≥ 64, K class ≤ 128): each warpgroup of 4 warps owns 64 columns and issues m64nNk16
 *     with B straight from the stage (the workspace panels are wgmma's 128-byte-swizzled layout, K-major for W,
 *     QΓ, Aqk and MN-major for K̃). The tensor cores read each B tile once per 64 columns of S; with mma.sync
 *     every warp read all of W, QΓ and K̃ through ldmatrix, and shared-memory bandwidth bounded a step.
 *   - mma.sync m16n8k16 (BV = 32, K class 256, and sm_100a, where wgmma does not exist): B fragments by
 *     ldmatrix per warp; causal tiles of Aqk skipped.
 *
 * Staging (KD = the K class):
 *   - ring (KD ≤ 128): the next chunks' blocks stream in by bulk copies (the copy engine, completing on one
 *     mbarrier per stage) into a 2- or 3-stage ring while this one is used.
 *   - split (KD = 256: two stages do not fit in shared memory): one buffer in two parts, [W | QΓ] and
 *     [K̃ | Aqk | γ | U], each with its barrier; the next chunk's first part is copied in while this chunk's
 *     second part is used, and its second part while the O rows are stored and the next products run.
 * O goes through shared memory so that its global stores are whole rows. Columns past V and tokens past a
 * sequence's end are never stored.
 *
 * Four kernels, one per mode (kda_cuda.h KDA_REC_*), each a few lines over the same phases:
 *   kda_rec_seq_kernel      the forward: whole sequences, O and the final state
 *   kda_rec_prescan_kernel  intra-card CP (ALGORITHM.md §4): a split piece's map S_out = M S_in + E (M's columns
 *                           from the identity with U = 0, so Δᵀ = −Sᵀ Wᵀ; E's from zero), no O, QΓ and Aqk not
 *                           copied
 *   kda_rec_pieces_kernel   intra-card CP: every piece from its merged incoming state, O and the final state
 *   kda_rec_states_kernel   chunk_states and the backward's stage 1: S at every chunk start, no O
 * The phases: rec_seq_work / rec_piece_work (the CTA's sequence or piece, head and tile), rec_cta_setup,
 * rec_load_start (S from the identity, S_in, h0 or zero), rec_prologue (barriers, first copies), then per chunk
 * rec_chunk (rec_wait_chunk, rec_keep_state, the step, the O rows), and rec_store_end (Mᵀ and E, or ht).
 */
#include "common.cuh"
#include "cp_slot.cuh"
#include "seq.cuh"
#include "states16.cuh" /* store_states_bf16: S for the backward's split path */
#include "bwd.h"        /* KDA_BWD_MAX_HEAD_DIM: the KDA_REC_STATES instances */

typedef __nv_bfloat16 bf16;

#define REC_MAX_THREADS 256

/* One stage: W, QΓ, K̃ (C×KD), Aqk (C×C), γ (KD fp32) exactly as in the workspace (REC_LINEAR bytes), then
 * the panels of U that hold this CTA's columns (REC_UP(BV) of them: each panel is KDA_PANEL_BYTES and
 * contiguous in the workspace, common.cuh), then in the states pass over fine blocks (KTLO, ring only) K̃_lo at
 * the next 1 KB (wgmma's 128-byte swizzle repeats every 1 KB). NST stages (ring) or one (split), then the O
 * staging rows (two buffers, alternating by chunk, of BV + 8 elements of OES bytes), then one mbarrier per stage
 * (split: two). */
#define REC_PART_A(KD) (2 * KDA_CHUNK * 2 * (KD)) /* W, QΓ */
#define REC_LINEAR(KD) (3 * KDA_CHUNK * 2 * (KD) + KDA_CHUNK * KDA_CHUNK * 2 + 4 * (KD))
#define REC_UP(BV) ((BV) >= 128 ? 2 : 1)
#define REC_KTLO_OFF(KD, BV) ((REC_LINEAR(KD) + REC_UP(BV) * KDA_PANEL_BYTES + 1023) / 1024 * 1024) /* 1 KB-aligned */
#define REC_STAGE_BYTES(KD, BV, KTLO) (REC_KTLO_OFF(KD, BV) + ((KTLO) ? KDA_CHUNK * 2 * (KD) : 0))
#define REC_O_STRIDE(BV) ((BV) + 8)
#define REC_BYTES(KD, BV, NST, OES, KTLO)                                                                              \
    (1024 + REC_STAGE_BYTES(KD, BV, KTLO) * (NST) + 2 * KDA_CHUNK * REC_O_STRIDE(BV) * (OES) +                         \
     8 * ((NST) < 2 ? 2 : (NST)))
#define REC_SPLIT(KD) ((KD) > 128)
/* K̃_lo in the stages: the states pass (the backward's S, chunk_states) over blocks that carry it, K class ≤ 128.
 * The kernel's stage layout, its shared memory size and the launcher's choice of kernel all ask this. */
KDA_HD static inline int rec_ktlo(int kd, int mode, int fine) {
    return mode == KDA_REC_STATES && !REC_SPLIT(kd) && (fine & KDA_FINE_KT);
}

/* Bulk copies of chunk `blk` into a stage, completing on `bar` armed with their byte count (one thread).
 * first..last: the byte range of the linear part; with_u: the U panels too; off_kl ≥ 0: K̃_lo from there (fine
 * blocks) to the stage's REC_KTLO_OFF. no_o (the pre-scan, which makes no O): QΓ and Aqk are left out of the range
 * (a third fewer bytes), their places in the stage left stale. */
DEV void issue_copy(unsigned char *stage, uint32_t bar, const unsigned char *blk, int first, int last, int with_u,
                    int64_t off_u, int v0, int bv, int no_o, int kd, int64_t off_kl) {
    const uint32_t dst = smem_u32(stage);
    const int ubytes = (with_u ? REC_UP(bv) * KDA_PANEL_BYTES : 0) + (off_kl >= 0 ? KDA_CHUNK * kd * 2 : 0);
    fence_proxy_async(); /* the stage's previous contents were read through the generic proxy */
    if (!no_o) {
        mbar_expect_tx(bar, (uint32_t)(last - first + ubytes));
        bulk_g2s(dst + first, blk + first, (uint32_t)(last - first), bar);
    } else {
        /* [first, last) less QΓ = [C·kd·2, 2·C·kd·2) and Aqk = [3·C·kd·2, 3·C·kd·2 + C·C·2) */
        const int cut[2][2] = {{KDA_CHUNK * kd * 2, 2 * KDA_CHUNK * kd * 2},
                               {3 * KDA_CHUNK * kd * 2, 3 * KDA_CHUNK * kd * 2 + KDA_CHUNK * KDA_CHUNK * 2}};
        int lo[3], hi[3], n = 0, cur = first, bytes = ubytes;
        for (int i = 0; i < 2; i++) {
            const int e = min(cut[i][0], last);
            if (e > cur) lo[n] = cur, hi[n] = e, bytes += e - cur, n++;
            cur = max(cur, cut[i][1]);
        }
        if (last > cur) lo[n] = cur, hi[n] = last, bytes += last - cur, n++;
        mbar_expect_tx(bar, (uint32_t)bytes);
        for (int i = 0; i < n; i++) bulk_g2s(dst + lo[i], blk + lo[i], (uint32_t)(hi[i] - lo[i]), bar);
    }
    if (with_u)
        bulk_g2s(dst + last, blk + off_u + (v0 / KDA_PANEL_COLS) * KDA_PANEL_BYTES,
                 (uint32_t)(REC_UP(bv) * KDA_PANEL_BYTES), bar);
    if (off_kl >= 0) bulk_g2s(dst + REC_KTLO_OFF(kd, bv), blk + off_kl, (uint32_t)(KDA_CHUNK * kd * 2), bar);
}

/* Δᵀ = Uᵀ − (Sᵀ Wᵀ) in place, Uᵀ read in accumulator layout by ldmatrix.trans; then Δᵀ as bf16 A fragments over
 * the tokens. */
template <int ZU>
DEV void delta_fragments(float (&dacc)[8][4], uint32_t (&da)[4][4], uint32_t sU, int ucol, int lane) {
    if (ZU) { /* U = 0 (the pre-scan's M columns): Δᵀ = −Sᵀ Wᵀ */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) dacc[nt][c] = -dacc[nt][c];
    } else {
#pragma unroll
        for (int np = 0; np < 4; np++) {
            const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
            const int col = ucol + ((lane >> 3) & 1) * 8;
            uint32_t u[4];
            ldsm_x4_t(u, sU + pan_off(row, col));
            const float2 u0 = unpack_bf16(u[0]), u1 = unpack_bf16(u[1]), u2 = unpack_bf16(u[2]), u3 = unpack_bf16(u[3]);
            dacc[2 * np][0] = u0.x - dacc[2 * np][0];
            dacc[2 * np][1] = u0.y - dacc[2 * np][1];
            dacc[2 * np][2] = u1.x - dacc[2 * np][2];
            dacc[2 * np][3] = u1.y - dacc[2 * np][3];
            dacc[2 * np + 1][0] = u2.x - dacc[2 * np + 1][0];
            dacc[2 * np + 1][1] = u2.y - dacc[2 * np + 1][1];
            dacc[2 * np + 1][2] = u3.x - dacc[2 * np + 1][2];
            dacc[2 * np + 1][3] = u3.y - dacc[2 * np + 1][3];
        }
    }
#pragma unroll
    for (int kt = 0; kt < 4; kt++) acc_pair_to_a(dacc[2 * kt], dacc[2 * kt + 1], da[kt]);
}

/* The stage's tiles (shared addresses) and the warp's first column within the copied U panels */
typedef struct {
    uint32_t W, QG, KT, Aqk, U, KTlo; /* KTlo: K̃'s low part (fine blocks), 0 without */
    const float *gam;
    int ucol;
} rec_stage_t;

/* ---------------------------------------------------------------------------------------------------------
 * mma.sync, per warp (16 columns of Sᵀ): state_products gives dacc = Sᵀ Wᵀ and oacc = Sᵀ QΓᵀ (16 columns × 64
 * tokens, accumulator layout); state_update forms Δ, adds Δᵀ Aqkᵀ to oacc and updates s.
 * ------------------------------------------------------------------------------------------------------- */
template <int KD, int WO>
DEV void state_products_mma(const float (&s)[KD / 8][4], float (&dacc)[8][4], float (&oacc)[8][4],
                            const rec_stage_t &st, int lane) {
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = oacc[nt][c] = 0.0f;
    /* Sᵀ as bf16 A fragments over K: all of them first (K class ≤ 128), or one k-tile at a time (256: registers) */
    constexpr int NKT = KD / 16, NSA = KD <= 128 ? NKT : 1;
    uint32_t sall[NSA][4];
    if (NSA > 1)
#pragma unroll
        for (int kt = 0; kt < NSA; kt++) acc_pair_to_a(s[2 * kt], s[2 * kt + 1], sall[kt]);
            /* k-tiles outermost: the 16 mma of one k-tile are independent, so no mma waits on the one before */
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) {
        uint32_t *sa = sall[NSA > 1 ? kt : 0];
        if (NSA == 1) acc_pair_to_a(s[2 * kt], s[2 * kt + 1], sa);
#pragma unroll
        for (int np = 0; np < 4; np++) {
            const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
            const int col = kt * 16 + ((lane >> 3) & 1) * 8;
            const int off = pan_off(row, col);
            uint32_t b[4];
            ldsm_x4(b, st.W + off);
            mma_bf16(dacc[2 * np], sa, b[0], b[1]);
            mma_bf16(dacc[2 * np + 1], sa, b[2], b[3]);
            if (WO) {
                ldsm_x4(b, st.QG + off);
                mma_bf16(oacc[2 * np], sa, b[0], b[1]);
                mma_bf16(oacc[2 * np + 1], sa, b[2], b[3]);
            }
        }
    }
}

template <int KD, int WO, int ZU>
DEV void state_update_mma(float (&s)[KD / 8][4], float (&dacc)[8][4], float (&oacc)[8][4], const rec_stage_t &st,
                          int lane) {
    uint32_t da[4][4];
    delta_fragments<ZU>(dacc, da, st.U, st.ucol, lane);
    /* Oᵀ += Δᵀ Aqkᵀ: token tiles of Aqk rows i (n) against tokens j (k) ≤ i */
#pragma unroll
    for (int kt = 0; kt < 4 && WO; kt++) {
#pragma unroll
        for (int np = 0; np < 4; np++) {
            if (np < kt) continue;
            const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
            const int col = kt * 16 + ((lane >> 3) & 1) * 8;
            uint32_t b[4];
            ldsm_x4(b, st.Aqk + pan_off(row, col));
            mma_bf16(oacc[2 * np], da[kt], b[0], b[1]);
            mma_bf16(oacc[2 * np + 1], da[kt], b[2], b[3]);
        }
    }
    /* Sᵀ ← Sᵀ Diag(γ) + Δᵀ K̃ */
    decay_state<KD>(s, st.gam, lane & 3);
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
#pragma unroll
        for (int pp = 0; pp < KD / 16; pp++) {
            const int row = kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = pp * 16 + (lane >> 4) * 8;
            uint32_t b[4];
            ldsm_x4_t(b, st.KT + pan_off(row, col));
            mma_bf16(s[2 * pp], da[kt], b[0], b[1]);
            mma_bf16(s[2 * pp + 1], da[kt], b[2], b[3]);
            if (st.KTlo) { /* fine blocks: + Δᵀ K̃_lo */
                ldsm_x4_t(b, st.KTlo + pan_off(row, col));
                mma_bf16(s[2 * pp], da[kt], b[0], b[1]);
                mma_bf16(s[2 * pp + 1], da[kt], b[2], b[3]);
            }
        }
    }
}

/* The same step by the warpgroup (all 4 warps call it; the warp's rows are the warpgroup's rows 16 (warp % 4)..).
 * Two commit groups for Sᵀ Wᵀ and Sᵀ QΓᵀ, so Δ is formed while the second still runs; then Δᵀ Aqkᵀ joins the
 * Oᵀ accumulators (in order behind Sᵀ QΓᵀ, same shape) and Δᵀ K̃ the decayed Sᵀ. K class 64 or 128. */
template <int KD, int WO, int ZU, int KTLO>
DEV void step_wgmma(float (&s)[KD / 8][4], float (&oacc)[8][4], const rec_stage_t &st, int lane) {
#ifdef KDA_WGMMA
    if (KD > 128) __trap(); /* instantiated but never launched: configs.def gives K class 256 no wgmma version */
    constexpr int NT = KD / 8, NKT = KD / 16;
    const int t = lane & 3;
    uint32_t sa[NKT][4];
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) acc_pair_to_a(s[2 * kt], s[2 * kt + 1], sa[kt]);
    float dacc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = oacc[nt][c] = 0.0f;
    reg_fence(&dacc[0][0], 32);
    reg_fence(&oacc[0][0], 32);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < NKT; kt++)
        wgmma_n64_kmaj(&dacc[0][0], sa[kt], wg_desc_kmaj(st.W + (kt >> 2) * 8192 + (kt & 3) * 32));
    wg_commit();
    if (WO) {
#pragma unroll
        for (int kt = 0; kt < NKT; kt++)
            wgmma_n64_kmaj(&oacc[0][0], sa[kt], wg_desc_kmaj(st.QG + (kt >> 2) * 8192 + (kt & 3) * 32));
        wg_commit();
        WG_WAIT(1);
    } else {
        WG_WAIT(0);
    }
    reg_fence(&dacc[0][0], 32);

    uint32_t da[4][4];
    delta_fragments<ZU>(dacc, da, st.U, st.ucol, lane);
    decay_state<KD>(s, st.gam, t);
    reg_fence(&s[0][0], NT * 4);
    wg_fence();
    if (WO)
#pragma unroll
        for (int kt = 0; kt < 4; kt++) wgmma_n64_kmaj(&oacc[0][0], da[kt], wg_desc_kmaj(st.Aqk + kt * 32));
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
        if (KD == 128) wgmma_n128_mnmaj(&s[0][0], da[kt], wg_desc_mnmaj(st.KT + kt * 2048));
        else wgmma_n64_mnmaj(&s[0][0], da[kt], wg_desc_mnmaj(st.KT + kt * 2048));
    }
    /* + Δᵀ K̃_lo (KDA_REC_STATES), in the same group: the host takes this path in that mode only with K̃_lo in the
       blocks (launch_rec_states); a runtime branch here would serialize the group's wgmma */
#pragma unroll
    for (int kt = 0; kt < (KTLO ? 4 : 0); kt++) {
        if (KD == 128) wgmma_n128_mnmaj(&s[0][0], da[kt], wg_desc_mnmaj(st.KTlo + kt * 2048));
        else wgmma_n64_mnmaj(&s[0][0], da[kt], wg_desc_mnmaj(st.KTlo + kt * 2048));
    }
    wg_commit();
    WG_WAIT(0);
    reg_fence(&oacc[0][0], 32);
    reg_fence(&s[0][0], NT * 4);
#else
    (void)s, (void)oacc, (void)st, (void)lane;
    __trap(); /* the host launches this path on sm_90 only */
#endif
}

/* ---------------------------------------------------------------------------------------------------------
 * State in and out: s[nt][c] = S[d][v] with v = vw + g + 8 (c >> 1), d = 8 nt + 2 t + (c & 1); entries past K
 * or V are zero and never stored
 * ------------------------------------------------------------------------------------------------------- */
template <int KD>
DEV void load_state(const kda_rec_params_t &p, const void *src, int dtype, float (&s)[KD / 8][4], int64_t sbase,
                    int64_t sd, int64_t sv, int vw, int g, int t, int full) {
    /* dtype branch outside the loops, so that the loads are all in flight; masks only where K or V is padded
       (the masked loops hold more registers, which the main loop must not pay for) */
#define REC_LOAD_STATE(T, CONV, MASK)                                                                                  \
    for (int nt = 0; nt < KD / 8; nt++)                                                                                \
        for (int c = 0; c < 4; c++) {                                                                                  \
            const int d = 8 * nt + 2 * t + (c & 1), v = vw + g + 8 * (c >> 1);                                         \
            s[nt][c] = (MASK) ? CONV(((const T *)src)[sbase + d * sd + v * sv]) : 0.0f;                                \
        }
    if (full) {
        if (dtype == KDA_DT_F32) {
#pragma unroll
            REC_LOAD_STATE(float, , 1)
        } else {
#pragma unroll
            REC_LOAD_STATE(uint16_t, bf16_bits_to_f32, 1)
        }
    } else if (dtype == KDA_DT_F32) {
#pragma unroll
        REC_LOAD_STATE(float, , d < p.pb.K && v < p.pb.V)
    } else {
#pragma unroll
        REC_LOAD_STATE(uint16_t, bf16_bits_to_f32, d < p.pb.K && v < p.pb.V)
    }
#undef REC_LOAD_STATE
}

/* The non-finite rule of the initial state (ALGORITHM.md §7, 3): a ±∞ or NaN element poisons its value column,
 * which is set to NaN before the first chunk. A column's K elements lie in this thread (nt, c & 1) and the three
 * other lanes of its quad (t): an OR over both. Once per sequence (or piece), beside the state's load. */
template <int KD>
DEV void poison_columns(float (&s)[KD / 8][4]) {
#pragma unroll
    for (int half = 0; half < 2; half++) { /* c >> 1: columns g and g + 8 of the warp */
        int bad = 0;
#pragma unroll
        for (int nt = 0; nt < KD / 8; nt++) bad |= !isfinite(s[nt][2 * half]) | !isfinite(s[nt][2 * half + 1]);
        bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
        bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
        if (bad)
#pragma unroll
            for (int nt = 0; nt < KD / 8; nt++) s[nt][2 * half] = s[nt][2 * half + 1] = __int_as_float(0x7fffffff);
    }
}

template <int KD>
DEV void store_state(const kda_rec_params_t &p, void *dst, int dtype, const float (&s)[KD / 8][4], int64_t sbase,
                     int64_t sd, int64_t sv, int vw, int g, int t, int full) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int d = 8 * nt + 2 * t + (c & 1), v = vw + g + 8 * (c >> 1);
            if (full || (d < p.pb.K && v < p.pb.V)) store_elem(dst, dtype, sbase + d * sd + v * sv, s[nt][c]);
        }
}

/* Oᵀ (accumulators) → the staging rows O[token][column of the tile] (the dtype branch outside the loops) */
DEV void stage_o(const float (&oacc)[8][4], unsigned char *sO, int o_dtype, int ostride, int warp, int g, int t) {
#define REC_STAGE_O(T, CONV)                                                                                           \
    for (int nt = 0; nt < 8; nt++)                                                                                     \
        for (int c = 0; c < 4; c++)                                                                                    \
            ((T *)sO)[(8 * nt + 2 * t + (c & 1)) * ostride + 16 * warp + g + 8 * (c >> 1)] = CONV(oacc[nt][c]);
    if (o_dtype == KDA_DT_BF16) {
#pragma unroll
        REC_STAGE_O(__nv_bfloat16, __float2bfloat16_rn)
    } else if (o_dtype == KDA_DT_F16) {
#pragma unroll
        REC_STAGE_O(__half, __float2half_rn)
    } else {
#pragma unroll
        REC_STAGE_O(float, )
    }
#undef REC_STAGE_O
}

/* The staged O rows of one chunk → global: EXACT (V is its class: whole rows of 16-byte pieces), else pieces of
 * 16, 8, 4 or 2 bytes, the widest that divides a row, and no column past V */
template <int EXACT>
DEV void store_o(const kda_rec_params_t &p, const unsigned char *sO, int ostride, int oes, int64_t tok0, int clen,
                 int h, int v0, int bv, int tid, int nthreads) {
    unsigned char *o = (unsigned char *)p.o;
    if (EXACT) {
        const int row16 = bv * oes / 16;
        for (int e = tid; e < clen * row16; e += nthreads) {
            const int r = e / row16, c = e % row16;
            const uint4 val = *(const uint4 *)(sO + r * ostride * oes + c * 16);
            *(uint4 *)(o + (((tok0 + r) * p.pb.hv + h) * (int64_t)p.pb.V + v0) * oes + c * 16) = val;
        }
    } else {
        const int rowb = p.pb.V * oes, pb = rowb % 16 == 0 ? 16 : rowb % 8 == 0 ? 8 : rowb % 4 == 0 ? 4 : 2;
        const int np = min(bv, p.pb.V - v0) * oes / pb;
        for (int e = tid; e < clen * np; e += nthreads) {
            const int r = e / np, c = (e % np) * pb;
            const unsigned char *src = sO + r * ostride * oes + c;
            unsigned char *dst = o + (((tok0 + r) * p.pb.hv + h) * (int64_t)p.pb.V + v0) * oes + c;
            if (pb == 16) *(uint4 *)dst = *(const uint4 *)src;
            else if (pb == 8) *(uint2 *)dst = *(const uint2 *)src;
            else if (pb == 4) *(uint32_t *)dst = *(const uint32_t *)src;
            else *(uint16_t *)dst = *(const uint16_t *)src;
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The CTA's work: which (sequence or piece, value head, tile) it walks, from which state, to which end
 * ------------------------------------------------------------------------------------------------------- */
/* MODE (kda_cuda.h): KDA_REC_SEQ and KDA_REC_STATES walk whole sequences. With a piece table (intra-card CP,
 * ALGORITHM.md §4) a CTA is a (piece, value head, tile): KDA_REC_PRESCAN computes a split piece's map
 * S_out = M S_in + E (tiles 0 .. KC/BV − 1 are M's columns, from the identity with U = 0; the rest E's, from zero,
 * or from the initial state for a sequence's first piece, whose M is not needed) into the piece's slot, and writes
 * no O; KDA_REC_PIECES runs every piece from its incoming state (the merged S_in of its slot, or the sequence's
 * initial state) and writes O, and the final state from a sequence's last piece. The grids cover the table's
 * capacity; CTAs past the pieces the plan made, or with nothing to do, return at once. */
typedef struct {
    int h, vt;
    int mcols; /* this CTA computes columns of M (pre-scan) */
    int load_sin, from_h0, store_final;
    int64_t n, bos, eos, nchunks, chunk0;
    float *slot_base; /* this (piece, head)'s CP storage, or NULL */
    float *map_out;   /* the pre-scan's M for the backward (kda_rec_params_t.cp_maps), or NULL */
} rec_work_t;

/* A whole sequence (KDA_REC_SEQ, KDA_REC_STATES): CTA → (sequence, value head, V tile) */
DEV void rec_seq_work(const kda_rec_params_t &p, rec_work_t &w) {
    const int nvt = kda_cuda_size_class(p.pb.V) / p.bv;
    w.mcols = 0;
    w.slot_base = NULL;
    w.map_out = NULL;
    w.load_sin = 0, w.from_h0 = 1, w.store_final = 1;
    w.vt = (int)(blockIdx.x % nvt);
    const int64_t rest = blockIdx.x / nvt;
    w.h = (int)(rest % p.pb.hv);
    w.n = rest / p.pb.hv;
    seq_bounds(p.pb.seqs, w.n, &w.bos, &w.eos);
    w.nchunks = (w.eos - w.bos + KDA_CHUNK - 1) / KDA_CHUNK;
    w.chunk0 = seq_chunk0(p.pb.seqs, w.n);
}

/* A piece of the table (KDA_REC_PRESCAN, KDA_REC_PIECES): CTA → (entry, value head, tile); 0: nothing to do */
template <int KD, int MODE>
DEV int rec_piece_work(const kda_rec_params_t &p, rec_work_t &w) {
    const int nvt = kda_cuda_size_class(p.pb.V) / p.bv;
    w.mcols = 0;
    w.slot_base = NULL;
    w.map_out = NULL;
    w.load_sin = 0, w.from_h0 = 1, w.store_final = 1;
    const int mt = MODE == KDA_REC_PRESCAN ? KD / p.bv : 0, ntiles = mt + nvt;
    const int tile = (int)(blockIdx.x % ntiles);
    const int64_t rest = blockIdx.x / ntiles;
    w.h = (int)(rest % p.pb.hv);
    const int64_t piece = rest / p.pb.hv; /* the pre-scan's grid covers the slots: entry = slot (cp_plan.h) */
    if (piece >= p.cp_header[MODE == KDA_REC_PRESCAN ? 2 : 0]) return 0;
    const kda_cp_piece_t *e = &p.cp_table[piece];
    const int64_t flags = e->flags, cslot = e->slot;
    w.n = e->seq;
    w.bos = e->bos;
    w.eos = e->eos;
    w.nchunks = e->num_chunks;
    w.chunk0 = e->chunk0;
    if (cslot >= 0)
        w.slot_base = p.cp_slots + (cslot * p.pb.hv + w.h) * kda_cuda_cp_slot_floats(KD, kda_cuda_size_class(p.pb.V));
    if (MODE == KDA_REC_PRESCAN) {
        /* only split pieces before their sequence's last, and a first piece has no M; a primed summary's pre-scan
           (cp_summary) maps the last pieces too, and with cp_summary 2 the first ones from zero with M */
        const int first_map = p.cp_summary == 2;
        if (cslot < 0 || ((flags & KDA_CP_LAST) && !p.cp_summary) ||
            (tile < mt && (flags & KDA_CP_FIRST) && !first_map))
            return 0;
        w.mcols = tile < mt;
        w.vt = w.mcols ? tile : tile - mt;
        w.from_h0 = !w.mcols && (flags & KDA_CP_FIRST) && !first_map;
        w.store_final = 0;
        if (w.mcols && p.cp_maps) { /* at the backward's mirrored slot: its first slot + (np − 1 − index) */
            const int64_t ms = cslot - e->index + (e->seq_pieces - 1 - e->index);
            w.map_out = p.cp_maps + (ms * p.pb.hv + w.h) * (int64_t)KD * KD;
        }
    } else {
        w.vt = tile;
        w.load_sin = cslot >= 0 && !(flags & KDA_CP_FIRST);
        w.from_h0 = !w.load_sin;
        w.store_final = (flags & KDA_CP_LAST) != 0;
    }
    return 1;
}

/* What every phase of the CTA reads: its work, its columns, its shared memory, its state's place */
typedef struct {
    rec_work_t w;
    int tid, nthreads, warp, lane, g, t;
    int bv, vc, v0, vw;         /* tile width, V class, first state column of the CTA (of M's when mcols), the warp's */
    int ktlo, stage_bytes, nst; /* K̃_lo in the stages; ring: chunks in flight, nst − 1 ahead of the one in use */
    unsigned char *smem, *sO0;
    int ostride, oes;
    int64_t slot, sd, sv, sbase; /* the state's slot, strides of d and v, and its base */
    int full;                    /* no padded rows or columns in this CTA's part of S */
    const unsigned char *blocks;
    int64_t off_u, off_kl;
    uint32_t bars;
} rec_cta_t;

/* The thread's place in the CTA */
DEV void rec_cta_ids(const kda_rec_params_t &p, rec_cta_t &c) {
    c.bv = p.bv;
    c.tid = threadIdx.x, c.nthreads = blockDim.x, c.warp = c.tid >> 5, c.lane = c.tid & 31;
    c.g = c.lane >> 2, c.t = c.lane & 3;
}

/* The CTA's columns, stages and the slot of its state (c.w set) */
template <int KD, int MODE>
DEV void rec_cta_setup(const kda_rec_params_t &p, unsigned char *smem, rec_cta_t &c) {
    c.v0 = c.w.vt * c.bv;
    c.vw = c.v0 + 16 * c.warp;
    c.ktlo = rec_ktlo(KD, MODE, p.blocks.fine); /* (WG 2 is the wgmma version that adds it, the launcher's choice) */
    c.stage_bytes = REC_STAGE_BYTES(KD, c.bv, c.ktlo);
    c.nst = REC_SPLIT(KD) ? 1 : p.stages;
    c.smem = smem;
    c.sO0 = smem + c.nst * c.stage_bytes;
    c.ostride = REC_O_STRIDE(c.bv);
    c.oes = p.o_dtype == KDA_DT_F32 ? 4 : 2;
    c.slot = seq_slot(p.pb.state_indices, p.claim, p.pb.num_state_slots, c.w.n);
}

/* The state the CTA starts from: M's identity columns, a piece's merged S_in, the initial state, or zero; and
 * where its state lies in h0 and ht */
template <int KD, int EXACT>
DEV void rec_load_start(const kda_rec_params_t &p, rec_cta_t &c, float (&s)[KD / 8][4]) {
    c.sd = p.pb.v_first ? 1 : p.pb.V, c.sv = p.pb.v_first ? p.pb.K : 1;
    c.sbase = c.slot >= 0 ? (c.slot * p.pb.hv + c.w.h) * (int64_t)p.pb.K * p.pb.V : 0;
    c.vc = kda_cuda_size_class(p.pb.V);
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++) s[nt][cc] = 0.0f;
    c.full = EXACT || (p.pb.K == KD && c.v0 + c.bv <= p.pb.V);
    if (c.w.mcols) {
        identity_cols<KD>(s, p.pb.K, c.vw, c.g, c.t);
    } else if (c.w.load_sin) {
        load_slot<KD>(c.w.slot_base + KD * KD + KD * c.vc, s, c.vc, 1, c.vw, c.g, c.t);
    } else if (c.w.from_h0) {
        /* a whole sequence, or a sequence's first piece (pre-scan: its E is then its outgoing state), from h0; in
           cross-rank CP the fold of the earlier ranks' maps enters sequence 0 in its place ([hv][K][V] fp32). One
           load for both sources: a second inlined copy of the load lengthens the kernel's code for no work. */
        const int fold = c.w.n == 0 && p.pb.h0_first != NULL;
        const void *src = fold ? (const void *)p.pb.h0_first : c.slot >= 0 ? p.pb.h0 : NULL;
        if (src) {
            load_state<KD>(p, src, fold ? KDA_DT_F32 : p.pb.h0_dtype, s,
                           fold ? (int64_t)c.w.h * p.pb.K * p.pb.V : c.sbase, fold ? p.pb.V : c.sd, fold ? 1 : c.sv,
                           c.vw, c.g, c.t, c.full);
            poison_columns<KD>(s);
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * The chunk loop's phases: the copies of the blocks into the stages, the states a mode keeps, the step's math,
 * the O rows
 * ------------------------------------------------------------------------------------------------------- */
DEV const unsigned char *rec_block(const kda_rec_params_t &p, const rec_cta_t &c, int64_t ci) {
    return c.blocks + ((c.w.chunk0 + ci) * p.pb.hv + c.w.h) * p.blocks.block_bytes;
}

/* The barriers, then the first chunks' copies (ring: nst − 1 chunks ahead; split: both parts of chunk 0) */
template <int KD, int WO>
DEV void rec_prologue(const kda_rec_params_t &p, rec_cta_t &c) {
    constexpr int SPLIT = REC_SPLIT(KD);
    c.blocks = (const unsigned char *)p.blocks.base;
    c.off_u = kda_cuda_off_u(KD);
    c.off_kl = c.ktlo ? kda_cuda_off_ktlo(KD, c.vc, p.blocks.fine) : -1;
    c.bars = smem_u32(c.sO0 + 2 * KDA_CHUNK * c.ostride * c.oes);
    if (c.tid == 0) {
        for (int sidx = 0; sidx < (SPLIT ? 2 : c.nst); sidx++) mbar_init(c.bars + 8 * sidx, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (c.tid == 0) {
        if (SPLIT) {
            if (c.w.nchunks > 0) {
                issue_copy(c.smem, c.bars, rec_block(p, c, 0), 0, REC_PART_A(KD), 0, c.off_u, c.v0, c.bv, !WO, KD, -1);
                issue_copy(c.smem, c.bars + 8, rec_block(p, c, 0), REC_PART_A(KD), REC_LINEAR(KD), !c.w.mcols, c.off_u,
                           c.v0, c.bv, !WO, KD, -1);
            }
        } else {
            for (int sidx = 0; sidx < c.nst - 1 && sidx < c.w.nchunks; sidx++)
                issue_copy(c.smem + sidx * c.stage_bytes, c.bars + 8 * sidx, rec_block(p, c, sidx), 0, REC_LINEAR(KD),
                           !c.w.mcols, c.off_u, c.v0, c.bv, !WO, KD, c.off_kl);
        }
    }
}

/* Chunk ci's stage is in (ring: the copy nst − 1 chunks ahead issued first; split: its first part) */
template <int KD, int WO>
DEV void rec_wait_chunk(const kda_rec_params_t &p, const rec_cta_t &c, int64_t ci, int64_t ahead, int cur, int nocopy) {
    if (!REC_SPLIT(KD)) {
        if (c.tid == 0 && ahead < c.w.nchunks && !nocopy)
            issue_copy(c.smem + (ahead % c.nst) * c.stage_bytes, c.bars + 8 * (ahead % c.nst), rec_block(p, c, ahead),
                       0, REC_LINEAR(KD), !c.w.mcols, c.off_u, c.v0, c.bv, !WO, KD, c.off_kl);
        if (!nocopy || ci < c.nst - 1) mbar_wait(c.bars + 8 * cur, (uint32_t)((ci / c.nst) & 1));
    } else if (!nocopy || ci == 0) {
        mbar_wait(c.bars, (uint32_t)(ci & 1));
    }
}

/* S at chunk ci's start where the mode keeps it: KDA_REC_STATES into the caller's chunk_states or the backward's
 * S; the forward's sequences and pieces into the bf16 S kept for the backward (kda_args_t.saved) when set */
template <int KD, int MODE>
DEV void rec_keep_state(const kda_rec_params_t &p, const rec_cta_t &c, const float (&s)[KD / 8][4], int64_t ci) {
    if (MODE == KDA_REC_STATES) {
        if (p.states_out)
            store_state<KD>(p, p.states_out, p.states_out_dtype, s,
                            ((c.w.chunk0 + ci) * p.pb.hv + c.w.h) * (int64_t)p.pb.K * p.pb.V, c.sd, c.sv, c.vw, c.g,
                            c.t, c.full);
        else if (p.states_bf16)
            store_states_bf16<KD>(p.states_bf16 + ((c.w.chunk0 + ci) * p.pb.hv + c.w.h) * (int64_t)KD * c.vc, s, c.vw,
                                  c.lane);
        else
            store_slot<KD>(p.chunk_states + ((c.w.chunk0 + ci) * p.pb.hv + c.w.h) * (int64_t)KD * c.vc, s, c.vc, 1,
                           c.vw, c.g, c.t);
    } else if (MODE != KDA_REC_PRESCAN && KD <= KDA_BWD_TILE && p.states_bf16) {
        /* the forward keeps S for the backward (bf16 inputs, backend.c keeps_states): its states stage then
           does not run */
        store_states_bf16<KD>(p.states_bf16 + ((c.w.chunk0 + ci) * p.pb.hv + c.w.h) * (int64_t)KD * c.vc, s, c.vw,
                              c.lane);
    }
}

/* The tiles of stage `cur` */
template <int KD>
DEV rec_stage_t rec_stage_at(const rec_cta_t &c, int cur) {
    const unsigned char *stg = c.smem + cur * c.stage_bytes;
    rec_stage_t st;
    st.W = smem_u32(stg);
    st.QG = st.W + KDA_CHUNK * KD * 2;
    st.KT = st.W + 2 * KDA_CHUNK * KD * 2;
    st.Aqk = st.W + 3 * KDA_CHUNK * KD * 2;
    st.U = st.W + REC_LINEAR(KD);
    st.gam = (const float *)(stg + 3 * KDA_CHUNK * KD * 2 + KDA_CHUNK * KDA_CHUNK * 2);
    st.ucol = (c.v0 % KDA_PANEL_COLS) + 16 * c.warp;
    st.KTlo = c.ktlo ? st.W + REC_KTLO_OFF(KD, c.bv) : 0;
    return st;
}

/* One chunk: Δ = U − W S, O = QΓ S + Aqk Δ (staged in shared memory, then stored), S ← Diag(γ) S + K̃ᵀ Δ. Split
 * staging copies the next chunk's first part once [W | QΓ] is read, its second once the step is done. */
template <int KD, int WG, int EXACT, int MODE>
DEV void rec_chunk(const kda_rec_params_t &p, const rec_cta_t &c, float (&s)[KD / 8][4], int64_t ci) {
    constexpr int SPLIT = REC_SPLIT(KD);
    constexpr int WO = MODE != KDA_REC_PRESCAN && MODE != KDA_REC_STATES; /* the mode writes O */
    const int64_t ahead = ci + c.nst - 1;
    const int nocopy = KDA_SKIP(p, 1024); /* development: stale stages, to time the math alone */
    const int cur = SPLIT ? 0 : (int)(ci % c.nst);
    rec_wait_chunk<KD, WO>(p, c, ci, ahead, cur, nocopy);
    rec_keep_state<KD, MODE>(p, c, s, ci);
    /* O staging alternates: the buffer of chunk ci - 2 is free once every thread passed chunk ci - 1's closing
       barrier, which it must have to get here */
    unsigned char *sO = c.sO0 + (ci & 1) * KDA_CHUNK * c.ostride * c.oes;
    const rec_stage_t st = rec_stage_at<KD>(c, cur);

    float oacc[8][4], dacc[8][4];
    const int math = !KDA_SKIP(p, 2048); /* development: skip the math, to time the copies alone */
    if (!math) {
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int cc = 0; cc < 4; cc++) oacc[nt][cc] = 0.0f;
    } else if (WG) {
        if (c.w.mcols) step_wgmma<KD, WO, 1, 0>(s, oacc, st, c.lane);
        else step_wgmma<KD, WO, 0, WG == 2>(s, oacc, st, c.lane);
    } else {
        state_products_mma<KD, WO>(s, dacc, oacc, st, c.lane);
    }
    if (SPLIT) {
        __syncthreads(); /* [W | QΓ] read by every warp: the next chunk's may come in */
        if (c.tid == 0 && ci + 1 < c.w.nchunks && !nocopy)
            issue_copy(c.smem, c.bars, rec_block(p, c, ci + 1), 0, REC_PART_A(KD), 0, c.off_u, c.v0, c.bv, !WO, KD, -1);
        if (!nocopy || ci == 0) mbar_wait(c.bars + 8, (uint32_t)(ci & 1));
    }
    if (math && !WG) {
        if (c.w.mcols) state_update_mma<KD, WO, 1>(s, dacc, oacc, st, c.lane);
        else state_update_mma<KD, WO, 0>(s, dacc, oacc, st, c.lane);
    }
    if (WO) stage_o(oacc, sO, p.o_dtype, c.ostride, c.warp, c.g, c.t);
    __syncthreads(); /* the stage is free for the next copy; O staging is complete */
    if (SPLIT && c.tid == 0 && ci + 1 < c.w.nchunks && !nocopy)
        issue_copy(c.smem, c.bars + 8, rec_block(p, c, ci + 1), REC_PART_A(KD), REC_LINEAR(KD), !c.w.mcols, c.off_u,
                   c.v0, c.bv, !WO, KD, -1);

    /* O rows of this chunk → global */
    if (WO) {
        const int64_t tok0 = c.w.bos + ci * KDA_CHUNK;
        const int clen = (int)min((int64_t)KDA_CHUNK, c.w.eos - tok0);
        store_o<EXACT>(p, sO, c.ostride, c.oes, tok0, clen, c.w.h, c.v0, c.bv, c.tid, c.nthreads);
    }
}

/* The state the CTA ends with: the pre-scan's Mᵀ or E into the piece's slot (and M for the backward), else the
 * final state from a sequence's end */
template <int KD, int MODE>
DEV void rec_store_end(const kda_rec_params_t &p, const rec_cta_t &c, const float (&s)[KD / 8][4]) {
    if (MODE == KDA_REC_PRESCAN) {
        if (c.w.mcols) store_map<KD>(c.w.slot_base, s, 1, c.vw, c.g, c.t);        /* Mᵀ[e][d] (swizzled) */
        else store_slot<KD>(c.w.slot_base + KD * KD, s, c.vc, 1, c.vw, c.g, c.t); /* E[d][v] */
        if (c.w.map_out) store_map<KD>(c.w.map_out, s, 0, c.vw, c.g, c.t);        /* M[d][e]: the backward's Mᵀ */
    } else if (MODE != KDA_REC_STATES && c.w.store_final && p.pb.ht && c.slot >= 0) {
        store_state<KD>(p, p.pb.ht, p.pb.ht_dtype, s, c.sbase, c.sd, c.sv, c.vw, c.g, c.t, c.full);
    }
}

/* A CTA's walk over its chunks: the start state, the copies' prologue, the chunk steps, the end state */
template <int KD, int WG, int EXACT, int MODE>
DEV void rec_run(const kda_rec_params_t &p, rec_cta_t &c, unsigned char *smem) {
    constexpr int WO = MODE != KDA_REC_PRESCAN && MODE != KDA_REC_STATES;
    rec_cta_setup<KD, MODE>(p, smem, c);
    float s[KD / 8][4];
    rec_load_start<KD, EXACT>(p, c, s);
    rec_prologue<KD, WO>(p, c);
    for (int64_t ci = 0; ci < c.w.nchunks; ci++) rec_chunk<KD, WG, EXACT, MODE>(p, c, s, ci);
    rec_store_end<KD, MODE>(p, c, s);
}

/* ---------------------------------------------------------------------------------------------------------
 * The kernels, one per mode (kda_cuda.h KDA_REC_*). EXACT: K and V are their classes: no masks, whole 16-byte O
 * rows; without it the kernel carries the masks and the narrow stores, whose larger code would slow the common
 * sizes (instruction fetch). WG: 0 mma.sync, 1 wgmma, 2 wgmma adding Δᵀ K̃_lo (the states pass over fine blocks).
 * Each is launched with pdl: its first act waits for the kernel before (prep or the merge).
 * ------------------------------------------------------------------------------------------------------- */
/* A kernel's body: the shared memory's stages 1 KB-aligned (wgmma's 128-byte swizzle repeats every 1 KB), the wait
 * for the kernel before, the CTA's work (a whole sequence, or a piece of the table: none past the plan's), its walk */
template <int KD, int WG, int EXACT, int MODE>
DEV void rec_kernel(const kda_rec_params_t &p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    pdl_wait();
    pdl_trigger();
    rec_cta_t c;
    rec_cta_ids(p, c);
    if (MODE == KDA_REC_SEQ || MODE == KDA_REC_STATES) rec_seq_work(p, c.w);
    else if (!rec_piece_work<KD, MODE>(p, c.w)) return;
    rec_run<KD, WG, EXACT, MODE>(p, c, smem);
}

/* The forward: whole sequences, O and the final states */
template <int KD, int WG, int EXACT>
__global__ void __launch_bounds__(REC_MAX_THREADS, 1) kda_rec_seq_kernel(const kda_rec_params_t p) {
    rec_kernel<KD, WG, EXACT, KDA_REC_SEQ>(p);
}
/* CP's pre-scan: each split piece's map, no O */
template <int KD, int WG, int EXACT>
__global__ void __launch_bounds__(REC_MAX_THREADS, 1) kda_rec_prescan_kernel(const kda_rec_params_t p) {
    rec_kernel<KD, WG, EXACT, KDA_REC_PRESCAN>(p);
}
/* CP's pieces: every piece from its incoming state, O and the final states */
template <int KD, int WG, int EXACT>
__global__ void __launch_bounds__(REC_MAX_THREADS, 1) kda_rec_pieces_kernel(const kda_rec_params_t p) {
    rec_kernel<KD, WG, EXACT, KDA_REC_PIECES>(p);
}
/* The states pass (chunk_states, the backward's stage 1): whole sequences, S at every chunk start, no O */
template <int KD, int WG, int EXACT>
__global__ void __launch_bounds__(REC_MAX_THREADS, 1) kda_rec_states_kernel(const kda_rec_params_t p) {
    rec_kernel<KD, WG, EXACT, KDA_REC_STATES>(p);
}

/* Shared memory of a recurrence CTA of this configuration with `stages` ring stages (split: one buffer) */
template <int KD>
static int kda_rec_smem(const kda_rec_params_t *p, int stages) {
    const int oes = p->o_dtype == KDA_DT_F32 ? 4 : 2;
    return REC_BYTES(KD, p->bv, REC_SPLIT(KD) ? 1 : stages, oes, rec_ktlo(KD, p->mode, p->blocks.fine));
}

/* The KDA_REC_STATES kernel of a configuration (the backward's stage 1 and chunk_states; every K class since the
 * backward takes 256), or NULL above the backward's head sizes */
template <int KD, int WG, int EXACT>
static const void *rec_states_kernel(void) {
    if constexpr (WG == 2 && REC_SPLIT(KD)) return NULL; /* K̃_lo: K class ≤ 128 */
    else if constexpr (KD <= KDA_BWD_MAX_HEAD_DIM) return (const void *)kda_rec_states_kernel<KD, WG, EXACT>;
    else return NULL;
}

/* The launcher of one K class: one CTA of 2·BV threads per (sequence, value head, V tile); with a piece table
 * (p->mode) per (table entry up to the capacity, value head, tile), the pre-scan per (slot up to the capacity,
 * value head, tile) */
template <int KD, int HAS_WG>
static int kda_rec_launch(const kda_rec_params_t *p, int device, void *stream) {
    const int64_t nvt = kda_cuda_size_class(p->pb.V) / p->bv;
    const int64_t ctas = p->mode == KDA_REC_SEQ || p->mode == KDA_REC_STATES ? p->pb.seqs.num_seqs * p->pb.hv * nvt
                         : p->mode == KDA_REC_PIECES                         ? p->cp_capacity * p->pb.hv * nvt
                                                     : p->cp_capacity_slots * p->pb.hv * (KD / p->bv + nvt);
    if (ctas == 0) return 0;
    const int threads = p->bv * 2;
    const int bytes = kda_rec_smem<KD>(p, p->stages);
    static int done[4][6][KDA_MAX_DEVICES]; /* per kernel below */
    /* wgmma: 1, or 2 for the states pass over blocks with K̃_lo */
    const int wg = HAS_WG && p->wgmma ? 1 + rec_ktlo(KD, p->mode, p->blocks.fine) : 0;
    const int exact = p->pb.K == KD && p->pb.V == kda_cuda_size_class(p->pb.V);
#define REC_KERNELS(KERNEL)                                                                                            \
    {                                                                                                                  \
        (const void *)KERNEL<KD, 0, 0>, (const void *)KERNEL<KD, 0, 1>, (const void *)KERNEL<KD, HAS_WG, 0>,           \
            (const void *)KERNEL<KD, HAS_WG, 1>, NULL, NULL                                                            \
    }
    /* the backward's mode only where the backward runs (K ≤ KDA_BWD_MAX_HEAD_DIM) */
#define REC_STATES_KERNELS                                                                                             \
    {                                                                                                                  \
        rec_states_kernel<KD, 0, 0>(), rec_states_kernel<KD, 0, 1>(), rec_states_kernel<KD, HAS_WG, 0>(),              \
            rec_states_kernel<KD, HAS_WG, 1>(), rec_states_kernel<KD, 2 * HAS_WG, 0>(),                                \
            rec_states_kernel<KD, 2 * HAS_WG, 1>()                                                                     \
    }
    const void *kernels[4][6] = {REC_KERNELS(kda_rec_seq_kernel), REC_KERNELS(kda_rec_prescan_kernel),
                                 REC_KERNELS(kda_rec_pieces_kernel), REC_STATES_KERNELS};
#undef REC_KERNELS
#undef REC_STATES_KERNELS
    const int which = 2 * wg + exact, mode = p->mode;
    if (!kernels[mode][which]) return (int)cudaErrorNotSupported;
    return kda_launch_ex(kernels[mode][which], ctas, 1, threads, bytes, p, device, done[mode][which], stream, 1);
}
