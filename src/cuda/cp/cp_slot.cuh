/*
 * Intra-card CP's storage of a state tile (docs/ALGORITHM.md §4), shared by the forward's recurrence
 * (recurrence.cuh: S, M) and the backward's state-gradient recurrence (bwd_dstate.cuh: dS, its M): a warp's mma
 * accumulators hold 16 columns of the K × V tile transposed, s[nt][c] = X[d][v] with d = 8 nt + 2t + (c & 1),
 * v = vw + g + 8 (c >> 1) (g = lane / 4, t = lane % 4). The slot is fp32 with strides sd (of d) and sv (of v):
 * [d][v] row-major for S_ext and the incoming state; Mᵀ [v][d] by store_map, swizzled (the merge, cp_merge.cu,
 * streams Mᵀ by rows).
 * No masks: the slots hold the padded classes, and padded rows and columns hold zeros.
 */
#ifndef KDA_CUDA_CP_SLOT_CUH
#define KDA_CUDA_CP_SLOT_CUH

template <int KD>
DEV void load_slot(const float *src, float (&s)[KD / 8][4], int64_t sd, int64_t sv, int vw, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[nt][c] = src[(8 * nt + 2 * t + (c & 1)) * sd + (vw + g + 8 * (c >> 1)) * sv];
}

template <int KD>
DEV void store_slot(float *dst, const float (&s)[KD / 8][4], int64_t sd, int64_t sv, int vw, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) dst[(8 * nt + 2 * t + (c & 1)) * sd + (vw + g + 8 * (c >> 1)) * sv] = s[nt][c];
}

/* A KC × KC map's tile (M's columns v, the rows d as above) in the merge's swizzled layout (kda_cuda_map_index):
 * rows_v = 1 stores it as Mᵀ (row v, column d), 0 as M (row d, column v) */
template <int KD>
DEV void store_map(float *dst, const float (&s)[KD / 8][4], int rows_v, int vw, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int d = 8 * nt + 2 * t + (c & 1), v = vw + g + 8 * (c >> 1);
            dst[rows_v ? kda_cuda_map_index(KD, v, d) : kda_cuda_map_index(KD, d, v)] = s[nt][c];
        }
}

/* M's columns start from the identity: s = I restricted to the warp's columns (rows past K stay zero) */
template <int KD>
DEV void identity_cols(float (&s)[KD / 8][4], int K, int vw, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int d = 8 * nt + 2 * t + (c & 1);
            s[nt][c] = (d == vw + g + 8 * (c >> 1) && d < K) ? 1.0f : 0.0f;
        }
}

#endif /* KDA_CUDA_CP_SLOT_CUH */
