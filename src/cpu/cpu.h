/* The CPU backend's pieces: chunked forward (chunk.c), recurrent decode (recurrent.c), shared state I/O. */
#ifndef KDA_CPU_CPU_H
#define KDA_CPU_CPU_H

#include "../internal.h"

/* Load head h of state slot `slot` (negative or no initial_state: zeros) into S, K×V K-major float32, with
 * every column (value channel) that holds an inf or NaN set to NaN whole (kda_cpu_poison_columns, the
 * non-finite contract): every CPU path, forward, decode and backward, reads its initial state through here. */
void kda_cpu_load_state(const kda_problem_t *p, int64_t slot, int h, float *S);
/* The state sequence n starts from: kda_cpu_load_state of its slot, or for sequence 0 the cross-rank CP fold
 * (kda_problem_t.cp_state_in) where set, its non-finite columns NaN as well. */
void kda_cpu_load_seq_state(const kda_problem_t *p, int64_t n, int h, float *S);
/* Head h of slot `slot` of a state-shaped tensor src (layout of the states, dtype dt), K×V K-major; NULL or a
 * negative slot: zeros. No poisoning (gradients: d_final_state). */
void kda_cpu_load_head(const kda_problem_t *p, const void *src, kda_dtype_t dt, int64_t slot, int h, float *S);
/* Store S into head h of final_state slot `slot` (nothing when negative or no final_state). */
void kda_cpu_store_state(const kda_problem_t *p, int64_t slot, int h, const float *S);
/* Columns [j0, j0 + w) of S (K×V K-major) into row `row` of chunk_states, head h. */
void kda_cpu_store_chunk_state(const kda_problem_t *p, int64_t row, int h, const float *S, int j0, int w);
/* S into every chunk_states row of the chunks of a sequence [bos, eos) that start at token t0 or later (row0: its
 * first row), head h: after a poisoning token, with S all NaN (the non-finite contract). */
void kda_cpu_store_chunk_states_from(const kda_problem_t *p, int64_t row0, int64_t bos, int64_t t0, int64_t eos, int h,
                                     const float *S);

kda_status_t kda_cpu_chunk_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes);
kda_status_t kda_cpu_chunk_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes);
/* The x86-64 level the chunked path runs at on this CPU: 4 or 3, the highest level this build carries
 * (KDA_CPU_ISAS) that the CPU supports; 0: the portable object (no such level, and on other CPUs). */
int kda_cpu_chunk_isa(void);
kda_status_t kda_cpu_recurrent_workspace(const kda_context_t *ctx, const kda_problem_t *p, size_t *bytes);
kda_status_t kda_cpu_recurrent_forward(kda_context_t *ctx, const kda_problem_t *p, void *ws, size_t ws_bytes);

/* Cross-rank CP summaries (chunk.c, docs/ALGORITHM.md §4a): the backend's cp_summary ops. */
kda_status_t kda_cpu_xcp_workspace(const kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp,
                                   size_t *bytes);
kda_status_t kda_cpu_xcp_summary(kda_context_t *ctx, const kda_problem_t *p, const kda_bwd_problem_t *bp, double *out,
                                 void *ws, size_t ws_bytes);

/* The CPU backend's backward (chunk_bwd.c). */
kda_status_t kda_cpu_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes);
kda_status_t kda_cpu_backward(kda_context_t *ctx, const kda_bwd_problem_t *p, void *ws, size_t ws_bytes, void *stream);

#endif /* KDA_CPU_CPU_H */
