/*
 * The host side of CUDA decode: kda_decode_params_t from a checked problem, the launch plan (vector and bulk
 * accesses, the stage layout), the choice of kernel and instance, and the launch. The kernels and their
 * per-instance launchers are in decode_staged.cuh and decode_tile.cuh; the instances are configs.def's
 * KDA_DECODE_CONFIG rows, and both the choice here and kda_cuda_decode_fits read that table.
 *
 * Which kernel: the tile kernel (one CTA per tile, K ∈ {64, 128}, V a multiple of its tile's columns, one state
 * dtype) wherever it fits, with 16 chunks per thread when V allows it and the grid still fills the card (except
 * fp32 V-first tiles, which keep 8); else the staged kernel of the K class, its exact instance when K is the class,
 * V a multiple of BV, rows aligned and the states of the stage's dtype.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <string.h>

#include "decode.h"

/* ---------------------------------------------------------------------------------------------------------
 * The table of instances (configs.def)
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int kernel; /* KDA_DEC_KERNEL_staged or _tile */
    int vf, k;  /* V-first states; the K class (staged) or the exact K (tile) */
    int sf32;   /* fp32 state tile (else bf16) */
    int ex, na; /* exact head sizes; four-element chunks of state per thread */
    kda_decode_launch_fn launch;
} dec_config_t;

#define KDA_DECODE_CONFIG(KERN, VF, K, SF32, EX, NA)                                                                   \
    int kda_dec_##KERN##_vf##VF##_k##K##_f##SF32##_ex##EX##_na##NA(const kda_decode_params_t *p, int device,           \
                                                                   void *stream);
#include "cuda/configs.def"
#undef KDA_DECODE_CONFIG

static const dec_config_t configs[] = {
#define KDA_DECODE_CONFIG(KERN, VF, K, SF32, EX, NA)                                                                   \
    {KDA_DEC_KERNEL_##KERN, VF, K, SF32, EX, NA, kda_dec_##KERN##_vf##VF##_k##K##_f##SF32##_ex##EX##_na##NA},
#include "cuda/configs.def"
#undef KDA_DECODE_CONFIG
};

static const dec_config_t *find_config(int kernel, int vf, int k, int sf32, int ex, int na) {
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        const dec_config_t *c = &configs[i];
        if (c->kernel == kernel && c->vf == vf && c->k == k && c->sf32 == sf32 && c->ex == ex && c->na == na) return c;
    }
    return NULL;
}

/* The state tile's dtype: bf16 when the states present are (the initial one decides), else fp32. */
static int state_f32(int has_h0, int h0_dtype, int has_ht, int ht_dtype) {
    return !(has_h0 ? h0_dtype == KDA_DT_BF16 : (has_ht && ht_dtype == KDA_DT_BF16));
}

/* ---------------------------------------------------------------------------------------------------------
 * The plan
 * ------------------------------------------------------------------------------------------------------- */
static void decode_plan(kda_decode_params_t *p) {
    /* 4-element chunks of a state row are vector accesses when rows are whole chunks and the tensors aligned */
    const int row = p->pb.v_first ? p->pb.K : p->pb.V;
    const int h0_ok = !p->pb.h0 || ((uintptr_t)p->pb.h0 % (p->pb.h0_dtype == KDA_DT_F32 ? 16 : 8)) == 0;
    const int ht_ok = !p->pb.ht || ((uintptr_t)p->pb.ht % (p->pb.ht_dtype == KDA_DT_F32 ? 16 : 8)) == 0;
    p->vec = row % 4 == 0 && h0_ok && ht_ok;
    /* the first token's rows travel in the stage as element pairs (4 or 8 bytes): even rows, aligned bases */
#define PAIR_OK(ptr, dt) (!(ptr) || (uintptr_t)(ptr) % (2 * ((dt) == KDA_DT_F32 ? 4 : 2)) == 0)
    p->vec_in = p->pb.K % 2 == 0 && p->pb.V % 2 == 0 && PAIR_OK(p->pb.q, p->pb.dtype) &&
                PAIR_OK(p->pb.k, p->pb.dtype) && PAIR_OK(p->pb.v, p->pb.dtype) && PAIR_OK(p->pb.g, p->pb.g_dtype) &&
                PAIR_OK(p->pb.dt_bias, KDA_DT_F32) && (!p->beta_headwise || PAIR_OK(p->pb.beta, p->pb.beta_dtype));
#undef PAIR_OK
}

/* A stage of the staged kernel (K class kc, V-first vf, fp32 tile sf32): the tile, then p.ts token blocks (q, k,
 * g, v, headwise β rows, each rounded up to 16 bytes), then dt_bias. p.ts: the tokens per sequence when all
 * sequences have the same length, else the average rounded up, at most KDA_DEC_TS. */
static void stage_layout(kda_decode_params_t *p, int vf, int kc, int sf32) {
    const int tile = KDA_DEC_ELEMS(vf, kc) * (sf32 ? 4 : 2);
    const int es = p->pb.dtype == KDA_DT_F32 ? 4 : 2, eg = p->pb.g_dtype == KDA_DT_F32 ? 4 : 2;
    const int eb = p->pb.beta_dtype == KDA_DT_F32 ? 4 : 2;
    const int kp = (p->pb.K + 7) / 8 * 8, vp = (p->pb.V + 7) / 8 * 8;
    const int64_t n = p->pb.seqs.num_seqs, per = n > 0 ? (p->pb.seqs.num_tokens + n - 1) / n : 1;
    p->ts = per < 1 ? 1 : (per > KDA_DEC_TS ? KDA_DEC_TS : (int)per);
    int off = 0;
#define ROW(field, bytes) (p->field = off, off += ((bytes) + 15) / 16 * 16)
    ROW(raw_q, kp * es);
    ROW(raw_k, kp * es);
    ROW(raw_g, kp * eg);
    ROW(raw_v, vp * es);
    ROW(raw_b, p->beta_headwise ? vp * eb : 0);
#undef ROW
    p->raw_tok = off;
    p->raw_rows = tile;
    p->raw_bias = tile + p->ts * p->raw_tok;
    p->stage_bytes = p->vec_in ? p->raw_bias + (p->pb.dt_bias ? (kp * 4 + 15) / 16 * 16 : 0) : tile;
    /* bulk copies: 16-byte rows (sizes and addresses) on both sides */
    const int es_s = sf32 ? 4 : 2, rowb = (vf ? p->pb.K : p->pb.V) * es_s;
    const int srow = KDA_DEC_ROW(vf, kc) * es_s;
    p->bulk = p->pb.h0 && p->pb.h0_dtype == (sf32 ? KDA_DT_F32 : KDA_DT_BF16) && rowb % 16 == 0 && srow % 16 == 0 &&
              (uintptr_t)p->pb.h0 % 16 == 0;
}

int64_t kda_decode_staged_ctas(const kda_decode_params_t *p, int regs) {
    /* CTAs per SM: registers (allocated per warp in units of 256), shared memory (1 KB reserved per CTA) */
    const int warp_regs = (regs * 32 + 255) / 256 * 256;
    int occ = 65536 / (warp_regs * (KDA_DEC_THREADS / 32));
    const int by_smem = 233472 / (p->smem_bytes + 1024);
    occ = occ < by_smem ? occ : by_smem;
    occ = occ < 1 ? 1 : occ;
    const int bv = KDA_DEC_BV(kda_cuda_size_class(p->pb.K));
    const int64_t items = p->pb.seqs.num_seqs * p->pb.hv * ((p->pb.V + bv - 1) / bv);
    if (items == 0) return 0;
    int64_t ctas = (int64_t)p->sm_count * occ;
    if (p->forced_ctas > 0 && p->forced_ctas < ctas) ctas = p->forced_ctas;
    return ctas > items ? items : ctas;
}

/* The staged kernel's instance for p: its exact one where K = KC, whole tiles, aligned 4-element rows, the final
 * state (if any) of the stage's dtype and the initial state (if any) by bulk copy. Lays out p's stage. */
static const dec_config_t *staged_config(kda_decode_params_t *p) {
    const int vf = p->pb.v_first, kc = kda_cuda_size_class(p->pb.K);
    const int sf32 = state_f32(p->pb.h0 != NULL, p->pb.h0_dtype, p->pb.ht != NULL, p->pb.ht_dtype);
    stage_layout(p, vf, kc, sf32);
    const int sdt = sf32 ? KDA_DT_F32 : KDA_DT_BF16;
    const int ex = p->pb.K == kc && p->pb.V % KDA_DEC_BV(kc) == 0 && p->vec && (!p->pb.h0 || p->bulk) &&
                   (!p->pb.ht || p->pb.ht_dtype == sdt);
    return find_config(KDA_DEC_KERNEL_staged, vf, kc, sf32, ex, KDA_DEC_NA);
}

/* The tile kernel's instance for p (decode_plan done), or NULL where it does not run p: exact K with an instance,
 * V a multiple of its tile's columns up to 256, scalar β, one state dtype (fp32 or bf16) with 16-byte (fp32,
 * bf16 V-first: chunk pairs) or 8-byte aligned bases, a grid within CUDA's y and z limits. */
static const dec_config_t *tile_config(const kda_decode_params_t *p) {
    const int K = p->pb.K, V = p->pb.V, vf = p->pb.v_first;
    if (p->beta_headwise || (K != 64 && K != 128) || V % KDA_DT_BV(K, 8) || V > 256) return NULL;
    if (p->pb.seqs.num_seqs > 65535 || p->pb.hv > 65535 || !p->vec) return NULL;
    const int sdt = p->pb.h0 ? p->pb.h0_dtype : p->pb.ht_dtype;
    if (sdt != KDA_DT_F32 && sdt != KDA_DT_BF16) return NULL;
    if (p->pb.h0 && p->pb.ht && p->pb.h0_dtype != p->pb.ht_dtype) return NULL;
    const uintptr_t al = sdt == KDA_DT_F32 || vf ? 16 : 8;
    if ((p->pb.h0 && (uintptr_t)p->pb.h0 % al) || (p->pb.ht && (uintptr_t)p->pb.ht % al)) return NULL;
    const int f32 = sdt == KDA_DT_F32;
    /* 16 chunks per thread (twice the bytes in flight per thread, the per-token work of a CTA over twice the
       columns) when V allows it and the grid still fills the card, except fp32 V-first tiles (8 run faster
       there); else 8 */
    const int64_t ctas16 = p->pb.seqs.num_seqs * p->pb.hv * (V / KDA_DT_BV(K, 16));
    const int fits16 = V % KDA_DT_BV(K, 16) == 0;
    const int want16 = ctas16 >= 4 * (int64_t)p->sm_count && !(vf && f32);
    const dec_config_t *c16 = find_config(KDA_DEC_KERNEL_tile, vf, K, f32, 1, 16);
    if (c16 && fits16 && (p->forced_kernel == 4 || (p->forced_kernel != 3 && want16))) return c16;
    return find_config(KDA_DEC_KERNEL_tile, vf, K, f32, 1, 8);
}

/* ---------------------------------------------------------------------------------------------------------
 * The entry points
 * ------------------------------------------------------------------------------------------------------- */
int kda_cuda_decode_fits(const kda_problem_t *p, int is_decode) {
    const kda_args_t *a = &p->a;
    /* the staged kernel's general instance of the K class and state dtype runs any shape of that class */
    const int sf32 = state_f32(a->initial_state != NULL, (int)a->initial_state_dtype, a->final_state != NULL,
                               (int)a->final_state_dtype);
    if (!find_config(KDA_DEC_KERNEL_staged, a->state_v_first != 0, kda_cuda_size_class(a->head_dim_k), sf32, 0,
                     KDA_DEC_NA))
        return 0;
    if (a->beta_headwise || (a->state_indices && a->state_indices_cols > 0)) return 1;
    if (!is_decode) return 0;
    /* fp32 / fp16 inputs keep fp32 arithmetic at any length (the chunked kernels round to bf16) */
    if (a->dtype != KDA_BFLOAT16) return 1;
    return p->num_tokens <= (int64_t)KDA_DECODE_MAX_TOKENS_PER_SEQ * p->num_seqs;
}

size_t kda_cuda_claim_bytes(const kda_problem_t *p) {
    if (!p->a.state_indices || p->num_seqs < 2) return 0; /* one row cannot collide with another */
    return ((size_t)p->a.num_state_slots * sizeof(int32_t) + 255) & ~(size_t)255;
}

static void decode_params(kda_decode_params_t *c, const kda_problem_t *pr, int sm_count, const kda_tuning_t *tuning,
                          int32_t *claim) {
    const kda_args_t *a = &pr->a;
    memset(c, 0, sizeof *c);
    kda_cuda_problem_fill(&c->pb, pr, NULL);
    if (!a->state_indices) c->pb.num_state_slots = pr->num_seqs; /* sequence n is slot n */
    c->o = a->o;
    c->o_dtype = (int)a->o_dtype;
    c->num_accepted = a->num_accepted_tokens;
    c->claim = claim;
    c->idx_cols = a->state_indices ? a->state_indices_cols : 0;
    c->idx_stride = pr->idx_stride;
    c->beta_headwise = a->beta_headwise != 0;
    c->sm_count = sm_count;
    c->forced_ctas = tuning->decode_ctas;
    c->forced_kernel = tuning->decode_kernel;
    decode_plan(c);
}

kda_status_t kda_cuda_decode_run(const kda_problem_t *pr, int device, int sm_count, const kda_tuning_t *tuning,
                                 int32_t *claim, void *stream, const char *fn) {
    kda_decode_params_t c;
    decode_params(&c, pr, sm_count, tuning, claim);
    /* the tile kernel wherever it fits, unless a test forces the staged one (or its persistent CTAs) */
    const dec_config_t *cfg = c.forced_kernel != 1 && c.forced_ctas == 0 ? tile_config(&c) : NULL;
    /* few rows, 1-D indices, the tile kernel: it settles the slots' ownership itself (no claim launch) */
    if (cfg && claim && c.idx_cols == 0 && c.pb.seqs.num_seqs <= KDA_DEC_SCAN_MAX) {
        c.claim = claim = NULL;
        c.claim_scan = 1;
    }
    if (!cfg) cfg = staged_config(&c);

    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: cudaSetDevice: %s", fn, cudaGetErrorString(e));
    kda_claim_params_t cl = {
        pr->a.state_indices,  pr->num_seqs, c.idx_cols > 0 ? c.idx_cols : 1, c.idx_cols > 0 ? c.idx_stride : 1,
        c.pb.num_state_slots, claim};
    int err = kda_cuda_launch_claim(&cl, stream);
    if (err == 0) err = cfg ? cfg->launch(&c, device, stream) : (int)cudaErrorNotSupported;
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
    if (err != 0)
        return kda_error(KDA_STATUS_BACKEND_ERROR, "%s: launching the decode kernel: %s", fn,
                         cudaGetErrorString((cudaError_t)err));
    return KDA_STATUS_SUCCESS;
}
