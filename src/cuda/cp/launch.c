/*
 * Intra-card context parallelism, host side (cp.h; docs/ALGORITHM.md §4): the CP params over the workspace's CP
 * region, and the forward's pre-scan (S_out = M S_in + E per split piece), merge (S_in of every piece) and pieces
 * (O from each piece's S_in) on the caller's stream. The plan itself is made on the device (cp_plan.cu, or CTA 0
 * of the prep kernel), so nothing here reads the lengths or waits for the device.
 */
#include <string.h>

#include "cp.h"

void kda_cp_fill_params(const kda_cuda_problem_t *pb, const kda_args_t *a, kda_cp_capacity_t cap, int tiles_factor,
                        int sm_count, unsigned char *cpbase, kda_cp_params_t *cpp) {
    memset(cpp, 0, sizeof *cpp);
    cpp->pb = *pb;
    cpp->header = (int64_t *)cpbase;
    cpp->table = (kda_cp_piece_t *)(cpbase + 256);
    cpp->slots = (float *)(cpbase + 256 + (cap.pieces * (int64_t)sizeof(kda_cp_piece_t) + 255) / 256 * 256);
    cpp->cap_pieces = cap.pieces;
    cpp->cap_slots = cap.slots;
    cpp->mode = (int)a->cp_mode;
    cpp->piece_len = a->cp_piece_len;
    cpp->v_tiles = kda_cp_v_tiles(pb->V) * tiles_factor;
    cpp->prescan_pairs = tiles_factor > 1;
    cpp->sm_count = sm_count;
}

void kda_cp_fwd_params(kda_cp_params_t *cpp, int64_t *maps, kda_rec_params_t *rp) {
    if (maps) { /* the plan records its piece length, the pre-scan writes M for the backward */
        cpp->maps_mode = 1;
        cpp->maps_header = maps;
        rp->cp_maps = (float *)(maps + 32);
    }
    rp->cp_table = cpp->table;
    rp->cp_header = cpp->header;
    rp->cp_slots = cpp->slots;
    rp->cp_capacity = cpp->cap_pieces;
    rp->cp_capacity_slots = cpp->cap_slots;
}

int kda_cp_rec_bv(int kc, int vc) {
    const int bv = vc < 128 ? vc : 128;
    return kc < bv ? kc : bv;
}

int kda_cp_launch_fwd(const kda_cuda_config_t *cfg, kda_rec_params_t *rp, const kda_cp_params_t *cpp, int device,
                      void *stream, const char **stage) {
    int err;
    rp->mode = KDA_REC_PRESCAN;
    if ((err = cfg->rec(rp, device, stream)) != 0) {
        *stage = "CP pre-scan";
    } else if ((err = kda_cuda_launch_cp_merge(cpp, device, stream)) != 0) {
        *stage = "CP merge";
    } else {
        rp->mode = KDA_REC_PIECES;
        if ((err = cfg->rec(rp, device, stream)) != 0) *stage = "CP pieces";
    }
    return err;
}
