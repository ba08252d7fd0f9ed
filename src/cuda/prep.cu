/*
 * Chunk preparation: everything of a chunk that does not depend on the state (docs/ALGORITHM.md §3).
 *
 * One CTA of 8 warps per (chunk of 64 tokens, value head); chunks of all sequences run in parallel. In the
 * notation of ALGORITHM.md, with G the chunk's cumulative log decay (kept in log2 units, so every exp is one
 * ex2), it writes the chunk's workspace block (kda_cuda.h):
 *
 *   1. per-token inputs into shared memory: q (l2norm, × scale), k (l2norm), v as bf16 tiles; the gate
 *      (in-kernel gate, clamped to [KDA_GATE_MIN, 0]) summed down each channel into G (fp32); β.
 *   2. A = β_i k_i·k_j e^{G_i−G_j} (j < i) and Aqk = q_i·k_j e^{G_i−G_j} (j ≤ i), by 16×16 blocks on the
 *      tensor cores: the factor e^{G_i−G_j} is split around a reference R into row and column factors,
 *      the row factors shared by a warp's run of blocks in one row; R = G at the row block's middle row for a
 *      run that ends in the diagonal block, else (or where the diagonal block's exponents would leave
 *      ±KDA_DIAG_RANGE, which then falls back to one ex2 per (i, j, d)) at its first row. Aqk → workspace.
 *   3. K̃ = k e^{G_last−G}, γ = e^{G_last} → workspace (two warps, beside step 2); then QΓ = q e^{G} →
 *      workspace and KΓ = k e^{G} → shared.
 *   4. the diagonal 16×16 blocks T_II of T = (I + A)⁻¹, in fp32 by forward substitution (one warp each),
 *      written over A's diagonal blocks.
 *   5. [W | U] = T Diag(β) [KΓ | V] without forming T: block forward substitution over the 4 row blocks,
 *      Y_I = β_I ⊙ [KΓ | V]_I − Σ_{M<I} A_IM X_M, X_I = T_II Y_I, on the tensor cores → workspace.
 * Rows past the end of a short chunk are zeros (k = q = v = β = 0, G = G_last), so every output row there is
 * zero and the recurrence needs no masks.
 *
 * Shared memory (KD = head size, stride KD + 8 elements so that fragment reads are conflict-free):
 *   R_G  fp32 [64][KD+8]   G; later the W and U tiles being built (bf16, swizzled)
 *   R_K  bf16 [64][KD+8]   k; later each warp's Y scratch
 *   R_Q  bf16 [64][KD+8]   q; later KΓ
 *   R_V  bf16 [64][KD+8]   v
 *   R_A  fp32 [64][72]     the raw 16-bit gate tile [64][KD], then A (its diagonal blocks later T_II)
 *   β    fp32 [64], and 512 floats for the partial sums of the gate
 */
#include "common.cuh"
#include "seq.cuh"

#define PREP_THREADS 256
#define SA 72  /* fp32 stride of A and T: rows 8 banks apart, so the float2 fragment reads of step 5 (a half-warp
                  spans 4 rows) and the float2 stores of step 2 are conflict-free */

typedef __nv_bfloat16 bf16;

/* Shared memory layout (bytes) for head size KD; PREP_S is the element stride of the [64][KD] tiles */
#define PREP_S(KD) ((KD) + 8)
#define PREP_OFF_K(KD) (64 * PREP_S(KD) * 4)
#define PREP_OFF_Q(KD) (PREP_OFF_K(KD) + 64 * PREP_S(KD) * 2)
#define PREP_OFF_V(KD) (PREP_OFF_Q(KD) + 64 * PREP_S(KD) * 2)
#define PREP_OFF_A(KD) (PREP_OFF_V(KD) + 64 * PREP_S(KD) * 2)
#define PREP_OFF_BETA(KD) (PREP_OFF_A(KD) + 64 * SA * 4)
#define PREP_OFF_TOT(KD) (PREP_OFF_BETA(KD) + 64 * 4)
#define PREP_BYTES(KD) (PREP_OFF_TOT(KD) + 512 * 4)

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

/* A channel pair of the raw 16-bit gate tile ([64][KD], pairs as 32-bit words) over ROWS rows from `pair` →
 * fp32 (F16: fp16, else bf16) */
template <int F16, int KD, int ROWS>
DEV void gate_pairs_to_f32(const uint32_t *pair, float *gx, float *gy) {
#pragma unroll
    for (int u = 0; u < ROWS; u++) {
        const float2 f = unpack_16x2<F16>(pair[u * (KD / 2)]);
        gx[u] = f.x;
        gy[u] = f.y;
    }
}

/* Row factors of a 16-row block for one k-tile: A fragments of k_i e^{G_i − R} and q_i e^{G_i − R}. */
template <int KD>
DEV void row_factors(const float *sG, const bf16 *sK, const bf16 *sQ, const float *R, int row0, int kt, int lane,
                     uint32_t fk[4], uint32_t fq[4]) {
    constexpr int S = KD + 8;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = row0 + g + 8 * (r & 1), col = kt * 16 + 2 * t + 8 * (r >> 1);
        const float2 G = *(const float2 *)&sG[row * S + col];
        const float2 Rr = *(const float2 *)&R[col];
        const uint32_t e = pack_bf16(ex2(G.x - Rr.x), ex2(G.y - Rr.y));
        fk[r] = mul_bf16x2(*(const uint32_t *)&sK[row * S + col], e);
        fq[r] = mul_bf16x2(*(const uint32_t *)&sQ[row * S + col], e);
    }
}

/* Column factors for one k-tile: the B fragment (b0, b1) of k_j e^{R − G_j} for the 8 tokens row0..row0+7. */
template <int KD>
DEV void col_factors(const float *sG, const bf16 *sK, const float *R, int row0, int kt, int lane, uint32_t *b0,
                     uint32_t *b1) {
    constexpr int S = KD + 8;
    const int g = lane >> 2, t = lane & 3;
    const int row = row0 + g;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int col = kt * 16 + 2 * t + 8 * h;
        const float2 G = *(const float2 *)&sG[row * S + col];
        const float2 Rr = *(const float2 *)&R[col];
        const uint32_t b = mul_bf16x2(*(const uint32_t *)&sK[row * S + col], pack_bf16(ex2(Rr.x - G.x), ex2(Rr.y - G.y)));
        if (h == 0) *b0 = b;
        else *b1 = b;
    }
}

/* A and Aqk of the NB 16×16 blocks (rows row0.., columns col0 + 16 b..) by the split factors around reference
 * R: Σ_kt (row factors of the rows, computed once per k-tile for all NB blocks) · (column factors of the
 * columns) on the tensor cores, into accA[b] / accQ[b]. */
template <int KD, int NB>
DEV void blocks_by_factors(const float *sG, const bf16 *sK, const bf16 *sQ, const float *R, int row0, int col0,
                           int lane, float (*accA)[2][4], float (*accQ)[2][4]) {
#pragma unroll
    for (int kt = 0; kt < KD / 16; kt++) {
        uint32_t fk[4], fq[4];
        row_factors<KD>(sG, sK, sQ, R, row0, kt, lane, fk, fq);
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                uint32_t b0, b1;
                col_factors<KD>(sG, sK, R, col0 + 16 * b + 8 * nt, kt, lane, &b0, &b1);
                mma_bf16(accA[b][nt], fk, b0, b1);
                mma_bf16(accQ[b][nt], fq, b0, b1);
            }
    }
}

/* A and Aqk of the diagonal block D when its decays are too strong to split: one exponential per (i, j, d),
 * fp32 */
template <int KD>
DEV void diag_block_exact(const float *sG, const bf16 *sK, const bf16 *sQ, int D, int lane, float accA[2][4],
                          float accQ[2][4]) {
    constexpr int S = KD + 8;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int i = 16 * D + g + 8 * (c >> 1), j = 16 * D + 8 * nt + 2 * t + (c & 1);
            float sa = 0.0f, sq = 0.0f;
            for (int d = 0; d < KD && j <= i; d++) {
                const float e = __bfloat162float(sK[j * S + d]) * ex2(sG[i * S + d] - sG[j * S + d]);
                sa += __bfloat162float(sK[i * S + d]) * e;
                sq += __bfloat162float(sQ[i * S + d]) * e;
            }
            accA[nt][c] = sa;
            accQ[nt][c] = sq;
        }
}

/* Store a 16×16 block of A (β-scaled, strictly lower) into shared memory and of Aqk (lower with diagonal)
 * into the workspace, from the accumulators of its two 8-column halves. */
DEV void store_block(float *sA, unsigned char *blk_aqk, const float *sBeta, int I, int J, int lane,
                     const float accA[2][4], const float accQ[2][4], int diagonal) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int i = 16 * I + g + 8 * hr, j = 16 * J + 8 * nt + 2 * t;
            float a0 = accA[nt][2 * hr] * sBeta[i], a1 = accA[nt][2 * hr + 1] * sBeta[i];
            float q0 = accQ[nt][2 * hr], q1 = accQ[nt][2 * hr + 1];
            if (diagonal) {
                if (j >= i) a0 = 0.0f;
                if (j + 1 >= i) a1 = 0.0f;
                if (j > i) q0 = 0.0f;
                if (j + 1 > i) q1 = 0.0f;
            }
            *(float2 *)&sA[i * SA + j] = make_float2(a0, a1);
            *(uint32_t *)(blk_aqk + pan_off(i, j)) = pack_bf16(q0, q1);
        }
    }
}

template <int KD>
__global__ void __launch_bounds__(PREP_THREADS, 2) kda_prep_kernel(const kda_cuda_params_t p) {
    constexpr int S = PREP_S(KD);
    extern __shared__ __align__(16) unsigned char smem[];
    float *sG = (float *)smem;
    bf16 *sK = (bf16 *)(smem + PREP_OFF_K(KD));
    bf16 *sQ = (bf16 *)(smem + PREP_OFF_Q(KD));
    bf16 *sV = (bf16 *)(smem + PREP_OFF_V(KD));
    float *sA = (float *)(smem + PREP_OFF_A(KD));
    float *sBeta = (float *)(smem + PREP_OFF_BETA(KD));
    float *sTot = (float *)(smem + PREP_OFF_TOT(KD));

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t cid = blockIdx.x / p.hv;
    const int h = (int)(blockIdx.x % p.hv);
    const int64_t n = chunk_seq(p, cid);
    if (n < 0) return;
    int64_t bos, eos;
    seq_bounds(p, n, &bos, &eos);
    const int64_t t0 = bos + (cid - seq_chunk0(p, n)) * 64;
    const int clen = (int)min((int64_t)64, eos - t0);
    if (clen <= 0) return;
    const int hq = h / p.group;
    unsigned char *blk = (unsigned char *)p.blocks + (cid * p.hv + h) * p.block_bytes;

    /* ---- 1a. q, k, v (16-bit: into their tiles) and the gate (16-bit: raw into R_A) by 16-byte cp.async:
     *         each thread copies one 16-byte column chunk of rows r0, r0 + RSTEP, ...; rows past the chunk's
     *         end read 0 bytes (zero-filled). (One bulk copy per row cost ~10% of the kernel's instructions:
     *         a bulk copy's operands must be warp-uniform, so each warp issued its rows one lane at a time.) */
    constexpr int row_chunks = KD / 8; /* 16-byte chunks per row of a 16-bit tile */
    const int n_qkv = p.dtype != KDA_DT_F32 ? 3 : 0;
    const int n_tiles = (p.dev_skip & 512) ? 0 : n_qkv + (p.g_dtype != KDA_DT_F32 ? 1 : 0);
    {
        constexpr int RSTEP = PREP_THREADS / row_chunks; /* rows between a thread's copies */
        const int c = tid % row_chunks, r0 = tid / row_chunks;
#pragma unroll
        for (int ti = 0; ti < 4; ti++) {
            if (ti >= n_tiles) break;
            const int tile = ti < n_qkv ? ti : 3; /* 0 q, 1 k, 2 v, 3 g */
            const int64_t heads = tile < 2 ? p.hqk : p.hv; /* rows of the tensor per token */
            const uint16_t *base = (const uint16_t *)(tile == 0 ? p.q : tile == 1 ? p.k : tile == 2 ? p.v : p.g);
            const uint16_t *src = base + ((t0 + r0) * heads + (tile < 2 ? hq : h)) * KD + c * 8;
            const int64_t step = RSTEP * heads * KD;
            const uint32_t dst = tile == 3 ? smem_u32((bf16 *)sA + r0 * KD + c * 8)
                                           : smem_u32((tile == 0 ? sQ : tile == 1 ? sK : sV) + r0 * S + c * 8);
            const uint32_t dstep = (tile == 3 ? KD : S) * RSTEP * 2;
#pragma unroll
            for (int j = 0; j < 64 / RSTEP; j++) {
                const int ok = r0 + j * RSTEP < clen;
                cp_async16_zfill(dst + j * dstep, ok ? (const void *)(src + j * step) : (const void *)base, ok ? 16 : 0);
            }
        }
    }
    if (tid < 64) {
        float b = 0.0f;
        if (tid < clen) {
            b = load_elem(p.beta, p.beta_dtype, (t0 + tid) * p.hv + h);
            if (p.beta_sigmoid) b = (p.neg_eigval ? 2.0f : 1.0f) * sigmoidf_(b);
        }
        sBeta[tid] = b;
    }

    /* ---- 1c. the gate (log2 units), summed down each channel in two levels: each thread takes a pair of
     *         channels over GROWS rows (all its loads and gate values independent, the running sum a chain of
     *         adds), its part's total goes to shared memory, and after the next barrier every thread adds the
     *         totals of the parts above it. fp32 gates come straight from global memory. ------------------ */
    constexpr int PAIRS = KD / 2;
    constexpr int GPARTS = PREP_THREADS / PAIRS; /* 4 (KD 128) or 8 (KD 64) */
    constexpr int GROWS = 64 / GPARTS;
    const int gd = 2 * (tid % PAIRS), gr0 = (tid / PAIRS) * GROWS;
    float gx[GROWS], gy[GROWS];
    {
        const float A = p.A_log ? __expf(p.A_log[h]) : 1.0f;
        const float2 bias = (p.gate_in_kernel && p.dt_bias) ? *(const float2 *)&p.dt_bias[h * KD + gd]
                                                            : make_float2(0.0f, 0.0f);
        if (p.g_dtype == KDA_DT_F32) {
            const float *gp = (const float *)p.g + (t0 * p.hv + h) * KD + gd;
            const int64_t rs = (int64_t)p.hv * KD;
#pragma unroll
            for (int u = 0; u < GROWS; u++) {
                const float2 v = gr0 + u < clen ? *(const float2 *)&gp[(gr0 + u) * rs] : make_float2(0.0f, 0.0f);
                gx[u] = v.x;
                gy[u] = v.y;
            }
        }
        cp_async_wait_all();
        __syncthreads(); /* the tiles were copied by all threads */
        const uint32_t *graw = (const uint32_t *)sA + gd / 2;
        if (p.g_dtype == KDA_DT_F16) /* dtype branches outside the loops, as in 1b */
            gate_pairs_to_f32<1, KD, GROWS>(graw + gr0 * (KD / 2), gx, gy);
        else if (p.g_dtype == KDA_DT_BF16)
            gate_pairs_to_f32<0, KD, GROWS>(graw + gr0 * (KD / 2), gx, gy);
        /* gate values, branch-free within each mode (a branch per element would serialise the independent
           elements' latency chains), in log2 units; rows past the chunk's end add 0 */
        const int nvalid = clen - gr0;
        float run0 = 0.0f, run1 = 0.0f;
        if (p.gate_in_kernel && p.lower_bound != 0.0f) {
            /* lower_bound · sigmoid(A (g + bias)), straight in log2 units: it lies in [lower_bound, 0] (the
               validated lower_bound ≥ −5 is inside the clamp), so one fmaxf is the whole clamp (NaN → min) */
            const float za = -A * LOG2E, lb2 = p.lower_bound * LOG2E;
            if (!(p.dev_skip & 32)) {
#pragma unroll
                for (int u = 0; u < GROWS; u++) {
                    run0 += u < nvalid ? fmaxf(lb2 * rcp_approx(1.0f + ex2(za * (gx[u] + bias.x))), lb2) : 0.0f;
                    run1 += u < nvalid ? fmaxf(lb2 * rcp_approx(1.0f + ex2(za * (gy[u] + bias.y))), lb2) : 0.0f;
                    gx[u] = run0;
                    gy[u] = run1;
                }
            }
        } else {
        if (p.gate_in_kernel) { /* −A softplus(g + bias) */
#pragma unroll
            for (int u = 0; u < GROWS; u++) {
                gx[u] = -A * softplusf_(gx[u] + bias.x);
                gy[u] = -A * softplusf_(gy[u] + bias.y);
            }
        }
        if (!(p.dev_skip & 32)) {
#pragma unroll
            for (int u = 0; u < GROWS; u++) {
                /* clamp into [KDA_GATE_MIN, 0]: NaN and −inf become the minimum */
                run0 += u < nvalid ? fminf(fmaxf(gx[u], KDA_GATE_MIN), 0.0f) * LOG2E : 0.0f;
                run1 += u < nvalid ? fminf(fmaxf(gy[u], KDA_GATE_MIN), 0.0f) * LOG2E : 0.0f;
                gx[u] = run0;
                gy[u] = run1;
            }
        }
        }
        *(float2 *)&sTot[(gr0 / GROWS) * KD + gd] = make_float2(run0, run1);
    }

    /* ---- 1b. normalise q (× scale) and k, convert to bf16: four threads per row ------------------------- */
    if (!(p.dev_skip & 64)) {
        constexpr int CW = KD / 4;
        const int r = tid >> 2, c0 = (tid & 3) * CW;
#pragma unroll
        for (int which = 0; which < 3; which++) {
            bf16 *tile = which == 0 ? sQ : which == 1 ? sK : sV;
            if (which == 2 && p.dtype == KDA_DT_BF16) break;
            float x[CW];
            if (p.dtype == KDA_DT_F32) {
                const int64_t row = which < 2 ? (t0 + r) * p.hqk + hq : (t0 + r) * p.hv + h;
                const float *src = (const float *)(which == 0 ? p.q : which == 1 ? p.k : p.v) + row * KD + c0;
#pragma unroll
                for (int c = 0; c < CW; c += 4) {
                    const float4 f = r < clen ? *(const float4 *)(src + c) : make_float4(0.f, 0.f, 0.f, 0.f);
                    x[c] = f.x;
                    x[c + 1] = f.y;
                    x[c + 2] = f.z;
                    x[c + 3] = f.w;
                }
            } else if (p.dtype == KDA_DT_F16) { /* the dtype branch outside the loops: inside, the compiler
                                                     computed both conversions and selected */
                row16_to_f32<1, CW>(tile + r * S + c0, x);
            } else {
                row16_to_f32<0, CW>(tile + r * S + c0, x);
            }
            float f = 1.0f;
            if (which < 2 && p.l2norm) {
                float ss = 0.0f;
#pragma unroll
                for (int c = 0; c < CW; c++) ss += x[c] * x[c];
                ss += __shfl_xor_sync(0xffffffffu, ss, 1);
                ss += __shfl_xor_sync(0xffffffffu, ss, 2);
                f = rsqrtf(ss + 1e-6f);
            }
            if (which == 0) f *= p.scale;
#pragma unroll
            for (int c = 0; c < CW; c += 8)
                *(uint4 *)(tile + r * S + c0 + c) =
                    make_uint4(pack_bf16(x[c] * f, x[c + 1] * f), pack_bf16(x[c + 2] * f, x[c + 3] * f),
                               pack_bf16(x[c + 4] * f, x[c + 5] * f), pack_bf16(x[c + 6] * f, x[c + 7] * f));
        }
    }
    __syncthreads(); /* the parts' totals, the raw gate tile's last reads, and q, k, v are done */
    {
        float pre0 = 0.0f, pre1 = 0.0f;
        for (int q = 0; q < gr0 / GROWS; q++) {
            const float2 t = *(const float2 *)&sTot[q * KD + gd];
            pre0 += t.x;
            pre1 += t.y;
        }
#pragma unroll
        for (int u = 0; u < GROWS; u++) *(float2 *)&sG[(gr0 + u) * S + gd] = make_float2(gx[u] + pre0, gy[u] + pre1);
    }
    for (int e = tid; e < 64 * SA / 4; e += PREP_THREADS) ((float4 *)sA)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();

    /* ---- 2. A and Aqk by 16×16 blocks, warps 0-5, each a run of blocks of one row block I that share their
     *         row factors: (0,0) | (1,0) (1,1) | (2,0) (2,1) | (2,2) | (3,0) (3,1) | (3,2) (3,3).
     *         The reference R is G at the middle row of block I when the warp has the diagonal block and the
     *         block's exponents stay within ±KDA_DIAG_RANGE (the off-diagonal column factors e^{R − G_j} are
     *         then ≤ 1, the row factors ≤ e^{KDA_DIAG_RANGE}); otherwise G at block I's first row (every factor
     *         ≤ 1) and the diagonal block by one exponential per (i, j, d).
     *    3a. meanwhile warps 6 and 7: K̃, γ → workspace, Aqk's zero blocks above the diagonal */
    unsigned char *blk_aqk = blk + kda_cuda_off_aqk(KD);
    const float *GL = sG + (clen - 1) * S;
    if (warp < 6) {
        if (!(p.dev_skip & 1)) {
            const int I = warp < 2 ? warp : (warp + 2) >> 1, J0 = (warp >= 2 && (warp & 1)) ? 2 : 0;
            const int nb = (warp == 0 || warp == 3) ? 1 : 2, has_diag = J0 + nb - 1 == I;
            int split = 0;
            if (has_diag) {
                const float *Gfirst = sG + (16 * I) * S, *Gmid = sG + (16 * I + 7) * S, *Glast = sG + (16 * I + 15) * S;
                float range = 0.0f;
                for (int d = lane; d < KD; d += 32)
                    range = fmaxf(range, fmaxf(Gfirst[d] - Gmid[d], Gmid[d] - Glast[d]));
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) range = fmaxf(range, __shfl_xor_sync(0xffffffffu, range, o));
                split = range <= KDA_DIAG_RANGE * LOG2E;
            }
            const float *R = sG + (16 * I + (split ? 7 : 0)) * S;
            const int nf = nb - (has_diag && !split); /* blocks by factors */
            float accA[2][2][4] = {{{0.f}}}, accQ[2][2][4] = {{{0.f}}};
            if (nf == 2) blocks_by_factors<KD, 2>(sG, sK, sQ, R, 16 * I, 16 * J0, lane, accA, accQ);
            else if (nf == 1) blocks_by_factors<KD, 1>(sG, sK, sQ, R, 16 * I, 16 * J0, lane, accA, accQ);
            if (nf < nb) {
                if (nb == 2) diag_block_exact<KD>(sG, sK, sQ, I, lane, accA[1], accQ[1]);
                else diag_block_exact<KD>(sG, sK, sQ, I, lane, accA[0], accQ[0]);
            }
#pragma unroll
            for (int b = 0; b < 2; b++)
                if (b < nb) store_block(sA, blk_aqk, sBeta, I, J0 + b, lane, accA[b], accQ[b], J0 + b == I);
        }
    } else {
        const int tid2 = tid - 192;
        if (!(p.dev_skip & 128)) {
            unsigned char *blk_kt = blk + kda_cuda_off_kt(KD);
            for (int e = tid2; e < 64 * row_chunks; e += 64) {
                const int r = e / row_chunks, c = e % row_chunks;
                const float *G = sG + r * S + c * 8;
                const uint4 k8 = *(const uint4 *)(sK + r * S + c * 8);
                const uint32_t *kw = (const uint32_t *)&k8;
                const float4 ga = *(const float4 *)G, gb = *(const float4 *)(G + 4);
                const float4 la = *(const float4 *)(GL + c * 8), lb = *(const float4 *)(GL + c * 8 + 4);
                const float gv[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
                const float lv[8] = {la.x, la.y, la.z, la.w, lb.x, lb.y, lb.z, lb.w};
                uint32_t kt[4];
#pragma unroll
                for (int u = 0; u < 4; u++)
                    kt[u] = mul_bf16x2(kw[u], pack_bf16(ex2(lv[2 * u] - gv[2 * u]), ex2(lv[2 * u + 1] - gv[2 * u + 1])));
                *(uint4 *)(blk_kt + pan_off(r, c * 8)) = make_uint4(kt[0], kt[1], kt[2], kt[3]);
            }
            float *gamma = (float *)(blk + kda_cuda_off_gamma(KD));
            for (int d = tid2; d < KD; d += 64) gamma[d] = ex2(GL[d]);
        }
        if (!(p.dev_skip & 1))
            for (int e = tid2; e < 64 * 8; e += 64) {
                const int r = e >> 3, c = e & 7;
                if (c >= 2 * ((r >> 4) + 1)) *(uint4 *)(blk_aqk + pan_off(r, 8 * c)) = make_uint4(0, 0, 0, 0);
            }
    }
    __syncthreads(); /* step 3b overwrites q with KΓ */

    /* ---- 3b. QΓ = q e^{G} → workspace, KΓ = k e^{G} → shared (over q) --------------------------------------- */
    if (!(p.dev_skip & 128)) {
        unsigned char *blk_qg = blk + kda_cuda_off_qg(KD);
        for (int e = tid; e < 64 * row_chunks; e += PREP_THREADS) {
            const int r = e / row_chunks, c = e % row_chunks;
            const float *G = sG + r * S + c * 8;
            const uint4 q8 = *(const uint4 *)(sQ + r * S + c * 8), k8 = *(const uint4 *)(sK + r * S + c * 8);
            const uint32_t *qw = (const uint32_t *)&q8, *kw = (const uint32_t *)&k8;
            const float4 ga = *(const float4 *)G, gb = *(const float4 *)(G + 4);
            const float gv[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
            uint32_t qg[4], kg[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const uint32_t e = pack_bf16(ex2(gv[2 * u]), ex2(gv[2 * u + 1]));
                qg[u] = mul_bf16x2(qw[u], e);
                kg[u] = mul_bf16x2(kw[u], e);
            }
            *(uint4 *)(blk_qg + pan_off(r, c * 8)) = make_uint4(qg[0], qg[1], qg[2], qg[3]);
            *(uint4 *)(sQ + r * S + c * 8) = make_uint4(kg[0], kg[1], kg[2], kg[3]); /* same thread read it */
        }
    }

    /* ---- 4. the diagonal blocks of T = (I + A)⁻¹ in fp32 by forward substitution (warps 0-3, one block
     *         each, a column per lane), written over A's diagonal blocks (step 5 reads only A_IM, M < I) -------- */
    if (warp < 4 && !(p.dev_skip & 2)) {
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
            for (int i = 0; i < 16; i++) sA[(b + i) * SA + b + j] = tcol[i];
    }
    __syncthreads();

    /* ---- 5. [W | U] = T Diag(β) [KΓ | V] by block forward substitution: for row blocks I = 0..3,
     *         Y_I = β_I ⊙ [KΓ | V]_I − Σ_{M<I} A_IM X_M,  X_I = T_II Y_I.
     *         Warp w owns a slab of KD/4 of the 2 KD columns (w < 4: W, else U), so it needs no other warp. ---- */
    {
        constexpr int NTW = KD / 32;  /* n-tiles of a warp's slab */
        constexpr int YS = KD / 4 + 8; /* stride (elements) of the per-warp Y scratch [16][KD/4] */
        const int g = lane >> 2, t = lane & 3, w = warp;
        const int is_u = w >= 4, col0 = (w & 3) * (KD / 4); /* slab columns within W or U */
        const bf16 *src = is_u ? sV : sQ;                 /* V, or KΓ (over q) */
        unsigned char *stage = (unsigned char *)sG + is_u * (64 * KD * 2); /* X tile, panel layout */
        bf16 *Y = sK + w * 16 * YS;
        for (int I = 0; I < 4 && !(p.dev_skip & 4); I++) {
            float acc[NTW][4];
#pragma unroll
            for (int nt = 0; nt < NTW; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
            for (int M = 0; M < I; M++) {
                uint32_t a[4];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const float2 v = *(const float2 *)&sA[(16 * I + g + 8 * (r & 1)) * SA + 16 * M + 2 * t + 8 * (r >> 1)];
                    a[r] = pack_bf16(v.x, v.y);
                }
#pragma unroll
                for (int pp = 0; pp < NTW / 2; pp++) {
                    const int row = 16 * M + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int col = col0 + pp * 16 + (lane >> 4) * 8;
                    uint32_t b[4];
                    ldsm_x4_t(b, smem_u32(stage + pan_off(row, col)));
                    mma_bf16(acc[2 * pp], a, b[0], b[1]);
                    mma_bf16(acc[2 * pp + 1], a, b[2], b[3]);
                }
            }
            /* Y = β ⊙ B − acc, as bf16 rows of the warp's scratch */
#pragma unroll
            for (int nt = 0; nt < NTW; nt++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int r = 16 * I + g + 8 * hr, c = col0 + nt * 8 + 2 * t;
                    const float2 bb = unpack_bf16(*(const uint32_t *)&src[r * S + c]);
                    const float be = sBeta[r];
                    *(uint32_t *)&Y[(g + 8 * hr) * YS + nt * 8 + 2 * t] =
                        pack_bf16(be * bb.x - acc[nt][2 * hr], be * bb.y - acc[nt][2 * hr + 1]);
                }
            __syncwarp();
            uint32_t a[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const float2 v = *(const float2 *)&sA[(16 * I + g + 8 * (r & 1)) * SA + 16 * I + 2 * t + 8 * (r >> 1)];
                a[r] = pack_bf16(v.x, v.y);
            }
#pragma unroll
            for (int nt = 0; nt < NTW; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
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
                    const int i = 16 * I + g + 8 * hr, c = col0 + nt * 8 + 2 * t;
                    *(uint32_t *)(stage + pan_off(i, c)) = pack_bf16(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
                }
            __syncwarp();
        }
        __syncthreads();
        const int tile16 = 64 * KD * 2 / 16;
        uint4 *w_out = (uint4 *)blk, *u_out = (uint4 *)(blk + kda_cuda_off_u(KD));
        const unsigned char *w_in = (const unsigned char *)sG, *u_in = w_in + 64 * KD * 2;
        for (int e = tid; e < tile16 && !(p.dev_skip & 256); e += PREP_THREADS) { /* both in the panel layout */
            w_out[e] = *(const uint4 *)(w_in + e * 16);
            u_out[e] = *(const uint4 *)(u_in + e * 16);
        }
    }
}

extern "C" int kda_cuda_launch_prep(const kda_cuda_params_t *p, void *stream) {
    const int64_t ctas = p->max_chunks * p->hv;
    if (ctas == 0) return 0;
    cudaError_t err;
    if (p->kd == 128) {
        const int bytes = PREP_BYTES(128);
        static int done_128[KDA_MAX_DEVICES];
        if ((err = kda_smem_limit((const void *)kda_prep_kernel<128>, bytes, p->device, done_128)) != cudaSuccess)
            return (int)err;
        kda_prep_kernel<128><<<(unsigned)ctas, PREP_THREADS, bytes, (cudaStream_t)stream>>>(*p);
    } else {
        const int bytes = PREP_BYTES(64);
        static int done_64[KDA_MAX_DEVICES];
        if ((err = kda_smem_limit((const void *)kda_prep_kernel<64>, bytes, p->device, done_64)) != cudaSuccess)
            return (int)err;
        kda_prep_kernel<64><<<(unsigned)ctas, PREP_THREADS, bytes, (cudaStream_t)stream>>>(*p);
    }
    return (int)cudaGetLastError();
}
