/*
 * The per-call problem of the CUDA kernels (kda_cuda_problem_t, kda_cuda.h): what every launch of a forward,
 * decode or backward reads, taken once from the checked arguments, so that each op's launch file adds only its
 * own workspace regions and tiling.
 */
#include <string.h>

#include "kda_cuda.h"

void kda_cuda_problem_fill(kda_cuda_problem_t *pb, const kda_problem_t *p, int32_t *chunk_offsets) {
    const kda_args_t *a = &p->a;
    memset(pb, 0, sizeof *pb);
    pb->seqs.cu_seqlens = a->cu_seqlens;
    pb->seqs.cu_seqlens_64 = a->cu_seqlens_dtype == KDA_INT64;
    pb->seqs.num_tokens = p->num_tokens;
    pb->seqs.seq_len = a->seq_len;
    pb->seqs.num_seqs = p->num_seqs;
    pb->seqs.chunks_per_row = (a->seq_len + KDA_CHUNK - 1) / KDA_CHUNK;
    pb->seqs.chunk_offsets = p->varlen ? chunk_offsets : NULL;
    pb->q = a->q;
    pb->k = a->k;
    pb->v = a->v;
    pb->g = a->g;
    pb->beta = a->beta;
    pb->A_log = a->use_gate_in_kernel ? a->A_log : NULL;
    pb->dt_bias = a->use_gate_in_kernel ? a->dt_bias : NULL;
    pb->h0 = a->initial_state;
    pb->ht = a->final_state;
    pb->state_indices = a->state_indices;
    pb->num_state_slots = a->num_state_slots;
    pb->dtype = (int)a->dtype;
    pb->g_dtype = (int)a->g_dtype;
    pb->beta_dtype = (int)a->beta_dtype;
    pb->h0_dtype = (int)a->initial_state_dtype;
    pb->ht_dtype = (int)a->final_state_dtype;
    pb->hqk = a->num_qk_heads;
    pb->hv = a->num_v_heads;
    pb->group = p->group;
    pb->K = a->head_dim_k;
    pb->V = a->head_dim_v;
    pb->kc = kda_cuda_size_class(pb->K);
    pb->vc = kda_cuda_size_class(pb->V);
    pb->v_first = a->state_v_first != 0;
    pb->scale = p->scale;
    pb->lower_bound = p->has_lower_bound ? a->lower_bound : 0.0f;
    pb->l2norm = a->use_qk_l2norm != 0;
    pb->gate_in_kernel = a->use_gate_in_kernel != 0;
    pb->beta_sigmoid = a->use_beta_sigmoid != 0;
    pb->neg_eigval = a->allow_neg_eigval != 0;
}
