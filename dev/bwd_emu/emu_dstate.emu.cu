/* The dS+ kernels (bwd_dstate.cuh, cut before its launchers) under the emulator: a CTA per (sequence, value head,
 * BV-column tile). The fallback kernel: EMU_DS_BV=16 or 32 (default 32), the tile width the launcher picks from the
 * SM count. EMU_DS_REC=32, 64 or 128: the recurrence kernel's mma.sync path at that tile width instead, from a bf16
 * copy of d_o (the harness rounds d_o to bf16 values then, so that the oracle sees the same dO). */
#define EMU_TU "dstate" /* EMU_TF32_EXACT names stages by it (common.cuh) */
#include "bwd_dstate.emu.h"
#include <stdlib.h>
#include <stdio.h>

#define DSTATE_INSTANCE(KC, BV, width) \
    static void dstate_##KC##_##width(const void *p) { kda_bwd_dstate_kernel<KC, BV>(*(const kda_bwd_params_t *)p); }
DSTATE_INSTANCE(64, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(128, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(64, KDA_BWD_BV_WIDE, wide)
DSTATE_INSTANCE(128, KDA_BWD_BV_WIDE, wide)
DSTATE_INSTANCE(256, KDA_BWD_BV, narrow)
DSTATE_INSTANCE(256, KDA_BWD_BV_WIDE, wide)

#define DSTATE_REC_INSTANCE(KC, BV) \
    static void dstate_rec_##KC##_##BV(const void *p) { kda_bwd_dstate_rec_kernel<KC, BV, 0, 3, KDA_DS_SEQ>(*(const kda_bwd_params_t *)p); }
DSTATE_REC_INSTANCE(64, 32)
DSTATE_REC_INSTANCE(64, 64)
DSTATE_REC_INSTANCE(64, 128)
DSTATE_REC_INSTANCE(128, 32)
DSTATE_REC_INSTANCE(128, 64)
DSTATE_REC_INSTANCE(128, 128)
DSTATE_REC_INSTANCE(256, 32) /* K class 256: BV 32 only (a 2-stage ring) */

#define DSTATE_CP_INSTANCE(KC, BV, MODE) \
    static void dstate_cp_##KC##_##BV##_##MODE(const void *p) { kda_bwd_dstate_rec_kernel<KC, BV, 0, 3, MODE>(*(const kda_bwd_params_t *)p); }
DSTATE_CP_INSTANCE(64, 64, KDA_DS_PRESCAN)
DSTATE_CP_INSTANCE(64, 64, KDA_DS_PIECES)
DSTATE_CP_INSTANCE(128, 64, KDA_DS_PRESCAN)
DSTATE_CP_INSTANCE(128, 64, KDA_DS_PIECES)
DSTATE_CP_INSTANCE(128, 128, KDA_DS_PRESCAN)
DSTATE_CP_INSTANCE(128, 128, KDA_DS_PIECES)

/* EMU_DS_CP=P: the recurrence kernel's CP modes with pieces of P chunks (bf16 d_o as EMU_DS_REC): the table by
 * kda_cp_fill_table on the host, the pre-scan, the merge as cp_merge.cu computes it (a host loop, fp32, the
 * mirrored slots in order), the pieces */
static void run_dstate_cp(kda_bwd_params_t *q, int64_t P) {
    const kda_cp_seqs_t cs = {q->pb.seqs.cu_seqlens, q->pb.seqs.cu_seqlens_64, q->pb.seqs.num_seqs, q->pb.seqs.seq_len,
                              q->pb.seqs.num_tokens};
    const int64_t cap = q->pb.seqs.num_seqs + q->blocks.max_chunks + 1;
    kda_cp_piece_t *table = (kda_cp_piece_t *)calloc((size_t)cap, sizeof *table);
    const kda_cp_plan_t plan = kda_cp_fill_table(&cs, P, table, cap);
    int64_t header[4] = {plan.num_pieces, P, plan.num_slots, 0}; /* [3]: no kept forward maps */
    const int KC = q->pb.kc, VC = q->pb.vc, HV = q->pb.hv;
    const int64_t sz = kda_cuda_cp_slot_floats(KC, VC);
    float *slots = (float *)malloc((size_t)(plan.num_slots > 0 ? plan.num_slots : 1) * HV * sz * sizeof(float));
    for (int64_t i = 0; i < plan.num_slots * HV * sz; i++) slots[i] = NAN;
    q->cp_table = table; q->cp_header = header; q->cp_slots = slots; q->cp_capacity = cap;
    q->cp_capacity_slots = plan.num_slots; /* the pre-scan's grid: the split pieces are entries 0 .. slots − 1 */
    int bv = VC < 128 ? VC : 128;
    bv = KC < bv ? KC : bv;
    emu_kernel_fn pre = KC == 64 ? dstate_cp_64_64_KDA_DS_PRESCAN : bv == 64 ? dstate_cp_128_64_KDA_DS_PRESCAN : dstate_cp_128_128_KDA_DS_PRESCAN;
    emu_kernel_fn pcs = KC == 64 ? dstate_cp_64_64_KDA_DS_PIECES : bv == 64 ? dstate_cp_128_64_KDA_DS_PIECES : dstate_cp_128_128_KDA_DS_PIECES;
    q->ds_mode = KDA_DS_PRESCAN;
    emu_launch((unsigned)(plan.num_slots * HV * (KC / bv + VC / bv)), 2 * bv, pre, q);
    for (int64_t e = 0; e < plan.num_pieces; e++) { /* the merge */
        const kda_cp_piece_t *x = &table[e];
        if (!(x->flags & KDA_CP_FIRST) || x->slot < 0) continue;
        for (int h = 0; h < HV; h++) {
#define SLOT(j) (slots + ((x->slot + (j)) * HV + h) * sz)
            for (int64_t i = 0; i < (int64_t)KC * VC; i++) SLOT(1)[KC * KC + KC * VC + i] = SLOT(0)[KC * KC + i];
            for (int64_t j = 1; j + 1 < x->seq_pieces; j++)
                for (int d = 0; d < KC; d++)
                    for (int v = 0; v < VC; v++) {
                        float acc = 0.0f;
                        for (int e2 = 0; e2 < KC; e2++) /* Mᵀ as the pre-scan stores it (swizzled, cp_slot.cuh) */
                            acc = fmaf(SLOT(j)[kda_cuda_map_index(KC, e2, d)], SLOT(j)[KC * KC + KC * VC + e2 * VC + v], acc);
                        SLOT(j + 1)[KC * KC + KC * VC + d * VC + v] = acc + SLOT(j)[KC * KC + d * VC + v];
                    }
#undef SLOT
        }
    }
    q->ds_mode = KDA_DS_PIECES;
    emu_launch((unsigned)(cap * HV * (VC / bv)), 2 * bv, pcs, q);
    fprintf(stderr, "EMU_DS_CP: %lld pieces, %lld slots of %lld-chunk pieces\n", (long long)plan.num_pieces,
            (long long)plan.num_slots, (long long)P);
    free(table);
    free(slots);
}

/* *q = *p with d_o as a bf16 copy (the recurrence kernel's input); returns the copy, for free() */
static uint16_t *with_bf16_do(const kda_bwd_params_t *p, kda_bwd_params_t *q) {
    const int64_t n = p->pb.seqs.num_tokens * p->pb.hv * p->pb.V;
    uint16_t *bf = (uint16_t *)malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) bf[i] = f32_to_bf16_bits(((const float *)p->d_o)[i]);
    *q = *p;
    q->d_o = bf;
    q->do_dtype = KDA_DT_BF16;
    return bf;
}

void run_dstate(const kda_bwd_params_t *p) {
    if (getenv("EMU_DS_CP")) {
        kda_bwd_params_t q;
        uint16_t *bf = with_bf16_do(p, &q);
        run_dstate_cp(&q, atoll(getenv("EMU_DS_CP")));
        free(bf);
        return;
    }
    if (getenv("EMU_DS_REC")) {
        const int bv = atoi(getenv("EMU_DS_REC"));
        if (bv > p->pb.vc) { fprintf(stderr, "EMU_DS_REC %d above the V class %d\n", bv, p->pb.vc); exit(2); }
        kda_bwd_params_t q;
        uint16_t *bf = with_bf16_do(p, &q);
        if (p->pb.kc == 256 && bv != 32) { fprintf(stderr, "EMU_DS_REC: K class 256 takes 32 only\n"); exit(2); }
        emu_kernel_fn kernel = p->pb.kc == 64 ? (bv == 32 ? dstate_rec_64_32 : bv == 64 ? dstate_rec_64_64 : dstate_rec_64_128)
                               : p->pb.kc == 128 ? (bv == 32 ? dstate_rec_128_32 : bv == 64 ? dstate_rec_128_64 : dstate_rec_128_128)
                                              : dstate_rec_256_32;
        emu_launch((unsigned)(p->pb.seqs.num_seqs * p->pb.hv * (p->pb.vc / bv)), 2 * bv, kernel, &q);
        free(bf);
        return;
    }
    const int bv = getenv("EMU_DS_BV") ? atoi(getenv("EMU_DS_BV")) : KDA_BWD_BV_WIDE;
    const unsigned blocks = (unsigned)(p->pb.seqs.num_seqs * p->pb.hv * (p->pb.vc / bv));
    emu_kernel_fn kernel;
    if (bv == KDA_BWD_BV) kernel = p->pb.kc == 64 ? dstate_64_narrow : p->pb.kc == 128 ? dstate_128_narrow : dstate_256_narrow;
    else kernel = p->pb.kc == 64 ? dstate_64_wide : p->pb.kc == 128 ? dstate_128_wide : dstate_256_wide;
    emu_launch(blocks, 256, kernel, p);
}
