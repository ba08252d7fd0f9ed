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
 * Intra-card context parallelism (ALGORITHM.md §4) runs the same step over pieces of sequences (the kernel's MODE):
 * the pre-scan forms a piece's map S_out = M S_in + E (M's columns from the identity with U = 0, E's from zero),
 * Δᵀ = −Sᵀ Wᵀ and no O for M's columns, no O at all, QΓ and Aqk not copied; the pieces' pass is this kernel from
 * each piece's merged incoming state.
 */
#include "common.cuh"
#include "cp_slot.cuh"
#include "seq.cuh"
#include "states16.cuh" /* store_states_bf16: S for the backward's split path */
#include "bwd.h" /* KDA_BWD_MAX_HEAD_DIM: the KDA_REC_STATES instances */

typedef __nv_bfloat16 bf16;

#define REC_MAX_THREADS 256

/* One stage: W, QΓ, K̃ (C×KD), Aqk (C×C), γ (KD fp32) exactly as in the workspace (REC_LINEAR bytes), then
 * the panels of U that hold this CTA's columns (REC_UP(BV) of them: each panel is KDA_PANEL_BYTES and
 * contiguous in the workspace, common.cuh), then in the states pass over fine blocks (KTLO, ring only) K̃_lo at
 * the next 1 KB (wgmma's 128-byte swizzle repeats every 1 KB). NST stages (ring) or one (split), then the O
 * staging rows (two buffers, alternating by chunk, of BV + 8 elements of OES bytes), then one mbarrier per stage
 * (split: two). */
#define REC_PART_A(KD) (2 * KDA_CHUNK * (KD) * 2) /* W, QΓ */
#define REC_LINEAR(KD) (3 * KDA_CHUNK * (KD) * 2 + KDA_CHUNK * KDA_CHUNK * 2 + (KD) * 4)
#define REC_UP(BV) ((BV) >= 128 ? 2 : 1)
#define REC_KTLO_OFF(KD, BV) ((REC_LINEAR(KD) + REC_UP(BV) * KDA_PANEL_BYTES + 1023) / 1024 * 1024) /* 1 KB-aligned */
#define REC_STAGE_BYTES(KD, BV, KTLO) (REC_KTLO_OFF(KD, BV) + ((KTLO) ? KDA_CHUNK * (KD) * 2 : 0))
#define REC_O_STRIDE(BV) ((BV) + 8)
#define REC_BYTES(KD, BV, NST, OES, KTLO)                                                                     \
    (1024 + (NST) * REC_STAGE_BYTES(KD, BV, KTLO) + 2 * KDA_CHUNK * REC_O_STRIDE(BV) * (OES) +                  \
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
    for (int kt = 0; kt < 4; kt++)
        acc_pair_to_a(dacc[2 * kt], dacc[2 * kt + 1], da[kt]);
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
    for (int kt = 0; kt < NKT; kt++)
        acc_pair_to_a(s[2 * kt], s[2 * kt + 1], sa[kt]);
    float dacc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dacc[nt][c] = oacc[nt][c] = 0.0f;
    reg_fence(&dacc[0][0], 32);
    reg_fence(&oacc[0][0], 32);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < NKT; kt++) wgmma_n64_kmaj(&dacc[0][0], sa[kt], wg_desc_kmaj(st.W + (kt >> 2) * 8192 + (kt & 3) * 32));
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
DEV void load_state(const kda_rec_params_t &p, float (&s)[KD / 8][4], int64_t sbase, int64_t sd, int64_t sv, int vw,
                    int g, int t, int full) {
    /* dtype branch outside the loops, so that the loads are all in flight; masks only where K or V is padded
       (the masked loops hold more registers, which the main loop must not pay for) */
#define REC_LOAD_STATE(T, CONV, MASK)                                                                          \
    for (int nt = 0; nt < KD / 8; nt++)                                                                          \
        for (int c = 0; c < 4; c++) {                                                                           \
            const int d = 8 * nt + 2 * t + (c & 1), v = vw + g + 8 * (c >> 1);                                  \
            s[nt][c] = (MASK) ? CONV(((const T *)p.pb.h0)[sbase + d * sd + v * sv]) : 0.0f;                        \
        }
    if (full) {
        if (p.pb.h0_dtype == KDA_DT_F32) {
#pragma unroll
            REC_LOAD_STATE(float, , 1)
        } else {
#pragma unroll
            REC_LOAD_STATE(uint16_t, bf16_bits_to_f32, 1)
        }
    } else if (p.pb.h0_dtype == KDA_DT_F32) {
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
        for (int nt = 0; nt < KD / 8; nt++)
            bad |= !isfinite(s[nt][2 * half]) | !isfinite(s[nt][2 * half + 1]);
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
#define REC_STAGE_O(T, CONV)                                                                                   \
    for (int nt = 0; nt < 8; nt++)                                                                           \
        for (int c = 0; c < 4; c++)                                                                          \
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
 * The kernel
 * ------------------------------------------------------------------------------------------------------- */
/* EXACT: K and V are their classes: no masks, whole 16-byte O rows. Without it the kernel carries the masks and
 * the narrow stores, and its larger code slowed the common sizes (instruction fetch: +13% per step at BV 32,
 * +40% for 8-chunk sequences, measured).
 * MODE (kda_cuda.h): KDA_REC_SEQ walks whole sequences. With a piece table (intra-card CP, ALGORITHM.md §4) a CTA
 * is a (piece, value head, tile): KDA_REC_PRESCAN computes a split piece's map S_out = M S_in + E (tiles 0 ..
 * KC/BV − 1 are M's columns, from the identity with U = 0; the rest E's, from zero, or from the initial state for
 * a sequence's first piece, whose M is not needed) into the piece's slot, and writes no O; KDA_REC_PIECES runs
 * every piece from its incoming state (the merged S_in of its slot, or the sequence's initial state) and writes
 * O, and the final state from a sequence's last piece. The grids cover the table's capacity; CTAs past the
 * pieces the plan made, or with nothing to do, return at once. */
template <int KD, int WG, int EXACT, int MODE>
__global__ void __launch_bounds__(REC_MAX_THREADS, 1) kda_recurrence_kernel(const kda_rec_params_t p) {
    constexpr int NT = KD / 8; /* n-tiles of Sᵀ over K */
    constexpr int SPLIT = REC_SPLIT(KD);
    constexpr int WO = MODE != KDA_REC_PRESCAN && MODE != KDA_REC_STATES; /* the kernel writes O */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u); /* stages 1 KB-aligned */
    pdl_wait(); /* (launched with pdl: the kernel before, prep or the merge, has completed) */
    pdl_trigger();

    const int bv = p.bv, nvt = kda_cuda_size_class(p.pb.V) / bv;
    const int tid = threadIdx.x, nthreads = blockDim.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    int h, vt, mcols = 0; /* mcols: this CTA computes columns of M (pre-scan) */
    int64_t n, bos, eos, nchunks, chunk0;
    float *slot_base = NULL; /* this (piece, head)'s CP storage, or NULL */
    float *map_out = NULL;   /* the pre-scan's M for the backward (kda_rec_params_t.cp_maps), or NULL */
    int load_sin = 0, from_h0 = 1, store_final = 1;
    if (MODE == KDA_REC_SEQ || MODE == KDA_REC_STATES) {
        vt = (int)(blockIdx.x % nvt);
        const int64_t rest = blockIdx.x / nvt;
        h = (int)(rest % p.pb.hv);
        n = rest / p.pb.hv;
        seq_bounds(p.pb.seqs, n, &bos, &eos);
        nchunks = (eos - bos + KDA_CHUNK - 1) / KDA_CHUNK;
        chunk0 = seq_chunk0(p.pb.seqs, n);
    } else {
        const int mt = MODE == KDA_REC_PRESCAN ? KD / bv : 0, ntiles = mt + nvt;
        const int tile = (int)(blockIdx.x % ntiles);
        const int64_t rest = blockIdx.x / ntiles;
        h = (int)(rest % p.pb.hv);
        const int64_t piece = rest / p.pb.hv; /* the pre-scan's grid covers the slots: entry = slot (cp_plan.h) */
        if (piece >= p.cp_header[MODE == KDA_REC_PRESCAN ? 2 : 0]) return;
        const kda_cp_piece_t *e = &p.cp_table[piece];
        const int64_t flags = e->flags, cslot = e->slot;
        n = e->seq;
        bos = e->bos;
        eos = e->eos;
        nchunks = e->num_chunks;
        chunk0 = e->chunk0;
        if (cslot >= 0)
            slot_base = p.cp_slots + (cslot * p.pb.hv + h) * kda_cuda_cp_slot_floats(KD, kda_cuda_size_class(p.pb.V));
        if (MODE == KDA_REC_PRESCAN) {
            /* only split pieces before their sequence's last; a first piece has no M */
            if (cslot < 0 || (flags & KDA_CP_LAST) || (tile < mt && (flags & KDA_CP_FIRST))) return;
            mcols = tile < mt;
            vt = mcols ? tile : tile - mt;
            from_h0 = !mcols && (flags & KDA_CP_FIRST);
            store_final = 0;
            if (mcols && p.cp_maps) { /* at the backward's mirrored slot: its first slot + (np − 1 − index) */
                const int64_t ms = cslot - e->index + (e->seq_pieces - 1 - e->index);
                map_out = p.cp_maps + (ms * p.pb.hv + h) * (int64_t)KD * KD;
            }
        } else {
            vt = tile;
            load_sin = cslot >= 0 && !(flags & KDA_CP_FIRST);
            from_h0 = !load_sin;
            store_final = (flags & KDA_CP_LAST) != 0;
        }
    }
    const int v0 = vt * bv;           /* first state column of this CTA (of M's columns when mcols) */
    const int vw = v0 + 16 * warp;    /* first state column of this warp */

    /* K̃_lo in the stages (WG 2 is the wgmma version that adds it, the launcher's choice) */
    const int ktlo = rec_ktlo(KD, MODE, p.blocks.fine);
    const int stage_bytes = REC_STAGE_BYTES(KD, bv, ktlo);
    const int nst = SPLIT ? 1 : p.stages; /* ring: chunks in flight, nst - 1 ahead of the one in use */
    unsigned char *sO0 = smem + nst * stage_bytes;
    const int ostride = REC_O_STRIDE(bv);
    const int oes = p.o_dtype == KDA_DT_F32 ? 4 : 2;
    const int64_t slot = seq_slot(p.pb.state_indices, p.claim, p.pb.num_state_slots, n);

    float s[NT][4];
    const int64_t sd = p.pb.v_first ? 1 : p.pb.V, sv = p.pb.v_first ? p.pb.K : 1; /* strides of d and v in a state */
    const int64_t sbase = slot >= 0 ? (slot * p.pb.hv + h) * (int64_t)p.pb.K * p.pb.V : 0;
    const int vc = kda_cuda_size_class(p.pb.V);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[nt][c] = 0.0f;
    const int full = EXACT || (p.pb.K == KD && v0 + bv <= p.pb.V); /* no padded rows or columns in this CTA's part of S */
    if (mcols) {
        identity_cols<KD>(s, p.pb.K, vw, g, t);
    } else if (load_sin) {
        load_slot<KD>(slot_base + KD * KD + KD * vc, s, vc, 1, vw, g, t);
    } else if (from_h0 && p.pb.h0 && slot >= 0) {
        /* a whole sequence, or a sequence's first piece (pre-scan: its E is then its outgoing state) */
        load_state<KD>(p, s, sbase, sd, sv, vw, g, t, full);
        poison_columns<KD>(s);
    }
    const unsigned char *blocks = (const unsigned char *)p.blocks.base;
    const int64_t off_u = kda_cuda_off_u(KD);
    const int64_t off_kl = ktlo ? kda_cuda_off_ktlo(KD, vc, p.blocks.fine) : -1;
    const uint32_t bars = smem_u32(sO0 + 2 * KDA_CHUNK * ostride * oes);
    if (tid == 0) {
        for (int sidx = 0; sidx < (SPLIT ? 2 : nst); sidx++) mbar_init(bars + 8 * sidx, 1);
        mbar_init_fence();
    }
    __syncthreads();
#define REC_BLOCK(ci) (blocks + ((chunk0 + (ci)) * p.pb.hv + h) * p.blocks.block_bytes)
    if (tid == 0) {
        if (SPLIT) {
            if (nchunks > 0) {
                issue_copy(smem, bars, REC_BLOCK(0), 0, REC_PART_A(KD), 0, off_u, v0, bv, !WO, KD, -1);
                issue_copy(smem, bars + 8, REC_BLOCK(0), REC_PART_A(KD), REC_LINEAR(KD), !mcols, off_u, v0, bv, !WO,
                           KD, -1);
            }
        } else {
            for (int sidx = 0; sidx < nst - 1 && sidx < nchunks; sidx++)
                issue_copy(smem + sidx * stage_bytes, bars + 8 * sidx, REC_BLOCK(sidx), 0, REC_LINEAR(KD), !mcols,
                           off_u, v0, bv, !WO, KD, off_kl);
        }
    }
    for (int64_t ci = 0; ci < nchunks; ci++) {
        const int64_t ahead = ci + nst - 1;
        const int nocopy = KDA_SKIP(p, 1024); /* development: stale stages, to time the math alone */
        const int cur = SPLIT ? 0 : (int)(ci % nst);
        if (!SPLIT) {
            if (tid == 0 && ahead < nchunks && !nocopy)
                issue_copy(smem + (ahead % nst) * stage_bytes, bars + 8 * (ahead % nst), REC_BLOCK(ahead), 0,
                           REC_LINEAR(KD), !mcols, off_u, v0, bv, !WO, KD, off_kl);
            if (!nocopy || ci < nst - 1) mbar_wait(bars + 8 * cur, (uint32_t)((ci / nst) & 1));
        } else if (!nocopy || ci == 0) {
            mbar_wait(bars, (uint32_t)(ci & 1));
        }
        if (MODE == KDA_REC_STATES) { /* S at this chunk's start: the caller's chunk_states, or the backward's */
            if (p.states_out)
                store_state<KD>(p, p.states_out, p.states_out_dtype, s, ((chunk0 + ci) * p.pb.hv + h) * (int64_t)p.pb.K * p.pb.V,
                                sd, sv, vw, g, t, full);
            else if (p.states_bf16)
                store_states_bf16<KD>(p.states_bf16 + ((chunk0 + ci) * p.pb.hv + h) * (int64_t)KD * vc, s, vw, lane);
            else
                store_slot<KD>(p.chunk_states + ((chunk0 + ci) * p.pb.hv + h) * (int64_t)KD * vc, s, vc, 1, vw, g, t);
        } else if (MODE != KDA_REC_PRESCAN && KD <= KDA_BWD_TILE && p.states_bf16) {
            /* the forward keeps S for the backward (kda_args_t.saved, bf16 inputs, backend.c keeps_states): the
               backward's states stage is then not run */
            store_states_bf16<KD>(p.states_bf16 + ((chunk0 + ci) * p.pb.hv + h) * (int64_t)KD * vc, s, vw, lane);
        }
        /* O staging alternates: the buffer of chunk ci - 2 is free once every thread passed chunk ci - 1's
           closing barrier, which it must have to get here */
        unsigned char *sO = sO0 + (ci & 1) * KDA_CHUNK * ostride * oes;
        const unsigned char *stg = smem + cur * stage_bytes;
        rec_stage_t st;
        st.W = smem_u32(stg);
        st.QG = st.W + KDA_CHUNK * KD * 2;
        st.KT = st.W + 2 * KDA_CHUNK * KD * 2;
        st.Aqk = st.W + 3 * KDA_CHUNK * KD * 2;
        st.U = st.W + REC_LINEAR(KD);
        st.gam = (const float *)(stg + 3 * KDA_CHUNK * KD * 2 + KDA_CHUNK * KDA_CHUNK * 2);
        st.ucol = (v0 % KDA_PANEL_COLS) + 16 * warp;
        st.KTlo = ktlo ? st.W + REC_KTLO_OFF(KD, bv) : 0;

        float oacc[8][4], dacc[8][4];
        const int math = !KDA_SKIP(p, 2048); /* development: skip the math, to time the copies alone */
        if (!math) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) oacc[nt][c] = 0.0f;
        } else if (WG) {
            if (mcols) step_wgmma<KD, WO, 1, 0>(s, oacc, st, lane);
            else step_wgmma<KD, WO, 0, WG == 2>(s, oacc, st, lane);
        } else {
            state_products_mma<KD, WO>(s, dacc, oacc, st, lane);
        }
        if (SPLIT) {
            __syncthreads(); /* [W | QΓ] read by every warp: the next chunk's may come in */
            if (tid == 0 && ci + 1 < nchunks && !nocopy)
                issue_copy(smem, bars, REC_BLOCK(ci + 1), 0, REC_PART_A(KD), 0, off_u, v0, bv, !WO, KD, -1);
            if (!nocopy || ci == 0) mbar_wait(bars + 8, (uint32_t)(ci & 1));
        }
        if (math && !WG) {
            if (mcols) state_update_mma<KD, WO, 1>(s, dacc, oacc, st, lane);
            else state_update_mma<KD, WO, 0>(s, dacc, oacc, st, lane);
        }
        if (WO) stage_o(oacc, sO, p.o_dtype, ostride, warp, g, t);
        __syncthreads(); /* the stage is free for the next copy; O staging is complete */
        if (SPLIT && tid == 0 && ci + 1 < nchunks && !nocopy)
            issue_copy(smem, bars + 8, REC_BLOCK(ci + 1), REC_PART_A(KD), REC_LINEAR(KD), !mcols, off_u, v0, bv,
                       !WO, KD, -1);

        /* O rows of this chunk → global */
        if (WO) {
            const int64_t tok0 = bos + ci * KDA_CHUNK;
            const int clen = (int)min((int64_t)KDA_CHUNK, eos - tok0);
            store_o<EXACT>(p, sO, ostride, oes, tok0, clen, h, v0, bv, tid, nthreads);
        }
    }
#undef REC_BLOCK

    if (MODE == KDA_REC_PRESCAN) {
        if (mcols) store_map<KD>(slot_base, s, 1, vw, g, t);             /* Mᵀ[e][d] (swizzled) */
        else store_slot<KD>(slot_base + KD * KD, s, vc, 1, vw, g, t);    /* E[d][v] */
        if (map_out) store_map<KD>(map_out, s, 0, vw, g, t);              /* M[d][e]: the backward's Mᵀ */
    } else if (MODE != KDA_REC_STATES && store_final && p.pb.ht && slot >= 0) {
        store_state<KD>(p, p.pb.ht, p.pb.ht_dtype, s, sbase, sd, sv, vw, g, t, full);
    }
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
    else if constexpr (KD <= KDA_BWD_MAX_HEAD_DIM)
        return (const void *)kda_recurrence_kernel<KD, WG, EXACT, KDA_REC_STATES>;
    else return NULL;
}

/* The launcher of one K class: one CTA of 2·BV threads per (sequence, value head, V tile); with a piece table
 * (p->mode) per (table entry up to the capacity, value head, tile), the pre-scan per (slot up to the capacity,
 * value head, tile) */
template <int KD, int HAS_WG>
static int kda_rec_launch(const kda_rec_params_t *p, int device, void *stream) {
    const int64_t nvt = kda_cuda_size_class(p->pb.V) / p->bv;
    const int64_t ctas = p->mode == KDA_REC_SEQ || p->mode == KDA_REC_STATES ? p->pb.seqs.num_seqs * p->pb.hv * nvt
                         : p->mode == KDA_REC_PIECES ? p->cp_capacity * p->pb.hv * nvt
                                                     : p->cp_capacity_slots * p->pb.hv * (KD / p->bv + nvt);
    if (ctas == 0) return 0;
    const int threads = p->bv * 2;
    const int bytes = kda_rec_smem<KD>(p, p->stages);
    static int done[4][6][KDA_MAX_DEVICES]; /* per kernel below */
    /* wgmma: 1, or 2 for the states pass over blocks with K̃_lo */
    const int wg = HAS_WG && p->wgmma ? 1 + rec_ktlo(KD, p->mode, p->blocks.fine) : 0, exact = p->pb.K == KD && p->pb.V == kda_cuda_size_class(p->pb.V);
#define REC_KERNELS(M)                                                                                          \
    {(const void *)kda_recurrence_kernel<KD, 0, 0, M>, (const void *)kda_recurrence_kernel<KD, 0, 1, M>,        \
     (const void *)kda_recurrence_kernel<KD, HAS_WG, 0, M>, (const void *)kda_recurrence_kernel<KD, HAS_WG, 1, M>, \
     NULL, NULL}
    /* the backward's mode only where the backward runs (K ≤ KDA_BWD_MAX_HEAD_DIM) */
#define REC_STATES_KERNELS                                                                                      \
    {rec_states_kernel<KD, 0, 0>(), rec_states_kernel<KD, 0, 1>(), rec_states_kernel<KD, HAS_WG, 0>(),          \
     rec_states_kernel<KD, HAS_WG, 1>(), rec_states_kernel<KD, 2 * HAS_WG, 0>(), rec_states_kernel<KD, 2 * HAS_WG, 1>()}
    const void *kernels[4][6] = {REC_KERNELS(KDA_REC_SEQ), REC_KERNELS(KDA_REC_PRESCAN), REC_KERNELS(KDA_REC_PIECES),
                                 REC_STATES_KERNELS};
#undef REC_KERNELS
#undef REC_STATES_KERNELS
    const int which = 2 * wg + exact, mode = p->mode;
    if (!kernels[mode][which]) return (int)cudaErrorNotSupported;
    return kda_launch_ex(kernels[mode][which], ctas, 1, threads, bytes, p, device, done[mode][which], stream, 1);
}
